"""The training progress bar: step, loss (or another metric), tokens/s and ETA (rich)."""

from __future__ import annotations

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)


class TrainingProgress:
    def __init__(
        self,
        total: int,
        start: int,
        *,
        enabled: bool,
        console: Console,
        description: str = "sft",
        metric: str = "loss",
    ) -> None:
        self._progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn(f"{metric} {{task.fields[loss]}}"),
            TextColumn("{task.fields[tps]} tok/s"),
            TimeElapsedColumn(),
            TextColumn("ETA"),
            TimeRemainingColumn(),
            console=console,
            disable=not enabled,
        )
        self._task = self._progress.add_task(
            description, total=total, completed=start, loss="-", tps="-"
        )

    def __enter__(self) -> TrainingProgress:
        self._progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._progress.stop()

    def update(self, *, loss: float, tokens_per_s: float, task: float | None = None) -> None:
        """``task``: the task's own reward beside a shaped total shown as ``loss``."""
        shown = f"{loss:.4f}" if task is None else f"{loss:.4f} (task {task:.4f})"
        self._progress.update(self._task, advance=1, loss=shown, tps=f"{tokens_per_s:,.0f}")
