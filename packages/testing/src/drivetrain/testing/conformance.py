"""The engine conformance checks: what every drivetrain engine must demonstrate.

Every rank runs every check and makes the same engine calls in the same order (engines'
methods are collective); assertions come after the calls, so one rank's failure does not leave
its peers waiting in a collective.

Each check is a plain function ``check_x(harness)`` that raises ``AssertionError`` with an
explanation when the engine breaks the contract. They use only the standard library and the
engine's public interface, so they run under pytest (see :mod:`drivetrain.testing.suite`),
inside each rank of a distributed test (``run_conformance`` on every rank, same order), or from
a script.
"""

from __future__ import annotations

import math
import random
import time
import traceback
import unittest
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from drivetrain.api.batch import Batch
from drivetrain.api.columns import ENTROPY, LOG_PROBS, LOSS_MASK, SAMPLE_GROUP, SHARED_PREFIX_LEN
from drivetrain.api.config import MicroBatchConfig
from drivetrain.api.engine import Engine, ParallelInfo, StepResult
from drivetrain.api.errors import EngineStateError
from drivetrain.api.loss import LossContext, OutputSpec
from drivetrain.testing.atomic_check import check_checkpoint_atomic
from drivetrain.testing.dtype_check import check_output_dtypes
from drivetrain.testing.failure_checks import check_split_failure_reaches_every_rank
from drivetrain.testing.harness import EngineHarness
from drivetrain.testing.nested import flatten, shape_of
from drivetrain.testing.optim_checks import (
    check_gradient_clipping,
    check_lr_schedule,
    check_nonfinite_step_skipped,
)
from drivetrain.testing.state_checks import (
    check_checkpoint_round_trip,
    check_offload_round_trip,
    check_rng_restored,
)
from drivetrain.testing.steps import (
    LENGTHS,
    Run,
    assert_close,
    assert_weights_close,
    close,
    data,
    fresh_step,
    gather,
    rows,
    sample_data,
    token_mean_nll,
    train_step,
    weights,
)


def _infer_rows(
    h: EngineHarness, engine: Engine, batch: Batch, spec: OutputSpec, *, shard: bool = True
) -> list[list[list[float]]] | None:
    with engine.eval_mode():
        out = engine.infer(engine.parallel.shard_of(batch) if shard else batch, spec)
    if out is None:
        return None
    return [rows(h, out, name) for name in spec.names]


def _assert_same_results(
    h: EngineHarness,
    spec: OutputSpec,
    got: tuple[list[list[list[float]]] | None, Run],
    want: tuple[list[list[list[float]]] | None, Run],
    got_name: str,
    want_name: str,
) -> None:
    """Two ways of feeding the same samples gave the same outputs, loss and step."""
    (got_rows, got_run), (want_rows, want_run) = got, want
    if want_rows is not None:
        assert got_rows is not None
        for k, name in enumerate(spec.names):
            for i, (a, b) in enumerate(zip(got_rows[k], want_rows[k], strict=True)):
                assert all(close(h, x, y) for x, y in zip(a, b, strict=True)), (
                    f"{got_name}: {name} of sample {i} differ from {want_name}: {a} != {b}"
                )
    assert_close(h, got_run.loss, want_run.loss, f"loss {got_name} vs {want_name}")
    assert_weights_close(h, got_run.weights, want_run.weights, f"step {got_name} vs {want_name}")


