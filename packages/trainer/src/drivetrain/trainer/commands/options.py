"""The training commands' command-line options: config files and overrides, the engine, what
to do instead of training, and where a run starts; then the RL commands' own (their roles'
engines, the rollout, the transport, a preset)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

Overrides = Annotated[
    list[str] | None,
    typer.Argument(help="Dotted config overrides, e.g. engine.optim.lr=1e-5 run.max_steps=9"),
]
ConfigFiles = Annotated[
    list[Path] | None, typer.Option("--config", "-c", help="YAML config file(s), merged in order.")
]
EngineName = Annotated[
    str, typer.Option("--engine", help="Training engine (see `drivetrain engines`).")
]
PrintConfig = Annotated[
    bool, typer.Option("--print-config", help="Print the config and exit (trains nothing).")
]
DryRun = Annotated[
    bool,
    typer.Option("--dry-run", help="Validate engine, model and data; exit without training."),
]

NoPlanCheck = Annotated[
    bool,
    typer.Option(
        "--no-plan-check",
        help="On a GPU, start even when `drivetrain plan` says a role will not fit.",
    ),
]
Resume = Annotated[
    str, typer.Option("--resume", help="auto (newest verified checkpoint), none, or a path.")
]
Overwrite = Annotated[
    bool, typer.Option("--overwrite", help="Start a new run; move a run in the output dir aside.")
]

# ---- the RL commands' (grpo, ppo, distill) ----
RLOverrides = Annotated[
    list[str] | None,
    typer.Argument(help="Dotted config overrides, e.g. actor.optim.lr=1e-6 run.steps=100"),
]
RLEngine = Annotated[
    str, typer.Option("--engine", help="Engine of the actor and reference (`drivetrain engines`).")
]
CriticEngine = Annotated[
    str,
    typer.Option("--critic-engine", help="Critic and reward-model engine (default: --engine)."),
]
RolloutName = Annotated[
    str, typer.Option("--rollout", help="Rollout backend (`drivetrain rollouts`).")
]
WeightSync = Annotated[
    str,
    typer.Option(
        "--weight-sync",
        help=(
            "Transport (`drivetrain ckpt-engines`) for a rollout outside this process; auto: "
            "direct in-process, colocated for rollout.python or placement.mode=colocated, "
            "broadcast for placement.mode=separate."
        ),
    ),
]
Preset = Annotated[
    str,
    typer.Option(
        "--preset",
        help="A named variant's algorithm settings (grpo, dr_grpo, bnpo, dapo, cispo, "
        "reinforce_pp, reinforce_pp_baseline: trainer README); files and overrides win.",
    ),
]
PluginsDryRun = Annotated[
    bool, typer.Option("--dry-run", help="Validate plugins, model and data; exit without training.")
]
