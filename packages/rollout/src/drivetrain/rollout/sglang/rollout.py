"""The ``sglang`` rollout: SGLang's offline ``sglang.Engine``, CUDA GPUs only.

SGLang runs its scheduler (one process per tensor-parallel rank) and detokenizer as child
processes; this object drives them through ``sglang.Engine``. Requests stream through its
native async API (``async_generate(stream=True)``, one task per request on the engine's event
loop, run by whoever polls: :mod:`drivetrain.rollout.sglang.streams`); SGLang batches them
continuously. Requests and answers are built and checked in
:mod:`drivetrain.rollout.sglang.requests`.

Weights: ``update_weights_from_tensor`` with CUDA tensors, in buckets sent as the stream
arrives (SGLang pickles them once per tensor-parallel rank through CUDA IPC; its maintainers
ask for GPU tensors there), the prefix cache flushed by going idle before the first bucket.
SGLang applies an
update only when no request runs (its tokenizer manager holds the update until the running
requests end), so an update first lets the running requests finish: their tokens carry the
old version, and the requests after it the new one. LoRA adapters are written as a peft
directory and swapped with ``load_lora_adapter``/``unload_lora_adapter``. Memory:
``release_memory_occupation``/``resume_memory_occupation`` (torch_memory_saver; server arg
``enable_memory_saver``); a sleep aborts the running requests.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import os
import random
import shutil
import tempfile
import warnings
from collections.abc import AsyncIterator, Collection, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from drivetrain.api.engine import NamedTensor
from drivetrain.api.requests import SEED_MODULUS, Request
from drivetrain.api.rollout import SamplingParams
from drivetrain.rollout.checkpoint_names import checkpoint_shapes
from drivetrain.rollout.config import SGLangRolloutConfig
from drivetrain.rollout.devices import model_dir
from drivetrain.rollout.routed import routing_shape
from drivetrain.rollout.sglang.requests import (
    KV_CACHE,
    WEIGHTS,
    RoutingShape,
    check_result,
    check_stops,
    context_limits,
    memory_tags,
    processor_string,
    request_kwargs,
    stream_event,
)
from drivetrain.rollout.sglang.streams import LoopStreams
from drivetrain.rollout.tokenized import TokenizedRollout
from drivetrain.rollout.weight_dirs import (
    adapter_config,
    adapter_update,
    peek_adapter,
    write_adapter,
)
from drivetrain.rollout.weights import collect_weights, device_buckets
from drivetrain.runtime.request_queue import RequestQueue, WeightUpdate

MIN_SGLANG = "0.5.22"
#: how long SGLang may take to end aborted requests before weights or memory change
IDLE_TIMEOUT_S = 60.0

NO_CUDA = "SGLang needs a CUDA GPU; on CPU use the hf or vllm rollout"


def require_sglang_version() -> None:
    """Fail with the install command where the installed SGLang predates what this backend
    relies on: the cleanup that aborts a cancelled stream's request in the scheduler and its
    guard against aborting a newer request under the same id (0.5.22), ``Engine.loop``, the
    weight-update session, and a flush that waits for the scheduler to go idle."""
    from importlib.metadata import PackageNotFoundError, version

    from packaging.version import Version

    try:
        installed = version("sglang")
    except PackageNotFoundError:
        return  # the import below names the install command
    if Version(installed) < Version(MIN_SGLANG):
        raise RuntimeError(
            f"the sglang rollout needs sglang >= {MIN_SGLANG}, this environment has "
            f"{installed}: python -m drivetrain.rollout.env sglang <dir> makes one"
        )


def require_cuda(device: str) -> None:
    """Fail before sglang is imported: its import alone needs CUDA libraries."""
    if device == "cpu":
        raise RuntimeError(f"{NO_CUDA} (rollout.device='cpu')")
    if not torch.cuda.is_available():
        raise RuntimeError(f"{NO_CUDA} (torch sees no CUDA device)")


def _configure_environment(config: SGLangRolloutConfig) -> None:
    """Set before the engine starts: its child processes inherit the environment."""
    for item in config.env:
        name, _, value = item.partition("=")
        os.environ[name] = value
    # the contract's log-probs are after temperature: SGLang's default, unless this is set
    os.environ["SGLANG_RETURN_ORIGINAL_LOGPROB"] = "false"


def lora_targets(targets: Sequence[str]) -> list[str]:
    """SGLang's ``lora_target_modules``: ``all`` where peft says ``all-linear``."""
    return ["all"] if list(targets) == ["all-linear"] else list(targets)


