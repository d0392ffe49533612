"""What every job's configuration shares: logging and where the workers run, plugging the
chosen engine's config class into a job's ``engine`` field, and the layers a built-in task puts
beneath the user's config."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from drivetrain.api.config import EngineConfig
from drivetrain.api.errors import ConfigError

if TYPE_CHECKING:
    from drivetrain.trainer.config_loader import ConfigLayer

LAUNCHERS = ("auto", "inprocess", "torchrun", "ray")


@dataclass(frozen=True)
class LoggingConfig:
    tensorboard: bool = True
    wandb: bool = True  # when wandb is installed; offline unless WANDB_MODE says otherwise
    wandb_project: str = "drivetrain"
    progress: bool = True


@dataclass(frozen=True)
class WorkersConfig:
    """Where the engine's ranks run. ``auto``: torchrun's ranks when launched by torchrun, else
    Ray actors when ``num > 1``, else this process."""

    num: int = 1
    launcher: str = "auto"
    ray_address: str = ""  # join an existing cluster ("auto" or "host:port"); empty: start one
    cpus_per_worker: float = 1.0
    gpus_per_worker: float = -1.0  # -1: one GPU each when the cluster has GPUs, else none
    start_timeout_s: float = 300.0

    def __post_init__(self) -> None:
        if self.launcher not in LAUNCHERS:
            raise ConfigError(
                f"workers.launcher={self.launcher!r} is not one of {', '.join(LAUNCHERS)}"
            )
        if self.num < 1:
            raise ConfigError(f"workers.num={self.num} must be >= 1")


def with_engine_config(
    config: type[Any], engine_config: type[EngineConfig], default: Callable[[], EngineConfig]
) -> type[Any]:
    """``config`` (a frozen dataclass with an ``engine`` field) whose ``engine`` has the chosen
    engine's config class, keeping ``default()``'s values for the fields the base class
    shares (a job's own defaults: lr, token budget)."""
    base = default()
    shared = {f.name: getattr(base, f.name) for f in dataclasses.fields(EngineConfig)}

    def plugged() -> Any:
        return engine_config(**shared)

    return dataclasses.make_dataclass(
        f"{config.__name__}[{engine_config.__name__}]",
        [("engine", engine_config, field(default_factory=plugged))],
        bases=(config,),
        frozen=True,
    )


@dataclass(frozen=True)
class RunConfig:
    """How long a supervised job (SFT, DPO) trains and what it keeps."""

    output_dir: str = "runs/sft"
    epochs: int = 1
    max_steps: int | None = None  # overrides epochs when set
    batch_size: int = 32  # sequences per optimizer step, over all data-parallel ranks
    eval_every: int = 0  # validation loss every N steps (0: only at the end, if val data)
    eval_batch_size: int = 64
    save_every: int = 0  # checkpoint every N steps (0: only at the end)
    keep_last: int = 2  # complete checkpoints kept; older ones are deleted
    export_hf: bool = True  # write a Hugging Face model directory at the end
    #: after SIGTERM/SIGINT, the step in progress and its checkpoint must end within this many
    #: seconds, else the run exits without a new checkpoint (0: no limit). Set it a little
    #: under the scheduler's kill delay (Slurm's KillWait and Kubernetes' grace: 30 s)
    stop_grace_s: float = 25.0
    checkpoint_on_interrupt: bool = False  # SIGINT (Ctrl-C) also checkpoints; SIGTERM always

    def __post_init__(self) -> None:
        for name in ("epochs", "batch_size", "eval_batch_size", "keep_last"):
            if getattr(self, name) < 1:
                raise ConfigError(f"run.{name}={getattr(self, name)} must be >= 1")
        if self.stop_grace_s < 0:
            raise ConfigError(f"run.stop_grace_s={self.stop_grace_s} must be >= 0")
        if self.max_steps is not None and self.max_steps < 1:
            raise ConfigError(f"run.max_steps={self.max_steps} must be >= 1")
        for name in ("eval_every", "save_every"):
            if getattr(self, name) < 0:
                raise ConfigError(f"run.{name}={getattr(self, name)} must be >= 0")


@dataclass(frozen=True)
class TaskLayers:
    """What a command runs when given no data and no model: a built-in task's config beneath
    the user's files and overrides. A job takes the function that makes these as a hook (the
    built-in tasks sit above the jobs and pass theirs in), so no job knows a task."""

    files: tuple[ConfigLayer, ...] = ()  # beneath everything the job ships
    #: RL: the task's settings for the chosen algorithm, over the algorithm's own defaults
    algorithm_files: tuple[ConfigLayer, ...] = ()
    overrides: tuple[str, ...] = ()  # the paths of what it built (data, models)
    assets: Any = None  # what the task's report reads (its held-out problems...)
