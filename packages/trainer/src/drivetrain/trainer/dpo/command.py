"""``drivetrain dpo``: preference optimisation (DPO, IPO, SimPO) on any installed engine."""

from __future__ import annotations

import json
import os

import typer

from drivetrain.api import registry
from drivetrain.trainer.command_flow import (
    ending_in_one_line,
    prepared_for_training,
    settled_before_preparing,
)
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

console = plain_console()


def dpo(
    overrides: Overrides = None,
    config: ConfigFiles = None,
    engine: EngineName = "fsdp2",
    print_config: PrintConfig = False,
    dry_run: DryRun = False,
    resume: Resume = "auto",
    overwrite: Overwrite = False,
) -> None:
    """Preference optimisation. With no data and no model: the built-in addition pairs."""
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    from drivetrain.trainer.builtin.prerequisites import untrained_prerequisites
    from drivetrain.trainer.dpo.job import builtin_report, describe, load_dpo_job, prepare, run_dpo

    with ending_in_one_line(console):
        job = load_dpo_job(
            engine,
            files=config or (),
            overrides=overrides or (),
            console=console,
            train_prerequisites=not (print_config or dry_run),
        )
        untrained = untrained_prerequisites(job.builtin, engine=engine) if job.builtin else []
        if settled_before_preparing(
            job, untrained, print_config=print_config, dry_run=dry_run,
            plugins=[(registry.engines, job.engine_name)], what="engine", console=console,
        ):  # fmt: skip
            return
        prepared = prepared_for_training(
            prepare, describe, job, resume=resume, dry_run=dry_run, what="engine", console=console
        )
        if prepared is None:
            return
        result = run_dpo(prepared, resume=resume, overwrite=overwrite, console=console)
    if result is None:  # a non-zero torchrun rank
        return
    summary = {
        "output_dir": str(result.output_dir),
        "steps": result.final_step,
        "seconds": round(result.seconds, 1),
        "final_train_loss": result.train_loss.get(result.final_step),
        "val_before": result.val_before,
        "val_after": result.val_after,
        "hf_model": str(result.hf_dir) if result.hf_dir else None,
    }
    before = result.val_before.get("val/preference_accuracy")
    after = result.val_after.get("val/preference_accuracy")
    if before is not None and after is not None:
        console.print(
            f"held-out preference accuracy (the model's own log-probs prefer the chosen "
            f"answer): {before:.1%} before, {after:.1%} after DPO"
        )
    if job.builtin is not None and result.hf_dir is not None:
        report = builtin_report(job, result)
        console.print(
            f"exact-match accuracy on {report['test_examples']} held-out problems: greedy "
            f"{report['exact_match_before']:.1%} before, {report['exact_match_after']:.1%} after; "
            f"sampled {report['sampled_accuracy_before']:.1%} before, "
            f"{report['sampled_accuracy_after']:.1%} after DPO"
        )
        summary.update(report)
    typer.echo(json.dumps(summary))
