"""The runtime's micro-batch driver over torch.distributed (gloo, two ranks), and the layouts."""

from pathlib import Path

import pytest
import torch

from drivetrain.api import Batch, MicroBatchConfig
from drivetrain.engine_core import (
    InferOutputs,
    TorchCollectives,
    flat_column,
    loss_free_batch,
    to_layout,
)
from drivetrain.runtime.micro_batching import loss_totals, plan_micro_batches
from drivetrain.testing.torch_engines.ranks import launch_ranks

HERE = Path(__file__).parent


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_one_ranks_split_failure_fails_every_rank_with_the_same_error(tmp_path):
    ranks = launch_ranks(HERE / "worker_split_failure.py", tmp_path, timeout=100)
    errors = [r["error"] for r in ranks]
    assert errors[0] == errors[1], errors
    assert errors[0].startswith("rank 1 could not cut its shard into micro-batches: sample 1 ")
    assert "max_tokens=8" in errors[0]
    # a short shard is spread over (or padded to) the agreed count: two on both ranks
    assert [len(r["parts"]) for r in ranks] == [2, 2]
    assert ranks[1]["parts"] == [[0], []]
    assert ranks[0]["totals"] == ranks[1]["totals"] == [15, 5]
    assert (
        ranks[0]["empty"]
        == ranks[1]["empty"]
        == ("the mini-batch has no tokens with loss_mask == 1")
    )


def test_world_of_one_without_a_process_group():
    ids = torch.ones(2, 3, dtype=torch.long)
    batch = Batch.from_columns(
        {"input_ids": ids, "loss_mask": torch.tensor([[0.0, 1, 1], [1, 1, 9]])}, seq_lens=[3, 2]
    )
    collectives = TorchCollectives(torch.device("cpu"))
    totals = loss_totals(batch, collectives)
    assert (totals.tokens, totals.sequences) == (4, 2)  # the padding's 9 never counts
    parts = plan_micro_batches(batch, MicroBatchConfig(micro_batch_size=1), collectives)
    assert parts == [[0], [1]]


def test_layout_round_trip_and_infer_order():
    batch = Batch.from_columns({"input_ids": torch.tensor([[5, 6, 7], [8, 9, 0]])}, seq_lens=[3, 2])
    flat = flat_column(batch, "input_ids")
    assert flat.tolist() == [5, 6, 7, 8, 9]
    assert to_layout(flat, batch).tolist() == [[5, 6, 7], [8, 9, 0]]
    assert to_layout(flat, batch.to_packed()).tolist() == flat.tolist()
    dummy = loss_free_batch(2, torch.device("cpu"))
    assert dummy.seq_lens == (2,) and dummy["loss_mask"].dtype == torch.float32
    assert float(dummy["loss_mask"].sum()) == 0
    collected = InferOutputs(batch)
    for i in (1, 0):  # micro-batches in another order than the batch's
        micro = batch.select([i])
        collected.add([i], micro, {"log_probs": micro["input_ids"].float().requires_grad_()})
    result = collected.result(["log_probs"])
    assert result["log_probs"].tolist() == [[5, 6, 7], [8, 9, 0]]
    assert not result["log_probs"].requires_grad
    assert InferOutputs(batch).result(["values"])["values"].numel() == 0
