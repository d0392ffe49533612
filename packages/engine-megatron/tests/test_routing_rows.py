"""Which packed-row positions each rank's routers see under sequence and context parallel
(``routing.Routing``), on CPU without a process group: each simulated rank's replay targets
must sit on the tokens that rank's row holds (as ``pack_row`` / ``pack_row_cp`` lay them out),
and the experts assembled from every rank's rows must be the batch's column again. The 2-rank
runs in test_routing.py cover TP+SP, EP and PP end to end; context parallel needs CUDA and
TransformerEngine, so this is its CPU check."""

import pytest
import torch

from drivetrain.api import Batch
from drivetrain.api.columns import INPUT_IDS, ROUTED_EXPERTS
from drivetrain.engine.megatron.context import pack_row_cp
from drivetrain.engine.megatron.packing import pack_row
from drivetrain.engine.megatron.routing import Replayer, Routing
from drivetrain.engine_core import flat_column

LENGTHS = [5, 11, 3]
LAYERS, TOP_K, EXPERTS = 2, 2, 4


def experts_of(ids: torch.Tensor) -> torch.Tensor:
    """A routing that names its token: ``[tokens, layers, top_k]``, -1 for padding (id 0)."""
    picks = torch.stack([(ids + layer) % EXPERTS for layer in range(LAYERS)], -1)
    out = torch.stack([picks, (picks + 1) % EXPERTS], -1)
    return torch.where(ids[:, None, None] > 0, out, -1)


def micro_batch() -> Batch:
    ids = torch.zeros(len(LENGTHS), max(LENGTHS), dtype=torch.long)
    routed = torch.full((*ids.shape, LAYERS, TOP_K), -1, dtype=torch.int16)
    start = 1
    for i, n in enumerate(LENGTHS):
        ids[i, :n] = torch.arange(start, start + n)  # ids > 0: 0 marks padding
        routed[i, :n] = experts_of(ids[i, :n])
        start += n
    return Batch.from_columns({INPUT_IDS: ids, ROUTED_EXPERTS: routed}, seq_lens=LENGTHS)


def rank(sp: int, tp_rank: int, cp: int, cp_rank: int) -> Routing:
    """A ``Routing`` of one simulated rank: two routers, no process group (the test reduces)."""
    routing = Routing.__new__(Routing)
    routing.per_chunk = [[Replayer(0), Replayer(1)]]
    routing.layers, routing.top_k, routing.experts, routing.pipeline = LAYERS, TOP_K, EXPERTS, 1
    routing.sp, routing.tp_rank, routing.tp_group = sp, tp_rank, None
    routing.cp, routing.cp_rank, routing.cp_group = cp, cp_rank, None
    return routing


@pytest.mark.parametrize(("cp", "sp"), [(1, 1), (1, 2), (2, 1), (2, 2)])
def test_each_rank_replays_its_own_tokens_and_the_ranks_together_report_all(cp, sp):
    micro = micro_batch()
    ids = flat_column(micro, INPUT_IDS)
    parts = []
    for cp_rank in range(cp):
        if cp > 1:
            row = pack_row_cp(ids, LENGTHS, cp=cp, rank=cp_rank, multiple=sp)
        else:
            row = pack_row(micro, torch.device("cpu"), multiple=sp)
        for tp_rank in range(sp):
            routing = rank(sp, tp_rank, cp, cp_rank)
            routing.before_forward(0, micro, row)
            held = row.input_ids[0].chunk(sp)[tp_rank]  # what this rank's routers see
            for replayer in routing.per_chunk[0]:
                want = experts_of(held)[:, replayer.layer]
                assert torch.equal(replayer.target, want)
                replayer.used = torch.where(want >= 0, want, 0)  # padding: some own choice
            parts.append(routing.used(row))
    assembled = torch.stack(parts).amax(0)  # the all-reduce MAX over the TP and CP groups
    assert assembled.dtype == torch.int16
    assert torch.equal(assembled, flat_column(micro, ROUTED_EXPERTS))
