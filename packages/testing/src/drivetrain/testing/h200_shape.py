"""The one configuration measured on a GPU that planners are checked against: the 1.07B Llama of
``benchmarks/gpu/mfu.py`` (H200, 2026-11-27, ``benchmarks/README.md``) and the work of one of
its steps' largest micro-batch, dense and packed, as an engine's planner takes it."""

from __future__ import annotations

import random
from pathlib import Path

from drivetrain.api.batch import Batch
from drivetrain.api.plan import RankWork

#: 16 x 4096 tokens a step in micro-batches of 4 rows
DENSE = RankWork(rows=4, width=4096, micro_batches=4)
PARAMETERS = 1_072_236_544


def save_llama_1b_config(path: Path) -> str:
    """mfu.py's GPU_SHAPE as a model directory holding only its config (planners read no
    weights)."""
    from transformers import LlamaConfig

    LlamaConfig(
        hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=16,
        num_key_value_heads=8, vocab_size=32000, max_position_embeddings=4096,
        tie_word_embeddings=True,
    ).save_pretrained(path)  # fmt: skip
    return str(path)


def packed_work(max_tokens: int = 16384) -> RankWork:
    """mfu.py's 26 documents of 128..4096 tokens cut as the engines cut them (``max_tokens`` a
    micro-batch): the largest micro-batch's documents, and how many there are."""
    rng = random.Random(1)
    lengths = [rng.randint(4096 // 32, 4096) for _ in range(26)]
    batch = Batch.from_columns({"input_ids": [[3] * n for n in lengths]}, seq_lens=lengths)
    parts = batch.token_budget_parts(max_tokens)
    largest = max(parts, key=lambda part: sum(lengths[i] for i in part))
    return RankWork(documents=tuple(lengths[i] for i in largest), micro_batches=len(parts))
