"""Metrics sinks: JSONL (always), TensorBoard, and W&B when it is installed (offline unless
``WANDB_MODE`` says otherwise), plus the loss-curve PNG written at the end of a run.

A sink that cannot write fails on the run's own thread, naming its file (the run loop turns a
directory that stopped taking writes into one line: :mod:`drivetrain.trainer.output_writes`).
TensorBoard writes from a thread of its own, which ends on a failed write with a traceback
printed and leaves the error for the writer's next call: that traceback is not printed, and
closing the logger flushes the writer, so a failure after the last step is raised too.
"""

from __future__ import annotations

import importlib.util
import json
import os
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from drivetrain.trainer.job_config import LoggingConfig

METRICS_FILE = "metrics.jsonl"


def read_metrics(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:  # a line cut short by a killed run
            continue
    return rows


class StepLog:
    """One JSON line per step in ``path``, flushed as written. A resumed run repeats the steps
    after its checkpoint: what the interrupted run wrote for them is dropped, so the file holds
    one history."""

    def __init__(self, path: Path, *, resume_step: int = 0) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        kept = [r for r in read_metrics(path) if r.get("step", 0) <= resume_step]
        path.write_text("".join(json.dumps(r) + "\n" for r in kept))
        self._file = open(path, "a")  # noqa: SIM115 - open for the run's lifetime

    def write(self, row: Mapping[str, Any]) -> None:
        try:
            self._file.write(json.dumps(row) + "\n")
            self._file.flush()
        except OSError as exc:  # a write to an open file names none: say which
            exc.filename = exc.filename or str(self.path)
            raise

    def close(self) -> None:
        self._file.close()


_quiet_installed = False


def _quiet_tensorboard_thread() -> None:
    """Leave unprinted the traceback of TensorBoard's writer thread ending on a failed write
    (the writer raises the same error on the run's thread: one report); other threads' as
    before."""
    global _quiet_installed
    if _quiet_installed:
        return
    previous = threading.excepthook

    def hook(args: threading.ExceptHookArgs) -> None:
        thread = type(args.thread).__name__ if args.thread is not None else ""
        if not (isinstance(args.exc_value, OSError) and thread == "_AsyncWriterThread"):
            previous(args)

    threading.excepthook = hook
    _quiet_installed = True


class MetricsLogger:
    def __init__(
        self,
        out_dir: Path,
        config: LoggingConfig,
        *,
        run_config: Mapping[str, Any],
        resume_step: int = 0,
    ) -> None:
        self.path = out_dir / METRICS_FILE
        self._file = StepLog(self.path, resume_step=resume_step)
        self._tb = None
        if config.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            _quiet_tensorboard_thread()
            self._tb = SummaryWriter(str(out_dir / "tensorboard"), purge_step=resume_step + 1)
        self._wandb = None
        if config.wandb and importlib.util.find_spec("wandb") is not None:
            import wandb

            self._wandb = wandb.init(
                project=config.wandb_project,
                dir=str(out_dir),
                mode=os.environ.get("WANDB_MODE", "offline"),
                config=dict(run_config),
                resume="allow",
            )

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        self._file.write({"step": step, **{k: float(v) for k, v in metrics.items()}})
        if self._tb is not None:
            for key, value in metrics.items():
                self._tb.add_scalar(key, value, step)
        if self._wandb is not None:
            self._wandb.log(dict(metrics), step=step)

    def close(self) -> None:
        """Close every sink; the first failure is raised once all are closed (TensorBoard's
        flush raises what its writer thread failed on)."""
        closers: list[Callable[[], Any]] = [self._file.close]
        if self._tb is not None:
            closers += [self._tb.flush, self._tb.close]
        if self._wandb is not None:
            closers.append(self._wandb.finish)
        failed: Exception | None = None
        for close in closers:
            try:
                close()
            except Exception as exc:
                failed = failed or exc
        if failed is not None:
            raise failed


@dataclass(frozen=True)
class Curve:
    """The PNG a run leaves beside its metrics: which series (key, label) against step."""

    file: str
    series: tuple[tuple[str, str], ...]
    ylabel: str
    log_scale: bool = False

    def plot(self, run_dir: Path) -> Path:
        """Drawn from ``run_dir``'s metrics file, written into ``run_dir``."""
        return plot_curve(
            run_dir / METRICS_FILE,
            run_dir / self.file,
            list(self.series),
            ylabel=self.ylabel,
            log_scale=self.log_scale,
        )


#: SFT's and DPO's: train (and validation) loss
LOSS_CURVE = Curve(
    "loss_curve.png", (("train/loss", "train"), ("val/loss", "validation")), "loss", log_scale=True
)


def plot_curve(
    metrics_path: Path,
    png_path: Path,
    series: list[tuple[str, str]],
    *,
    ylabel: str,
    log_scale: bool = False,
) -> Path:
    """The metrics named in ``series`` (key, label) against step, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(metrics_path)
    fig, ax = plt.subplots(figsize=(7, 4))
    for key, label in series:
        points = [(r["step"], r[key]) for r in rows if key in r]
        if points:
            steps, values = zip(*points, strict=True)
            ax.plot(steps, values, label=label, marker="o" if len(points) < 30 else None)
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    if log_scale:
        ax.set_yscale("log")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(png_path, dpi=100)
    plt.close(fig)
    return png_path
