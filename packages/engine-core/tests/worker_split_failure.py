"""gloo worker: the micro-batch driver over TorchCollectives at two ranks.

argv: OUT_DIR. Rank 1's shard holds a sample longer than the token budget; both ranks must
raise the same BatchError. Then a short shard: both ranks agree on one micro-batch count."""

import sys

import torch
import torch.distributed as dist

from drivetrain.api import Batch, BatchError, MicroBatchConfig
from drivetrain.engine_core import TorchCollectives
from drivetrain.runtime.micro_batching import loss_totals, plan_micro_batches
from drivetrain.testing.torch_engines.ranks import write_result


def batch(lengths: list[int]) -> Batch:
    width = max(lengths)
    ids = torch.ones(len(lengths), width, dtype=torch.long)
    mask = (torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]).float()
    return Batch.from_columns({"input_ids": ids, "loss_mask": mask}, seq_lens=lengths)


if __name__ == "__main__":
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    collectives = TorchCollectives(torch.device("cpu"))
    budget = MicroBatchConfig(max_tokens=8)
    report = {}
    try:
        plan_micro_batches(batch([4, 12] if rank == 1 else [4, 4]), budget, collectives)
        report["error"] = None
    except BatchError as exc:
        report["error"] = str(exc)
    shard = batch([3, 3, 3, 3] if rank == 0 else [3])  # rank 1: one sample, rank 0: two rows
    report["parts"] = plan_micro_batches(shard, MicroBatchConfig(max_tokens=6), collectives)
    totals = loss_totals(shard, collectives)
    report["totals"] = [totals.tokens, totals.sequences]
    try:
        loss_totals(batch([2]).with_columns(loss_mask=torch.zeros(1, 2)), collectives)
        report["empty"] = None
    except BatchError as exc:
        report["empty"] = str(exc)
    write_result(sys.argv[1], report)
    dist.destroy_process_group()