# ---- the checks ------------------------------------------------------------------------
def check_contract_shapes(h: EngineHarness) -> None:
    """Types, parallel info, outputs aligned with inputs, state errors outside the modes."""
    engine = h.make_engine(MicroBatchConfig(micro_batch_size=3))
    assert isinstance(engine, Engine), f"{type(engine).__name__} does not subclass Engine"
    info = engine.parallel
    assert isinstance(info, ParallelInfo), "parallel must be a ParallelInfo"
    assert not hasattr(engine, "shard_data"), (
        f"{type(engine).__name__}.shard_data is never called: the trainer shards every batch "
        "with ParallelInfo.shard_of (Batch.dp_shards); remove the method"
    )
    batch = data(h)
    shard = info.shard_of(batch)
    assert len(shard) >= 1, (
        f"dp rank {info.dp_rank} of {info.dp_size} got no sample of the kit's batch"
    )
    try:
        engine.forward_backward(shard, token_mean_nll)
    except EngineStateError:
        pass
    else:
        raise AssertionError("forward_backward outside train_mode() must raise EngineStateError")
    for call in (engine.optimizer_step, engine.optimizer_zero_grad):
        try:
            call()
        except EngineStateError:
            continue
        raise AssertionError(f"{call.__name__} outside train_mode() must raise EngineStateError")

    # every rank makes every call (they may be collective); assertions come after
    spec = OutputSpec(log_probs=True, entropy=True)
    with engine.eval_mode():
        out = engine.infer(shard, spec)
        hot = engine.infer(shard, OutputSpec(log_probs=True, temperature=2.0))
    with engine.train_mode():
        engine.optimizer_zero_grad()
        result = engine.forward_backward(shard, token_mean_nll)
        grad_norm = engine.optimizer_step()
        lr = engine.lr_scheduler_step()
    engine.close()

    assert isinstance(result, StepResult), "forward_backward must return a StepResult"
    assert math.isfinite(result.loss) and result.loss > 0, f"bad loss {result.loss!r}"
    assert isinstance(grad_norm, float) and grad_norm > 0, f"bad grad norm {grad_norm!r}"
    assert isinstance(lr, float) and lr > 0, f"bad learning rate {lr!r}"
    want_tokens = int(sum(sum(m) for m in sample_data(h.vocab_size)[1]))
    assert result.num_tokens == want_tokens, f"num_tokens {result.num_tokens} != {want_tokens}"
    if not info.is_output_rank:
        assert out is None and hot is None, "infer must return None on non-output ranks"
        return
    assert isinstance(out, Batch), "infer must return a Batch on output ranks"
    assert out.seq_lens == shard.seq_lens, "infer output must keep the input's samples and lengths"
    assert set(out.columns) == set(spec.names), (
        f"infer returned {sorted(out.columns)}, asked {spec.names}"
    )
    assert out.layout == shard.layout, "infer output must keep the input layout"
    for row in rows(h, out, LOG_PROBS):
        assert row[0] == 0.0, "log_probs at the first token of a sequence must be 0"
        assert all(x <= 1e-6 for x in row), "log-probs must be <= 0"
    for row in rows(h, out, ENTROPY):
        assert all(x >= -1e-6 for x in row), "entropy must be >= 0"
    assert hot is not None and rows(h, hot, LOG_PROBS) != rows(h, out, LOG_PROBS), (
        "log-probs must depend on OutputSpec.temperature"
    )


