"""The engine conformance checks: what every drivetrain engine must demonstrate.

Each check is a plain function ``check_x(harness)`` that raises ``AssertionError`` with an
explanation when the engine breaks the contract. They use only the standard library and the
engine's public interface, so they run under pytest (see :mod:`drivetrain.api.testing.suite`),
inside each rank of a distributed test (``run_conformance`` on every rank, same order), or from
a script.
"""

from __future__ import annotations

import itertools
import math
import random
import tempfile
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from drivetrain.api.batch import Batch
from drivetrain.api.columns import LOG_PROBS, LOSS_MASK
from drivetrain.api.config import MicroBatchConfig
from drivetrain.api.engine import Engine, ParallelInfo, StepResult
from drivetrain.api.errors import EngineStateError
from drivetrain.api.loss import LossContext, OutputSpec
from drivetrain.api.testing.harness import EngineHarness

#: Lengths of the kit's sequences: varied, so token budgets regroup them.
LENGTHS = (7, 3, 12, 5, 9, 4, 11, 6)


def token_mean_nll(
    outputs: Mapping[str, Any], micro_batch: Batch, ctx: LossContext
) -> tuple[Any, dict]:
    """The kit's loss: mean negative log-likelihood over the loss tokens of the mini-batch.

    Written with ``*``, unary ``-``, ``.sum()`` and ``/`` only, which torch tensors, numpy
    arrays and the fake engine's arrays all support."""
    return -(outputs[LOG_PROBS] * micro_batch[LOSS_MASK]).sum() / ctx.global_tokens, {}


def sample_data(vocab_size: int, seed: int = 0) -> tuple[list[list[int]], list[list[int]]]:
    """Deterministic sequences and loss masks (first token of each sequence never counted)."""
    rng = random.Random(seed)
    sequences = [[rng.randrange(1, vocab_size) for _ in range(n)] for n in LENGTHS]
    masks = [[0] + [1 if rng.random() < 0.8 else 0 for _ in range(n - 1)] for n in LENGTHS]
    for mask in masks:
        mask[-1] = 1  # at least one loss token per sample
    return sequences, masks


# ---- helpers ---------------------------------------------------------------------------
def _flatten(value: Any) -> list[float]:
    if isinstance(value, list | tuple):
        return [x for item in value for x in _flatten(item)]
    return [float(value)]


def _shape(value: Any) -> tuple[int, ...]:
    shape = []
    while isinstance(value, list | tuple):
        shape.append(len(value))
        value = value[0] if value else None
    return tuple(shape)


def _close(h: EngineHarness, a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=h.rtol, abs_tol=h.atol)


def _assert_close(h: EngineHarness, a: float, b: float, what: str) -> None:
    assert _close(h, a, b), f"{what}: {a!r} != {b!r} (rtol={h.rtol}, atol={h.atol})"


def _weights(h: EngineHarness, engine: Engine) -> dict[str, list[float]]:
    return {name: _flatten(h.to_list(value)) for name, value in engine.export_weights()}


def _assert_weights_close(h: EngineHarness, a: Mapping, b: Mapping, what: str) -> None:
    assert list(a) == list(b), f"{what}: weight names differ: {sorted(set(a) ^ set(b))}"
    for name in a:
        worst = max(
            (abs(x - y) - h.rtol * abs(y) for x, y in zip(a[name], b[name], strict=True)),
            default=0.0,
        )
        assert worst <= h.atol, f"{what}: weight {name!r} differs by {worst + h.atol:.3g}"


def _rows(h: EngineHarness, batch: Batch, column: str) -> list[list[float]]:
    """Per-sample values of a token column without padding (padded or packed layout)."""
    values = h.to_list(batch[column])
    if batch.layout.value == "packed":
        offsets = batch.offsets
        return [values[a:b] for a, b in itertools.pairwise(offsets)]
    return [row[:n] for row, n in zip(values, batch.seq_lens, strict=True)]


@dataclass
class _Run:
    loss: float
    grad_norm: float
    lr: float
    result: StepResult
    weights: dict[str, list[float]]


def _train_step(h: EngineHarness, engine: Engine, batch: Batch) -> _Run:
    with engine.train_mode():
        engine.optimizer_zero_grad()
        result = engine.forward_backward(engine.shard_data(batch), token_mean_nll)
        grad_norm = engine.optimizer_step()
        lr = engine.lr_scheduler_step()
    return _Run(result.loss, grad_norm, lr, result, _weights(h, engine))


def _data(h: EngineHarness) -> Batch:
    return h.make_batch(*sample_data(h.vocab_size))


