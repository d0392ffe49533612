"""TRL's ``SFTTrainer`` configured as the reference for drivetrain's SFT: same pre-tokenized
examples, same order, fp32, plain AdamW, constant LR, one optimizer step per batch.

TRL 1.x defaults that would otherwise differ (measured): ``bf16=True`` even on CPU, activation
checkpointing on, a linear LR decay, shuffled data, truncation at 1024 tokens, and a
``completion_mask`` that only counts with ``completion_only_loss=True``.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: TRL's batching: ``padded`` (its default), ``padding_free`` (each batch one row with
#: position ids) and ``packing`` (best-fit-decreasing bins of ``max_length`` tokens, padding
#: free; ``batch_size`` then counts bins).
LAYOUTS = ("padded", "padding_free", "packing")


@dataclass(frozen=True)
class ReferenceRun:
    losses: list[float]
    seconds: float  # wall time of trainer.train()
    tokens: int  # non-padding tokens fed


def trl_sft(
    model_dir: Path,
    examples: Sequence[Any],
    *,
    batch_size: int,
    steps: int,
    lr: float,
    out_dir: Path,
    max_grad_norm: float = 1.0,
    callbacks: Sequence[Any] = (),
    layout: str = "padded",
    max_length: int | None = None,
    examples_used: int | None = None,
) -> ReferenceRun:
    """TRL's SFT over the first ``examples_used`` examples (default: ``batch_size * steps``).
    The trainer counts the real tokens it sees (``state.num_input_tokens_seen``)."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout {layout!r} is not one of {LAYOUTS}")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
    import time

    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import SFTConfig, SFTTrainer

    class Losses(TrainerCallback):
        def __init__(self) -> None:
            self.values: list[float] = []

        def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kw: Any) -> None:
            if logs and "loss" in logs:
                self.values.append(float(logs["loss"]))

    used = list(examples[: examples_used or batch_size * steps])
    dataset = Dataset.from_dict(
        {
            "input_ids": [list(e.input_ids) for e in used],
            "completion_mask": [list(e.loss_mask) for e in used],
        }
    )
    args = SFTConfig(
        output_dir=str(out_dir),
        per_device_train_batch_size=batch_size,
        gradient_accumulation_steps=1,
        max_steps=steps,
        learning_rate=lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        optim="adamw_torch",
        max_grad_norm=max_grad_norm,
        bf16=False,
        fp16=False,
        activation_checkpointing=False,
        use_cpu=True,
        seed=0,
        train_sampling_strategy="sequential",
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        completion_only_loss=True,
        packing=layout == "packing",
        padding_free=layout != "padded",
        max_length=max_length if layout == "packing" else None,
        include_num_input_tokens_seen="non_padding",
    )
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    losses = Losses()
    trainer = SFTTrainer(
        model=model, args=args, train_dataset=dataset, processing_class=tokenizer,
        callbacks=[losses, *callbacks],
    )  # fmt: skip
    began = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - began
    return ReferenceRun(losses.values, seconds, sum(len(e.input_ids) for e in used))


def split_prompt(input_ids: Sequence[int], loss_mask: Sequence[int]) -> tuple[list[int], list[int]]:
    """An example's prompt (before its first loss token) and answer (the rest), for TRL's
    pre-tokenized preference columns; the loss tokens must be one suffix."""
    start = list(loss_mask).index(1)
    if not all(loss_mask[start:]):
        raise ValueError("the loss tokens are not one suffix: TRL would score other tokens")
    return list(input_ids[:start]), list(input_ids[start:])


def trl_dpo(
    model_dir: Path,
    pairs: Sequence[Any],
    *,
    batch_size: int,
    steps: int,
    lr: float,
    beta: float,
    loss_type: str,
    out_dir: Path,
) -> ReferenceRun:
    """TRL's ``DPOTrainer`` over the first ``batch_size * steps`` pairs (drivetrain ``Pair``s)
    in order, fp32, plain AdamW, constant LR, a reference loaded from the same directory.

    TRL 1.16 re-tokenizes every dataset (``_prepare_dataset``: prompt extraction, EOS appended
    to text answers); its collator reads ``prompt_ids``/``chosen_ids``/``rejected_ids``, so a
    subclass hands it drivetrain's tokens as they are."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import time

    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import DPOConfig, DPOTrainer

    class PreTokenized(DPOTrainer):
        def _prepare_dataset(self, dataset: Any, *args: Any, **kwargs: Any) -> Any:
            return dataset

    class Losses(TrainerCallback):
        def __init__(self) -> None:
            self.values: list[float] = []

        def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kw: Any) -> None:
            if logs and "loss" in logs:
                self.values.append(float(logs["loss"]))

    rows = []
    for pair in pairs[: batch_size * steps]:
        prompt, chosen = split_prompt(pair.chosen.input_ids, pair.chosen.loss_mask)
        same, rejected = split_prompt(pair.rejected.input_ids, pair.rejected.loss_mask)
        assert same == prompt, "chosen and rejected must share the prompt"
        rows.append({"prompt_ids": prompt, "chosen_ids": chosen, "rejected_ids": rejected})
    args = DPOConfig(
        output_dir=str(out_dir), beta=beta, loss_type=[loss_type], max_length=None,
        per_device_train_batch_size=batch_size, gradient_accumulation_steps=1, max_steps=steps,
        learning_rate=lr, lr_scheduler_type="constant", warmup_steps=0, optim="adamw_torch",
        weight_decay=0.0, max_grad_norm=1.0, bf16=False, fp16=False,
        activation_checkpointing=False, use_cpu=True, train_sampling_strategy="sequential",
        seed=0, logging_steps=1, save_strategy="no", report_to="none", disable_tqdm=True,
    )  # fmt: skip
    load = lambda: AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)  # noqa: E731
    losses = Losses()
    trainer = PreTokenized(
        model=load(), ref_model=load(), args=args, train_dataset=Dataset.from_list(rows),
        processing_class=AutoTokenizer.from_pretrained(str(model_dir)), callbacks=[losses],
    )  # fmt: skip
    began = time.perf_counter()
    trainer.train()
    tokens = sum(len(r[k]) for r in rows for k in ("prompt_ids", "chosen_ids", "rejected_ids"))
    return ReferenceRun(losses.values, time.perf_counter() - began, tokens)
