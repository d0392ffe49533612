"""Weight sync: seconds and GB/s per transport against the naive path and memcpy.

For a ~100M and a ~500M parameter Llama (bf16), a sender in this process streams the model's
tensors to a receiver process running drivetrain's ``hf`` rollout on the same model, which
applies them as they arrive (the rollout's own weight path: ``WeightReceiver.receive`` ->
``update_weights``; a tensor split across buckets is written straight into its parameter),
through each drivetrain transport, measured side by side with:

- the naive path: ``torch.save(model.state_dict())`` and ``from_pretrained`` on the other
  side (the reload of a whole checkpoint that weight sync replaces), and
- this machine's memcpy bandwidth (one thread copying a 1 GiB buffer): the physical limit
  of moving bytes on the CPU.

Each path runs ``--repeats`` times; the first two are warm-up (first touch of the receiver's
memory, of the buffers and of new files; this VM also reclaims idle pages in the background,
so a large model's first passes fault its pages back in) and the median of the rest is
reported as "steady"; "first" is the very first run, cold.

One torch thread per process (the machine has two cores: sender and receiver get one each).
The last line is JSON with ``speedup_vs_naive`` and ``fraction_of_memcpy`` per model and
transport.

    uv run python benchmarks/weight_sync.py [--sizes 100M,500M] [--repeats 10] [--bucket-mib 64]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

TRANSPORTS = ("colocated", "broadcast", "disk")
WARMUP = 2  # leading repeats not counted (first touch of pages, buffers, files)
SIZES = {
    # hidden, layers, intermediate, heads: 106M and 497M parameters with a 32k vocabulary
    "100M": (768, 8, 2048, 12),
    "500M": (1280, 21, 3456, 20),
}


def model_config(size: str):
    from transformers import LlamaConfig

    hidden, layers, intermediate, heads = SIZES[size]
    return LlamaConfig(
        vocab_size=32000,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        tie_word_embeddings=False,
        dtype="bfloat16",
    )


def build_model(size: str, *, random: bool, device: str = "cpu"):
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(model_config(size))
    model = model.to_empty(device=device).to(torch.bfloat16)
    if random:
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for param in model.parameters():
                value = torch.randn(param.shape, generator=g, dtype=torch.bfloat16) * 0.02
                param.copy_(value)
    return model


def save_model(size: str, directory: Path) -> Path:
    """The model (bf16) with a small tokenizer, for the receiving rollout to load."""
    from drivetrain.trainer.builtin.char_tokenizer import build_char_tokenizer

    build_model(size, random=False).save_pretrained(directory)
    build_char_tokenizer(directory)
    return directory


def receiver(
    name: str, config: dict, endpoint: dict, model_dir: str, repeats: int, device: str, out
) -> None:
    """The rollout side: an ``hf`` rollout receiving every sync into its model."""
    torch.set_num_threads(1)
    from drivetrain.api.config import WeightSyncConfig
    from drivetrain.api.registry import ckpt_engines, rollouts
    from drivetrain.api.weight_receiver import WeightReceiver
    from drivetrain.api.weight_sync import Topology
    from drivetrain.rollout.config import HFRolloutConfig

    rollout = rollouts.load("hf")(
        HFRolloutConfig(model_path=model_dir, dtype="bfloat16", device=device, num_threads=1)
    )
    config_cls = ckpt_engines.load_config_class(name, WeightSyncConfig)
    weights = WeightReceiver(rollout)
    topology = Topology.one_sender(1)
    weights.connect(name, config_cls(**config), rank=1, topology=topology, endpoint=endpoint)
    for version in range(1, repeats + 1):
        weights.receive(version)
    weights.disconnect()
    rollout.shutdown()
    out.put("done")


def time_transport(
    name: str, model, model_dir: Path, repeats: int, bucket_bytes: int
) -> list[float]:
    from drivetrain.api.config import WeightSyncConfig
    from drivetrain.api.registry import ckpt_engines
    from drivetrain.api.weight_sync import Topology, TransportRole

    device = str(next(model.parameters()).device.type)
    config = {"bucket_bytes": bucket_bytes, "timeout_s": 600.0, "device": device}
    config_cls = ckpt_engines.load_config_class(name, WeightSyncConfig)
    sender = ckpt_engines.load(name)(config_cls(**config))
    endpoint = sender.prepare()
    ctx = mp.get_context("spawn")
    done = ctx.Queue()
    proc = ctx.Process(
        target=receiver,
        args=(name, config, dict(endpoint), str(model_dir), repeats, device, done),
    )
    proc.start()
    try:
        sender.connect(TransportRole.SENDER, 0, Topology.one_sender(1), endpoint)
        seconds = []
        for version in range(1, repeats + 1):
            stats = sender.send(model.state_dict().items(), version=version)
            seconds.append(stats.seconds)
        done.get(timeout=600)
    finally:
        proc.join(timeout=60)
        if proc.is_alive():
            proc.kill()
        sender.finalize()
    return seconds


def time_naive(model, size: str, work: Path, repeats: int) -> list[float]:
    """Save the whole state dict, reload it with ``from_pretrained`` and put it into the live
    model the rollout serves from (the end state the transports reach: the new weights in the
    receiver's own parameters). In this process: the reload dominates either way."""
    from transformers import AutoModelForCausalLM

    device = next(model.parameters()).device
    live = build_model(size, random=False, device=device.type)
    seconds = []
    for _ in range(repeats):
        directory = work / "naive"
        start = time.perf_counter()
        directory.mkdir()
        model.config.save_pretrained(directory)
        torch.save(model.state_dict(), directory / "pytorch_model.bin")
        loaded = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.bfloat16)
        live.load_state_dict(loaded.state_dict())
        if device.type == "cuda":
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - start)
        del loaded
        shutil.rmtree(directory)
    return seconds