def check_micro_batch_invariance(h: EngineHarness) -> None:
    """Loss, gradient norm and updated weights do not depend on how the batch is split, and
    the loss is the global token mean that ``infer``'s log-probs imply."""
    batch = data(h)
    splits = [
        MicroBatchConfig(micro_batch_size=len(batch)),
        MicroBatchConfig(micro_batch_size=1),
        MicroBatchConfig(micro_batch_size=3),
        MicroBatchConfig(max_tokens=max(LENGTHS) + 4),
    ]
    runs = [(split, fresh_step(h, split, batch)) for split in splits]
    _, base = runs[0]
    for split, run in runs[1:]:
        assert_close(h, run.loss, base.loss, f"loss with {split} vs one micro-batch")
        assert_close(h, run.grad_norm, base.grad_norm, f"grad norm with {split} vs one micro-batch")
        assert_weights_close(h, run.weights, base.weights, f"weights after a step with {split}")
    assert runs[1][1].result.num_micro_batches > runs[0][1].result.num_micro_batches, (
        "micro_batch_size=1 must run more micro-batches than one whole batch"
    )

    assert runs[3][1].result.num_micro_batches > 1, "the kit's token budget must split the batch"
    masks = sample_data(h.vocab_size)[1]
    for split, run in runs:
        got = run.result.metrics
        assert got.get("loss_tokens") == sum(map(sum, masks)), (
            f"loss metrics must be summed over micro-batches and ranks ({split}): {got}"
        )
    one_each = runs[1][1].result.metrics.get("loss_tokens_max")
    assert one_each == max(map(sum, masks)), (
        f"a *_max loss metric must be the largest over micro-batches and ranks, not {one_each}"
    )

    engine = h.make_engine(splits[0])
    shard = engine.parallel.shard_of(batch)
    logp = _infer_rows(h, engine, shard, OutputSpec(log_probs=True), shard=False)
    local = (0.0, 0)
    if logp is not None:  # output ranks of each data-parallel group report their shard's sums
        masks = rows(h, shard, LOSS_MASK)
        nll = -sum(
            lp * m
            for r, mk in zip(logp[0], masks, strict=True)
            for lp, m in zip(r, mk, strict=True)
        )
        local = (nll, int(sum(map(sum, masks))))
    reports = [r for r in gather(h, (engine.parallel.dp_rank, logp is not None, local)) if r[1]]
    per_dp = {dp: sums for dp, _, sums in reports}  # one report per dp rank
    total = sum(n for n, _ in per_dp.values()) / sum(t for _, t in per_dp.values())
    assert_close(h, base.loss, total, "loss vs global token-mean NLL from infer")
    engine.close()


#: The kit's ``sample_group`` values: three pairs apart in the batch, each within the kit's
#: token budget (``max(LENGTHS) + 4``), and two single samples: five units, so two
#: data-parallel shards hold different numbers of them.
PAIRS = (0, 1, 1, 2, 3, 0, 2, 4)


def check_sample_groups_stay_together(h: EngineHarness) -> None:
    """Samples sharing a ``sample_group`` value reach the loss in one micro-batch, on one rank,
    whatever the split (a DPO loss needs chosen and rejected together)."""
    batch = data(h).with_columns(**{SAMPLE_GROUP: list(PAIRS)})
    seen: list[list[int]] = []

    def recording_loss(outputs: Mapping[str, Any], micro: Batch, ctx: LossContext) -> Any:
        seen.append([int(g) for g in micro[SAMPLE_GROUP]])
        return token_mean_nll(outputs, micro, ctx)

    splits = [MicroBatchConfig(micro_batch_size=1), MicroBatchConfig(max_tokens=max(LENGTHS) + 4)]
    for split in splits:
        engine = h.make_engine(split)
        with engine.train_mode():
            engine.optimizer_zero_grad()
            engine.forward_backward(engine.parallel.shard_of(batch), recording_loss)
        engine.close()
    micros = [micro for rank in gather(h, seen) for micro in rank]
    assert micros, "the loss never ran"
    for micro in micros:
        for g in set(micro):
            assert micro.count(g) == PAIRS.count(g), (
                f"sample_group {g} was split: a micro-batch holds {micro.count(g)} of its "
                f"{PAIRS.count(g)} samples (use Batch.fixed_size_parts / token_budget_parts / "
                "dp_shards, which keep groups together)"
            )


