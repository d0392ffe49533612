"""The ``vllm`` rollout: vLLM's ``LLM`` in this process, serving requests through its
``LLMEngine`` (``add_request``/``step``/``abort_request``, outputs as per-step deltas), stepped
by whoever polls (:class:`~drivetrain.runtime.request_queue.RequestQueue`).

Weights: full updates go through vLLM's weight-transfer API where the installed vLLM has it
(``start_weight_update``/``update_weights``/``finish_weight_update``, backend ``"drivetrain"``:
:mod:`drivetrain.rollout.vllm.transfer_engine`, which loads them with the model's own
``load_weights`` inside vLLM's layer-wise reload and stamps the version on vLLM's outputs), else
through vLLM's ``reload_weights`` worker method, which does the same load in one call; calling
``model.load_weights`` directly would skip vLLM's post-load processing. With vLLM's engine core
in this process (``multiprocessing=False``, the default, which needs tensor-parallel size 1) the
weights go in as tensors. With worker processes (``multiprocessing=True``, needed for tensor
parallel) tensors do not survive vLLM's RPC, so the update is written as safetensors into a
fresh directory the workers read (a disk hand-off, 0.15-0.3 s at 100M parameters here). The
prefix cache is reset afterwards (its KV was computed with the old weights). LoRA adapters are
written as a peft directory and loaded as a new ``LoRARequest``.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

from drivetrain.api.engine import NamedTensor
from drivetrain.api.errors import ConfigError
from drivetrain.api.requests import Request
from drivetrain.api.rollout import (
    MEMORY_TAGS,
    FinishReason,
    SamplingParams,
)
from drivetrain.api.routing import RoutedExperts
from drivetrain.rollout.checkpoint_names import checkpoint_shapes
from drivetrain.rollout.config import VLLMRolloutConfig
from drivetrain.rollout.devices import model_dir
from drivetrain.rollout.routed import model_routing_shape, routed_from_array
from drivetrain.rollout.tokenized import TokenizedRollout
from drivetrain.rollout.weight_dirs import (
    adapter_config,
    adapter_update,
    peek_adapter,
    write_adapter,
    write_weights_dir,
)
from drivetrain.rollout.weights import checked_clones, collect_weights, stage_weights
from drivetrain.runtime.request_queue import RequestQueue, TokenEvent


def _routed_experts_arguments(vllm: Any, on_cpu: bool, config: VLLMRolloutConfig) -> dict[str, Any]:
    """``LLM`` arguments that make vLLM return each finished request's routed experts, or a
    one-line refusal where it cannot (an older vLLM; its CPU backend, whose model runner lacks
    the capture: vLLM 0.32 asks for Model Runner V2, which needs Triton)."""
    from vllm.engine.arg_utils import EngineArgs

    if "enable_return_routed_experts" not in {f.name for f in dataclasses.fields(EngineArgs)}:
        raise ConfigError(
            "rollout.return_routed_experts needs a vLLM with enable_return_routed_experts "
            f"(0.30 or newer), not {vllm.__version__}"
        )
    if on_cpu:
        raise ConfigError(
            "rollout.return_routed_experts: vLLM records routed experts in its GPU model runner "
            "only; on a CPU use the hf rollout"
        )
    if not config.enable_prefix_caching:  # vLLM reads a cached prefix's routing back from it
        raise ConfigError(
            "rollout.return_routed_experts needs rollout.enable_prefix_caching=true (vLLM keeps "
            "a prompt's routing with its cached blocks)"
        )
    return {"enable_return_routed_experts": True}


def _configure_environment(config: VLLMRolloutConfig) -> None:
    """vLLM reads these when it is imported and when its engine starts: set them first."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if config.multiprocessing else "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(config.kv_cache_space_gib))
    for item in config.env:
        name, _, value = item.partition("=")
        os.environ[name] = value
    if not torch.cuda.is_available() and config.tensor_parallel_size > 1:
        # vLLM's CPU backend binds each worker's threads to a NUMA node of its own and refuses
        # more workers than nodes; split this process's cores between the workers instead
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", cpu_binding(config.tensor_parallel_size))