def _infer_rows(
    h: EngineHarness, engine: Engine, batch: Batch, spec: OutputSpec
) -> list[list[list[float]]] | None:
    with engine.eval_mode():
        out = engine.infer(engine.shard_data(batch), spec)
    if out is None:
        return None
    return [_rows(h, out, name) for name in spec.names]


# ---- the checks ------------------------------------------------------------------------
def check_contract_shapes(h: EngineHarness) -> None:
    """Types, parallel info, outputs aligned with inputs, state errors outside the modes."""
    engine = h.make_engine(MicroBatchConfig(micro_batch_size=3))
    assert isinstance(engine, Engine), f"{type(engine).__name__} does not subclass Engine"
    info = engine.parallel
    assert isinstance(info, ParallelInfo), "parallel must be a ParallelInfo"
    batch = _data(h)
    shard = engine.shard_data(batch)
    assert isinstance(shard, Batch) and len(shard) >= 1, "shard_data must return a non-empty Batch"
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

    spec = OutputSpec(log_probs=True, entropy=True)
    with engine.eval_mode():
        out = engine.infer(shard, spec)
    if not info.is_output_rank:
        assert out is None, "infer must return None on ranks that are not output ranks"
        return
    assert isinstance(out, Batch), "infer must return a Batch on output ranks"
    assert out.seq_lens == shard.seq_lens, "infer output must keep the input's samples and lengths"
    assert set(out.columns) == set(spec.names), (
        f"infer returned {sorted(out.columns)}, asked {spec.names}"
    )
    assert out.layout == shard.layout, "infer output must keep the input layout"
    for row in _rows(h, out, "log_probs"):
        assert row[0] == 0.0, "log_probs at the first token of a sequence must be 0"
        assert all(x <= 1e-6 for x in row), "log-probs must be <= 0"
    for row in _rows(h, out, "entropy"):
        assert all(x >= -1e-6 for x in row), "entropy must be >= 0"

    with engine.train_mode():
        engine.optimizer_zero_grad()
        result = engine.forward_backward(shard, token_mean_nll)
        grad_norm = engine.optimizer_step()
        lr = engine.lr_scheduler_step()
    assert isinstance(result, StepResult), "forward_backward must return a StepResult"
    assert math.isfinite(result.loss) and result.loss > 0, f"bad loss {result.loss!r}"
    assert isinstance(grad_norm, float) and grad_norm > 0, f"bad grad norm {grad_norm!r}"
    assert isinstance(lr, float) and lr > 0, f"bad learning rate {lr!r}"
    want_tokens = int(sum(sum(m) for m in sample_data(h.vocab_size)[1]))
    assert result.num_tokens == want_tokens, f"num_tokens {result.num_tokens} != {want_tokens}"


def check_micro_batch_invariance(h: EngineHarness) -> None:
    """Loss, gradient norm and updated weights do not depend on how the batch is split, and
    the loss is the global token mean that ``infer``'s log-probs imply."""
    batch = _data(h)
    splits = [
        MicroBatchConfig(micro_batch_size=len(batch)),
        MicroBatchConfig(micro_batch_size=1),
        MicroBatchConfig(micro_batch_size=3),
        MicroBatchConfig(max_tokens=max(LENGTHS) + 4),
    ]
    runs = [(split, _train_step(h, h.make_engine(split), batch)) for split in splits]
    _, base = runs[0]
    for split, run in runs[1:]:
        _assert_close(h, run.loss, base.loss, f"loss with {split} vs one micro-batch")
        _assert_close(
            h, run.grad_norm, base.grad_norm, f"grad norm with {split} vs one micro-batch"
        )
        _assert_weights_close(h, run.weights, base.weights, f"weights after a step with {split}")
    assert runs[1][1].result.num_micro_batches > runs[0][1].result.num_micro_batches, (
        "micro_batch_size=1 must run more micro-batches than one whole batch"
    )

    engine = h.make_engine(splits[0])
    rows = _infer_rows(h, engine, batch, OutputSpec(log_probs=True))
    if rows is not None and engine.parallel.dp_size == 1:
        _, masks = sample_data(h.vocab_size)
        nll = -sum(
            lp * m
            for row, mask in zip(rows[0], masks, strict=True)
            for lp, m in zip(row, mask, strict=True)
        )
        _assert_close(h, base.loss, nll / sum(map(sum, masks)), "loss vs token-mean NLL from infer")


