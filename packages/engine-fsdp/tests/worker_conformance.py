"""torchrun worker: the engine-api conformance kit on every rank, for several configurations.

argv: OUT_DIR MODEL_DIR CASES_JSON  (a list of {"engine": ..., "overrides": {...}})
"""

import json
import sys

import torch

from drivetrain.testing import run_conformance
from fsdp_harness import FSDPHarness, single_thread
from launch import write_result

if __name__ == "__main__":
    single_thread()
    out_dir, model_dir, cases = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    results = []
    for case in cases:
        overrides = dict(case.get("overrides", {}))
        harness = FSDPHarness(model_dir, engine=case["engine"], overrides=overrides)
        for r in run_conformance(harness):
            results.append(
                {
                    "case": case,
                    "check": r.name,
                    "passed": r.passed,
                    "error": r.error,
                    "seconds": r.seconds,
                }
            )
    write_result(out_dir, results)
    torch.distributed.destroy_process_group()
