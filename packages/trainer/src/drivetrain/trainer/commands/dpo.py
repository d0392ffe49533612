"""``drivetrain dpo``: preference optimisation (DPO, IPO, SimPO) on any installed engine."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from drivetrain.api import registry
from drivetrain.api.registry import Registry
from drivetrain.trainer.commands.options import (
    ConfigFiles,
    DryRun,
    EngineName,
    Overrides,
    Overwrite,
    PrintConfig,
    Resume,
)
from drivetrain.trainer.commands.skeleton import JobCommand, run_job_command
from drivetrain.trainer.console import plain_console

if TYPE_CHECKING:
    from drivetrain.trainer.dpo.job import DPOJob, PreparedDPO
    from drivetrain.trainer.dpo.trainer import DPOResult

console = plain_console()


class DPOCommand(JobCommand["DPOJob", "PreparedDPO", "DPOResult"]):
    def __init__(self, engine: str, files: Sequence[Path], overrides: Sequence[str]) -> None:
        super().__init__(console, "drivetrain.trainer.dpo.job")
        self.engine, self.files, self.overrides = engine, files, overrides

    def load(self, *, train_prerequisites: bool) -> DPOJob:
        from drivetrain.trainer.builtin.tasks import addition_dpo

        return self.jobs.load_dpo_job(
            self.engine,
            files=self.files,
            overrides=self.overrides,
            task=addition_dpo(self.engine, console),
            train_prerequisites=train_prerequisites,
        )

    def untrained(self, job: DPOJob) -> list[str]:
        from drivetrain.trainer.builtin.prerequisites import untrained

        return untrained(job.task, engine=self.engine)

    def plugins(self, job: DPOJob) -> list[tuple[Registry, str]]:
        return [(registry.engines, job.engine_name)]

    def fit(self, prepared: PreparedDPO, *, resume: str, overwrite: bool) -> DPOResult | None:
        return self.jobs.run_dpo(prepared, resume=resume, overwrite=overwrite, console=console)

    def summary(self, job: DPOJob, prepared: PreparedDPO, result: DPOResult) -> dict[str, Any]:
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
        if job.task is not None and result.hf_dir is not None:
            from drivetrain.trainer.builtin.tasks import dpo_report

            report = dpo_report(job, result)
            console.print(
                f"exact-match accuracy on {report['test_examples']} held-out problems: greedy "
                f"{report['exact_match_before']:.1%} before, "
                f"{report['exact_match_after']:.1%} after; sampled "
                f"{report['sampled_accuracy_before']:.1%} before, "
                f"{report['sampled_accuracy_after']:.1%} after DPO"
            )
            summary.update(report)
        return summary


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
    command = DPOCommand(engine, config or (), overrides or ())
    run_job_command(
        command, print_config=print_config, dry_run=dry_run, resume=resume, overwrite=overwrite
    )
