"""Addition word problems for SmolLM2 as RL prompts (JSONL with ``prompt`` and ``answer``).

uv run python examples/smollm2/make_data.py data/smollm2-addition
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path


def rows(count: int, seed: int) -> list[dict[str, str]]:
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        a, b = rng.randrange(10, 100), rng.randrange(10, 100)
        out.append(
            {
                "prompt": f"What is {a} + {b}? Reply with the number only.",
                "answer": str(a + b),
            }
        )
    return out


if __name__ == "__main__":
    root = Path(sys.argv[1] if len(sys.argv) > 1 else "data/smollm2-addition")
    root.mkdir(parents=True, exist_ok=True)
    for name, count, seed in (("train", 2000, 0), ("val", 64, 1)):
        with open(root / f"{name}.jsonl", "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows(count, seed))
    print(root)
