"""What the kit's checks share: its data and loss, one training step through the engine's
public interface, weight snapshots and tolerant comparisons. Standard library only."""

from __future__ import annotations

import inspect
import math
import random
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from drivetrain.api.batch import Batch
from drivetrain.api.columns import LOG_PROBS, LOSS_MASK
from drivetrain.api.config import MicroBatchConfig
from drivetrain.api.engine import Engine, StepResult
from drivetrain.api.loss import LossContext
from drivetrain.testing.harness import EngineHarness
from drivetrain.testing.nested import flatten, sample_rows

#: Lengths of the kit's sequences: varied, so token budgets regroup them.
LENGTHS = (7, 3, 12, 5, 9, 4, 11, 6)


def token_mean_nll(
    outputs: Mapping[str, Any], micro_batch: Batch, ctx: LossContext
) -> tuple[Any, dict]:
    """The kit's loss: mean negative log-likelihood over the loss tokens of the mini-batch.
    Its metrics are the micro-batch's loss tokens, summed (``loss_tokens``) and the largest
    (``loss_tokens_max``: a ``*_max`` metric is reduced by max).

    Written with ``*``, unary ``-``, ``.sum()`` and ``/`` only, which torch tensors, numpy
    arrays and the fake engine's arrays all support."""
    log_probs = outputs[LOG_PROBS]
    detached = log_probs.detach() if hasattr(log_probs, "detach") else log_probs  # a count
    ones = detached * 0.0 + 1.0  # the mask may be a plain list: count through this
    tokens = float((ones * micro_batch[LOSS_MASK]).sum())
    metrics = {"loss_tokens": tokens, "loss_tokens_max": tokens}
    return -(outputs[LOG_PROBS] * micro_batch[LOSS_MASK]).sum() / ctx.global_tokens, metrics


def sample_data(vocab_size: int, seed: int = 0) -> tuple[list[list[int]], list[list[int]]]:
    """Deterministic sequences and loss masks (first token of each sequence never counted)."""
    rng = random.Random(seed)
    sequences = [[rng.randrange(1, vocab_size) for _ in range(n)] for n in LENGTHS]
    masks = [[0] + [1 if rng.random() < 0.8 else 0 for _ in range(n - 1)] for n in LENGTHS]
    for mask in masks:
        mask[-1] = 1  # at least one loss token per sample
    return sequences, masks


# ---- helpers ---------------------------------------------------------------------------
def gather(h: EngineHarness, obj: Any) -> list[Any]:
    """``obj`` from every rank (the harness's collective), or ``[obj]`` in one process."""
    gather = getattr(h, "all_gather_object", None)
    return gather(obj) if gather is not None else [obj]


def close(h: EngineHarness, a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=h.rtol, abs_tol=h.atol)


def assert_close(h: EngineHarness, a: float, b: float, what: str) -> None:
    assert close(h, a, b), f"{what}: {a!r} != {b!r} (rtol={h.rtol}, atol={h.atol})"


def weights(h: EngineHarness, engine: Engine) -> dict[str, list[float]]:
    return {name: flatten(h.to_list(value)) for name, value in engine.export_weights()}


def weight_mismatch(h: EngineHarness, a: Mapping, b: Mapping) -> str:
    """How two weight snapshots differ beyond the tolerance ("" when they do not)."""
    if set(a) != set(b):
        return f"weight names differ: {sorted(set(a) ^ set(b))}"
    if list(a) != list(b):
        return "weights exported in a different order"
    for name in a:
        worst = max((abs(x - y) for x, y in zip(a[name], b[name], strict=True)), default=0.0)
        scale = max((abs(y) for y in b[name]), default=0.0)
        if not worst <= h.atol + h.rtol * scale:  # NaN differs too
            return f"weight {name!r} differs by {worst:.3g}"
    return ""


def assert_weights_close(h: EngineHarness, a: Mapping, b: Mapping, what: str) -> None:
    mismatch = weight_mismatch(h, a, b)
    assert not mismatch, f"{what}: {mismatch}"


def rows(h: EngineHarness, batch: Batch, column: str) -> list[list[float]]:
    """Per-sample values of a token column without padding (padded or packed layout)."""
    return sample_rows(batch, h.to_list(batch[column]))


@dataclass
class Run:
    loss: float
    grad_norm: float
    lr: float
    result: StepResult
    weights: dict[str, list[float]]


def train_step(
    h: EngineHarness, engine: Engine, batch: Batch, loss_fn: Any = token_mean_nll
) -> Run:
    with engine.train_mode():
        engine.optimizer_zero_grad()
        result = engine.forward_backward(engine.parallel.shard_of(batch), loss_fn)
        grad_norm = engine.optimizer_step()
        lr = engine.lr_scheduler_step()
    return Run(result.loss, grad_norm, lr, result, weights(h, engine))


def fresh_step(h: EngineHarness, micro_batch: MicroBatchConfig, batch: Batch) -> Run:
    """One training step on a new engine, which is closed after it. An engine left to the
    garbage collector is finalised at a different moment on each rank: while the kit leaked
    six, megatron_fsdp's two ranks were caught in different checks (runs hung, and once the
    heap was corrupted)."""
    engine = h.make_engine(micro_batch)
    run = train_step(h, engine, batch)
    engine.close()
    return run


def data(h: EngineHarness) -> Batch:
    return h.make_batch(*sample_data(h.vocab_size))


def takes(h: EngineHarness, keyword: str) -> bool:
    """Whether the harness's ``make_engine`` accepts ``keyword``."""
    params = inspect.signature(h.make_engine).parameters
    return keyword in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


def make(h: EngineHarness, micro_batch: MicroBatchConfig, **changes: Any) -> Engine:
    """``h.make_engine(micro_batch, **changes)``; a harness that cannot take a change the
    check needs fails the check (the kit must not pass an engine it could not test)."""
    missing = [name for name in changes if not takes(h, name)]
    assert not missing, (
        f"the harness's make_engine takes no {', '.join(f'{m}=' for m in missing)} keyword: "
        "see EngineHarness.make_engine"
    )
    return h.make_engine(micro_batch, **changes)


def world_size(h: EngineHarness) -> int:
    """How many processes run the check (the harness's collective answers once per rank)."""
    return len(gather(h, None))


def capabilities(h: EngineHarness) -> frozenset[str]:
    """What the harness's plugin declares; a harness that does not say fails the check (the
    kit must not skip a check its engine owes because the harness is older than it)."""
    declared = getattr(h, "capabilities", None)
    assert declared is not None, (
        "the harness declares no capabilities (EngineHarness.capabilities: its plugin's "
        "PluginSpec.capabilities); the kit cannot tell which checks apply"
    )
    return frozenset(declared)


def delta(after: Mapping[str, list[float]], before: Mapping[str, list[float]]) -> list[float]:
    """Every weight's change, flattened in export order."""
    return [a - b for name in before for a, b in zip(after[name], before[name], strict=True)]


def is_finite(x: float) -> bool:
    return isinstance(x, float) and math.isfinite(x)
