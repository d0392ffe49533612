"""The Megatron-FSDP engine's configuration (no torch import: the trainer reads it to validate
runs)."""

from __future__ import annotations

from dataclasses import dataclass

from drivetrain.api import ConfigError
from drivetrain.engine.megatron.config import MegatronConfig

#: what is sharded over the data-parallel ranks (ZeRO-1, ZeRO-2, ZeRO-3)
STRATEGIES = ("optim", "optim_grads", "optim_grads_params")


@dataclass(frozen=True)
class MegatronFSDPConfig(MegatronConfig):
    """engine-megatron's knobs, with Megatron-FSDP in place of megatron's DDP.

    ``sharding_strategy``: ``optim`` shards the optimizer state, ``optim_grads`` also the
    gradients, ``optim_grads_params`` (default) also the parameters, which are then gathered
    one transformer layer at a time around its forward and backward. Advanced knobs (``None``:
    Megatron-FSDP's choice): ``overlap_grad_reduce`` / ``overlap_param_gather`` (Megatron-FSDP
    forces both on where its strategy needs them), ``bucket_size`` (elements per
    communication bucket). ``no_shard`` is refused: its first optimizer step fails with
    megatron-fsdp 0.3.1 (see the README). At data-parallel size 1 every strategy runs as
    ``optim`` (see ``wrap.py``).
    """

    sharding_strategy: str = "optim_grads_params"
    overlap_grad_reduce: bool | None = None
    overlap_param_gather: bool | None = None
    bucket_size: int | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.sharding_strategy == "no_shard":
            raise ConfigError(
                "sharding_strategy='no_shard' does not work with megatron-fsdp 0.3.1 / "
                "megatron-core 0.16.1 (measured: the first optimizer step fails in "
                "start_param_sync, 'NoneType' object has no attribute 'fetch_bucket'); use "
                f"engine megatron (plain DDP) or one of {', '.join(STRATEGIES)}"
            )
        if self.sharding_strategy not in STRATEGIES:
            choices = ", ".join(STRATEGIES)
            raise ConfigError(
                f"sharding_strategy={self.sharding_strategy!r} is not one of {choices}"
            )
        if not self.distributed_optimizer:
            raise ConfigError(
                "Megatron-FSDP always shards the optimizer: distributed_optimizer must stay True"
            )
        for name in ("context_parallel", "expert_parallel"):
            if getattr(self, name) > 1:
                raise ConfigError(
                    f"{name} > 1 is not supported by the megatron_fsdp engine yet; "
                    "use engine megatron"
                )
        if self.bucket_size is not None and self.bucket_size < 1:
            raise ConfigError(f"bucket_size={self.bucket_size} must be >= 1")
        if self.offload.params or self.offload.optimizer:
            raise ConfigError(
                "the megatron_fsdp engine has no offload yet (offload.params / "
                "offload.optimizer); use engine megatron"
            )
