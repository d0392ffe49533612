"""Greedy exact-match accuracy of a Hugging Face model directory on chat prompt/answer rows."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


def exact_match(
    model_dir: str,
    rows: Sequence[Mapping[str, Any]],
    *,
    batch_size: int = 100,
    samples: int = 0,
    seed: int = 0,
) -> float:
    """Fraction of rows whose greedy completion equals the assistant answer exactly; with
    ``samples`` > 0, the fraction of that many answers per row sampled at temperature 1
    (seeded) that do."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    answers = [row["messages"][-1]["content"] for row in rows]
    prompts = [
        tokenizer.apply_chat_template(
            row["messages"][:-1], tokenize=False, add_generation_prompt=True
        )
        for row in rows
    ]
    longest = max(len(tokenizer(a, add_special_tokens=False)["input_ids"]) for a in answers)
    correct = 0
    torch.manual_seed(seed)
    for start in range(0, len(rows), batch_size):
        chunk = prompts[start : start + batch_size]
        encoded = tokenizer(chunk, return_tensors="pt", padding=True, add_special_tokens=False)
        with torch.no_grad():
            out = model.generate(
                **encoded,
                do_sample=samples > 0,
                temperature=1.0 if samples else None,
                top_k=0 if samples else None,
                num_return_sequences=max(samples, 1),
                max_new_tokens=longest + 1,
                pad_token_id=tokenizer.pad_token_id,
                eos_token_id=tokenizer.eos_token_id,
            )
        texts = tokenizer.batch_decode(
            out[:, encoded["input_ids"].shape[1] :], skip_special_tokens=True
        )
        expected = [a for a in answers[start : start + batch_size] for _ in range(max(samples, 1))]
        correct += sum(text.strip() == answer for text, answer in zip(texts, expected, strict=True))
    return correct / (len(rows) * max(samples, 1))
