"""Worker: the megatron_fsdp (or megatron) engine on every rank, case after case in one process.

argv: OUT_DIR MODEL_DIR CASES_JSON, each case {"engine": "megatron_fsdp" | "megatron",
"overrides": {...}, "run": [...]}; actions are engine-megatron's ``worker_engine`` ones
(``conformance``, ``steps``, ``save:DIR``, ``load:DIR``) plus ``chunks`` (a step, then every
chunk's exported weights against its optimizer's gathered main weights).
"""

import json
import sys

import torch

from fsdp_harness import FSDPHarness
from megatron_harness import MegatronHarness
from megatron_launch import single_thread, write_result
from parity_data import training_batch
from worker_engine import BATCH_MICRO, run_case, train


def exported_vs_training(harness):
    """After one step: the engine's HF export against the same export read from the
    optimizer's main weights (the training weights, gathered from their shards). Returns
    {hf name: max |difference|}; every chunk's layers are in the stream."""
    from drivetrain.engine.megatron.convert import export_hf_weights
    from drivetrain.engine.megatron_fsdp.gather import GatheredParams

    engine = harness.make_engine(BATCH_MICRO)
    try:
        # rows of one length: engine-megatron's interleaved (virtual pipeline) schedule fails on
        # micro-batches of different lengths (see the README)
        sequences, masks = training_batch()
        sequences, masks = [s[:6] for s in sequences], [[0, 0, 0, 1, 1, 1]] * len(masks)
        train(engine, harness.make_batch(sequences, masks), 1)
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
            result = (
                exported_vs_training(harness) if action == "chunks" else run_case(harness, action)
            )
            results.append({"case": case, "action": action, "result": result})
    write_result(out_dir, results)
    torch.distributed.destroy_process_group()
