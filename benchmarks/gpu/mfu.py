"""MFU of drivetrain's engines on one device, beside a plain PyTorch loop on the same model.

The GPU table of issue 33: a ~1B Llama (hidden 2048, 16 layers, 16 heads / 8 KV heads, MLP
8192, 32k vocabulary, tied: 1.07B parameters) in bf16, 64k tokens per optimizer step:

- ``plain``: transformers' model in bf16, fused AdamW, 16 rows x 4096 in micro-batches of 4;
- ``fsdp2_dense``: fsdp2, the same 16 x 4096 rows, ``attention=sdpa``, no packing, mbs 4;
- ``fsdp2_packed``: fsdp2 on 26 documents of 128..4096 tokens, packed, ``max_tokens=16384``
  (its defaults: the packed kernel ``auto`` picks);
- ``fsdp2_compiled``: ``fsdp2_dense`` with ``torch_compile=true`` (each decoder layer
  compiled; the warm-up steps take the compile);
- ``megatron_dense`` / ``megatron_packed``: the megatron engine on the same two batches.

Each configuration is built, warmed up (2 steps), timed (4 steps) and closed before the next:
six 1B engines do not fit one device together, so they cannot be interleaved as the CPU
benchmarks are; the device is the run's own. Reported per configuration: s/step, useful
tokens/s, MFU (model FLOPs of the real tokens, ``flops.py``, over ``--peak-tflops``, the bf16
dense peak of an H100 SXM by default) and MFU over a matmul measured in the same run, peak
memory. ``--cpu-smoke``: a tiny model in fp32 on the CPU through every configuration's code
path, one timed step (proves the script runs; its numbers mean nothing). ``--profile``: one
more step of ``plain`` and ``fsdp2_dense`` under ``torch.profiler``, their 15 costliest ops by
self device time side by side (where fsdp2's gap to the plain loop goes).

Each engine configuration (compile aside) is also planned by its engine's planner (``drivetrain
plan``'s: fake tensors on the CPU) and its ``planned_gib`` set beside the measured peak.

The last line is JSON: ``dense_mfu``, ``dense_vs_plain``, ``packed_vs_dense_mfu``,
``compiled_vs_dense``, ``megatron_peak_vs_fsdp2``, ``plan_error.<configuration>`` (planned
over measured peak, minus 1; on a device), ``configurations``, ``profile`` (with
``--profile``), ``device``.
Usage: python benchmarks/gpu/mfu.py [--cpu-smoke] [--peak-tflops 989] [--profile]
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: flops, engine_fsdp
from engine_fsdp import make_batch
from flops import matmul_peak, training_flops

from drivetrain.api import Batch, MicroBatchConfig, ModelConfig, OptimConfig
from drivetrain.testing import token_mean_nll

GPU_SHAPE = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                 num_attention_heads=16, num_key_value_heads=8, vocab_size=32000)  # fmt: skip
SMOKE_SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, vocab_size=256)  # fmt: skip


def build_model(path: Path, shape: dict[str, int], longest: int) -> Any:
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(**shape, max_position_embeddings=longest, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(path)
    return model


def plain_step(model_dir: Path, batch: Batch, device: str, dtype: torch.dtype, mbs: int) -> Any:
    """The baseline: transformers' model, AdamW, micro-batches with gradient accumulation."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation="sdpa")
    model.to(device).train()
    optim = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=device == "cuda")
    ids = batch["input_ids"].to(device)

    def step() -> None:
        optim.zero_grad(set_to_none=True)
        for start in range(0, ids.shape[0], mbs):
            part = ids[start : start + mbs]
            loss = model(input_ids=part, labels=part, use_cache=False).loss
            (loss * part.shape[0] / ids.shape[0]).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optim.step()

    return step, lambda: None


def engine_config(kind: str, model_dir: Path, device: str, dtype: str,
                  micro: MicroBatchConfig, **overrides: object) -> Any:  # fmt: skip
    """The fsdp2 or megatron engine's config of a configuration."""
    common = dict(
        model=ModelConfig(path=str(model_dir), dtype=dtype),
        optim=OptimConfig(lr=1e-5, weight_decay=0.0, clip_grad=1.0),
        micro_batch=micro, device=device,
    )  # fmt: skip
    if kind == "fsdp2":
        from drivetrain.engine.fsdp.config import FSDPConfig

        return FSDPConfig(**common, **overrides)
    from drivetrain.engine.megatron.config import MegatronConfig

    return MegatronConfig(**common, **overrides)


