"""The cluster ``drivetrain plan`` plans for: a device model (its memory, dense bf16 peak and
memory bandwidth, from the vendors' sheets) times a number of GPUs over some nodes."""

from __future__ import annotations

from dataclasses import dataclass

from drivetrain.api.errors import ConfigError


@dataclass(frozen=True)
class Accelerator:
    name: str
    memory_gib: float
    bf16_tflops: float
    hbm_tb_per_s: float


ACCELERATORS = {
    a.name: a
    for a in (
        Accelerator("h100-80gb", 79.6, 989.0, 3.35),
        Accelerator("h200-141gb", 139.8, 989.0, 4.8),
        Accelerator("a100-80gb", 79.3, 312.0, 2.04),
        Accelerator("a100-40gb", 39.4, 312.0, 1.56),
        Accelerator("b200-180gb", 178.4, 2250.0, 8.0),
    )
}


def accelerator(name: str) -> Accelerator:
    """The device called ``name``; one line naming the known ones otherwise."""
    if name not in ACCELERATORS:
        raise ConfigError(f"--gpu {name!r} is not one of {', '.join(ACCELERATORS)}")
    return ACCELERATORS[name]


@dataclass(frozen=True)
class PlanTarget:
    """Where the job will run: ``gpus`` devices in all over ``nodes`` nodes."""

    device: Accelerator
    gpus: int = 1
    nodes: int = 1

    def __post_init__(self) -> None:
        if self.gpus < 1 or self.nodes < 1 or self.gpus % self.nodes:
            raise ConfigError(f"--gpus {self.gpus} must be >= 1 and a multiple of --nodes")
