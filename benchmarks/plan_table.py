"""The plan on paper of GRPO at scale, beside what peers published for the same jobs.

Qwen3-8B, Qwen3-32B and Llama-3.1-70B (their public architectures, no weights) at 8, 16 and 64
H100-80GB, for each training engine, planned by ``drivetrain plan``'s own code (the engine's
planner on fake tensors over a fake process group of that size): GRPO with a colocated vLLM
rollout at ``gpu_memory_utilization`` 0.6, as NeMo-RL's performance recipes run it: 64 prompts
x 32 samples a step, up to 4,096 tokens each (1,024 prompt + 3,072 new), bf16 with fp32 master
weights and AdamW, activation checkpointing, micro-batches of 16,384 tokens, 4 optimizer steps
a step (mini-batches of 512). Per configuration: the busiest phase's peak GiB a rank, whether
it fits and what would make it, and the step time on paper (``plan_time.py``: the roofline,
and the same with training at fsdp2's one measured MFU) at the limits and at the mean
generated length the peer reported.

Peers' numbers (their repositories, read 2026-11-29): NeMo-RL v0.5's performance summary
(``docs/about/performance-summary.md``, tag v0.5.0): Llama-3.1-8B-Instruct on 16 H100, on
policy, Megatron TP1 PP2, vLLM colocated at 0.6, max 4,096 tokens, 1,019 generated on average:
92.8 s/step, 1,581 tokens/s/GPU; Qwen3-32B on 32 H100, Megatron TP4 PP4, vLLM TP4: 376 s/step,
571 tokens/s/GPU (3,251 generated on average). verl and prime-rl publish no step time or memory
for these models on H100 (verl's dense numbers are on H20 with 20-28k responses; prime-rl's
trainer-only table stops at Qwen3-4B); no peer publishes a 70B RL number on H100. So the
Llama-3.1-8B and Qwen3-32B rows at NeMo-RL's GPU counts are added for the comparison.

The last line is JSON: ``paper_vs_nemo_rl.<model>_<gpus>`` (our step time at fsdp2's measured
MFU over NeMo-RL's measured one, at its mean generated length: below 1 is a plan faster than
their measurement, a bound, not a result), ``configurations`` (every row), ``seconds``.
``--quick``: Qwen3-0.6B's shape at 8 GPUs only (proves the script runs).
Usage: python benchmarks/plan_table.py [--quick] [--engines fsdp2,megatron]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import tempfile
import time
from pathlib import Path
from typing import Any

from transformers import LlamaConfig, Qwen3Config

from drivetrain.trainer.commands.plan import job_inputs
from drivetrain.trainer.plan_report import time_of
from drivetrain.trainer.plan_target import PlanTarget, accelerator
from drivetrain.trainer.planning import plan_with_fixes

MODELS = {
    "qwen3-0.6b": Qwen3Config(
        hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
        num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True,
    ),
    "qwen3-8b": Qwen3Config(
        hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=False,
    ),
    "llama-3.1-8b": LlamaConfig(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False,
    ),
    "qwen3-32b": Qwen3Config(
        hidden_size=5120, intermediate_size=25600, num_hidden_layers=64, num_attention_heads=64,
        num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=False,
    ),
    "llama-3.1-70b": LlamaConfig(
        hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
        num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False,
    ),
}  # fmt: skip

#: (model, GPUs) -> NeMo-RL v0.5's measured s/step, tokens/s/GPU, mean generated tokens
NEMO_RL = {("llama-3.1-8b", 16): (92.8, 1581, 1019), ("qwen3-32b", 32): (376.0, 571, 3251)}
PEER_KEYS = ("s_per_step", "tokens_per_s_per_gpu", "mean_new")
GRID = [(m, g) for m in ("qwen3-8b", "qwen3-32b", "llama-3.1-70b") for g in (8, 16, 64)]
#: megatron's (tensor, pipeline) parallel sizes by model and GPUs (NeMo-RL's recipes' where
#: they have one: 8B TP1 PP2, 32B TP4 PP4), and vLLM's tensor parallel size per replica
MEGATRON_LAYOUT = {
    "qwen3-0.6b": {8: (1, 1)},
    "qwen3-8b": {8: (1, 2), 16: (1, 2), 64: (1, 2)},
    "llama-3.1-8b": {16: (1, 2)},
    "qwen3-32b": {8: (4, 2), 16: (4, 4), 32: (4, 4), 64: (4, 4)},
    "llama-3.1-70b": {8: (8, 1), 16: (8, 2), 64: (8, 4)},
}
ROLLOUT_TP = {"qwen3-32b": 4, "llama-3.1-70b": 8}
PROMPT, NEW = 1024, 3072
JOB = [
    f"data.max_prompt_length={PROMPT}", f"sampling.max_new_tokens={NEW}",
    "run.prompts_per_step=64", "sampling.n=32", "algorithm.mini_batch_size=512",
    "actor.model.dtype=bfloat16", "rollout.dtype=bfloat16",
    "actor.model.gradient_checkpointing=true", "actor.micro_batch.max_tokens=16384",
    "placement.mode=colocated", "rollout.gpu_memory_utilization=0.6",
]  # fmt: skip


def plan_row(root: Path, model: str, gpus: int, engine: str) -> dict[str, Any]:
    path = root / model
    if not path.exists():
        MODELS[model].save_pretrained(path)
    data = root / "prompts.jsonl"
    data.write_text('{"prompt": "1+1", "ground_truth": "2"}\n')
    said = [*JOB, f"actor.model.path={path}", f"data.train_path={data}", f"workers.num={gpus}"]
    layout = ""
    if engine == "megatron":
        tp, pp = MEGATRON_LAYOUT[model][gpus]
        said += [f"actor.tensor_parallel={tp}", f"actor.pipeline_parallel={pp}"]
        said += ["actor.sequence_parallel=true"] * (tp > 1)
        layout = f" TP{tp} PP{pp}"
    began = time.perf_counter()
    inputs, _ = job_inputs("grpo", engine, "vllm", [], said)
    target = PlanTarget(accelerator("h100-80gb"), gpus=gpus, nodes=max(1, gpus // 8))
    planned, fixes = plan_with_fixes(inputs, target)
    tp = ROLLOUT_TP.get(model, 1)
    at_limits = time_of(inputs, target, rollout_tp=tp)
    peer = NEMO_RL.get((model, gpus))
    at_mean = (
        time_of(dataclasses.replace(inputs, new=peer[2]), target, rollout_tp=tp) if peer else None
    )
    peak = planned.peak
    return {
        "model": model,
        "gpus": gpus,
        "engine": engine + layout,
        "peak_gib": round(peak.bytes / 2**30, 1) if peak else None,
        "busiest": peak.name if peak else None,
        "fits": planned.fits(),
        "fits_with": [setting for setting, _ in fixes],
        "unplanned": list(planned.unplanned),
        "step_s_at_limits": at_limits.row(gpus) if at_limits else None,
        "step_s_at_peer_mean": at_mean.row(gpus) if at_mean else None,
        "nemo_rl": dict(zip(PEER_KEYS, peer, strict=True)) if peer else None,
        "plan_seconds": round(time.perf_counter() - began, 1),
    }


def markdown(rows: list[dict[str, Any]]) -> list[str]:
    out = [
        "| model | GPUs | engine | peak GiB a rank (phase) | fits on 80 GB | s/step roofline / "
        "at measured MFU (limits) | same at the peer's mean length | NeMo-RL measured |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r["peak_gib"] is None:
            memory, fits = "unplanned: " + "; ".join(r["unplanned"]), "-"
        else:
            memory = f"{r['peak_gib']:g} ({r['busiest']})"
            fits = {True: "yes", None: "as far as planned"}.get(r["fits"], "no")
            if r["fits"] is False:
                fits += "; fits with: " + ("; ".join(r["fits_with"]) or "none of ours")
        limits, mean = r["step_s_at_limits"], r["step_s_at_peer_mean"]
        peer = r["nemo_rl"]
        out.append(
            f"| {r['model']} | {r['gpus']} | {r['engine']} | {memory} | {fits} | "
            f"{limits['roofline_s']:.0f} / {limits['at_measured_mfu_s']:.0f} | "
            + (f"{mean['roofline_s']:.0f} / {mean['at_measured_mfu_s']:.0f} | " if mean else "- | ")
            + (f"{peer['s_per_step']:g} s ({peer['tokens_per_s_per_gpu']} tok/s/GPU) |"
               if peer else "- |")
        )  # fmt: skip
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--engines", default="fsdp2,megatron")
    args = parser.parse_args()
    began = time.perf_counter()
    engines = args.engines.split(",")
    grid = [("qwen3-0.6b", 8)] if args.quick else [*GRID, *NEMO_RL]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for model, gpus in grid:
            for engine in engines:
                rows.append(plan_row(Path(tmp), model, gpus, engine))
                print(json.dumps(rows[-1]), flush=True)
    for line in markdown(rows):
        print(line)
    ratios = {
        f"paper_vs_nemo_rl.{r['model']}_{r['gpus']}": round(
            r["step_s_at_peer_mean"]["at_measured_mfu_s"] / r["nemo_rl"]["s_per_step"], 3
        )
        for r in rows
        if r["nemo_rl"] and r["engine"] == "fsdp2"  # the roofline is the engine's any way
    }
    planned = [r for r in rows if r["peak_gib"] is not None]
    print(json.dumps({
        **ratios, "planned": len(planned), "configurations": rows,
        "seconds": round(time.perf_counter() - began, 1),
    }))  # fmt: skip


if __name__ == "__main__":
    main()
