"""The built-in agentic task's model, tokenizer and tool-using SFT warm start.

Like the addition task's (:mod:`drivetrain.trainer.builtin.addition`), everything is built
locally from fixed seeds into the cache directory: a character tokenizer whose chat template
renders tools, tool results and Hermes ``<tool_call>`` markers (single tokens), a small Llama,
and multi-turn demonstrations from a careless annotator. A share ``NOISE`` of them slip: the
annotator answers without the calculator (a near guess), copies a result wrong into the second
call, or writes the answer with a slip. SFT learns the tool protocol and the slips; the
built-in GRPO job (``drivetrain grpo env=calculator``) trains the slips out with the
environment's exact-answer reward.
"""

from __future__ import annotations

import json
import random
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console

from drivetrain.api.environment import ToolCall
from drivetrain.runtime.atomic_dir import publish, staging_path
from drivetrain.trainer.agentic.tool_parsers import HermesParser
from drivetrain.trainer.builtin import calculator
from drivetrain.trainer.builtin.addition import cache_dir
from drivetrain.trainer.builtin.build_once import build_once
from drivetrain.trainer.builtin.char_tokenizer import ROLES, build_char_tokenizer
from drivetrain.trainer.builtin.tiny_model import build_llama_model
from drivetrain.trainer.console import plain_console

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
SFT_MODEL = "sft-model"
SFT_REPORT = "drivetrain_sft_report.json"
SFT_CONFIG = Path(__file__).parent / "calculator_sft.yaml"
#: single tokens: the Hermes markers, and the fixed JSON around a calculator call's
#: expression (as a BPE vocabulary would merge frequent strings): a call is a few tokens plus
#: its expression, so the small model spends its capacity on the numbers it must copy
WORDS = (
    "<tool_call>",
    "</tool_call>",
    '{"name":"calculator","arguments":{"expression":"',
    '"}}',
    "calculator",
)
#: tools named in a system turn; tool results as ``<|tool|>`` turns; an assistant turn's
#: ``tool_calls`` (OpenAI agents send them back) in the Hermes form the model writes
CHAT_TEMPLATE = (
    "{% if tools %}<|system|>tools:{% for t in tools %} {{ t['function']['name'] }}"
    "{% endfor %}<|end|>{% endif %}"
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] or '' }}"
    "{% for c in m.get('tool_calls') or [] %}<tool_call>"
    '{"name":"{{ c["function"]["name"] }}","arguments":'
    "{% if c['function']['arguments'] is string %}{{ c['function']['arguments'] }}"
    "{% else %}{{ c['function']['arguments'] | tojson }}{% endif %}}</tool_call>"
    "{% endfor %}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


@dataclass(frozen=True)
class CalculatorAssets:
    root: Path

    @property
    def model_dir(self) -> Path:
        return self.root / "model"

    @property
    def sft_path(self) -> Path:
        return self.root / "sft.jsonl"

    @property
    def sft_model(self) -> Path:
        return self.root / SFT_MODEL


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


def assets_at(root: Path | None = None) -> CalculatorAssets:
    return CalculatorAssets((root or cache_dir()) / ASSETS_VERSION)


def ensure_assets(root: Path | None = None) -> CalculatorAssets:
    """Build the tokenizer, model and demonstrations once; later calls reuse them."""
    assets = assets_at(root)
    build_once(assets.root, _build)
    return assets


def _build(staging: Path) -> None:
    rng = random.Random(21)
    with open(staging / "sft.jsonl", "w") as f:
        for task in calculator.tasks(SFT_SIZE, seed=20):
            f.write(json.dumps(demonstration(task, rng, NOISE)) + "\n")
    model = staging / "model"
    build_char_tokenizer(
        model, roles=(*ROLES, "<|tool|>"), words=WORDS, chat_template=CHAT_TEMPLATE
    )
    build_llama_model(model, tokenizer_dir=model, **MODEL_SHAPE)


def cached_sft_model(assets: CalculatorAssets) -> Path | None:
    return assets.sft_model if (assets.sft_model / SFT_REPORT).is_file() else None


def ensure_sft_model(
    assets: CalculatorAssets,
    console: Console | None,
    *,
    engine: str = "fsdp2",
    train: bool = True,
) -> Path:
    """The tool-using SFT model, trained on ``engine`` first when it is not cached; without
    ``train``, only where it will be."""
    cached = cached_sft_model(assets)
    if cached is not None or not train:
        return assets.sft_model
    from drivetrain.trainer.sft.job import load_sft_job, prepare, run_sft

    console = console or plain_console()
    console.print(
        "no cached calculator SFT model: training the tool-using warm start first "
        f"(drivetrain sft on {assets.sft_path}, --engine {engine})"
    )
    work = staging_path(assets.sft_model)
    job = load_sft_job(
        engine,
        overrides=[
            f"engine.model.path={assets.model_dir}",
            f"data.train_path={assets.sft_path}",
            f"run.output_dir={work}",
        ],
        files=[SFT_CONFIG],
    )
    result = run_sft(prepare(job), resume="none", console=console)
    assert result is not None and result.hf_dir is not None
    staging = staging_path(assets.sft_model)
    shutil.copytree(result.hf_dir, staging)
    report = {"steps": result.final_step, "val_loss": result.val_loss}
    (staging / SFT_REPORT).write_text(json.dumps(report, indent=2))
    publish(staging, assets.sft_model)
    shutil.rmtree(work, ignore_errors=True)
    return assets.sft_model