def engine_arguments(
    config: SGLangRolloutConfig, path: Path, context_length: int, supported: Collection[str]
) -> dict[str, Any]:
    """``sglang.Engine`` keyword arguments (SGLang's ``ServerArgs`` fields). ``supported`` are
    the installed version's field names: the optional ones it lacks are left out, or refused
    when asked for explicitly."""
    kwargs: dict[str, Any] = dict(
        model_path=str(path),
        dtype=config.dtype,
        context_length=context_length,
        tp_size=config.tensor_parallel_size,
        random_seed=config.seed,
        mem_fraction_static=config.mem_fraction_static,
        enable_memory_saver=config.enable_memory_saver,
        disable_cuda_graph=config.disable_cuda_graph,
        log_level=config.log_level,
        # top-k/top-p run in requests.TopKTopPFilter, see there
        enable_custom_logit_processor=True,
        max_running_requests=config.max_running_requests,
    )
    if config.attention_backend:
        kwargs["attention_backend"] = config.attention_backend
    if (
        config.enable_memory_saver
        and config.weights_cpu_backup
        and "enable_weights_cpu_backup" in supported  # SGLang >= 0.5.3
    ):
        kwargs["enable_weights_cpu_backup"] = True
    if config.return_routed_experts:
        if "enable_return_routed_experts" not in supported:
            raise RuntimeError(
                "rollout.return_routed_experts needs an SGLang with enable_return_routed_experts"
            )
        kwargs["enable_return_routed_experts"] = True
    if config.deterministic_inference:
        if "enable_deterministic_inference" not in supported:
            raise RuntimeError(
                "rollout.deterministic_inference needs an SGLang with "
                "enable_deterministic_inference (>= 0.5.3)"
            )
        kwargs["enable_deterministic_inference"] = True
    if config.lora.enabled:
        kwargs.update(
            enable_lora=True,
            max_lora_rank=config.lora.rank,
            lora_target_modules=lora_targets(config.lora.target_modules),
        )
    return kwargs


def _server_arg_names() -> set[str]:
    """Field names of the installed SGLang's ``ServerArgs`` (a dataclass in the 0.5 series)."""
    from sglang.srt.server_args import ServerArgs

    if dataclasses.is_dataclass(ServerArgs):
        return {field.name for field in dataclasses.fields(ServerArgs)}
    fields = getattr(ServerArgs, "model_fields", None)
    if isinstance(fields, dict):
        return set(fields)
    return set(inspect.signature(ServerArgs).parameters)


