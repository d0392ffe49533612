"""The built-in distillation demo's student: a Llama four times smaller than the built-in
SFT model, given a short SFT run of its own so its sampled answers are worth scoring (a random
student samples noise a teacher's per-token signal can hardly shape), cached beside the
assets like the SFT model."""

from __future__ import annotations

import shutil
from pathlib import Path

from rich.console import Console

from drivetrain.runtime.atomic_dir import staging_path
from drivetrain.trainer.builtin import addition
from drivetrain.trainer.builtin.fine_tune import fine_tune_cached
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
    console = console or plain_console()
    console.print(f"no cached student: a {STUDENT_SFT_STEPS}-step SFT of a smaller model first")
    work = staging_path(target)
    try:
        base = build_llama_model(work / "base", tokenizer_dir=assets.model_dir, **STUDENT_SHAPE)
        return fine_tune_cached(
            target,
            engine=engine,
            start=base,
            overrides=[f"data.train_path={assets.train_path}"],
            marker="drivetrain_student.json",
            steps=STUDENT_SFT_STEPS,
            console=console,
        )
    finally:
        shutil.rmtree(work, ignore_errors=True)