def check_order_restored(h: EngineHarness) -> None:
    """``infer`` returns samples in the caller's order, whatever its micro-batching."""
    regrouping = h.make_engine(MicroBatchConfig(max_tokens=max(LENGTHS) + 4))
    one_by_one = h.make_engine(MicroBatchConfig(micro_batch_size=1))
    shard = regrouping.parallel.shard_of(data(h))
    spec = OutputSpec(log_probs=True, entropy=True)
    got = _infer_rows(h, regrouping, shard, spec, shard=False)
    want = _infer_rows(h, one_by_one, shard, spec, shard=False)
    order = list(reversed(range(len(shard))))
    flipped = _infer_rows(h, regrouping, shard.reorder(order), spec, shard=False)
    regrouping.close()
    one_by_one.close()
    if got is None:
        return
    assert want is not None and flipped is not None
    for k, name in enumerate(spec.names):
        for i in range(len(shard)):
            assert all(close(h, a, b) for a, b in zip(got[k][i], want[k][i], strict=True)), (
                f"infer row {i} ({name}) is not sample {i}'s output: order not restored"
            )
        for new, old in enumerate(order):
            assert all(close(h, a, b) for a, b in zip(flipped[k][new], got[k][old], strict=True)), (
                "infer on a reordered batch must return the reordered outputs"
            )


def check_packed_matches_padded(h: EngineHarness) -> None:
    """Packed input gives the padded input's outputs, sample for sample."""
    if not getattr(h, "packed", True):
        raise unittest.SkipTest("the harness says its engine does not take packed batches")
    batch = data(h)
    # the fresh engine's step first: closing it while another engine is open would take the
    # process-wide state of engines such as megatron's with it
    padded_run = fresh_step(h, MicroBatchConfig(micro_batch_size=3), batch)
    engine = h.make_engine(MicroBatchConfig(micro_batch_size=3))
    spec = OutputSpec(log_probs=True, entropy=True)
    padded = _infer_rows(h, engine, batch, spec)
    packed = _infer_rows(h, engine, batch.to_packed(), spec)
    packed_run = train_step(h, engine, batch.to_packed())
    engine.close()
    _assert_same_results(h, spec, (packed, packed_run), (padded, padded_run), "packed", "padded")


def shared_prefix_data(vocab_size: int, seed: int = 1) -> tuple[Any, list[int]]:
    """Sequences and masks where groups of samples start with the same prompt (as GRPO's n
    responses do), and each sample's ``shared_prefix_len``: prompts with 3, 2, 1 and 1
    responses (two prompts of the same length), one response repeated, two samples shorter
    than the prefix they name."""
    rng = random.Random(seed)
    sequences, masks, shared = [], [], []
    for prompt_len, responses in ((6, 3), (4, 2), (9, 1), (4, 1)):
        prompt = [rng.randrange(1, vocab_size) for _ in range(prompt_len)]
        for _ in range(responses):
            own = [rng.randrange(1, vocab_size) for _ in range(rng.randint(1, 5))]
            sequences.append(prompt + own)
            masks.append([0] * prompt_len + [1] * len(own))
            shared.append(prompt_len)
    sequences.append(list(sequences[0]))  # the same response twice
    masks.append(list(masks[0]))
    shared.append(6)
    for _ in range(2):  # shorter than the shared_prefix_len they name
        sequences.append(sequences[3][:3])
        masks.append([0, 1, 1])
        shared.append(4)
    return (sequences, masks), shared


def check_shared_prefix_is_only_a_hint(h: EngineHarness) -> None:
    """A batch with ``shared_prefix_len`` gives the same outputs and the same training step as
    without it (an engine may compute shared prompts once, or ignore the column)."""
    (sequences, masks), shared = shared_prefix_data(h.vocab_size)
    plain = h.make_batch(sequences, masks)
    hinted = plain.with_columns(**{SHARED_PREFIX_LEN: shared})
    config = MicroBatchConfig(max_tokens=10_000)  # one micro-batch: all groups together
    want_run = fresh_step(h, config, plain)  # first: see check_packed_matches_padded
    engine = h.make_engine(config)
    spec = OutputSpec(log_probs=True, entropy=True)
    want = _infer_rows(h, engine, plain, spec)
    got = _infer_rows(h, engine, hinted, spec)
    got_run = train_step(h, engine, hinted)
    engine.close()
    _assert_same_results(
        h, spec, (got, got_run), (want, want_run), "with shared_prefix_len", "without"
    )


