"""The built-in SFT model the addition jobs (grpo, ppo, dpo, distill's teacher) start from:
the cached one, or the SFT default trained first."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console

from drivetrain.trainer.builtin import addition
from drivetrain.trainer.console import plain_console
from drivetrain.trainer.errors import CheckpointError, RunDirectoryError


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
    from drivetrain.trainer.sft.job import builtin_report, load_sft_job, prepare, run_sft

    console = console or plain_console()
    console.print(
        "no cached built-in SFT model: running the SFT default first "
        f"(`drivetrain sft --engine {engine}`)"
    )
    job = load_sft_job(engine)
    try:  # "auto": an interrupted default SFT run continues
        result = run_sft(prepare(job), resume="auto", console=console)
    except (CheckpointError, RunDirectoryError) as exc:  # another model's run (older release)
        out = f"{job.config.run.output_dir}-{addition.ASSETS_VERSION}"
        console.print(f"{exc}: training the SFT default in {out} instead")
        job = load_sft_job(engine, overrides=[f"run.output_dir={out}"])
        result = run_sft(prepare(job), resume="auto", console=console)
    assert result is not None
    builtin_report(job, result)
    cached = addition.cached_sft_model(assets.root.parent)
    assert cached is not None
    return cached
