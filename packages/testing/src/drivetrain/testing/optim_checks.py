"""Conformance checks of ``optimizer_step`` and ``lr_scheduler_step``: gradient clipping, the LR
schedule in effect, and skipping a step whose gradient norm is not finite.

They observe the optimizer through the weights it writes. AdamW's first update is
``lr * g / (|g| + eps)`` per weight: with ``eps`` far above every ``|g|`` it is proportional to
the gradient (so clipping shows), and with betas ``(0, 0)`` and a tiny ``eps`` every update is
``lr * sign(g)`` (so the largest weight change is the learning rate in effect).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from drivetrain.api.batch import Batch
from drivetrain.api.config import MicroBatchConfig, OptimConfig
from drivetrain.api.loss import LossContext
from drivetrain.runtime.schedule import lr_multiplier
from drivetrain.testing.harness import EngineHarness
from drivetrain.testing.steps import (
    assert_close,
    assert_weights_close,
    data,
    delta,
    is_finite,
    make,
    takes,
    token_mean_nll,
    train_step,
    weights,
)

SPLIT = MicroBatchConfig(micro_batch_size=3)

#: AdamW as plain gradient descent for one step (``eps`` >> ``|g|``): update = ``g``.
LINEAR_EPS = 1e3


def _linear(clip_grad: float | None) -> OptimConfig:
    return OptimConfig(lr=LINEAR_EPS, eps=LINEAR_EPS, weight_decay=0.0, clip_grad=clip_grad)


def _update_ratio(
    h: EngineHarness, clip_grad: float, unclipped: list[float]
) -> tuple[float, float]:
    """One step with ``clip_grad``: (its update projected on the unclipped one, its norm)."""
    engine = make(h, SPLIT, optim=_linear(clip_grad))
    before = weights(h, engine)
    run = train_step(h, engine, data(h))
    engine.close()
    update = delta(run.weights, before)
    ratio = sum(a * b for a, b in zip(update, unclipped, strict=True)) / sum(
        b * b for b in unclipped
    )
    return ratio, run.grad_norm


def check_gradient_clipping(h: EngineHarness) -> None:
    """``optim.clip_grad`` scales the update by ``clip_grad / norm`` when the total gradient norm
    exceeds it, and leaves it alone otherwise; ``optimizer_step`` returns the norm before
    clipping."""
    engine = make(h, SPLIT, optim=_linear(None))
    before = weights(h, engine)
    free = train_step(h, engine, data(h))
    engine.close()
    norm, unclipped = free.grad_norm, delta(free.weights, before)
    assert is_finite(norm) and 0 < norm < LINEAR_EPS / 20, (
        f"gradient norm {norm!r}: the clipping check needs a finite norm far below {LINEAR_EPS}"
    )
    assert any(unclipped), "a step with lr=1e3 left every weight unchanged"
    tight, tight_norm = _update_ratio(h, norm / 4, unclipped)
    loose, loose_norm = _update_ratio(h, norm * 4, unclipped)
    for got, clip in ((tight_norm, norm / 4), (loose_norm, norm * 4)):
        assert_close(
            h,
            got,
            norm,
            f"optimizer_step must return the norm before clipping (clip_grad={clip:.3g})",
        )
    assert math.isclose(tight, 0.25, rel_tol=0.05), (
        f"gradient clipping not applied: with clip_grad = norm/4 the update is {tight:.3g} x "
        "the unclipped one, expected 0.25"
    )
    assert math.isclose(loose, 1.0, rel_tol=0.05), (
        f"clip_grad above the gradient norm changed the update ({loose:.3g} x the unclipped "
        "one, expected 1): only norms above clip_grad are clipped"
    )


#: Warm-up over two steps, then cosine decay to a tenth by step 5.
SCHEDULE = OptimConfig(
    lr=1e-2,
    betas=(0.0, 0.0),
    weight_decay=0.0,
    clip_grad=None,
    scheduler="cosine",
    warmup_steps=2,
    total_steps=5,
    min_lr_ratio=0.1,
)


def _full_precision(h: EngineHarness) -> dict[str, Any]:
    """``make_engine(dtype="float32")`` where the harness can make one, else nothing.

    The LR in effect is read off exported weights, which come in the model's dtype: a
    bfloat16 export rounds a change of 0.0033 to 0.0039 (its spacing near 1), so the check
    read in bfloat16 fails an engine that steps fp32 master weights exactly. The schedule and
    the optimizer are the same under every model dtype; read in fp32, the check still fails a
    wrong schedule for a harness that trains in bfloat16."""
    if takes(h, "dtype") and "float32" in getattr(h, "model_dtypes", ()):
        return {"dtype": "float32"}
    return {}


def check_lr_schedule(h: EngineHarness) -> None:
    """Each optimizer step uses ``lr * lr_multiplier(k)`` (warm-up, then decay), and
    ``lr_scheduler_step`` returns the LR of the next step (read in fp32 where the harness can
    make an fp32 engine: ``_full_precision``)."""
    engine = make(h, SPLIT, optim=SCHEDULE, **_full_precision(h))
    batch = data(h)
    applied, returned = [], []
    before = weights(h, engine)
    for _ in range(SCHEDULE.total_steps or 0):
        run = train_step(h, engine, batch)
        applied.append(max(abs(d) for d in delta(run.weights, before)))
        returned.append(run.lr)
        before = run.weights
    engine.close()
    for k, (used, told) in enumerate(zip(applied, returned, strict=True)):
        want = SCHEDULE.lr * lr_multiplier(k, SCHEDULE)
        assert math.isclose(used, want, rel_tol=1e-3), (
            f"the learning rate in effect at step {k} is {used:.4g}, the schedule says {want:.4g} "
            f"(warm-up {SCHEDULE.warmup_steps}, {SCHEDULE.scheduler} decay to "
            f"{SCHEDULE.min_lr_ratio} x lr): the optimizer does not follow the LR schedule"
        )
        want = SCHEDULE.lr * lr_multiplier(k + 1, SCHEDULE)
        assert math.isclose(told, want, rel_tol=1e-6), (
            f"lr_scheduler_step after step {k} returned {told:.4g}, the schedule says {want:.4g}"
        )


def _nan_loss(outputs: Mapping[str, Any], micro_batch: Batch, ctx: LossContext) -> Any:
    loss, metrics = token_mean_nll(outputs, micro_batch, ctx)
    return loss * float("nan"), metrics


def check_nonfinite_step_skipped(h: EngineHarness) -> None:
    """A step whose gradient norm is not finite returns that norm and changes nothing: the
    weights stay, and the next finite step equals that of an engine that never saw it."""
    batch = data(h)
    engine = make(h, SPLIT)
    train_step(h, engine, batch)  # optimizer state to keep
    kept = weights(h, engine)
    with engine.train_mode():
        engine.optimizer_zero_grad()
        engine.forward_backward(engine.parallel.shard_of(batch), _nan_loss)
        bad_norm = engine.optimizer_step()
    after_bad = weights(h, engine)
    got = train_step(h, engine, batch)
    engine.close()
    reference = make(h, SPLIT)
    train_step(h, reference, batch)
    want = train_step(h, reference, batch)
    reference.close()
    assert isinstance(bad_norm, float) and not math.isfinite(bad_norm), (
        f"optimizer_step returned {bad_norm!r} after a NaN loss: it must return the non-finite "
        "total norm"
    )
    assert_weights_close(
        h,
        after_bad,
        kept,
        "a step with a non-finite gradient norm changed the weights (it must be skipped)",
    )
    assert_weights_close(
        h,
        got.weights,
        want.weights,
        "the step after a skipped one differs from an engine "
        "that never took it (the skipped step updated optimizer moments or step count, or "
        "optimizer_zero_grad left its gradients)",
    )