def cpu_binding(workers: int) -> str:
    """``VLLM_CPU_OMP_THREADS_BIND`` giving each worker an equal share of the usable cores."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < workers:
        raise ValueError(f"{workers} vLLM CPU workers need at least {workers} cores, have {cores}")
    share = len(cores) // workers
    groups = [cores[i * share : (i + 1) * share] for i in range(workers)]
    return "|".join(",".join(map(str, group)) for group in groups)


FINISH_REASONS = {
    "stop": FinishReason.STOP,
    "length": FinishReason.LENGTH,
    "abort": FinishReason.ABORT,
}


class VLLMRollout(TokenizedRollout):
    config: VLLMRolloutConfig

    def __init__(self, config: VLLMRolloutConfig) -> None:
        super().__init__(config)
        path = model_dir(config.model_path)
        if config.tensor_parallel_size > 1 and not config.multiprocessing:
            raise ValueError(
                "rollout.tensor_parallel_size > 1 needs vLLM worker processes: set "
                "rollout.multiprocessing=true"
            )
        _configure_environment(config)
        import vllm
        from vllm.platforms import current_platform

        self.vllm = vllm
        self.on_cpu = current_platform.is_cpu()
        kwargs: dict[str, Any] = dict(
            model=str(path),
            tokenizer=str(path),
            dtype=config.dtype,
            max_model_len=config.max_model_len,
            tensor_parallel_size=config.tensor_parallel_size,
            seed=config.seed,
            enforce_eager=config.enforce_eager,
            enable_prefix_caching=config.enable_prefix_caching,
            max_num_seqs=config.max_num_seqs,
            # sampled log-probs after temperature/top-k/top-p: what the trainer recomputes
            logprobs_mode="processed_logprobs",
            distributed_executor_backend="mp" if config.multiprocessing else "uni",
            worker_extension_cls=(
                "drivetrain.rollout.vllm.worker_extension.DrivetrainWorkerExtension"
            ),
        )
        if not self.on_cpu:
            kwargs["gpu_memory_utilization"] = config.gpu_memory_utilization
            kwargs["enable_sleep_mode"] = config.enable_sleep_mode
        self.weight_api = _uses_weight_transfer_api(config.weight_transfer)
        if self.weight_api:
            kwargs["weight_transfer_config"] = {"backend": "drivetrain"}
        if config.lora.enabled:
            kwargs.update(
                enable_lora=True,
                max_lora_rank=_max_lora_rank(config.lora.rank),
                max_loras=config.max_loras,
            )
        self._routing: tuple[list[int], int] | None = None  # (router layers, top_k)
        if config.return_routed_experts:
            self._routing = model_routing_shape(path)
            kwargs.update(_routed_experts_arguments(vllm, self.on_cpu, config))
        self.llm = vllm.LLM(**kwargs)
        self.tokenizer = self.llm.get_tokenizer()
        self.vocab_size = self.llm.llm_engine.model_config.get_vocab_size()
        self.max_model_len = self.llm.llm_engine.model_config.max_model_len
        self._shapes = checkpoint_shapes(path)
        self._version = 0
        self._lora_request: Any = None
        self._work_root = Path(tempfile.mkdtemp(prefix="drivetrain-vllm-"))
        self._asleep = False
        self._woken: set[str] = set()  # memory tags restored since the last sleep
        self._weights_discarded = False
        # as many requests in vLLM as it schedules at once: the rest wait in our queue, where
        # a pause holds them (vLLM would start them)
        self._in_vllm: set[str] = set()
        self.requests = RequestQueue(
            self._step, lambda: self._version, capacity=config.max_num_seqs, reset=self._reset
        )

    @property
    def weight_version(self) -> int:
        return self._version

    # ---- requests: vLLM's LLMEngine, stepped by whoever polls ---------------------------
    def sampling_params(self, params: SamplingParams) -> Any:
        from vllm.sampling_params import RequestOutputKind

        return self.vllm.SamplingParams(
            n=1,
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=params.top_k if params.top_k > 0 else 0,
            max_tokens=params.max_new_tokens,
            stop=list(params.stop) or None,
            stop_token_ids=list(params.stop_token_ids) or None,
            ignore_eos=params.ignore_eos,
            seed=params.seed,
            logprobs=0,  # the sampled token's log-prob only
            include_stop_str_in_output=True,
            output_kind=RequestOutputKind.DELTA,  # each step's new tokens
        )

    def _step(self, joining: list[Request], aborted: list[str]) -> list[TokenEvent]:
        """Aborted requests leave vLLM (it reports nothing more for them), joining ones enter
        its scheduler, then one engine step; every output is a request's new tokens."""
        engine = self.llm.llm_engine
        if aborted:
            engine.abort_request(aborted)
            self._in_vllm -= set(aborted)
        for request in joining:
            self._in_vllm.add(request.request_id)
            engine.add_request(
                request.request_id,
                {"prompt_token_ids": list(request.prompt_ids)},
                self.sampling_params(request.params),
                lora_request=self._lora_request,
            )
        if not engine.has_unfinished_requests():
            return []
        events = []
        for output in engine.step():
            sample = output.outputs[0]
            events.append(
                TokenEvent(
                    output.request_id,
                    list(sample.token_ids),
                    list(_sampled_log_probs(sample.token_ids, sample.logprobs)),
                    _finish_reason(sample.finish_reason) if output.finished else None,
                    self._routed(sample) if output.finished else None,
                )
            )
            if output.finished:
                self._in_vllm.discard(output.request_id)
        return events

    def _routed(self, sample: Any) -> RoutedExperts | None:
        """A finished request's routing (vLLM attaches it to the last output only)."""
        routing = getattr(sample, "routed_experts", None)
        if self._routing is None or routing is None:
            return None
        return routed_from_array(routing, *self._routing)

    def _reset(self) -> None:
        """After a failed step: nothing of ours stays in vLLM."""
        if self._in_vllm:
            self.llm.llm_engine.abort_request(sorted(self._in_vllm))
        self._in_vllm.clear()

    def check_ready(self) -> None:
        super().check_ready()
        if self._asleep:
            raise RuntimeError("the vllm rollout is asleep; call wake_up() first")
        if self._weights_discarded:
            raise RuntimeError("sleep(level=2) discarded the weights; send new weights first")

    # ---- weights ------------------------------------------------------------------------
    def update_weights(self, weights: Iterable[NamedTensor], *, version: int) -> None:
        adapter, empty, stream = peek_adapter(weights)
        with self.updating_weights(version) as update:  # between engine steps, never inside one
            if adapter:  # small: vLLM takes an adapter from a directory
                tensors = adapter_update(collect_weights(stream), self.config.lora.enabled)
                self._load_adapter(list(tensors or ()), version)
            elif not empty:
                # vLLM loads the update as it arrives; its layer-wise reload sets the layers
                # aside before the first tensor, so a failure leaves them torn
                update.changed = True
                if self.config.multiprocessing:  # worker processes read it from a directory
                    staged = stage_weights(stream, self._shapes)
                    directory = write_weights_dir(self._work_root / "weights", version, staged)
                    self._load_full({"directory": str(directory)}, version)
                    for old in directory.parent.iterdir():  # the previous update's directory
                        if old != directory:
                            shutil.rmtree(old, ignore_errors=True)
                else:
                    self._load_full({"tensors": checked_clones(stream, self._shapes)}, version)
            if not adapter:
                self._weights_discarded = False
            # its KV was computed with the old weights; running requests are preempted and
            # recompute theirs under the new ones (vLLM refuses the reset while they hold KV)
            self.llm.reset_prefix_cache(reset_running_requests=True)
            self._version = version

    def _load_full(self, update: dict[str, Any], version: int) -> None:
        """One full (or partial, never adapter) update: ``tensors`` or a ``directory``."""
        if self.weight_api:
            self.llm.start_weight_update()
            self.llm.update_weights({"update_info": update})
            self.llm.finish_weight_update(weight_version=str(version))
            return
        if "directory" in update:
            kwargs: dict[str, Any] = {"weights_path": update["directory"]}
        else:
            kwargs = {"weights_iterator": update["tensors"]}
        self.llm.collective_rpc("reload_weights", kwargs=kwargs)
        # a tied output layer is not reloaded with the embedding (see tied_head)
        self.llm.collective_rpc("drivetrain_refresh_tied_lm_head")

    def _load_adapter(self, tensors: list[tuple[str, torch.Tensor]], version: int) -> None:
        from vllm.lora.request import LoRARequest

        config = adapter_config(self.config.lora, self.config.model_path)
        directory = write_adapter(self._work_root / "lora", version, tensors, config)
        previous = self._lora_request
        # a new id makes vLLM load the new adapter; the old one is evicted
        new_id = 1 if previous is None else previous.lora_int_id + 1
        self._lora_request = LoRARequest(f"policy-v{version}", new_id, str(directory))
        if previous is not None:
            self.llm.llm_engine.remove_lora(previous.lora_int_id)

    # ---- memory -------------------------------------------------------------------------
    def sleep(self, level: int = 1) -> bool:
        super().sleep(level)
        if self.on_cpu or not self.config.enable_sleep_mode:
            return False  # vLLM's CPU backend ignores sleep: nothing is freed
        with self.requests.lock:  # nothing runs on a sleeping engine
            self.requests.pause(abort=True)
            self.llm.sleep(level=level)
        self._asleep = True
        self._woken = set()
        self._weights_discarded = level == 2
        return True

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        super().wake_up(tags)
        if not self._asleep:
            return
        wanted = set(MEMORY_TAGS if tags is None else tags) - self._woken
        if wanted:
            self.llm.wake_up(tags=sorted(wanted))
            self._woken |= wanted
        if self._woken >= MEMORY_TAGS:
            self.requests.resume()
            self._asleep = False
            self._woken = set()

    def shutdown(self) -> None:
        engine = getattr(self, "llm", None)
        if engine is not None:
            shutdown = getattr(engine.llm_engine, "shutdown", None)
            if shutdown is not None:
                shutdown()
            self.llm = None  # type: ignore[assignment]
        shutil.rmtree(getattr(self, "_work_root", ""), ignore_errors=True)