def engine_step(kind: str, model_dir: Path, batch: Batch, device: str, dtype: str,
                micro: MicroBatchConfig, **overrides: object) -> Any:  # fmt: skip
    """One drivetrain optimizer step (the engine stays up between calls); and its close."""
    config = engine_config(kind, model_dir, device, dtype, micro, **overrides)
    if kind == "fsdp2":
        from drivetrain.engine.fsdp.engine import FSDP2Engine

        engine: Any = FSDP2Engine(config)
    else:
        from drivetrain.engine.megatron.engine import MegatronEngine

        engine = MegatronEngine(config)
    engine.initialize()

    def step() -> None:
        with engine.train_mode():
            engine.optimizer_zero_grad()
            engine.forward_backward(batch, token_mean_nll)
            engine.optimizer_step()
            engine.lr_scheduler_step()

    return step, engine.close


def planned_gib(kind: str, model_dir: Path, batch: Batch, dtype: str, micro: MicroBatchConfig,
                **overrides: object) -> float:  # fmt: skip
    """What ``drivetrain plan``'s planner of the engine says the configuration's rank peaks at
    (fake tensors on the CPU, in a child process when this one holds a process group)."""
    from drivetrain.api.plan import RankWork

    config = engine_config(kind, model_dir, "cpu", dtype, micro, **overrides)
    packed = kind == "megatron" or getattr(config, "attention", "") == "varlen"
    if micro.max_tokens is not None and packed:
        parts = batch.token_budget_parts(micro.max_tokens)
        sizes = [sum(batch.seq_lens[i] for i in part) for part in parts]
        largest = parts[sizes.index(max(sizes))]
        lengths = tuple(batch.seq_lens[i] for i in largest)
        work = RankWork(documents=lengths, micro_batches=len(parts))
    else:
        rows = micro.micro_batch_size or len(batch)
        width = max(batch.seq_lens)
        work = RankWork(rows=rows, width=width, micro_batches=-(-len(batch) // rows))
    if kind == "fsdp2":
        from drivetrain.engine.fsdp.plan import plan_memory
    else:
        from drivetrain.engine.megatron.plan import plan_memory
    return plan_memory(config, 1, work).peak_gib


def profiled(step: Callable[[], None], device: str, top: int = 15) -> list[dict[str, Any]]:
    """One more ``step`` under the profiler: its ``top`` ops by self time on ``device``."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities) as prof:
        step()
        if device == "cuda":
            torch.cuda.synchronize()
    key = "self_device_time_total" if device == "cuda" else "self_cpu_time_total"
    events = sorted(prof.key_averages(), key=lambda e: getattr(e, key), reverse=True)
    return [
        {"op": e.key, "ms": round(getattr(e, key) / 1e3, 3), "calls": e.count} for e in events[:top]
    ]


def measure(
    build: Callable[[], Any], device: str, warmup: int, timed: int, profile: bool = False
) -> dict[str, Any]:
    """Build, warm up, time ``timed`` steps, close; peak memory on CUDA; with ``profile``,
    one more step's costliest ops. Everything of the configuration is gone on return: its
    engine lives only in :func:`_measured`'s frame (megatron's modules sit in reference cycles,
    so a frame still holding them at ``gc.collect()`` left the next configuration 10 bytes a
    parameter of it: +10 GiB on megatron_packed's peak after megatron_dense)."""
    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    try:
        return _measured(build, device, warmup, timed, profile)
    except torch.OutOfMemoryError as exc:  # a result too: the megatron row was one
        return {"error": f"out of memory: {str(exc).splitlines()[0]}"}
    finally:
        gc.collect()


def _measured(
    build: Callable[[], Any], device: str, warmup: int, timed: int, profile: bool
) -> dict[str, Any]:
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    step, close = build()
    for _ in range(warmup):
        step()
    sync()
    start = time.perf_counter()
    for _ in range(timed):
        step()
    sync()
    seconds = (time.perf_counter() - start) / timed
    peak = torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None
    ops = profiled(step, device) if profile else None
    close()
    return {"s_per_step": seconds, "peak_gib": peak, **({"top_ops": ops} if ops else {})}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny model on the CPU")
    parser.add_argument("--peak-tflops", type=float, default=989.0, help="the device's peak")
    parser.add_argument("--profile", action="store_true", help="plain vs fsdp2_dense ops")
    args = parser.parse_args()
    smoke = args.cpu_smoke
    device = "cpu" if smoke or not torch.cuda.is_available() else "cuda"
    if device == "cpu" and not smoke:
        raise SystemExit("no CUDA device: run with --cpu-smoke")
    shape, rows, longest = (SMOKE_SHAPE, 4, 64) if smoke else (GPU_SHAPE, 16, 4096)
    budget = 4 * longest
    dtype_name = "float32" if smoke else "bfloat16"
    dtype = getattr(torch, dtype_name)
    warmup, timed = (1, 1) if smoke else (2, 4)
    rng = random.Random(1)
    dense = make_batch([longest] * rows, seed=0, vocab=shape["vocab_size"])
    lengths = [rng.randint(longest // 32, longest) for _ in range(26 if not smoke else 6)]
    packed = make_batch(lengths, seed=2, vocab=shape["vocab_size"])
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "llama"
        model = build_model(model_dir, shape, longest)
        mbs, per_tokens = MicroBatchConfig(micro_batch_size=4), MicroBatchConfig(max_tokens=budget)
        row_layout = {"attention": "sdpa", "remove_padding": False}
        configs: dict[str, tuple[Batch, Callable[[], Any]]] = {
            "plain": (dense, lambda: plain_step(model_dir, dense, device, dtype, 4)),
            "fsdp2_dense": (dense, lambda: engine_step(
                "fsdp2", model_dir, dense, device, dtype_name, mbs, **row_layout)),
            "fsdp2_packed": (packed, lambda: engine_step(
                "fsdp2", model_dir, packed, device, dtype_name, per_tokens)),
            "fsdp2_compiled": (dense, lambda: engine_step(
                "fsdp2", model_dir, dense, device, dtype_name, mbs, **row_layout,
                torch_compile=True)),
            "megatron_dense": (dense, lambda: engine_step(
                "megatron", model_dir, dense, device, dtype_name, mbs)),
            "megatron_packed": (packed, lambda: engine_step(
                "megatron", model_dir, packed, device, dtype_name, per_tokens)),
        }  # fmt: skip
        #: what each engine configuration's planner is given (compile is not planned)
        plans = {
            "fsdp2_dense": ("fsdp2", dense, mbs, row_layout),
            "fsdp2_packed": ("fsdp2", packed, per_tokens, {}),
            "megatron_dense": ("megatron", dense, mbs, {}),
            "megatron_packed": ("megatron", packed, per_tokens, {}),
        }
        matmul = matmul_peak(dtype, device)
        peak = matmul if smoke else args.peak_tflops * 1e12
        table, ops = {}, {}
        for name, (batch, build) in configs.items():
            wanted = args.profile and name in ("plain", "fsdp2_dense")
            row = measure(build, device, warmup, timed, profile=wanted)
            if "top_ops" in row:
                ops[name] = row.pop("top_ops")
            if "s_per_step" in row:
                flops = training_flops(model, batch.seq_lens)
                row["tokens_per_s"] = batch.num_tokens / row["s_per_step"]
                row["mfu"] = flops / row["s_per_step"] / peak
                row["mfu_vs_matmul"] = flops / row["s_per_step"] / matmul
            if name in plans:
                kind, planned_batch, micro, layout = plans[name]
                row["planned_gib"] = planned_gib(
                    kind, model_dir, planned_batch, dtype_name, micro, **layout
                )
                if row.get("peak_gib"):
                    row["plan_error"] = row["planned_gib"] / row["peak_gib"] - 1
            table[name] = row
            print(f"{name:<18}" + "  ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
                                            for k, v in row.items()), flush=True)  # fmt: skip
    params = sum(p.numel() for p in model.parameters())

    def ratio(a: str, b: str, key: str) -> float | None:
        x, y = table[a].get(key), table[b].get(key)
        return round(x / y, 3) if x and y else None

    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    print(json.dumps({
        "dense_mfu": round(table["fsdp2_dense"].get("mfu", 0.0), 3),
        "dense_vs_plain": ratio("fsdp2_dense", "plain", "tokens_per_s"),
        "packed_vs_dense_mfu": ratio("fsdp2_packed", "fsdp2_dense", "mfu"),
        "compiled_vs_dense": ratio("fsdp2_compiled", "fsdp2_dense", "tokens_per_s"),
        "megatron_peak_vs_fsdp2": ratio("megatron_packed", "fsdp2_packed", "peak_gib"),
        **{f"plan_error.{n}": round(r["plan_error"], 4)
           for n, r in table.items() if "plan_error" in r},
        "configurations": table, **({"profile": ops} if ops else {}),
        "device": name, "dtype": dtype_name, "params_m": round(params / 1e6, 1),
        "matmul_tflops": round(matmul / 1e12, 3), "peak_tflops": round(peak / 1e12, 3),
        "torch": torch.__version__, "cpu_smoke": smoke,
    }), flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
