"""Run a worker script on N ranks (drivetrain-testing's launch_ranks); each rank's report."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from drivetrain.testing.torch_engines.ranks import launch_ranks, write_result

HERE = Path(__file__).parent
#: what every worker imports: its ranks fork from a process that has
#: (drivetrain.testing.torch_engines.ranks)
PRELOAD = ("drivetrain.engine.fsdp.engine",)
__all__ = ["launch", "write_result"]


def launch(
    script: str, out_dir: Path, *args: str, nproc: int = 2, timeout: float = 600
) -> list[Any]:
    return launch_ranks(
        HERE / script,
        out_dir,
        *args,
        nproc=nproc,
        timeout=timeout,
        pythonpath=[HERE],
        preload=PRELOAD,
    )
