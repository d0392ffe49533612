"""Run a worker script here on N ranks with engine-core's launcher; each rank's JSON report."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from drivetrain.engine_core.testing import launch_ranks, write_result

HERE = Path(__file__).parent
#: what every worker imports: its ranks fork from a process that has (engine_core.testing)
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
