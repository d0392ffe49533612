"""Per-transport configuration (light module: no torch)."""

from __future__ import annotations

from dataclasses import dataclass

from drivetrain.api.config import WeightSyncConfig
from drivetrain.api.errors import ConfigError


@dataclass(frozen=True)
class ColocatedConfig(WeightSyncConfig):
    """Shared memory between processes on the CPU, CUDA IPC handles on one GPU."""

    #: The address the sender listens on for its receivers (same machine by definition).
    host: str = "127.0.0.1"


@dataclass(frozen=True)
class BroadcastConfig(WeightSyncConfig):
    """A process group from the sending trainer rank to every rollout worker."""

    #: An address of the sending machine that every receiver can reach.
    host: str = "127.0.0.1"
    #: Port of the group's rendezvous store; 0 picks a free one at ``prepare``.
    port: int = 0
    #: Override the collective backend ("gloo", "nccl", "hccl"); "" chooses from the device.
    backend: str = ""

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0 <= self.port < 65536:
            raise ConfigError(f"weight_sync.port={self.port} must be in [0, 65535]")


@dataclass(frozen=True)
class DiskConfig(WeightSyncConfig):
    """safetensors shards (at most ``bucket_bytes`` each, unless one tensor is larger)."""

    #: A directory every receiver can read; "" makes a temporary one (single machine only).
    path: str = ""
    #: Published versions kept on disk after every receiver confirmed the newest.
    keep_versions: int = 1
    #: A peer whose heartbeat file (rewritten every 0.5 s) stood still this long is dead;
    #: raise it on a network filesystem that shows other machines' writes late.
    liveness_s: float = 10.0

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.keep_versions < 1:
            raise ConfigError(f"weight_sync.keep_versions={self.keep_versions} must be >= 1")
        if self.liveness_s < 2:
            raise ConfigError(f"weight_sync.liveness_s={self.liveness_s} must be >= 2 s")
