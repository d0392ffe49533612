"""The micro-batch driver against an in-memory Collectives: two ranks as two threads."""

import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import pytest

from drivetrain.api import Batch, BatchError, EngineConfig, MicroBatchConfig
from drivetrain.api.config import coerce_config
from drivetrain.runtime.micro_batching import loss_totals, plan_micro_batches


class ThreadCollectives:
    """Every rank's values meet at a barrier; each reduction reads them all."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.barrier = threading.Barrier(world, timeout=10)
        self.slots: list = [None] * world
        self.calls: list[str] = []

    def rank(self, rank: int) -> "RankView":
        return RankView(self, rank)

    def exchange(self, rank: int, value):
        self.slots[rank] = value
        self.barrier.wait()
        values = list(self.slots)
        self.barrier.wait()  # nobody overwrites a slot before every rank has read
        return values


@dataclass
class RankView:
    group: ThreadCollectives
    rank: int

    def max_ints(self, values):
        return [max(v) for v in zip(*self.group.exchange(self.rank, list(values)), strict=True)]

    def sum_over_data_parallel(self, values):
        return [sum(v) for v in zip(*self.group.exchange(self.rank, list(values)), strict=True)]

    def gather_texts(self, text):
        return self.group.exchange(self.rank, text)


def batch(lengths, loss=1):
    width = max(lengths)
    ids = [[1] * width for _ in lengths]
    mask = [[loss if t < n else 7 for t in range(width)] for n in lengths]  # 7: padding
    return Batch.from_columns({"input_ids": ids, "loss_mask": mask}, seq_lens=lengths)


def on_two_ranks(fn, shards):
    group = ThreadCollectives(2)

    def run(rank):
        try:
            return fn(shards[rank], group.rank(rank))
        except BatchError as exc:
            return f"BatchError: {exc}"

    with ThreadPoolExecutor(2) as pool:
        return list(pool.map(run, range(2)))


def test_one_ranks_failure_is_every_ranks_error():
    budget = MicroBatchConfig(max_tokens=8)
    got = on_two_ranks(
        lambda b, c: plan_micro_batches(b, budget, c), [batch([4, 4]), batch([4, 12])]
    )
    assert got[0] == got[1]
    assert got[0].startswith("BatchError: rank 1 could not cut its shard into micro-batches: ")


def test_ranks_agree_on_the_count_spreading_or_padding():
    budget = MicroBatchConfig(max_tokens=6)
    got = on_two_ranks(
        lambda b, c: plan_micro_batches(b, budget, c), [batch([3, 3, 3, 3]), batch([2, 2])]
    )
    assert got == [[[0, 2], [1, 3]], [[0], [1]]]  # rank 1 spreads its two samples over two
    got = on_two_ranks(
        lambda b, c: plan_micro_batches(b, budget, c), [batch([3, 3, 3, 3]), batch([2])]
    )
    assert got[1] == [[0], []]  # one sample cannot spread: an empty (loss-free) micro-batch


def test_loss_totals_count_real_tokens_only_and_fail_together():
    totals = on_two_ranks(lambda b, c: loss_totals(b, c), [batch([3, 1]), batch([2])])
    assert [(t.tokens, t.sequences) for t in totals] == [(6, 3), (6, 3)]  # padding's 7 ignored
    empty = on_two_ranks(lambda b, c: loss_totals(b, c), [batch([3], loss=0), batch([2], loss=0)])
    assert empty == ["BatchError: the mini-batch has no tokens with loss_mask == 1"] * 2
    unmasked = batch([2]).drop("loss_mask")  # rank 1 cannot count: rank 0 must not wait
    failed = on_two_ranks(lambda b, c: loss_totals(b, c), [batch([3]), unmasked])
    assert failed[0] == failed[1]
    assert failed[0].startswith("BatchError: rank 1 could not count its shard's loss tokens: ")


@pytest.mark.parametrize("extra", [{}, {"micro_batch": MicroBatchConfig(max_tokens=9)}])
def test_coerce_config_builds_the_backends_class_from_a_base_config(extra):
    @dataclass(frozen=True)
    class AcmeConfig(EngineConfig):
        knob: int = 3

    base = EngineConfig(seed=5, **extra)
    acme = coerce_config(base, AcmeConfig)
    assert isinstance(acme, AcmeConfig) and acme.seed == 5 and acme.knob == 3
    assert acme.micro_batch == base.micro_batch
    assert coerce_config(acme, AcmeConfig) is acme