def check_modes(h: EngineHarness) -> None:
    """eval is deterministic and leaves weights alone; a train step changes them."""
    engine = h.make_engine(MicroBatchConfig(micro_batch_size=4))
    batch = data(h)
    before = weights(h, engine)
    spec = OutputSpec(log_probs=True)
    first = _infer_rows(h, engine, batch, spec)
    second = _infer_rows(h, engine, batch, spec)
    assert first == second, "infer in eval_mode must be deterministic"
    assert weights(h, engine) == before, "infer must not change the weights"
    train_step(h, engine, batch)
    after = weights(h, engine)
    assert any(a != b for name in before for a, b in zip(before[name], after[name], strict=True)), (
        "a train step must change the weights"
    )
    engine.close()


def check_weight_export(h: EngineHarness) -> None:
    """Every weight exported once, with its Hugging Face name, full shape and initial value."""
    engine = h.make_engine(MicroBatchConfig(micro_batch_size=4))
    reference = {name: h.to_list(value) for name, value in h.reference_weights().items()}
    seen: list[str] = []
    for name, value in engine.export_weights():
        assert name not in seen, f"weight {name!r} exported twice"
        seen.append(name)
        if name not in reference:
            continue
        got = h.to_list(value)
        want_shape = shape_of(reference[name])
        assert shape_of(got) == want_shape, (
            f"weight {name!r} has shape {shape_of(got)}, expected the full {want_shape}"
        )
        worst = max(
            (abs(a - b) for a, b in zip(flatten(got), flatten(reference[name]), strict=True)),
            default=0.0,
        )
        assert worst <= h.atol, f"weight {name!r} differs from the reference by {worst:.3g}"
    missing = sorted(set(reference) - set(seen))
    extra = sorted(set(seen) - set(reference))
    assert not missing, f"export is missing weights {missing}"
    assert not extra, f"export has weights the reference does not: {extra}"
    engine.close()


ENGINE_CHECKS: tuple[Callable[[EngineHarness], None], ...] = (
    check_contract_shapes,
    check_micro_batch_invariance,
    check_order_restored,
    check_sample_groups_stay_together,
    check_split_failure_reaches_every_rank,
    check_packed_matches_padded,
    check_shared_prefix_is_only_a_hint,
    check_modes,
    check_checkpoint_round_trip,
    check_rng_restored,
    check_checkpoint_atomic,
    check_gradient_clipping,
    check_lr_schedule,
    check_nonfinite_step_skipped,
    check_offload_round_trip,
    check_output_dtypes,
    check_weight_export,
)


@dataclass(frozen=True)
class CheckResult:
    name: str
    passed: bool
    error: str = ""
    #: wall-clock seconds the check took (where a kit run's time goes)
    seconds: float = 0.0


def iter_conformance(
    harness: EngineHarness, checks: Sequence[Callable[[EngineHarness], None]] = ENGINE_CHECKS
) -> Iterator[CheckResult]:
    for check in checks:
        start = time.perf_counter()
        try:
            check(harness)
        except unittest.SkipTest as exc:
            outcome = CheckResult(check.__name__, True, f"skipped: {exc}")
        except AssertionError as exc:
            outcome = CheckResult(check.__name__, False, str(exc) or traceback.format_exc())
        else:
            outcome = CheckResult(check.__name__, True)
        yield replace(outcome, seconds=time.perf_counter() - start)


def run_conformance(
    harness: EngineHarness, checks: Sequence[Callable[[EngineHarness], None]] = ENGINE_CHECKS
) -> list[CheckResult]:
    """Run every check (on every rank, in the same order) and report each one's outcome.

    Only contract violations (``AssertionError``) are caught; anything else propagates."""
    return list(iter_conformance(harness, checks))
