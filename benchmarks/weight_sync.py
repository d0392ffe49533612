"""Weight sync: seconds and GB/s per transport against the naive path and memcpy.

For a ~100M and a ~500M parameter Llama (bf16), and one of many small tensors (``many``: 579
tensors, 13.5 MB, where the host work per tensor is what is measured), a sender in this
process streams the model's tensors to a receiver process running drivetrain's ``hf``
rollout on the same model, which applies them as they arrive (the rollout's own weight path:
``WeightReceiver.receive`` -> ``update_weights``; a tensor split across buckets is written
straight into its parameter), through each drivetrain transport, measured side by side with:

- the naive path: ``torch.save(model.state_dict())`` and ``from_pretrained`` on the other
  side (the reload of a whole checkpoint that weight sync replaces), and
- this machine's memcpy bandwidth (one thread copying a 1 GiB buffer): the physical limit
  of moving bytes on the CPU.

Every transport's receiver stays up for the whole run, so the paths are interleaved
(``timing.py``: naive, colocated, broadcast, disk, the order rotating every round). Two
warm-up rounds (first touch of the receiver's memory, of the buffers and of new files; this
VM also reclaims idle pages in the background, so a large model's first passes fault its
pages back in), then at least 5 timed rounds: "steady" is a path's median over them, the
speedup over naive is the median of the per-round ratios (with min-max), and "first" is the
very first, cold run.

One torch thread per process (the machine has two cores: sender and receiver get one each).
The last line is JSON with ``speedup_vs_naive.<size>.<transport>`` (and its spread),
``fraction_of_memcpy`` and ``host_us_per_tensor`` (a steady sync's seconds over its tensors)
per model and transport, and the delta rows of ``weight_delta.py``
(``delta_bytes_fraction.unchanged`` / ``.half_frozen``, ``delta_vs_adapter_bytes.lora`` /
``.lora_merged``; ``--delta-size ''`` skips them). ``--quick``: the 100M model, one round.

    uv run python benchmarks/weight_sync.py [--sizes 100M,500M] [--pairs 5] [--bucket-mib 64]
    [--device cuda] [--quick]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
from timing import (
    Measured,
    add_arguments,
    interleaved,
    print_result,
    rounds_of,
    speedup,
    warmup_rounds,
)

TRANSPORTS = ("colocated", "broadcast", "disk")
WARMUP = 2  # warm-up rounds, not counted (first touch of pages, buffers, files)
SIZES = {
    # hidden, layers, intermediate, heads: 106M and 497M parameters with a 32k vocabulary
    "100M": (768, 8, 2048, 12),
    "500M": (1280, 21, 3456, 20),
    # 579 small tensors (13.5 MB): the per-tensor host work, which bounds a sync on a GPU
    "many": (64, 64, 128, 2),
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


def save_model(size: str, directory: Path, model=None) -> Path:
    """The model (bf16; ``model`` or an uninitialised one of ``size``) with a small tokenizer,
    for the receiving rollout to load."""
    from drivetrain.trainer.builtin.char_tokenizer import build_char_tokenizer

    (model or build_model(size, random=False)).save_pretrained(directory)
    build_char_tokenizer(directory)
    return directory


def receiver(
    name: str, config: dict, endpoint: dict, model_dir: str, repeats: int, device: str, out
) -> None:
    """The rollout side: an ``hf`` rollout receiving every sync into its model."""
    torch.set_num_threads(1)
    from drivetrain.api.config import WeightSyncConfig
    from drivetrain.api.registry import ckpt_engines, rollouts
    from drivetrain.api.weight_sync import Topology
    from drivetrain.rollout.config import HFRolloutConfig
    from drivetrain.runtime.weight_receiver import WeightReceiver

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


class TransportRun:
    """One transport's sender here and its receiving rollout in a process of its own, both up
    for the whole benchmark so the paths can be interleaved; ``sends``: syncs it will do."""

    def __init__(self, name: str, model, model_dir: Path, sends: int, bucket_bytes: int) -> None:
        from drivetrain.api.config import WeightSyncConfig
        from drivetrain.api.registry import ckpt_engines
        from drivetrain.api.weight_sync import Topology, TransportRole

        self.model, self.version, self.finished = model, 0, False
        device = str(next(model.parameters()).device.type)
        config = {"bucket_bytes": bucket_bytes, "timeout_s": 600.0, "device": device}
        config_cls = ckpt_engines.load_config_class(name, WeightSyncConfig)
        self.sender = ckpt_engines.load(name)(config_cls(**config))
        endpoint = self.sender.prepare()
        ctx = mp.get_context("spawn")
        self.done = ctx.Queue()
        self.proc = ctx.Process(
            target=receiver,
            args=(name, config, dict(endpoint), str(model_dir), sends, device, self.done),
        )
        self.proc.start()
        self.sender.connect(TransportRole.SENDER, 0, Topology.one_sender(1), endpoint)

    def sync(self) -> Measured:
        self.version += 1
        sent = self.sender.send(self.model.state_dict().items(), version=self.version)
        return Measured(sent.seconds)

    def finish(self) -> None:
        """Wait for the receiver to confirm it applied every sync."""
        self.done.get(timeout=600)
        self.finished = True

    def stop(self) -> None:
        """After ``finish`` the receiver exits by itself; after a failure it is killed."""
        self.proc.join(timeout=60 if self.finished else 0)
        if self.proc.is_alive():
            self.proc.kill()
        self.sender.finalize()


class NaiveSync:
    """Save the whole state dict, reload it with ``from_pretrained`` and put it into the live
    model the rollout serves from (the end state the transports reach: the new weights in the
    receiver's own parameters). In this process: the reload dominates either way."""

    def __init__(self, model, size: str, work: Path) -> None:
        self.model, self.directory = model, work / "naive"
        self.live = build_model(size, random=False, device=next(model.parameters()).device.type)

    def sync(self) -> None:
        from transformers import AutoModelForCausalLM

        self.directory.mkdir()
        self.model.config.save_pretrained(self.directory)
        torch.save(self.model.state_dict(), self.directory / "pytorch_model.bin")
        loaded = AutoModelForCausalLM.from_pretrained(self.directory, dtype=torch.bfloat16)
        self.live.load_state_dict(loaded.state_dict())
        if self.live.device.type == "cuda":
            torch.cuda.synchronize()
        del loaded
        shutil.rmtree(self.directory)


def time_paths(args: argparse.Namespace, size: str, work: Path, rounds: int) -> tuple:
    """Seconds per timed round of the naive path and each transport, interleaved, plus the
    first (cold) sync of each, the state dict's bytes and its number of tensors."""
    model = build_model(size, random=True, device=args.device)
    nbytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    count = len(model.state_dict())
    model_dir = save_model(size, work / f"model-{size}")
    runs: list[TransportRun] = []
    try:
        sides: dict[str, object] = {"naive": NaiveSync(model, size, work).sync}
        for name in args.transports.split(","):
            syncs = warmup_rounds(rounds, WARMUP) + rounds
            runs.append(TransportRun(name, model, model_dir, syncs, args.bucket_mib << 20))
            sides[name] = runs[-1].sync
        seen: list[dict[str, float]] = []
        times = interleaved(sides, rounds, WARMUP, progress=lambda _, s, __: seen.append(s))
        for run in runs:
            run.finish()
    finally:
        for run in runs:
            run.stop()
    return times, seen[0], nbytes, count


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
    add_arguments(parser)
    parser.add_argument("--sizes", default="100M,500M")
    parser.add_argument(
        "--bucket-mib",
        type=int,
        default=None,
        help="bucket size; default 64 on the CPU (two shared-memory buckets per transport), "
        "the product's weight_sync.bucket_bytes (256) on a GPU",
    )
    parser.add_argument("--transports", default=",".join(TRANSPORTS))
    parser.add_argument("--device", default="cpu", help="cpu, or cuda (one GPU: no broadcast)")
    parser.add_argument(
        "--delta-size", default="100M", help="the model of the delta rows ('' skips them)"
    )
    args = parser.parse_args()
    if args.bucket_mib is None:
        from drivetrain.api.config import WeightSyncConfig

        args.bucket_mib = 64 if args.device == "cpu" else WeightSyncConfig.bucket_bytes >> 20
    rounds = rounds_of(args)
    sizes = ["100M"] if args.quick else args.sizes.split(",")
    torch.set_num_threads(1)
    memcpy = memcpy_gb_per_s(device=args.device)
    print(f"memcpy ({args.device}, 1 GiB): {memcpy:.2f} GB/s; buckets {args.bucket_mib} MiB")
    ratios, first, fraction, per_tensor, rows = {}, {}, {}, {}, []
    work = Path(tempfile.mkdtemp(prefix="drivetrain-bench-sync-"))
    try:
        for size in sizes:
            times, cold, nbytes, count = time_paths(args, size, work, rounds)
            first[size], fraction[size], per_tensor[size] = {}, {}, {}
            for name, seconds in times.items():
                steady = statistics.median(seconds)
                rows.append((size, name, cold[name], steady, nbytes))
                if name != "naive":
                    ratios[f"speedup_vs_naive.{size}.{name}"] = speedup(times, name, "naive")
                    first[size][name] = round(cold["naive"] / cold[name], 2)
                    fraction[size][name] = round(nbytes / steady / 1e9 / memcpy, 3)
                    per_tensor[size][name] = round(steady / count * 1e6, 1)
        delta = {}
        if args.delta_size:  # bytes a delta sync moves (weight_delta.py)
            import weight_delta

            model = build_model(args.delta_size, random=True)
            trained = save_model(args.delta_size, work / "delta", model)  # LoRA trains on it
            delta.update(weight_delta.model_rows(model))
            delta.update(weight_delta.lora_rows(trained))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"{'model':>6} {'backend':>10} {'first s':>8} {'steady s':>9} {'GB/s':>6} "
          f"{'/ memcpy':>9}  x naive [min, max]")  # fmt: skip
    for size, name, cold, steady, nbytes in rows:
        gbs = nbytes / steady / 1e9
        ratio = ratios.get(f"speedup_vs_naive.{size}.{name}", "")
        print(f"{size:>6} {name:>10} {cold:>8.3f} {steady:>9.3f} {gbs:>6.2f} "
              f"{gbs / memcpy:>9.2f}  {ratio}")  # fmt: skip
    print_result(
        ratios,
        **delta,
        memcpy_gb_per_s=round(memcpy, 2),
        bucket_mib=args.bucket_mib,
        speedup_vs_naive_first_sync=first,
        fraction_of_memcpy=fraction,
        host_us_per_tensor=per_tensor,
        rounds=rounds,
    )


if __name__ == "__main__":
    main()
