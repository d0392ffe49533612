"""``drivetrain sft``: supervised fine-tuning on any installed engine."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path

import typer

from drivetrain.api.config import EngineConfig
from drivetrain.api.errors import PluginError
from drivetrain.trainer.command_flow import ending_in_one_line, prepared_for_training
from drivetrain.trainer.console import plain_console
from drivetrain.trainer.run_options import (
    ConfigFiles,
    DryRun,
    EngineName,
    Overrides,
    Overwrite,
    PrintConfig,
    Resume,
)

console = plain_console()  # errors stay whole lines (greppable)


def _config_yaml(engine: str, files: Sequence[Path], overrides: Sequence[str]) -> str:
    """The config ``engine`` runs with; when that engine cannot be used (not installed,
    disabled) the keys every engine shares, and a line on stderr saying so."""
    from drivetrain.trainer.config_loader import load_config, to_yaml
    from drivetrain.trainer.sft.config import sft_config_type
    from drivetrain.trainer.sft.job import load_sft_job

    try:
        return load_sft_job(engine, files=files, overrides=overrides).to_yaml()
    except PluginError as exc:
        console.print(f"note: {exc}; showing the keys every engine shares")
        base = sft_config_type(EngineConfig)
        return to_yaml(load_config(base, files=files, overrides=overrides))


def sft(
    overrides: Overrides = None,
    config: ConfigFiles = None,
    engine: EngineName = "fsdp2",
    print_config: PrintConfig = False,
    dry_run: DryRun = False,
    resume: Resume = "auto",
    overwrite: Overwrite = False,
) -> None:
    """Supervised fine-tuning. With no data and no model: the built-in addition task."""
    # Our progress bar is the one to watch; read by huggingface_hub when transformers loads
    # (here, in torchrun ranks and in Ray actors, which get HF_* variables forwarded).
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    # Here, not at module level: it imports torch, which `drivetrain engines` does not need.
    from drivetrain.trainer.sft.job import builtin_report, describe, load_sft_job, prepare, run_sft

    with ending_in_one_line(console):
        if print_config:
            typer.echo(_config_yaml(engine, config or (), overrides or ()), nl=False)
            return
        job = load_sft_job(engine, files=config or (), overrides=overrides or ())
        prepared = prepared_for_training(
            prepare, describe, job, resume=resume, dry_run=dry_run, what="engine", console=console
        )
        if prepared is None:
            return
        result = run_sft(prepared, resume=resume, overwrite=overwrite, console=console)
    if result is None:  # a non-zero torchrun rank
        return
    summary = {
        "output_dir": str(result.output_dir),
        "steps": result.final_step,
        "final_train_loss": result.train_loss.get(result.final_step),
        "val_loss": result.val_loss,
        "hf_model": str(result.hf_dir) if result.hf_dir else None,
    }
    if job.builtin is not None and result.hf_dir is not None:
        report = builtin_report(job, result)
        console.print(
            f"exact-match accuracy on {report['test_examples']} held-out problems: "
            f"{report['accuracy_before']:.1%} before, {report['accuracy_after']:.1%} after SFT"
        )
        summary.update(report)
    typer.echo(json.dumps(summary))
