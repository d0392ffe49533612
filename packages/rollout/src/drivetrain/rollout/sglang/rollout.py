"""The ``sglang`` rollout: SGLang's offline ``sglang.Engine``, CUDA GPUs only.

SGLang runs its scheduler (one process per tensor-parallel rank) and detokenizer as child
processes; this object drives them through ``sglang.Engine``. Requests and answers are built
and checked in :mod:`drivetrain.rollout.sglang.requests`.

Weights: ``update_weights_from_tensor`` with CUDA tensors, in buckets (SGLang pickles them once
per tensor-parallel rank through CUDA IPC; its maintainers ask for GPU tensors there), the KV
cache flushed after the last bucket. LoRA adapters are written as a peft directory and swapped
with ``load_lora_adapter``/``unload_lora_adapter``. Memory: ``release_memory_occupation`` /
``resume_memory_occupation`` (torch_memory_saver; server arg ``enable_memory_saver``). A
broadcast weight-sync transport drives :meth:`SGLangRollout.init_weights_update_group` and
:meth:`SGLangRollout.update_weights_from_distributed`.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import random
import shutil
import tempfile
import warnings
from collections.abc import Collection, Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

from drivetrain.api.engine import NamedTensor
from drivetrain.api.rollout import Completion, Prompt, Rollout, SamplingParams
from drivetrain.rollout.call_gate import CallGate
from drivetrain.rollout.checkpoint_names import checkpoint_shapes
from drivetrain.rollout.config import SGLangRolloutConfig
from drivetrain.rollout.devices import model_dir
from drivetrain.rollout.prompts import check_stop_token_ids, new_token_budgets, render_prompts
from drivetrain.rollout.sglang.requests import (
    check_result,
    check_weight_metadata,
    context_limits,
    generate_kwargs,
    memory_tags,
    parse_outputs,
    processor_string,
    request_seeds,
    weight_buckets,
)
from drivetrain.rollout.weight_dirs import adapter_config, adapter_update, write_adapter
from drivetrain.rollout.weights import collect_weights, stage_weights

NO_CUDA = "SGLang needs a CUDA GPU; on CPU use the hf or vllm rollout"


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
    )
    if config.attention_backend:
        kwargs["attention_backend"] = config.attention_backend
    if (
        config.enable_memory_saver
        and config.weights_cpu_backup
        and "enable_weights_cpu_backup" in supported  # SGLang >= 0.5.3
    ):
        kwargs["enable_weights_cpu_backup"] = True
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


class SGLangRollout(Rollout):
    config: SGLangRolloutConfig

    def __init__(self, config: SGLangRolloutConfig) -> None:
        super().__init__(config)
        path = model_dir(config.model_path)
        require_cuda(config.device)
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
        self._gate = CallGate()  # batch calls: a weight update waits for the running one
        self.engine: Any = sglang.Engine(**kwargs)  # last: nothing to clean up if above fails

    @property
    def weight_version(self) -> int:
        return self._version

    # ---- generation ---------------------------------------------------------------------
    def generate(self, prompts: Sequence[Prompt], params: SamplingParams) -> list[Completion]:
        self._check_awake("generate")
        if self._weights_discarded:
            raise RuntimeError("sleep(level=2) discarded the weights; send new weights first")
        prompt_ids = render_prompts(prompts, self.tokenizer, self.vocab_size)
        budgets = new_token_budgets(prompt_ids, params, self.max_model_len)
        check_stop_token_ids(params, self.vocab_size)
        kwargs = generate_kwargs(
            prompt_ids,
            budgets,
            params,
            processor=self._processor,
            seeds=self._seeds(params, len(prompt_ids) * params.n),
            lora_name=self._lora_name,
        )
        with self._gate.call():
            outputs = self.engine.generate(**kwargs)
            return parse_outputs(outputs, prompt_ids, params.n, self._version)

    def pause_generation(self, *, abort: bool = False) -> int:
        """Waits for the running ``generate`` call (SGLang's offline engine serves whole
        calls here; nothing is aborted) and holds new ones."""
        self._gate.pause()
        return 0

    def resume_generation(self) -> None:
        self._gate.resume()

    def _seeds(self, params: SamplingParams, count: int) -> list[int] | None:
        """Per-request seeds where SGLang honours them (deterministic inference): the call's
        seed, or else one drawn from the rollout's generator, so that calls differ."""
        if not self.config.deterministic_inference:
            if params.seed is not None and not self._warned_seed:
                warnings.warn(
                    "SamplingParams.seed is ignored by the sglang rollout unless "
                    "rollout.deterministic_inference=true",
                    stacklevel=3,
                )
                self._warned_seed = True
            return None
        base = params.seed if params.seed is not None else self._rng.randrange(2**31)
        return request_seeds(base, count)

    # ---- weights ------------------------------------------------------------------------
    def update_weights(self, weights: Iterable[NamedTensor], *, version: int) -> None:
        self._check_awake("update_weights")
        items = collect_weights(weights)
        adapter = adapter_update(items, self.config.lora.enabled)
        if adapter is not None:
            self._load_adapter(list(adapter), version)
        else:
            self._send(stage_weights(items, self._shapes, copy=False))
            self._weights_discarded = False
        self._version = version

    def _send(self, staged: list[tuple[str, torch.Tensor]]) -> None:
        """Bucket by bucket as CUDA tensors; the cache is flushed after the last one."""
        device = torch.device("cuda", torch.cuda.current_device())
        buckets = weight_buckets(staged, self.config.weight_bucket_bytes)
        for index, bucket in enumerate(buckets):
            on_device = [(name, tensor.to(device)) for name, tensor in bucket]
            result = self.engine.update_weights_from_tensor(
                named_tensors=on_device, flush_cache=index == len(buckets) - 1
            )
            try:
                check_result(result, "update_weights_from_tensor")
            except RuntimeError as error:
                if index == 0:
                    raise
                raise RuntimeError(
                    f"{error}; {index} of {len(buckets)} weight buckets were already loaded, "
                    "so the engine now mixes old and new weights: send them all again"
                ) from error
            del on_device

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
        self.engine.flush_cache()  # cached prefixes may hold KV computed with the old adapter

    def _unload_adapter(self, name: str) -> None:
        check_result(self.engine.unload_lora_adapter(lora_name=name), "unload_lora_adapter")
        if self._lora_name == name:
            self._lora_name = None

    # ---- broadcast weight sync (SGLang's own process group) ------------------------------
    def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str,
        backend: str = "nccl",
    ) -> None:
        """Join the trainer's weight-broadcast group: SGLang's ranks take ranks
        ``rank_offset ..`` of ``world_size``; the trainer's sender is rank 0."""
        result = self._live_engine().init_weights_update_group(
            master_address=master_address,
            master_port=master_port,
            rank_offset=rank_offset,
            world_size=world_size,
            group_name=group_name,
            backend=backend,
        )
        check_result(result, "init_weights_update_group")

    def update_weights_from_distributed(
        self,
        names: Sequence[str],
        dtypes: Sequence[str],
        shapes: Sequence[Sequence[int]],
        group_name: str = "weight_update_group",
        flush_cache: bool = True,
        load_format: str | None = None,
        *,
        version: int | None = None,
    ) -> None:
        """Receive tensors the trainer broadcasts in ``group_name`` (``dtypes`` as torch dtype
        names, e.g. ``bfloat16``). Names and shapes are checked first. Pass ``version`` with the
        last call of an update: generation then reports it."""
        self._check_awake("update_weights_from_distributed")
        check_weight_metadata(names, dtypes, shapes, self._shapes)
        kwargs: dict[str, Any] = dict(
            names=list(names),
            dtypes=list(dtypes),
            shapes=[list(shape) for shape in shapes],
            group_name=group_name,
            flush_cache=flush_cache,
        )
        if load_format is not None:
            kwargs["load_format"] = load_format
        result = self.engine.update_weights_from_distributed(**kwargs)
        check_result(result, "update_weights_from_distributed")
        if version is not None:
            self._version = version
            self._weights_discarded = False

    def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> None:
        destroy = getattr(self._live_engine(), "destroy_weights_update_group", None)
        if destroy is None:
            raise RuntimeError("this SGLang has no destroy_weights_update_group; upgrade it")
        check_result(destroy(group_name=group_name), "destroy_weights_update_group")

    # ---- memory -------------------------------------------------------------------------
    def sleep(self, level: int = 1) -> bool:
        super().sleep(level)
        if not self.config.enable_memory_saver:
            return False  # SGLang can release memory only through torch_memory_saver
        if self._asleep:
            return True  # already released by an earlier sleep
        tags = memory_tags(level, self._weights_backup)
        check_result(
            self._live_engine().release_memory_occupation(tags=tags), "release_memory_occupation"
        )
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
        result = self._live_engine().resume_memory_occupation(tags=resume)
        check_result(result, "resume_memory_occupation")
        if resume is None or tags is None:
            self._asleep = False
            return
        self._released_tags = [t for t in remaining if t not in resume]
        self._asleep = bool(self._released_tags)

    def shutdown(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()
            self.engine = None
        root = getattr(self, "_lora_root", None)
        if root is not None:
            shutil.rmtree(root, ignore_errors=True)

    # ---- state checks -------------------------------------------------------------------
    def _live_engine(self) -> Any:
        if getattr(self, "engine", None) is None:
            raise RuntimeError("the sglang rollout was shut down")
        return self.engine

    def _check_awake(self, action: str) -> None:
        self._live_engine()
        if self._asleep:
            raise RuntimeError(f"the sglang rollout is asleep; call wake_up() before {action}")
