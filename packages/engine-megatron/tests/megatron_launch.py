"""Start a worker script on N local ranks with launch_ranks (torchrun's environment,
one torch thread, own sessions, a deadline). Workers here write ``rank{r}.pt`` (their reports
hold tensors); it is read back weights-only."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from drivetrain.testing.torch_engines.ranks import launch_ranks

HERE = Path(__file__).parent
#: what every worker imports: its ranks fork from a process that has
#: (drivetrain.testing.torch_engines.ranks)
PRELOAD = ("drivetrain.engine.megatron.engine",)


def _read(out_dir: Path, rank: int) -> Any:
    return torch.load(out_dir / f"rank{rank}.pt", weights_only=True)


def launch(
    script: str, out_dir: Path, *args: str, nproc: int = 2, timeout: float = 300
) -> list[Any]:
    """``script`` (here, or an absolute path) on ``nproc`` ranks; each rank's report."""
    return launch_ranks(
        HERE / script,
        out_dir,
        *args,
        nproc=nproc,
        timeout=timeout,
        pythonpath=[HERE],
        read=_read,
        preload=PRELOAD,
    )


def write_result(out_dir: str, value: Any) -> None:
    torch.save(value, Path(out_dir, f"rank{os.environ.get('RANK', '0')}.pt"))


def single_thread() -> None:
    torch.set_num_threads(1)
    torch.set_num_interop_threads(1)
