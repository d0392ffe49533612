"""The built-in task: multi-digit addition as a chat, with an answer that can be checked.

``drivetrain sft`` with no data and no model trains on it: a small Llama-style model created
locally from a config, the character tokenizer, and train/test JSONL files written into the
cache directory (``$DRIVETRAIN_CACHE``, default ``~/.cache/drivetrain``). Everything is derived
from fixed seeds, so every machine builds the same assets.

The training answers come from a careless annotator: a quarter of them are off by 1, 2 or 10
(the held-out test answers are all correct). SFT learns addition from them, and also the
annotator's slips: greedy answers are right, sampled ones often are not. That is the gap the
built-in GRPO job closes with an exact-match verifier, as RL with verifiable rewards does for
models trained on imperfect demonstrations. Operands are written with two digits ("07+60"),
which measured here to let the small model learn the carry within the default SFT run.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from dataclasses import dataclass
from pathlib import Path

from drivetrain.runtime.atomic_dir import publish, staging_path
from drivetrain.trainer.builtin.build_once import build_once
from drivetrain.trainer.builtin.char_tokenizer import build_char_tokenizer
from drivetrain.trainer.builtin.tiny_model import build_llama_model

ASSETS_VERSION = "addition-v3"
MAX_DIGITS = 2
TRAIN_SIZE = 20000
TEST_SIZE = 200
RL_SIZE = 5000
#: Share of training answers the careless annotator gets wrong, and by how much.
NOISE, SLIPS = 0.25, (-10, -2, -1, 1, 2, 10)
MODEL_SHAPE = {
    "hidden_size": 128,
    "intermediate_size": 384,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
}


@dataclass(frozen=True)
class AdditionAssets:
    root: Path

    @property
    def model_dir(self) -> Path:
        return self.root / "model"

    @property
    def train_path(self) -> Path:
        return self.root / "train.jsonl"

    @property
    def test_path(self) -> Path:
        return self.root / "test.jsonl"

    @property
    def rl_path(self) -> Path:
        """Prompts for the GRPO default, with correct answers: the verifier is not the annotator."""
        return self.root / "rl.jsonl"


def cache_dir() -> Path:
    return Path(os.environ.get("DRIVETRAIN_CACHE") or Path.home() / ".cache" / "drivetrain")


def problem(rng: random.Random) -> tuple[str, str]:
    a, b = (rng.randrange(10 ** rng.randint(1, MAX_DIGITS)) for _ in range(2))
    return f"What is {a:02d}+{b:02d}?", str(a + b)


def make_rows(
    count: int, seed: int, exclude: set[str] = frozenset(), noise: float = 0.0
) -> list[dict[str, object]]:
    """``count`` chat rows; a ``noise`` share of the answers is off by one of ``SLIPS``."""
    rng, rows = random.Random(seed), []
    while len(rows) < count:
        prompt, answer = problem(rng)
        if prompt in exclude:
            continue
        if rng.random() < noise:
            answer = str(abs(int(answer) + rng.choice(SLIPS)))
        rows.append(
            {
                "messages": [
                    {"role": "user", "content": prompt},
                    {"role": "assistant", "content": answer},
                ]
            }
        )
    return rows


def _write_jsonl(path: Path, rows: list[dict[str, object]]) -> None:
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def assets_at(root: Path | None = None) -> AdditionAssets:
    """Where the built-in model, tokenizer and data are, built or not (``--print-config``
    names them without building them)."""
    return AdditionAssets((root or cache_dir()) / ASSETS_VERSION)


def ensure_assets(root: Path | None = None) -> AdditionAssets:
    """Build the model, tokenizer and data once; later calls reuse them."""
    assets = assets_at(root)
    build_once(assets.root, _build)
    return assets


def _build(staging: Path) -> None:
    test = make_rows(TEST_SIZE, seed=1)
    held_out = {row["messages"][0]["content"] for row in test}  # type: ignore[index]
    _write_jsonl(staging / "test.jsonl", test)
    train = make_rows(TRAIN_SIZE, seed=0, exclude=held_out, noise=NOISE)
    _write_jsonl(staging / "train.jsonl", train)
    _write_jsonl(staging / "rl.jsonl", make_rows(RL_SIZE, seed=2, exclude=held_out))
    build_char_tokenizer(staging / "model")
    build_llama_model(staging / "model", tokenizer_dir=staging / "model", **MODEL_SHAPE)


def preference_rows(
    count: int, seed: int, exclude: set[str] = frozenset()
) -> list[dict[str, object]]:
    """``count`` preference pairs: the true sum chosen, the careless annotator's slip
    rejected (the mistakes SFT learned from its data)."""
    rng, rows = random.Random(seed), []
    while len(rows) < count:
        prompt, answer = problem(rng)
        slip = str(abs(int(answer) + rng.choice(SLIPS)))
        if prompt in exclude or slip == answer:
            continue
        rows.append({"prompt": prompt, "chosen": answer, "rejected": slip})
    return rows


PREFERENCE_TRAIN, PREFERENCE_TEST = "dpo_train.jsonl", "dpo_test.jsonl"


def ensure_preference_pairs(assets: AdditionAssets, train_size: int = 4000) -> tuple[Path, Path]:
    """The built-in DPO job's pairs (training, and held-out on the test problems), written
    beside the assets once."""
    paths = (assets.root / PREFERENCE_TRAIN, assets.root / PREFERENCE_TEST)
    if all(p.is_file() for p in paths):
        return paths
    test = [json.loads(line) for line in assets.test_path.read_text().splitlines()]
    held_out = {row["messages"][0]["content"] for row in test}
    for path, rows in (
        (paths[0], preference_rows(train_size, seed=3, exclude=held_out)),
        (
            paths[1],
            [
                {
                    "prompt": r["messages"][0]["content"],
                    **_pair_answers(r["messages"][1]["content"], i),
                }
                for i, r in enumerate(test)
            ],
        ),
    ):
        staging = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        _write_jsonl(staging, rows)
        os.replace(staging, path)
    return paths


def _pair_answers(answer: str, index: int) -> dict[str, str]:
    rng = random.Random(1_000 + index)
    slip = answer
    while slip == answer:
        slip = str(abs(int(answer) + rng.choice(SLIPS)))
    return {"chosen": answer, "rejected": slip}


SFT_MODEL = "sft-model"
SFT_REPORT = "drivetrain_sft_report.json"


def cache_sft_model(assets: AdditionAssets, hf_dir: Path, report: dict[str, object]) -> Path:
    """Keep the SFT result beside the assets, where the RL default run starts from."""
    target = assets.root / SFT_MODEL
    staging = staging_path(target)
    shutil.copytree(hf_dir, staging)
    (staging / SFT_REPORT).write_text(json.dumps(report, indent=2))
    publish(staging, target)
    return target


def cached_sft_model(root: Path | None = None) -> Path | None:
    """The cached SFT model of the built-in task, if a default SFT run has finished."""
    path = (root or cache_dir()) / ASSETS_VERSION / SFT_MODEL
    return path if (path / SFT_REPORT).is_file() else None
