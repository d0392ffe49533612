"""Child process of ``test_plan.py``'s CPU check: the fsdp2 engine trains two optimizer steps
of one micro-batch on the CPU, and the process's own peak memory above what it held before the
engine was built is printed as JSON (bytes).

Run with ``MALLOC_MMAP_THRESHOLD_`` set (the test does): glibc then serves every large tensor
from its own mapping and gives it back when freed, so the process's resident peak follows the
tensors that are alive, not what the allocator kept after freeing them.
Usage: python plan_measure.py MODEL_DIR ROWS WIDTH
"""

from __future__ import annotations

import json
import resource
import sys


def resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        pages = int(statm.read().split()[1])
    return pages * resource.getpagesize()


def main() -> None:
    model_dir, rows, width = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    import torch

    torch.set_num_threads(2)
    from drivetrain.api import Batch, MicroBatchConfig, ModelConfig, OptimConfig
    from drivetrain.engine.fsdp.config import FSDPConfig
    from drivetrain.engine.fsdp.engine import FSDP2Engine
    from drivetrain.testing import token_mean_nll

    ids = torch.randint(3, 1000, (rows, width), generator=torch.Generator().manual_seed(0))
    columns = {"input_ids": ids, "loss_mask": torch.ones(rows, width)}
    batch = Batch.from_columns(columns, seq_lens=[width] * rows)
    config = FSDPConfig(
        model=ModelConfig(path=model_dir, dtype="float32"),
        optim=OptimConfig(lr=1e-5, weight_decay=0.0, clip_grad=1.0),
        micro_batch=MicroBatchConfig(max_tokens=rows * width),  # one micro-batch a step
        attention="sdpa",
        remove_padding=False,
        device="cpu",
    )
    engine = FSDP2Engine(config)
    before = resident_bytes()
    engine.initialize()
    for _ in range(2):  # the second step's backward meets the optimizer state
        with engine.train_mode():
            engine.optimizer_zero_grad()
            engine.forward_backward(batch, token_mean_nll)
            engine.optimizer_step()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    engine.close()
    print(json.dumps({"peak_above_start": peak - before, "start": before}))


if __name__ == "__main__":
    main()
