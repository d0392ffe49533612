"""A short ``drivetrain sft`` run on the built-in data whose model is kept in the cache: the
student of the distillation demo and the counting-up model of the async benchmark are built
this way."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from rich.console import Console

from drivetrain.runtime.atomic_dir import publish, staging_path
from drivetrain.trainer.builtin import addition


def fine_tune_cached(
    target: Path,
    *,
    engine: str,
    start: Path,
    overrides: list[str],
    marker: str,
    steps: int,
    console: Console,
) -> Path:
    """Fine-tune ``start`` for ``steps`` with ``addition_sft.yaml`` plus ``overrides`` on
    ``engine``, and publish its HF model at ``target`` with ``marker`` (a JSON file naming the
    steps) beside it. The run's own directory is a hidden staging path next to ``target``
    (removed once the model is published): an interrupted build leaves no directory under
    ``target``'s name for a later run to mistake for the model."""
    from drivetrain.trainer.sft.job import load_sft_job, prepare, run_sft

    work = staging_path(target)
    job = load_sft_job(
        engine,
        overrides=[
            f"engine.model.path={start}",
            f"run.output_dir={work / 'run'}",
            f"run.max_steps={steps}",
            "engine.optim.warmup_steps=10",
            "run.eval_every=0",
            "run.save_every=0",
            "logging.progress=false",
            *overrides,
        ],
        files=[Path(addition.__file__).parent / "addition_sft.yaml"],
    )
    result = run_sft(prepare(job), resume="none", console=console)
    assert result is not None and result.hf_dir is not None
    staging = staging_path(target)
    os.replace(result.hf_dir, staging)  # a sibling of the run: a rename, no copy
    (staging / marker).write_text(json.dumps({"sft_steps": steps}))
    publish(staging, target)
    shutil.rmtree(work, ignore_errors=True)
    return target
