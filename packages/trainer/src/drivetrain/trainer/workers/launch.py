"""Pick how the engine's ranks run: this process, torchrun's processes, or Ray actors."""

from __future__ import annotations

import os

from drivetrain.api.errors import ConfigError
from drivetrain.trainer.job_config import WorkersConfig
from drivetrain.trainer.workers.group import (
    LocalWorkerGroup,
    WorkerFactory,
    WorkerGroup,
    launched_by_torchrun,
)
from drivetrain.trainer.workers.shared_paths import SharedPaths


def resolve_launcher(workers: WorkersConfig) -> str:
    if workers.launcher != "auto":
        return workers.launcher
    if launched_by_torchrun():
        return "torchrun"
    return "ray" if workers.num > 1 else "inprocess"


def writes_files(workers: WorkersConfig) -> bool:
    """Whether this process is the one that writes the run's files (rank 0 of torchrun's
    processes, else the only process), known before any process group exists."""
    if resolve_launcher(workers) == "torchrun":
        return int(os.environ.get("RANK", "0")) == 0
    return True


def make_worker_group(
    factory: WorkerFactory, workers: WorkersConfig, *, shared: SharedPaths
) -> WorkerGroup:
    """The ranks ``factory`` builds, launched as ``workers`` says; Ray's ranks (on any node of
    a cluster) must see ``shared`` first."""
    launcher = resolve_launcher(workers)
    if launcher == "torchrun":
        if not launched_by_torchrun():
            raise ConfigError(
                "workers.launcher=torchrun, but this process was not started by torchrun; run "
                "`torchrun --nproc-per-node N -m drivetrain.trainer sft ...`"
            )
        return LocalWorkerGroup(factory)
    if launcher == "inprocess":
        if workers.num != 1:
            raise ConfigError(
                f"workers.launcher=inprocess runs one rank, but workers.num={workers.num}; "
                "use workers.launcher=ray (or torchrun) for more"
            )
        return LocalWorkerGroup(factory)
    from drivetrain.trainer.workers.ray_group import RayWorkerGroup

    return RayWorkerGroup(factory, workers, shared=shared)
