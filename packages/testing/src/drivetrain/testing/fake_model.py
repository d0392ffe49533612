"""The tiny model behind the fake engine and fake rollout: a bigram table.

``p(x_t | x_{t-1}) = softmax((W[x_{t-1}] + b) / temperature)``. Two named weights,
``bigram.weight`` (V by V) and ``bigram.bias`` (V), stored as nested lists of floats: enough
structure to exercise export, sync, checkpoints and optimizers without a tensor library.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from typing import Any

WEIGHT = "bigram.weight"
BIAS = "bigram.bias"
EOS_TOKEN_ID = 0
#: the text of token ``i`` is ``TEXT[i]`` (EOS: none), repeating past the alphabet
TEXT = "abcdefghijklmnopqrstuvwxyz"


def init_weights(vocab_size: int, seed: int, scale: float = 0.5) -> dict[str, Any]:
    """Deterministic initial weights for a vocabulary of ``vocab_size``."""
    rng = random.Random(seed)
    weight = [[rng.gauss(0.0, scale) for _ in range(vocab_size)] for _ in range(vocab_size)]
    bias = [rng.gauss(0.0, scale) for _ in range(vocab_size)]
    return {WEIGHT: weight, BIAS: bias}


def next_token_logits(weights: dict[str, Any], prev: int) -> list[Any]:
    """Logits (floats or autodiff scalars, whatever the weights hold) after token ``prev``."""
    return [w + b for w, b in zip(weights[WEIGHT][prev], weights[BIAS], strict=True)]


def log_softmax(logits: Sequence[float]) -> list[float]:
    peak = max(logits)
    total = math.log(sum(math.exp(x - peak) for x in logits)) + peak
    return [x - total for x in logits]


def decode(token_ids: Sequence[int]) -> str:
    """The text of tokens: a letter each, EOS skipped (as a tokenizer skips special tokens)."""
    return "".join(TEXT[(t - 1) % len(TEXT)] for t in token_ids if t != EOS_TOKEN_ID)
