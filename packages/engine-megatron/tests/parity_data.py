"""The fixed training data every parity check uses (token ids below the tiny vocabulary)."""

import random


def training_batch(count: int = 8, vocab: int = 64, seed: int = 0):
    """Sequences of 6..20 tokens and loss masks covering the second half of each."""
    rng = random.Random(seed)
    sequences, masks = [], []
    for _ in range(count):
        n = rng.randint(6, 20)
        sequences.append([rng.randrange(3, vocab) for _ in range(n)])
        masks.append([0] * (n // 2) + [1] * (n - n // 2))
    return sequences, masks
