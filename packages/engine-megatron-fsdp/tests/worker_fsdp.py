"""Worker: the megatron_fsdp (or megatron) engine on every rank, case after case in one process.

argv: OUT_DIR MODEL_DIR CASES_JSON, each case {"engine": "megatron_fsdp" | "megatron",
"overrides": {...}, "run": [...]}; actions are engine-megatron's ``worker_engine`` ones
(``conformance``, ``steps``, ``save:DIR``, ``load:DIR``) plus ``chunks`` (a step, then every
chunk's exported weights against its optimizer's gathered main weights) and the resume actions
of :func:`resume`.
"""

import json
import sys

import torch

from drivetrain.api import OutputSpec
from fsdp_harness import FSDPHarness
from megatron_harness import MegatronHarness
from megatron_launch import single_thread, write_result
from parity_data import training_batch
from worker_engine import BATCH_MICRO, run_case, train


def exported_vs_training(harness):
    """After one step and a forward-only pass: the engine's HF export against the same export
    read from the optimizer's main weights (the training weights, gathered from their shards).
    Returns
    {hf name: max |difference|}; every chunk's layers are in the stream."""
    from drivetrain.engine.megatron.convert import export_hf_weights
    from drivetrain.engine.megatron_fsdp.gather import GatheredParams

    engine = harness.make_engine(BATCH_MICRO)
    try:
        batch = harness.make_batch(*training_batch())  # rows of 6..20 tokens
        train(engine, batch, 1)
        with engine.eval_mode():  # a forward pass leaves every chunk's raw (gathered) params
            engine.infer(engine.parallel.shard_of(batch), OutputSpec())
        exported = {name: t.clone() for name, t in engine.export_weights()}
        main = {id(c.module): dict(c.param_and_grad_buffer.optimizer_named_parameters)
                for c in engine.model}  # fmt: skip
        truth = export_hf_weights(
            [c.module for c in engine.model], engine.hf_config, engine.tcfg,
            read_params=lambda chunk: GatheredParams(main[id(chunk)], torch.float32),
        )  # fmt: skip
        return {name: float((exported[name] - t).abs().max()) for name, t in truth}
    finally:
        engine.close()


def resume(harness, action):
    """``fresh3``: 3 steps, then the losses and the export; ``save2:DIR``: 2 steps, then a
    checkpoint; ``load1:DIR``: load, 1 step, then the losses and the export; ``refuse:DIR``:
    the load's error message (None if it loaded)."""
    batch = harness.make_batch(*training_batch())
    engine = harness.make_engine(BATCH_MICRO)
    kind, _, path = action.partition(":")
    try:
        if kind == "save2":
            train(engine, batch, 2)
            engine.save_checkpoint(path, step=2)
            return None
        if kind == "refuse":
            try:
                engine.load_checkpoint(path)
            except ValueError as error:
                return str(error)
            return None
        if kind == "load1":
            engine.load_checkpoint(path)
        steps = train(engine, batch, 1 if kind == "load1" else 3)
        return {"steps": steps, "weights": {n: t.clone() for n, t in engine.export_weights()}}
    finally:
        engine.close()


def run(harness, action):
    if action == "chunks":
        return exported_vs_training(harness)
    if action.partition(":")[0] in ("fresh3", "save2", "load1", "refuse"):
        return resume(harness, action)
    return run_case(harness, action)


if __name__ == "__main__":  # megatron's checkpoint writer re-imports the entry script
    single_thread()
    out_dir, model_dir, cases = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    results = []
    for case in cases:
        kind = (
            FSDPHarness
            if case.get("engine", "megatron_fsdp") == "megatron_fsdp"
            else MegatronHarness
        )
        harness = kind(model_dir, overrides=case.get("overrides", {}))
        for action in case["run"]:
            results.append({"case": case, "action": action, "result": run(harness, action)})
    write_result(out_dir, results)
    torch.distributed.destroy_process_group()