def _uses_weight_transfer_api(mode: str) -> bool:
    from drivetrain.rollout.vllm.worker_extension import has_weight_transfer_api

    available = has_weight_transfer_api()
    if mode == "api" and not available:
        import vllm

        raise ValueError(
            f"rollout.weight_transfer=api needs vLLM's weight-transfer API, which vLLM "
            f"{vllm.__version__} lacks; use auto or reload"
        )
    return available and mode != "reload"


# vLLM sizes its LoRA kernels for these ranks only; a smaller adapter fits the next one up.
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def _max_lora_rank(rank: int) -> int:
    fitting = [r for r in LORA_RANKS if r >= rank]
    if not fitting:
        raise ValueError(f"rollout.lora.rank={rank} exceeds vLLM's largest ({LORA_RANKS[-1]})")
    return fitting[0]


def _finish_reason(reason: str | None) -> FinishReason:
    """vLLM's reason for a finished request; anything but stop/length/abort (its ``error``)
    ended the request without finishing it, which is what ``abort`` tells the caller."""
    return FINISH_REASONS.get(reason or "", FinishReason.ABORT)


def _sampled_log_probs(token_ids: Sequence[int], logprobs: Any) -> tuple[float, ...]:
    if logprobs is None:
        raise RuntimeError("vLLM returned no log-probs; was logprobs=0 dropped?")
    return tuple(
        float(step[token].logprob) for token, step in zip(token_ids, logprobs, strict=True)
    )
