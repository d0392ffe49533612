"""torchrun worker: 3 training steps with several engine configurations on 2 ranks.

argv: OUT_DIR MODEL_DIR DATA_JSON CASES_JSON. Rank 0 saves final weights per case.
"""

import json
import sys
from pathlib import Path

import torch

from drivetrain.api import MicroBatchConfig
from drivetrain.testing import token_mean_nll
from drivetrain.testing.torch_engines.kit_harness import padded_batch
from fsdp_harness import FSDPHarness, single_thread
from launch import write_result

if __name__ == "__main__":
    single_thread()
    out_dir, model_dir = sys.argv[1], sys.argv[2]
    data, cases = json.loads(sys.argv[3]), json.loads(sys.argv[4])
    batch = padded_batch(data["sequences"], data["masks"])
    results = {}
    for case in cases:
        harness = FSDPHarness(model_dir, engine=case["engine"], overrides=case.get("overrides", {}))
        engine = harness.make_engine(MicroBatchConfig(**case["micro_batch"]))
        losses, norms = [], []
        for _ in range(data["steps"]):
            with engine.train_mode():
                engine.optimizer_zero_grad()
                result = engine.forward_backward(engine.parallel.shard_of(batch), token_mean_nll)
                norms.append(engine.optimizer_step())
                engine.lr_scheduler_step()
            losses.append(result.loss)
        weights = dict(engine.export_weights())
        if torch.distributed.get_rank() == 0:
            torch.save(weights, Path(out_dir) / f"{case['name']}.pt")
        results[case["name"]] = {"losses": losses, "grad_norms": norms}
        engine.close()
    write_result(out_dir, results)
    torch.distributed.destroy_process_group()
