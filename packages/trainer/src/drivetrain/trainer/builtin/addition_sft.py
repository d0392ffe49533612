"""The built-in SFT task (``drivetrain sft`` with no data and no model) and the model the
addition jobs start from (grpo, ppo, dpo, distill's teacher): the cached one, or this task
trained first."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console

from drivetrain.trainer.builtin import addition
from drivetrain.trainer.console import plain_console
from drivetrain.trainer.errors import CheckpointError, RunDirectoryError
from drivetrain.trainer.job_config import TaskLayers

if TYPE_CHECKING:
    from drivetrain.trainer.sft.job import SFTJob
    from drivetrain.trainer.sft.trainer import SFTResult

CONFIG = Path(__file__).parent / "addition_sft.yaml"


def addition_sft(train: bool) -> TaskLayers:
    """The task's layers: its model and data are built (small, seconds) even when only shown."""
    assets = addition.ensure_assets()
    return TaskLayers(
        files=(CONFIG,),
        overrides=(f"engine.model.path={assets.model_dir}", f"data.train_path={assets.train_path}"),
        assets=assets,
    )


def sft_report(job: SFTJob, result: SFTResult) -> dict[str, Any]:
    """Exact-match accuracy of the built-in task before and after training; caches the trained
    model for the RL default run when the job was the task as shipped."""
    from drivetrain.trainer.builtin.exact_match import exact_match

    assert job.task is not None and result.hf_dir is not None
    assets: addition.AdditionAssets = job.task.assets
    rows = [json.loads(line) for line in assets.test_path.read_text().splitlines()]
    report = {
        "accuracy_before": exact_match(str(assets.model_dir), rows),
        "accuracy_after": exact_match(str(result.hf_dir), rows),
        "test_examples": len(rows),
    }
    if job.as_shipped:
        addition.cache_sft_model(assets, result.hf_dir, report)
    return report


def ensure_sft_model(
    assets: addition.AdditionAssets,
    console: Console | None,
    *,
    engine: str = "fsdp2",
    train: bool = True,
) -> Path:
    """The built-in SFT model, training it with the SFT default on ``engine`` first when it is
    not cached; without ``train``, only where it will be."""
    cached = addition.cached_sft_model(assets.root.parent)
    if cached is not None:
        return cached
    if not train:
        return assets.root / addition.SFT_MODEL
    from drivetrain.trainer.sft import job as sft_job

    console = console or plain_console()
    console.print(
        "no cached built-in SFT model: running the SFT default first "
        f"(`drivetrain sft --engine {engine}`)"
    )
    job = sft_job.load_sft_job(engine, task=addition_sft)
    try:  # "auto": an interrupted default SFT run continues
        result = sft_job.run_sft(sft_job.prepare(job), resume="auto", console=console)
    except (CheckpointError, RunDirectoryError) as exc:  # another model's run (older release)
        out = f"{job.config.run.output_dir}-{addition.ASSETS_VERSION}"
        console.print(f"{exc}: training the SFT default in {out} instead")
        job = sft_job.load_sft_job(engine, overrides=[f"run.output_dir={out}"], task=addition_sft)
        result = sft_job.run_sft(sft_job.prepare(job), resume="auto", console=console)
    assert result is not None
    sft_report(job, result)
    cached = addition.cached_sft_model(assets.root.parent)
    assert cached is not None
    return cached
