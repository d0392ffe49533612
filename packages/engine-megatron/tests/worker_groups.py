"""torchrun worker: build and close a megatron engine several times in one process; report the
process groups still registered and the process's threads after each close."""

import os
import sys

import torch.distributed as dist

from drivetrain.api import MicroBatchConfig
from megatron_harness import MegatronHarness
from megatron_launch import single_thread, write_result


def threads() -> int:
    return len(os.listdir("/proc/self/task"))


if __name__ == "__main__":
    single_thread()
    out_dir, model_dir, rounds = sys.argv[1], sys.argv[2], int(sys.argv[3])
    harness = MegatronHarness(model_dir, overrides={"tensor_parallel": 2})
    report = []
    for _ in range(rounds):
        engine = harness.make_engine(MicroBatchConfig(micro_batch_size=2))
        built = len(dist.distributed_c10d._world.pg_map)
        engine.close()
        left = len(dist.distributed_c10d._world.pg_map)
        report.append({"groups_built": built, "groups_left": left, "threads": threads()})
    write_result(out_dir, report)
    dist.destroy_process_group()
