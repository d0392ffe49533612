"""Configuration of the rollout backends (light: imports only ``drivetrain.api``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from drivetrain.api.config import LoraConfig
from drivetrain.api.errors import ConfigError
from drivetrain.api.hosting import HostingConfig

DEVICES = ("auto", "cpu", "cuda")


@dataclass(frozen=True)
class BackendConfig(HostingConfig):
    """Knobs every drivetrain rollout backend has on top of the api's ``RolloutConfig``: the
    hosting knobs (``python``, ``start_timeout_s``, ``request_timeout_s``, ``env``; see
    :class:`~drivetrain.api.hosting.HostingConfig`), and a ``device`` of :data:`DEVICES`.

    ``python`` names the interpreter of another Python environment (one made by
    ``python -m drivetrain.rollout.env``): the backend then runs there as a server process and
    only plain data and weight bytes cross over, so that environment may pin its own torch and
    transformers. Empty: the backend runs in this process.
    """

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.device not in DEVICES:
            raise ConfigError(f"rollout.device={self.device!r} must be one of {DEVICES}")


@dataclass(frozen=True)
class HFRolloutConfig(BackendConfig):
    """A transformers model with continuous batching (``hf/batcher.py``). ``max_batch_size``:
    requests running at once (more wait for a free row); ``num_threads``: torch intra-op
    threads for this process (0 leaves torch's choice); ``share_prompt_prefill``: requests
    joining together with the same prompt (the n samples of a prompt) prefill it once."""

    max_batch_size: int = 64
    num_threads: int = 0
    share_prompt_prefill: bool = True
    attn_implementation: str = "sdpa"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.max_batch_size < 1 or self.num_threads < 0:
            raise ConfigError("rollout.max_batch_size must be >= 1 and num_threads >= 0")

    def device_share(self) -> tuple[float, int]:
        return 0.0, self.max_batch_size


@dataclass(frozen=True)
class VLLMRolloutConfig(BackendConfig):
    """vLLM's offline engine.

    ``multiprocessing=False`` keeps vLLM's engine core in this process (uni executor at
    tensor-parallel size 1), so new weights are handed over as tensors through vLLM's
    ``reload_weights``; with worker processes (``multiprocessing=True``, required for tensor
    parallel) they are handed over through a directory (see ``vllm/rollout.py``).
    ``kv_cache_space_gib`` sets ``VLLM_CPU_KVCACHE_SPACE`` on CPU. ``weight_transfer``: how
    full weight updates enter vLLM: ``"api"`` through vLLM's weight-transfer API (its update
    lifecycle, with drivetrain's engine), ``"reload"`` through ``reload_weights``, ``"auto"``
    the API where the installed vLLM has it (0.32 does).
    """

    gpu_memory_utilization: float = 0.5
    kv_cache_space_gib: int = 2
    max_num_seqs: int = 256
    enforce_eager: bool = True
    enable_prefix_caching: bool = True
    enable_sleep_mode: bool = True
    multiprocessing: bool = False
    lora: LoraConfig = field(default_factory=LoraConfig)
    max_loras: int = 1
    weight_transfer: str = "auto"

    def __post_init__(self) -> None:
        super().__post_init__()
        _refuse_exact(self, "vllm")
        if self.weight_transfer not in ("auto", "api", "reload"):
            raise ConfigError(
                f"rollout.weight_transfer must be auto, api or reload, got {self.weight_transfer!r}"
            )
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ConfigError("rollout.gpu_memory_utilization must be in (0, 1]")
        if self.kv_cache_space_gib < 1 or self.max_num_seqs < 1:
            raise ConfigError("rollout.kv_cache_space_gib and max_num_seqs must be >= 1")

    def device_share(self) -> tuple[float, int]:
        return self.gpu_memory_utilization, self.max_num_seqs


@dataclass(frozen=True)
class SGLangRolloutConfig(BackendConfig):
    """SGLang's offline ``Engine`` (CUDA only).

    ``enable_memory_saver`` lets ``sleep`` release weights and KV cache
    (``release_memory_occupation``); ``weights_cpu_backup`` keeps a host copy of the weights
    while asleep, so ``sleep(level=1)`` frees them too and ``wake_up`` restores them (SGLang
    >= 0.5.3; without it level 1 frees the KV cache only). ``deterministic_inference`` makes
    SGLang honour per-request seeds (``SamplingParams.seed``); it costs throughput.
    New weights go over in CUDA tensor buckets of at most ``weight_bucket_bytes``. At most
    ``max_running_requests`` requests run at once (SGLang's server arg of that name); the rest
    wait in the rollout's queue, where a pause holds them.
    """

    mem_fraction_static: float = 0.5
    enable_memory_saver: bool = True
    weights_cpu_backup: bool = True
    deterministic_inference: bool = False
    disable_cuda_graph: bool = False
    attention_backend: str = ""
    log_level: str = "error"
    weight_bucket_bytes: int = 512 * 1024 * 1024
    max_running_requests: int = 256
    lora: LoraConfig = field(default_factory=LoraConfig)

    def __post_init__(self) -> None:
        super().__post_init__()
        _refuse_exact(self, "sglang")
        if self.max_running_requests < 1:
            raise ConfigError("rollout.max_running_requests must be >= 1")
        if not 0 < self.mem_fraction_static <= 1:
            raise ConfigError("rollout.mem_fraction_static must be in (0, 1]")
        if self.weight_bucket_bytes < 1:
            raise ConfigError("rollout.weight_bucket_bytes must be >= 1")

    def device_share(self) -> tuple[float, int]:
        return self.mem_fraction_static, self.max_running_requests


def _refuse_exact(config: BackendConfig, backend: str) -> None:
    """A backend without the ``exact_numerics`` capability refuses the setting rather than
    ignore it."""
    if config.numerics != "default":
        raise ConfigError(f"rollout.numerics={config.numerics} is not implemented by {backend}")