class SGLangRollout(TokenizedRollout):
    config: SGLangRolloutConfig

    def __init__(self, config: SGLangRolloutConfig) -> None:
        super().__init__(config)
        path = model_dir(config.model_path)
        require_cuda(config.device)
        require_sglang_version()
        _configure_environment(config)
        import sglang
        from transformers import AutoConfig, AutoTokenizer

        text_config = AutoConfig.from_pretrained(path).get_text_config()
        positions = getattr(text_config, "max_position_embeddings", None)
        context_length, self.max_model_len = context_limits(config.max_model_len, positions)
        self.vocab_size = int(text_config.vocab_size)
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self._shapes = checkpoint_shapes(path)
        kwargs = engine_arguments(config, path, context_length, _server_arg_names())
        self._weights_backup = bool(kwargs.get("enable_weights_cpu_backup"))
        self._processor = processor_string()
        self._version = 0
        self._lora_name: str | None = None
        self._lora_root = Path(tempfile.mkdtemp(prefix="drivetrain-sglang-lora-"))
        self._released_tags: list[str] | None = None
        self._asleep = False
        self._weights_discarded = False
        self._rng = random.Random(config.seed)
        self._warned_seed = False
        self._routing: RoutingShape | None = None
        if config.return_routed_experts:
            layers, top_k = routing_shape(text_config.to_dict(), str(path))
            self._routing = RoutingShape(int(text_config.num_hidden_layers), layers, top_k)
        self.engine: Any = sglang.Engine(**kwargs)  # nothing to clean up if above fails
        event = functools.partial(stream_event, routing=self._routing)
        self._streams = LoopStreams(self.engine.loop, self._open_stream, event, self._holds)
        self.requests = RequestQueue(
            self._streams.step,
            lambda: self._version,
            capacity=config.max_running_requests,
            reset=self._streams.reset,
        )

    @property
    def weight_version(self) -> int:
        return self._version

    # ---- requests: streams of SGLang's async API, on its loop, run by whoever polls ---------
    def check_ready(self) -> None:
        super().check_ready()
        self._live_engine()
        if self._asleep:
            raise RuntimeError("the sglang rollout is asleep; call wake_up() first")
        if self._weights_discarded:
            raise RuntimeError("sleep(level=2) discarded the weights; send new weights first")

    def validate_request(self, request: Request) -> None:
        super().validate_request(request)
        check_stops(request.params)

    def _holds(self, rid: str) -> bool:
        """Whether SGLang's tokenizer manager still tracks the request: it forgets one when
        the scheduler reported its end (also after an abort)."""
        return rid in self.engine.tokenizer_manager.rid_to_state

    async def _open_stream(self, request: Request, rid: str) -> AsyncIterator[Mapping[str, Any]]:
        kwargs = request_kwargs(
            request,
            rid,
            processor=self._processor,
            seed=self._seed(request.params),
            lora_name=self._lora_name,
            routed_experts=self._routing is not None,
        )
        return await self.engine.async_generate(**kwargs)

    def _seed(self, params: SamplingParams) -> int | None:
        """A request's ``sampling_seed`` where SGLang honours it (deterministic inference): its
        own seed, or else one drawn from the rollout's generator, so that requests differ."""
        if not self.config.deterministic_inference:
            if params.seed is not None and not self._warned_seed:
                warnings.warn(
                    "SamplingParams.seed is ignored by the sglang rollout unless "
                    "rollout.deterministic_inference=true",
                    stacklevel=2,
                )
                self._warned_seed = True
            return None
        return params.seed if params.seed is not None else self._rng.randrange(SEED_MODULUS)

    # ---- weights ------------------------------------------------------------------------
    def update_weights(self, weights: Iterable[NamedTensor], *, version: int) -> None:
        self._check_weights_resident("update_weights")
        adapter, empty, stream = peek_adapter(weights)
        with self.updating_weights(version) as update:
            self._idle()  # SGLang updates an idle engine (module docstring)
            if adapter:  # small: SGLang takes an adapter from a directory
                tensors = adapter_update(collect_weights(stream), self.config.lora.enabled)
                self._load_adapter(list(tensors or ()), version)
            elif not empty:
                with self._weight_update_session():
                    self._send(stream, update)
                self._weights_discarded = False
            self._version = version

    def _send(self, stream: Iterator[NamedTensor], update: WeightUpdate) -> None:
        """Bucket by bucket as CUDA tensors, as the stream arrives. The prefix cache was
        flushed when the engine went idle (:meth:`_idle`) and nothing runs until the update
        ends, so no bucket flushes it again."""
        device = torch.device("cuda", torch.cuda.current_device())
        for bucket in device_buckets(stream, self._shapes, device, self.config.weight_bucket_bytes):
            update.changed = True
            result = self.engine.update_weights_from_tensor(named_tensors=bucket, flush_cache=False)
            check_result(result, "update_weights_from_tensor")

    @contextlib.contextmanager
    def _weight_update_session(self) -> Iterator[None]:
        """SGLang (>= 0.5.21) loads weights only inside a session (``begin_weight_update`` /
        ``end_weight_update``, which re-packs what the load changed). A failed update still
        closes its session, so the next one can open its own."""
        check_result(self.engine.begin_weight_update(), "begin_weight_update")
        try:
            yield
        except BaseException:
            with contextlib.suppress(Exception):
                self.engine.end_weight_update()
            raise
        check_result(self.engine.end_weight_update(), "end_weight_update")

    def _load_adapter(self, tensors: list[tuple[str, torch.Tensor]], version: int) -> None:
        config = adapter_config(self.config.lora, self.config.model_path)
        directory = write_adapter(self._lora_root, version, tensors, config)
        name = f"policy-v{version}"
        previous = self._lora_name
        if previous == name:  # the same version sent again: SGLang refuses a loaded name
            self._unload_adapter(previous)
            previous = None
        result = self.engine.load_lora_adapter(lora_name=name, lora_path=str(directory))
        check_result(result, "load_lora_adapter")
        self._lora_name = name
        if previous is not None:
            self._unload_adapter(previous)

    def _unload_adapter(self, name: str) -> None:
        check_result(self.engine.unload_lora_adapter(lora_name=name), "unload_lora_adapter")
        if self._lora_name == name:
            self._lora_name = None

    # ---- memory -------------------------------------------------------------------------
    def sleep(self, level: int = 1) -> bool:
        super().sleep(level)
        if not self.config.enable_memory_saver:
            return False  # SGLang can release memory only through torch_memory_saver
        if self._asleep:
            return True  # already released by an earlier sleep
        tags = memory_tags(level, self._weights_backup)
        with self.requests.lock:  # SGLang releases memory only when idle
            self.requests.pause(abort=True)
            try:
                self._idle()
                result = self._live_engine().release_memory_occupation(tags=tags)
                check_result(result, "release_memory_occupation")
            except BaseException:
                self.requests.resume()  # still awake: it serves on
                raise
        self._released_tags = tags
        self._asleep = True
        self._weights_discarded = self._weights_discarded or level == 2
        return True

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        super().wake_up(tags)
        if not self._asleep:
            return
        if tags is None:
            resume = self._released_tags  # None: everything that was released
        else:
            # SGLang's None released everything it tracks; CUDA graphs come back with the KV
            # cache (they hold its buffers' addresses)
            remaining = self._released_tags or ["weights", "kv_cache", "cuda_graph"]
            resume = [
                t for t in remaining if t in tags or (t == "cuda_graph" and "kv_cache" in tags)
            ]
            if not resume:
                return
        with self.requests.lock:
            result = self._live_engine().resume_memory_occupation(tags=resume)
        check_result(result, "resume_memory_occupation")
        if resume is not None and tags is not None:
            self._released_tags = [t for t in remaining if t not in resume]
            if self._released_tags:
                return
        self._asleep = False
        self._released_tags = None
        self.requests.resume()

    def shutdown(self) -> None:
        """SGLang's own shutdown kills every child process of this process, not only its
        own: where this process has other children, run the rollout as a server process of
        its own (``rollout.python``), as its own Python environment wants anyway."""
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()
            self.engine = None
        root = getattr(self, "_lora_root", None)
        if root is not None:
            shutil.rmtree(root, ignore_errors=True)

    # ---- state ----------------------------------------------------------------------------
    def _idle(self) -> None:
        """Under the step lock: no request runs or is still ending in SGLang, whose
        scheduler loads weights, flushes its cache and releases memory only when idle. Its
        tokenizer manager forgets a request one scheduler iteration before the scheduler is
        idle; a flush with a timeout waits for that (and the prefix cache goes, as an update
        needs). With the KV cache released the scheduler went idle before it and nothing ran
        since."""
        self.requests.finish_running()
        self._streams.settle(IDLE_TIMEOUT_S)
        if not self._kv_released():
            manager = self.engine.tokenizer_manager
            flushed = self.engine.loop.run_until_complete(
                manager.flush_cache(timeout_s=IDLE_TIMEOUT_S)
            )
            check_result(flushed, "flush_cache (waiting for the scheduler to go idle)")

    def _released(self, tag: str) -> bool:
        return self._asleep and (self._released_tags is None or tag in self._released_tags)

    def _kv_released(self) -> bool:
        """Releasing the KV cache flushed it, so an update then needs no flush of its own."""
        return self._released(KV_CACHE)

    def _live_engine(self) -> Any:
        if getattr(self, "engine", None) is None:
            raise RuntimeError("the sglang rollout was shut down")
        return self.engine

    def _check_weights_resident(self, action: str) -> None:
        """Weights may arrive while the rollout sleeps, once ``wake_up(("weights",))`` brought
        its weights back (colocated training wakes the KV cache after the update)."""
        self._live_engine()
        if self._released(WEIGHTS):
            raise RuntimeError(
                f"the sglang rollout's weights are released; call wake_up() before {action}"
            )
