"""The built-in agentic task's model, tokenizer and tool-using SFT warm start.

Like the addition task's (:mod:`drivetrain.trainer.builtin.addition`), everything is built
locally from fixed seeds into the cache directory: a character tokenizer whose chat template
renders tools, tool results and Hermes ``<tool_call>`` markers (single tokens), a small Llama
(both from :mod:`~drivetrain.trainer.builtin.tool_warm_start`, as its SFT warm start is),
and multi-turn demonstrations from a careless annotator. A share ``NOISE`` of them slip: the
annotator answers without the calculator (a near guess), copies a result wrong into the second
call, or writes the answer with a slip. SFT learns the tool protocol and the slips; the
built-in GRPO job (``drivetrain grpo env=calculator``) trains the slips out with the
environment's exact-answer reward.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from rich.console import Console

from drivetrain.api.environment import ToolCall
from drivetrain.trainer.agentic.tool_parsers import HermesParser
from drivetrain.trainer.builtin import calculator, tool_warm_start
from drivetrain.trainer.builtin.addition import cache_dir
from drivetrain.trainer.builtin.build_once import build_once
from drivetrain.trainer.builtin.tool_warm_start import (
    HERMES_MARKERS,
    ToolTaskAssets,
    build_tool_model,
    chat_template,
)

ASSETS_VERSION = "calculator-v1"
SFT_SIZE = 20000
NOISE = 0.4
SLIPS = (-100, -10, -1, 1, 10, 100)
MODEL_SHAPE = {
    "hidden_size": 128,
    "intermediate_size": 384,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
}
SFT_CONFIG = Path(__file__).parent / "calculator_sft.yaml"
#: single tokens: the Hermes markers, and the fixed JSON around a calculator call's
#: expression (as a BPE vocabulary would merge frequent strings): a call is a few tokens plus
#: its expression, so the small model spends its capacity on the numbers it must copy
WORDS = (
    *HERMES_MARKERS,
    '{"name":"calculator","arguments":{"expression":"',
    '"}}',
    "calculator",
)
#: the tools named in a system turn (``tools: calculator``)
CHAT_TEMPLATE = chat_template(" {{ t['function']['name'] }}")


def _call(expression: str) -> str:
    return HermesParser().format([ToolCall("calculator", {"expression": expression})])


def _slip(value: int, rng: random.Random) -> int:
    return value + rng.choice(SLIPS)


def demonstration(task: dict[str, Any], rng: random.Random, noise: float) -> dict[str, Any]:
    """The annotator's conversation for ``task``: calls, results, answer (sometimes slipped)."""
    first, second = task["steps"]
    answer = int(task["answer"])
    user = {"role": "user", "content": task["question"]}
    slip = rng.choice(("guess", "copy", "answer")) if rng.random() < noise else ""
    if slip == "guess":  # no calculator: a near guess
        messages = [user, {"role": "assistant", "content": str(_slip(answer, rng))}]
    else:
        inner = int(calculator.calculate(first))
        if slip == "copy":  # the first result copied wrong into the second call
            op_at = len(str(inner))
            second = str(_slip(inner, rng)) + second[op_at:]
            answer = int(calculator.calculate(second))
        if slip == "answer":
            answer = _slip(answer, rng)
        messages = [
            user,
            {"role": "assistant", "content": _call(first)},
            {"role": "tool", "content": str(inner)},
            {"role": "assistant", "content": _call(second)},
            {"role": "tool", "content": calculator.calculate(second)},
            {"role": "assistant", "content": str(answer)},
        ]
    return {"messages": messages, "tools": [calculator.CALCULATOR.schema()]}


def assets_at(root: Path | None = None) -> ToolTaskAssets:
    return ToolTaskAssets((root or cache_dir()) / ASSETS_VERSION, "calculator")


def ensure_assets(root: Path | None = None) -> ToolTaskAssets:
    """Build the tokenizer, model and demonstrations once; later calls reuse them."""
    assets = assets_at(root)
    build_once(assets.root, _build)
    return assets


def _build(staging: Path) -> None:
    rng = random.Random(21)
    with open(staging / "sft.jsonl", "w") as f:
        for task in calculator.tasks(SFT_SIZE, seed=20):
            f.write(json.dumps(demonstration(task, rng, NOISE)) + "\n")
    build_tool_model(staging / "model", words=WORDS, template=CHAT_TEMPLATE, shape=MODEL_SHAPE)


def ensure_sft_model(
    assets: ToolTaskAssets,
    console: Console | None,
    *,
    engine: str = "fsdp2",
    train: bool = True,
) -> Path:
    """The tool-using SFT model, trained on ``engine`` first when it is not cached; without
    ``train``, only where it will be."""
    return tool_warm_start.ensure_sft_model(
        assets, console, config=SFT_CONFIG, engine=engine, train=train
    )
