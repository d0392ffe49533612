"""torchrun worker: the megatron engine on every rank, case after case in one process (importing
megatron-core costs ~6 s per process).

argv: OUT_DIR MODEL_DIR CASES_JSON, each case {"overrides": {...}, "run": [...]} where run holds
``conformance`` (the engine-api kit), ``steps`` (3 training steps: losses and grad norms),
``save:DIR`` (one step, then a checkpoint, then the next step's loss) or ``load:DIR`` (load,
then that next step's loss).
"""

import json
import sys

import torch

from drivetrain.api import MicroBatchConfig
from drivetrain.testing import run_conformance, token_mean_nll
from megatron_harness import MegatronHarness
from megatron_launch import single_thread, write_result
from parity_data import training_batch

BATCH_MICRO = MicroBatchConfig(micro_batch_size=2)


def train(engine, batch, steps):
    results = []
    for _ in range(steps):
        with engine.train_mode():
            engine.optimizer_zero_grad()
            loss = engine.forward_backward(engine.parallel.shard_of(batch), token_mean_nll).loss
            norm = engine.optimizer_step()
            engine.lr_scheduler_step()
        results.append({"loss": loss, "grad_norm": norm})
    return results


def run_case(harness, action):
    if action == "conformance":
        return [
            {"check": r.name, "passed": r.passed, "error": r.error, "seconds": r.seconds}
            for r in run_conformance(harness)
        ]
    batch = harness.make_batch(*training_batch())
    engine = harness.make_engine(BATCH_MICRO)
    try:
        if action == "steps":
            return train(engine, batch, 3)
        kind, _, path = action.partition(":")
        if kind == "save":
            first = train(engine, batch, 1)
            engine.save_checkpoint(path, step=1)
            return {"first": first, "next": train(engine, batch, 2)}
        if kind == "load":
            engine.load_checkpoint(path)
            return {"next": train(engine, batch, 2)}
        raise ValueError(action)
    finally:
        engine.close()


if __name__ == "__main__":
    single_thread()
    out_dir, model_dir, cases = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    results = []
    for case in cases:
        harness = MegatronHarness(model_dir, overrides=case.get("overrides", {}))
        for action in case["run"]:
            results.append({"case": case, "action": action, "result": run_case(harness, action)})
    write_result(out_dir, results)
    torch.distributed.destroy_process_group()
