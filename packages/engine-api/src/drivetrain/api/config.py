"""Configuration shapes shared by every engine, rollout and weight-sync backend.

Frozen, nested stdlib dataclasses. Each backend adds its own dataclass beside its code,
usually by subclassing :class:`EngineConfig`. Loading YAML files and dotted command-line
overrides into these classes is the trainer's job; here each class only checks that its values
make sense and names the valid choices when they do not.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, TypeVar

from drivetrain.api.errors import ConfigError

_C = TypeVar("_C")

SCHEDULERS = ("constant", "linear", "cosine")
DTYPES = ("float32", "bfloat16", "float16")


def coerce_config(config: Any, cls: type[_C]) -> _C:
    """``config`` as a ``cls``: itself when it is one, else a ``cls`` built from its fields
    (a caller that knows only the base class, e.g. a test passing an :class:`EngineConfig`, to
    a backend with its own subclass; the subclass's extra fields keep their defaults)."""
    if isinstance(config, cls):
        return config
    return cls(**{name: getattr(config, name) for name in vars(config)})


def _check_choice(owner: str, name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(f"{owner}.{name}={value!r} is not one of {', '.join(choices)}")


def _check_positive(
    owner: str, name: str, value: float | None, *, allow_zero: bool = False
) -> None:
    if value is None:
        return
    if value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ConfigError(f"{owner}.{name}={value!r} must be {bound}")


@dataclass(frozen=True)
class LoraConfig:
    """LoRA adapters; ``rank == 0`` means full fine-tuning."""

    rank: int = 0
    alpha: int = 16
    dropout: float = 0.0
    target_modules: tuple[str, ...] = ("all-linear",)

    def __post_init__(self) -> None:
        _check_positive("lora", "rank", self.rank, allow_zero=True)
        _check_positive("lora", "alpha", self.alpha)
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"lora.dropout={self.dropout!r} must be in [0, 1)")

    @property
    def enabled(self) -> bool:
        return self.rank > 0


@dataclass(frozen=True)
class ModelConfig:
    """Which model to train and how to hold its parameters.

    ``path`` is a local Hugging Face model directory. ``dtype`` is the parameter dtype;
    engines may keep an fp32 master copy regardless.
    """

    path: str = ""
    dtype: str = "float32"
    trust_remote_code: bool = False
    gradient_checkpointing: bool = False
    value_head: bool = False  # one scalar per token instead of logits (critics, reward models)
    lora: LoraConfig = field(default_factory=LoraConfig)

    def __post_init__(self) -> None:
        _check_choice("model", "dtype", self.dtype, DTYPES)


@dataclass(frozen=True)
class OptimConfig:
    """AdamW and its learning-rate schedule.

    The schedule warms up linearly over ``warmup_steps`` (or ``warmup_ratio * total_steps``),
    then stays constant, decays linearly, or follows a cosine, down to ``min_lr_ratio * lr``.
    ``total_steps`` may stay unset in a config file: trainers fill it in from the run length;
    a schedule that needs it fails when it is first evaluated (:func:`.schedule.lr_multiplier`).
    """

    lr: float = 1e-5
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.01
    clip_grad: float | None = 1.0
    scheduler: str = "constant"
    warmup_steps: int | None = None
    warmup_ratio: float = 0.0
    min_lr_ratio: float = 0.0
    total_steps: int | None = None

    def __post_init__(self) -> None:
        _check_positive("optim", "lr", self.lr)
        _check_positive("optim", "eps", self.eps)
        _check_positive("optim", "weight_decay", self.weight_decay, allow_zero=True)
        _check_positive("optim", "clip_grad", self.clip_grad)
        _check_positive("optim", "warmup_steps", self.warmup_steps, allow_zero=True)
        _check_positive("optim", "total_steps", self.total_steps)
        _check_choice("optim", "scheduler", self.scheduler, SCHEDULERS)
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            raise ConfigError(f"optim.betas={self.betas!r} must be two numbers in [0, 1)")
        for name in ("warmup_ratio", "min_lr_ratio"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ConfigError(f"optim.{name}={getattr(self, name)!r} must be in [0, 1]")


@dataclass(frozen=True)
class MicroBatchConfig:
    """How an engine cuts a mini-batch into micro-batches: a fixed number of samples, or a
    token budget per micro-batch ("dynamic batch size"). Set exactly one."""

    micro_batch_size: int | None = None
    max_tokens: int | None = None

    def __post_init__(self) -> None:
        if (self.micro_batch_size is None) == (self.max_tokens is None):
            raise ConfigError(
                "micro_batch: set exactly one of micro_batch_size and max_tokens "
                f"(got micro_batch_size={self.micro_batch_size}, max_tokens={self.max_tokens})"
            )
        _check_positive("micro_batch", "micro_batch_size", self.micro_batch_size)
        _check_positive("micro_batch", "max_tokens", self.max_tokens)


def _default_micro_batch() -> MicroBatchConfig:
    return MicroBatchConfig(micro_batch_size=1)


@dataclass(frozen=True)
class OffloadConfig:
    """Move parameters / optimizer state to host memory while the engine is not in a mode that
    needs them (the contexts ``train_mode()`` and ``eval_mode()`` bring them back)."""

    params: bool = False
    optimizer: bool = False


#: ``exact``: the log-probs of a rollout and of an engine, both declaring the capability
#: ``exact_numerics``, are bitwise equal for every token, whatever the batch, cache and packing
NUMERICS = ("default", "exact")


@dataclass(frozen=True)
class EngineConfig:
    """What every training engine is configured with. Engines subclass it for their own knobs
    (and call this ``__post_init__`` from theirs). ``numerics``: one of :data:`NUMERICS`."""

    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    micro_batch: MicroBatchConfig = field(default_factory=_default_micro_batch)
    offload: OffloadConfig = field(default_factory=OffloadConfig)
    device: str = "auto"  # "auto", "cpu", "cuda", "npu"; auto picks the accelerator if present
    seed: int = 0
    numerics: str = "default"

    def __post_init__(self) -> None:
        _check_choice("engine", "numerics", self.numerics, NUMERICS)


@dataclass(frozen=True)
class RolloutConfig:
    """What every rollout backend is configured with. Backends subclass it for their own knobs.

    ``stall_timeout_s`` is the progress deadline of a rollout that is alive but silent (a
    stopped or hung process, a backend that stops producing tokens): a rollout that answers
    no call, or produces no token while requests of the trainer run on it, for this long
    fails the run with one line naming it. It bounds a stall; the time one request may take
    is the backend's own (``rollout.request_timeout_s``), and a weight sync's transfer has
    ``weight_sync.timeout_s``. ``numerics``: one of :data:`NUMERICS`.
    ``return_routed_experts``: report the experts a mixture-of-experts model routed every
    position to (:mod:`drivetrain.api.routing`), for an engine to replay; a backend without the
    ``routed_experts`` capability refuses it.
    """

    model_path: str = ""
    dtype: str = "float32"
    max_model_len: int = 2048
    tensor_parallel_size: int = 1
    device: str = "auto"
    seed: int = 0
    stall_timeout_s: float = 60.0
    numerics: str = "default"
    return_routed_experts: bool = False

    def __post_init__(self) -> None:
        _check_choice("rollout", "dtype", self.dtype, DTYPES)
        _check_choice("rollout", "numerics", self.numerics, NUMERICS)
        _check_positive("rollout", "max_model_len", self.max_model_len)
        _check_positive("rollout", "tensor_parallel_size", self.tensor_parallel_size)
        if self.stall_timeout_s < 2:  # a server process says it is alive once a second
            raise ConfigError(f"rollout.stall_timeout_s={self.stall_timeout_s:g} must be >= 2")

    def device_share(self) -> tuple[float, int]:
        """For planning: the fraction of its device a replica reserves to generate (0: what
        its weights and KV cache need), and the sequences it runs at once."""
        return 0.0, 64


@dataclass(frozen=True)
class WeightSyncConfig:
    """What every weight-sync transport is configured with.

    ``device`` is where buckets live and which collective backend moves them ("auto": the
    accelerator if there is one, else the CPU). ``verify`` makes both ends hash every byte they
    move (names, dtypes, shapes and data) and refuse a stream whose hashes differ; it costs a
    pass over the weights at each end.

    Every wait for a peer has a deadline that grows with the bytes the wait covers
    (:meth:`deadline_s`): ``timeout_s + nbytes / (min_gb_per_s * 1e9)`` seconds, where
    ``nbytes`` is one bucket for a bucket-by-bucket transport and a whole version for one that
    moves the stream at once (disk). With the defaults a 256 MiB bucket may take 65 s and a
    16 GB version 380 s. A peer that dies is noticed sooner, through the transport's own abort
    signal; the deadline is for a peer that is alive but stuck.
    """

    bucket_bytes: int = 256 * 1024 * 1024
    #: The fixed part of every deadline: export work between buckets, connection set-up.
    timeout_s: float = 60.0
    #: The slowest rate a healthy sync is assumed to reach, in GB/s (conservative on purpose).
    min_gb_per_s: float = 0.05
    device: str = "auto"
    verify: bool = False
    #: Send only the tensors whose fingerprint changed since the version every rollout holds
    #: (frozen layers never travel; an unchanged model moves nothing); a failed sync makes
    #: the next one send everything.
    delta: bool = True
    #: After each sync, every rollout that can fingerprint its weights
    #: (``Rollout.weights_fingerprint``) must serve exactly what was sent, or the sync fails
    #: naming the rollout, the version and the first tensor that differs.
    provenance: bool = True

    def __post_init__(self) -> None:
        _check_positive("weight_sync", "bucket_bytes", self.bucket_bytes)
        _check_positive("weight_sync", "timeout_s", self.timeout_s)
        _check_positive("weight_sync", "min_gb_per_s", self.min_gb_per_s)

    def deadline_s(self, nbytes: int) -> float:
        """How long a wait that moves ``nbytes`` may last before the peer counts as stuck."""
        return self.timeout_s + nbytes / (self.min_gb_per_s * 1e9)
