"""The command-line options every training command shares: config files and overrides, the
engine, what to do instead of training, and where a run starts."""

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

Resume = Annotated[
    str, typer.Option("--resume", help="auto (newest verified checkpoint), none, or a path.")
]
Overwrite = Annotated[
    bool, typer.Option("--overwrite", help="Start a new run; move a run in the output dir aside.")
]
