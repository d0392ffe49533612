"""The built-in distillation demo's student: a Llama four times smaller than the built-in
SFT model, given a short SFT run of its own so its sampled answers are worth scoring (a random
student samples noise a teacher's per-token signal can hardly shape), cached beside the
assets like the SFT model."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from rich.console import Console

from drivetrain.runtime.atomic_dir import publish, staging_path
from drivetrain.trainer.builtin import addition
from drivetrain.trainer.builtin.tiny_model import build_llama_model
from drivetrain.trainer.console import plain_console

STUDENT = "student-model"
STUDENT_SHAPE = {
    "hidden_size": 64,
    "intermediate_size": 192,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "max_position_embeddings": 128,
}
#: SFT steps the student gets (the SFT model had 600 at 4x the width)
STUDENT_SFT_STEPS = 400


def cached_student_model(assets: addition.AdditionAssets) -> Path | None:
    """The student, if it has been trained."""
    target = assets.root / STUDENT
    return target if (target / "config.json").is_file() else None


def ensure_student_model(
    assets: addition.AdditionAssets,
    console: Console | None,
    *,
    engine: str = "fsdp2",
    train: bool = True,
) -> Path:
    """The cached student, built and briefly SFT-trained (``drivetrain sft`` on the built-in
    data, on ``engine``) when missing; without ``train``, only where it will be."""
    target = assets.root / STUDENT
    if cached_student_model(assets) is not None or not train:
        return target
    from drivetrain.trainer.sft.job import load_sft_job, prepare, run_sft

    console = console or plain_console()
    console.print(f"no cached student: a {STUDENT_SFT_STEPS}-step SFT of a smaller model first")
    work = staging_path(target)
    base = build_llama_model(work / "base", tokenizer_dir=assets.model_dir, **STUDENT_SHAPE)
    job = load_sft_job(
        engine,
        overrides=[
            f"engine.model.path={base}",
            f"data.train_path={assets.train_path}",
            f"run.output_dir={work / 'run'}",
            f"run.max_steps={STUDENT_SFT_STEPS}",
            "engine.optim.warmup_steps=10",
            "run.eval_every=0",
            "run.save_every=0",
            "logging.progress=false",
        ],
        files=[Path(addition.__file__).parent / "addition_sft.yaml"],
    )
    result = run_sft(prepare(job), resume="none", console=console)
    assert result is not None and result.hf_dir is not None
    staging = staging_path(target)
    shutil.copytree(result.hf_dir, staging)
    (staging / "drivetrain_student.json").write_text(json.dumps({"sft_steps": STUDENT_SFT_STEPS}))
    publish(staging, target)
    shutil.rmtree(work, ignore_errors=True)
    return target
