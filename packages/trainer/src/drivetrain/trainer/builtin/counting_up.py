"""The built-in long-answer workload: the addition problems answered by counting up, so that
generation, not training, dominates an RL step (``benchmarks/async_grpo.py``'s ``gen_heavy``).

"What is 38+45?" is answered "38+45 48+35 58+25 68+15 78+5 =83": ten at a time moved from
the second operand to the first, then the sum; its last number is what ``numeric_match``
checks. An answer is 6 to 72 characters long (1 to 10 steps), set by the problem and by
sampling: long answers are the ones generation ahead of training finishes late, and the ones a
staleness rule would drop, as a reasoning model's long chains are. The model is the built-in
SFT model (it knows the sums) fine-tuned briefly on such answers, cached beside the assets.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

from rich.console import Console

from drivetrain.trainer.builtin import addition
from drivetrain.trainer.builtin.addition_sft import ensure_sft_model
from drivetrain.trainer.builtin.fine_tune import fine_tune_cached
from drivetrain.trainer.console import plain_console

#: fine-tuning steps of the cached model (tests ask for fewer: each count is its own model)
SFT_STEPS = 500
TRAIN_SIZE = 20000
#: an answer's longest (99+99)
MAX_ANSWER_CHARS = 72


def counting_up(a: int, b: int) -> str:
    """``a+b`` restated, moved ten at a time from ``b`` to ``a`` while ``b`` has tens, then the
    sum: every step needs only the one before it, the last the units added."""
    steps = [f"{a:02d}+{b:02d}"]  # as the prompt writes them
    while b >= 10:
        a, b = a + 10, b - 10
        steps.append(f"{a}+{b}")
    return " ".join([*steps, f"={a + b}"])


def make_rows(count: int, seed: int, exclude: set[str]) -> list[dict[str, object]]:
    """``count`` chat rows of the addition problems (none of ``exclude``) counted up."""
    rng, rows = random.Random(seed), []
    while len(rows) < count:
        prompt, _ = addition.problem(rng)
        if prompt in exclude:
            continue
        a, b = (int(x) for x in prompt.removeprefix("What is ").removesuffix("?").split("+"))
        rows.append(
            {
                "messages": [
                    {"role": "user", "content": prompt},
                    {"role": "assistant", "content": counting_up(a, b)},
                ]
            }
        )
    return rows


def train_path(assets: addition.AdditionAssets) -> Path:
    """The fine-tuning rows, written beside the assets once (held-out problems excluded)."""
    path = assets.root / "counting_up_train.jsonl"
    if not path.is_file():
        test = [json.loads(line) for line in assets.test_path.read_text().splitlines()]
        held_out = {row["messages"][0]["content"] for row in test}
        staging = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        staging.write_text(
            "".join(json.dumps(r) + "\n" for r in make_rows(TRAIN_SIZE, 4, held_out))
        )
        os.replace(staging, path)
    return path


def cached_model(assets: addition.AdditionAssets, steps: int = SFT_STEPS) -> Path | None:
    """The counting-up model fine-tuned for ``steps``, if it has been."""
    target = assets.root / f"counting-up-model-{steps}"
    return target if (target / "config.json").is_file() else None


def ensure_model(
    assets: addition.AdditionAssets,
    console: Console | None = None,
    *,
    engine: str = "fsdp2",
    steps: int = SFT_STEPS,
) -> Path:
    """The counting-up model: the built-in SFT model (trained first if missing) fine-tuned
    for ``steps`` on counted-up answers with ``drivetrain sft`` on ``engine``, cached."""
    cached = cached_model(assets, steps)
    if cached is not None:
        return cached
    console = console or plain_console()
    start = ensure_sft_model(assets, console, engine=engine)
    console.print(f"no cached counting-up model: a {steps}-step fine-tune of the SFT model first")
    return fine_tune_cached(
        assets.root / f"counting-up-model-{steps}",
        engine=engine,
        start=start,
        overrides=[
            f"data.train_path={train_path(assets)}",
            "data.max_length=128",
            "engine.optim.lr=0.003",
        ],
        marker="drivetrain_counting_up.json",
        steps=steps,
        console=console,
    )
