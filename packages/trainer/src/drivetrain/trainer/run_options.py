"""The command-line options every training command shares for where a run starts."""

from __future__ import annotations

from typing import Annotated

import typer

Resume = Annotated[
    str, typer.Option("--resume", help="auto (newest verified checkpoint), none, or a path.")
]
Overwrite = Annotated[
    bool, typer.Option("--overwrite", help="Start a new run; move a run in the output dir aside.")
]
