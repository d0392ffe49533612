"""The Megatron engine's configuration (no torch import: the trainer reads it to validate runs)."""

from __future__ import annotations

from dataclasses import dataclass

from drivetrain.api import ConfigError, EngineConfig


@dataclass(frozen=True)
class MegatronConfig(EngineConfig):
    """Knobs of drivetrain's Megatron-Core engine.

    The world is ``tensor_parallel * pipeline_parallel * data_parallel`` (data parallel is what
    is left). ``virtual_pipeline``: model chunks per pipeline stage (interleaved schedule;
    needs ``pipeline_parallel > 1``). ``sequence_parallel`` splits activations outside attention
    and MLP along the sequence over the tensor-parallel group. ``distributed_optimizer`` shards
    optimizer state (ZeRO-1) over data-parallel ranks. ``model.gradient_checkpointing`` turns on
    full activation recompute.

    ``context_parallel`` splits every sequence over that many ranks (load-balanced chunks; needs
    TransformerEngine on CUDA, refused on CPU); the world is then
    ``tensor_parallel * pipeline_parallel * context_parallel * data_parallel``.
    ``expert_parallel`` (mixture-of-experts models) spreads the experts over that many ranks of
    the data-parallel x context-parallel ranks; ``expert_tensor_parallel`` splits each expert
    (default: ``tensor_parallel``, megatron's default).

    ``packed_kernel``: what attends within each document of a packed row (no ``[T, T]`` mask
    or score matrix in any case): ``auto`` takes one variable-length kernel call per layer on
    CUDA (flash-attn's when installed, else PyTorch's ``varlen_attn``) and the grouped SDPA
    path elsewhere; or name one (``flash_attn``, ``torch_varlen``, ``grouped_sdpa``), checked
    when the engine starts. With ``context_parallel`` TransformerEngine's attention runs instead.
    """

    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    virtual_pipeline: int = 1
    sequence_parallel: bool = False
    distributed_optimizer: bool = True
    context_parallel: int = 1
    expert_parallel: int = 1
    expert_tensor_parallel: int | None = None
    packed_kernel: str = "auto"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.numerics != "default":  # no exact_numerics capability: refuse, never ignore
            raise ConfigError(f"numerics={self.numerics} is not implemented by megatron engines")
        names = (
            "tensor_parallel",
            "pipeline_parallel",
            "virtual_pipeline",
            "context_parallel",
            "expert_parallel",
        )
        if self.expert_tensor_parallel is not None:
            names += ("expert_tensor_parallel",)
        for name in names:
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}={getattr(self, name)} must be >= 1")
        if self.virtual_pipeline > 1 and self.pipeline_parallel < 2:
            raise ConfigError("virtual_pipeline > 1 needs pipeline_parallel >= 2")
        if self.sequence_parallel and self.tensor_parallel < 2:
            raise ConfigError("sequence_parallel needs tensor_parallel >= 2")
        if self.model.lora.enabled:
            raise ConfigError(
                "the megatron engine has no LoRA (model.lora.enabled): use engine fsdp2 for LoRA"
            )
