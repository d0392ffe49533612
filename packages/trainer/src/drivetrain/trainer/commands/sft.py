"""``drivetrain sft``: supervised fine-tuning on any installed engine."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from drivetrain.api import registry
from drivetrain.api.config import EngineConfig
from drivetrain.api.errors import PluginError
from drivetrain.api.registry import Registry
from drivetrain.trainer.commands.options import (
    ConfigFiles,
    DryRun,
    EngineName,
    NoPlanCheck,
    Overrides,
    Overwrite,
    PrintConfig,
    Resume,
)
from drivetrain.trainer.commands.skeleton import JobCommand, run_job_command
from drivetrain.trainer.console import plain_console

if TYPE_CHECKING:
    from drivetrain.trainer.sft.job import PreparedSFT, SFTJob
    from drivetrain.trainer.sft.trainer import SFTResult

console = plain_console()  # errors stay whole lines (greppable)


class SFTCommand(JobCommand["SFTJob", "PreparedSFT", "SFTResult"]):
    def __init__(self, engine: str, files: Sequence[Path], overrides: Sequence[str]) -> None:
        super().__init__(console, "drivetrain.trainer.sft.job")
        self.engine, self.files, self.overrides = engine, files, overrides

    def load(self, *, train_prerequisites: bool) -> SFTJob:
        from drivetrain.trainer.builtin.addition_sft import addition_sft

        return self.jobs.load_sft_job(
            self.engine,
            files=self.files,
            overrides=self.overrides,
            task=addition_sft,
            train_prerequisites=train_prerequisites,
        )

    def plugins(self, job: SFTJob) -> list[tuple[Registry, str]]:
        return [(registry.engines, job.engine_name)]

    def plan_inputs(self, job: SFTJob) -> Any:
        from drivetrain.trainer.planning import sft_inputs

        return sft_inputs(job.config, job.engine_name)

    def shown_config(self) -> str:
        """The config the engine runs with; when that engine cannot be used (not installed,
        disabled) the keys every engine shares, and a line on stderr saying so."""
        from drivetrain.trainer.config_loader import load_config, to_yaml
        from drivetrain.trainer.sft.config import sft_config_type

        try:
            return super().shown_config()
        except PluginError as exc:
            console.print(f"note: {exc}; showing the keys every engine shares")
            base = sft_config_type(EngineConfig)
            return to_yaml(load_config(base, files=self.files, overrides=self.overrides))

    def fit(self, prepared: PreparedSFT, *, resume: str, overwrite: bool) -> SFTResult | None:
        return self.jobs.run_sft(prepared, resume=resume, overwrite=overwrite, console=console)

    def summary(self, job: SFTJob, prepared: PreparedSFT, result: SFTResult) -> dict[str, Any]:
        summary = {
            "output_dir": str(result.output_dir),
            "steps": result.final_step,
            "final_train_loss": result.train_loss.get(result.final_step),
            "val_loss": result.val_loss,
            "hf_model": str(result.hf_dir) if result.hf_dir else None,
        }
        if job.task is not None and result.hf_dir is not None:
            from drivetrain.trainer.builtin.addition_sft import sft_report

            report = sft_report(job, result)
            console.print(
                f"exact-match accuracy on {report['test_examples']} held-out problems: "
                f"{report['accuracy_before']:.1%} before, {report['accuracy_after']:.1%} after "
                "SFT"
            )
            summary.update(report)
        return summary


def sft(
    overrides: Overrides = None,
    config: ConfigFiles = None,
    engine: EngineName = "fsdp2",
    print_config: PrintConfig = False,
    dry_run: DryRun = False,
    resume: Resume = "auto",
    overwrite: Overwrite = False,
    no_plan_check: NoPlanCheck = False,
) -> None:
    """Supervised fine-tuning. With no data and no model: the built-in addition task."""
    command = SFTCommand(engine, config or (), overrides or ())
    run_job_command(
        command,
        print_config=print_config,
        dry_run=dry_run,
        resume=resume,
        overwrite=overwrite,
        plan_check=not no_plan_check,
    )