def memcpy_gb_per_s(nbytes: int = 1 << 30, device: str = "cpu") -> float:
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        dst.copy_(src)
        if src.is_cuda:
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return nbytes / best / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="100M,500M")
    parser.add_argument("--repeats", type=int, default=10, help="runs per path, 2 of them warm-up")
    parser.add_argument("--bucket-mib", type=int, default=64)
    parser.add_argument("--transports", default=",".join(TRANSPORTS))
    parser.add_argument("--device", default="cpu", help="cpu, or cuda (one GPU: no broadcast)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    memcpy = memcpy_gb_per_s(device=args.device)
    print(f"memcpy ({args.device}, 1 GiB): {memcpy:.2f} GB/s; buckets {args.bucket_mib} MiB")
    rows, speedup, first, fraction = [], {}, {}, {}
    work = Path(tempfile.mkdtemp(prefix="drivetrain-bench-sync-"))

    def steady(seconds: list[float]) -> float:
        return statistics.median(seconds[WARMUP:])

    try:
        for size in args.sizes.split(","):
            model = build_model(size, random=True, device=args.device)
            nbytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
            params = sum(p.numel() for p in model.parameters()) / 1e6
            naive = time_naive(model, size, work, args.repeats)
            rows.append((size, params, "naive", naive[0], steady(naive), nbytes))
            speedup[size], first[size], fraction[size] = {}, {}, {}
            model_dir = save_model(size, work / f"model-{size}")
            for name in args.transports.split(","):
                seconds = time_transport(
                    name, model, model_dir, args.repeats, args.bucket_mib * 1024 * 1024
                )
                rows.append((size, params, name, seconds[0], steady(seconds), nbytes))
                speedup[size][name] = round(steady(naive) / steady(seconds), 2)
                first[size][name] = round(naive[0] / seconds[0], 2)
                fraction[size][name] = round(nbytes / steady(seconds) / 1e9 / memcpy, 3)
            del model
    finally:
        shutil.rmtree(work, ignore_errors=True)
    naive_of = {row[0]: row for row in rows if row[2] == "naive"}
    print(
        f"{'model':>6} {'params':>8} {'backend':>10} {'first s':>8} {'steady s':>9} "
        f"{'GB/s':>6} {'x naive':>8} {'x naive 1st':>11} {'/ memcpy':>9}"
    )
    for size, params, name, cold, warm, nbytes in rows:
        gbs = nbytes / warm / 1e9
        base = naive_of[size]
        print(
            f"{size:>6} {params:>7.1f}M {name:>10} {cold:>8.3f} {warm:>9.3f} {gbs:>6.2f} "
            f"{base[4] / warm:>7.1f}x {base[3] / cold:>10.1f}x {gbs / memcpy:>9.2f}"
        )
    print(
        json.dumps(
            {
                "memcpy_gb_per_s": round(memcpy, 2),
                "bucket_mib": args.bucket_mib,
                "speedup_vs_naive": speedup,
                "speedup_vs_naive_first_sync": first,
                "fraction_of_memcpy": fraction,
            }
        )
    )


if __name__ == "__main__":
    main()