def check_order_restored(h: EngineHarness) -> None:
    """``infer`` returns samples in the caller's order, whatever its micro-batching."""
    engine = h.make_engine(MicroBatchConfig(max_tokens=max(LENGTHS) + 4))
    batch = _data(h)
    spec = OutputSpec(log_probs=True, entropy=True)
    full = _infer_rows(h, engine, batch, spec)
    if full is None:
        return
    if engine.parallel.dp_size > 1:
        return  # samples of one rank's shard are compared below via a single-rank world
    for i in range(len(batch)):
        single = _infer_rows(h, engine, batch.select([i]), spec)
        assert single is not None
        for k, name in enumerate(spec.names):
            got, want = full[k][i], single[k][0]
            assert len(got) == len(want) and all(
                _close(h, a, b) for a, b in zip(got, want, strict=True)
            ), f"infer row {i} ({name}) is not sample {i}'s output: order not restored"
    order = list(reversed(range(len(batch))))
    flipped = _infer_rows(h, engine, batch.reorder(order), spec)
    assert flipped is not None
    for k in range(len(spec.names)):
        for new, old in enumerate(order):
            assert all(
                _close(h, a, b) for a, b in zip(flipped[k][new], full[k][old], strict=True)
            ), "infer on a reordered batch must return the reordered outputs"


def check_modes(h: EngineHarness) -> None:
    """eval is deterministic and leaves weights alone; a train step changes them."""
    engine = h.make_engine(MicroBatchConfig(micro_batch_size=4))
    batch = _data(h)
    before = _weights(h, engine)
    spec = OutputSpec(log_probs=True)
    first = _infer_rows(h, engine, batch, spec)
    second = _infer_rows(h, engine, batch, spec)
    assert first == second, "infer in eval_mode must be deterministic"
    assert _weights(h, engine) == before, "infer must not change the weights"
    _train_step(h, engine, batch)
    after = _weights(h, engine)
    assert any(a != b for name in before for a, b in zip(before[name], after[name], strict=True)), (
        "a train step must change the weights"
    )


def check_checkpoint_round_trip(h: EngineHarness) -> None:
    """Save after one step, load into a fresh engine: the next step matches exactly."""
    batch = _data(h)
    split = MicroBatchConfig(micro_batch_size=3)
    with tempfile.TemporaryDirectory() as tmp:
        path = f"{tmp}/ckpt"
        original = h.make_engine(split)
        _train_step(h, original, batch)
        info = original.save_checkpoint(path, step=1)
        assert info.step == 1, f"save_checkpoint returned step {info.step}"
        expected = _train_step(h, original, batch)

        resumed = h.make_engine(split)
        loaded = resumed.load_checkpoint(path)
        assert loaded.step == 1, f"load_checkpoint returned step {loaded.step}, saved 1"
        got = _train_step(h, resumed, batch)
    assert got.loss == expected.loss, f"loss after resume {got.loss!r} != {expected.loss!r}"
    assert got.grad_norm == expected.grad_norm, "grad norm after resume differs"
    assert got.lr == expected.lr, f"learning rate after resume {got.lr} != {expected.lr}"
    assert got.weights == expected.weights, "weights after resume + one step differ"


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
        assert _shape(got) == _shape(reference[name]), (
            f"weight {name!r} has shape {_shape(got)}, expected the full {_shape(reference[name])}"
        )
        worst = max(
            (abs(a - b) for a, b in zip(_flatten(got), _flatten(reference[name]), strict=True)),
            default=0.0,
        )
        assert worst <= h.atol, f"weight {name!r} differs from the reference by {worst:.3g}"
    missing = sorted(set(reference) - set(seen))
    extra = sorted(set(seen) - set(reference))
    assert not missing, f"export is missing weights {missing}"
    assert not extra, f"export has weights the reference does not: {extra}"


ENGINE_CHECKS: tuple[Callable[[EngineHarness], None], ...] = (
    check_contract_shapes,
    check_micro_batch_invariance,
    check_order_restored,
    check_modes,
    check_checkpoint_round_trip,
    check_weight_export,
)


@dataclass(frozen=True)
class CheckResult:
    name: str
    passed: bool
    error: str = ""


def iter_conformance(
    harness: EngineHarness, checks: Sequence[Callable[[EngineHarness], None]] = ENGINE_CHECKS
) -> Iterator[CheckResult]:
    for check in checks:
        try:
            check(harness)
        except AssertionError as exc:
            yield CheckResult(check.__name__, False, str(exc) or traceback.format_exc())
        else:
            yield CheckResult(check.__name__, True)


def run_conformance(
    harness: EngineHarness, checks: Sequence[Callable[[EngineHarness], None]] = ENGINE_CHECKS
) -> list[CheckResult]:
    """Run every check (on every rank, in the same order) and report each one's outcome.

    Only contract violations (``AssertionError``) are caught; anything else propagates."""
    return list(iter_conformance(harness, checks))
