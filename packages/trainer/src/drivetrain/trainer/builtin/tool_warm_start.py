"""What the built-in tool-using tasks share: a character tokenizer whose chat template renders
tools, tool results and Hermes ``<tool_call>`` markers, a small Llama beside it, and the SFT
warm start trained on the task's demonstrations and cached beside them.

The calculator task (:mod:`~drivetrain.trainer.builtin.calculator_assets`) and any
environment that demonstrates its task (:mod:`~drivetrain.trainer.builtin.demonstrated`) are
built this way; each brings its own words, its tools' header and its SFT settings.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console

from drivetrain.runtime.atomic_dir import publish, staging_path
from drivetrain.trainer.builtin.char_tokenizer import ROLES, build_char_tokenizer
from drivetrain.trainer.builtin.tiny_model import build_llama_model
from drivetrain.trainer.console import plain_console

SFT_MODEL = "sft-model"
SFT_REPORT = "drivetrain_sft_report.json"
#: the Hermes markers, single tokens (as Qwen's vocabulary has them)
HERMES_MARKERS = ("<tool_call>", "</tool_call>")
#: the conversation: tool results as ``<|tool|>`` turns, an assistant turn's ``tool_calls``
#: (OpenAI agents send them back) in the Hermes form the model writes
MESSAGES_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] or '' }}"
    "{% for c in m.get('tool_calls') or [] %}<tool_call>"
    '{"name":"{{ c["function"]["name"] }}","arguments":'
    "{% if c['function']['arguments'] is string %}{{ c['function']['arguments'] }}"
    "{% else %}{{ c['function']['arguments'] | tojson }}{% endif %}}</tool_call>"
    "{% endfor %}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def chat_template(each_tool: str) -> str:
    """The template with the tools named in a system turn, ``each_tool`` (Jinja over ``t``,
    one tool's schema) written for each, then the conversation."""
    return (
        "{% if tools %}<|system|>tools:{% for t in tools %}"
        f"{each_tool}"
        "{% endfor %}<|end|>{% endif %}" + MESSAGES_TEMPLATE
    )


def build_tool_model(
    model_dir: Path, *, words: tuple[str, ...], template: str, shape: dict[str, Any]
) -> None:
    """The tokenizer (roles, a ``<|tool|>`` role, ``words`` as single tokens, ``template``)
    and a random Llama of ``shape`` (``LlamaConfig`` sizes) in ``model_dir``."""
    build_char_tokenizer(model_dir, roles=(*ROLES, "<|tool|>"), words=words, chat_template=template)
    build_llama_model(model_dir, tokenizer_dir=model_dir, **shape)


@dataclass(frozen=True)
class ToolTaskAssets:
    """A tool-using task's files in the cache: the untrained model, the demonstrations (chat
    rows with ``tools``) and, once trained, the SFT model. ``task`` names it in messages."""

    root: Path
    task: str

    @property
    def model_dir(self) -> Path:
        return self.root / "model"

    @property
    def sft_path(self) -> Path:
        return self.root / "sft.jsonl"

    @property
    def sft_model(self) -> Path:
        return self.root / SFT_MODEL


def cached_sft_model(assets: ToolTaskAssets) -> Path | None:
    return assets.sft_model if (assets.sft_model / SFT_REPORT).is_file() else None


def ensure_sft_model(
    assets: ToolTaskAssets,
    console: Console | None,
    *,
    config: Path,
    engine: str = "fsdp2",
    train: bool = True,
) -> Path:
    """The tool-using SFT model (``drivetrain sft`` with ``config`` on the demonstrations),
    trained on ``engine`` first when it is not cached; without ``train``, only where it will
    be. Published whole (the report last) so an interrupted run leaves nothing a later one
    mistakes for the model."""
    cached = cached_sft_model(assets)
    if cached is not None or not train:
        return assets.sft_model
    from drivetrain.trainer.sft.job import load_sft_job, prepare, run_sft

    console = console or plain_console()
    console.print(
        f"no cached {assets.task} SFT model: training the tool-using warm start first "
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
        files=[config],
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
