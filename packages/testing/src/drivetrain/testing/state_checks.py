"""Conformance checks that training state survives a move: a checkpoint round trip (weights,
optimizer state, LR schedule position, RNG) and an offload round trip. A failure names the
piece of state that was lost, found by comparing what the engine shows one piece at a time:
the weights right after loading, then the loss and gradient (same weights: only RNG can
differ), the learning rate, and last the update (same weights, gradient and LR: only the
optimizer state can differ).
"""

from __future__ import annotations

import tempfile
import unittest
from collections.abc import Callable
from dataclasses import dataclass

from drivetrain.api.config import MicroBatchConfig, OptimConfig
from drivetrain.api.engine import Engine
from drivetrain.testing.harness import EngineHarness
from drivetrain.testing.steps import (
    Run,
    assert_close,
    assert_weights_close,
    capabilities,
    close,
    data,
    gather,
    make,
    takes,
    token_mean_nll,
    train_step,
    weights,
)

SPLIT = MicroBatchConfig(micro_batch_size=3)

#: A warm-up, so the LR after a resume depends on the restored schedule position.
RESUME_OPTIM = OptimConfig(
    lr=1e-2, weight_decay=0.0, clip_grad=None, scheduler="linear", warmup_steps=2, total_steps=6
)

#: The dropout the RNG check asks the harness for.
DROPOUT = 0.1


@dataclass
class _Resume:
    saved: dict[str, list[float]]  # weights when saved
    restored: dict[str, list[float]]  # weights right after loading into a fresh engine
    loaded_step: int
    expected: Run  # the step after saving, without the round trip
    got: Run  # the step after loading


def _round_trip(h: EngineHarness, new: Callable[[], Engine]) -> _Resume:
    """Step, save, step (expected); a fresh engine loads and steps (got)."""
    batch = data(h)
    original = new()  # first: a distributed engine may set up the harness's collectives
    with tempfile.TemporaryDirectory() as tmp:
        path = gather(h, f"{tmp}/ckpt")[0]  # every rank uses rank 0's (shared) path
        saved = train_step(h, original, batch).weights
        info = original.save_checkpoint(path, step=1)
        assert info.step == 1, f"save_checkpoint returned step {info.step}"
        expected = train_step(h, original, batch)
        resumed = new()  # made after the original's steps: it reseeds whatever RNG it uses
        loaded = resumed.load_checkpoint(path)
        restored = weights(h, resumed)
        got = train_step(h, resumed, batch)
        gather(h, None)  # nobody deletes the directory while another rank still reads it
    original.close()
    resumed.close()
    return _Resume(saved, restored, loaded.step, expected, got)


def _assert_weights_restored(h: EngineHarness, r: _Resume) -> None:
    assert r.loaded_step == 1, f"load_checkpoint returned step {r.loaded_step}, saved 1"
    assert_weights_close(h, r.restored, r.saved, "model weights not restored by load_checkpoint")


def check_checkpoint_round_trip(h: EngineHarness) -> None:
    """Save after a step, load into a fresh engine: weights, loss, grad norm, LR and the next
    update match the engine that never stopped; a mismatch names the state not restored."""
    r = _round_trip(h, lambda: make(h, SPLIT, optim=RESUME_OPTIM))
    _assert_weights_restored(h, r)
    assert_close(h, r.got.loss, r.expected.loss, "loss after resume (weights were restored)")
    assert_close(
        h, r.got.grad_norm, r.expected.grad_norm, "grad norm after resume (weights were restored)"
    )
    assert close(h, r.got.lr, r.expected.lr), (
        f"the LR schedule position was not restored: lr_scheduler_step after resume returned "
        f"{r.got.lr!r}, {r.expected.lr!r} without the round trip"
    )
    assert_weights_close(
        h,
        r.got.weights,
        r.expected.weights,
        "optimizer state not restored: with the same "
        "weights, gradient and LR the update after resume differs (AdamW moments, its step "
        "count or the LR in effect were lost)",
    )


def check_rng_restored(h: EngineHarness) -> None:
    """With dropout on, the first step after a resume draws the same masks as the engine that
    never stopped: load_checkpoint restores the RNG state."""
    if not takes(h, "dropout"):
        raise unittest.SkipTest("the harness makes no model with dropout (make_engine(dropout=))")
    engine = make(h, SPLIT, dropout=DROPOUT)
    losses = []
    with engine.train_mode():
        for _ in range(2):
            engine.optimizer_zero_grad()
            losses.append(
                engine.forward_backward(engine.parallel.shard_of(data(h)), token_mean_nll).loss
            )
    engine.close()
    assert losses[0] != losses[1], (
        f"make_engine(dropout={DROPOUT}) trains deterministically (same loss twice): the RNG "
        "check cannot see the RNG"
    )
    r = _round_trip(h, lambda: make(h, SPLIT, dropout=DROPOUT))
    _assert_weights_restored(h, r)
    assert close(h, r.got.loss, r.expected.loss), (
        f"the RNG state was not restored by load_checkpoint: with the weights restored, the "
        f"first step after resume draws other dropout masks (loss {r.got.loss!r}, "
        f"{r.expected.loss!r} without the round trip)"
    )


def check_offload_round_trip(h: EngineHarness) -> None:
    """``to("cpu")`` then ``to("device")`` (or the next ``train_mode()``) keeps weights and
    optimizer state: training continues as if nothing moved. Engines declaring ``offload``."""
    if "offload" not in capabilities(h):
        raise unittest.SkipTest("the engine does not declare the 'offload' capability")
    batch = data(h)
    moved, stayed = make(h, SPLIT), make(h, SPLIT)
    train_step(h, moved, batch)
    train_step(h, stayed, batch)
    kept = weights(h, stayed)
    moved.to("cpu", model=True, optimizer=True)
    moved.to("device", model=True, optimizer=True)
    back = weights(h, moved)
    explicit = (train_step(h, moved, batch), train_step(h, stayed, batch))
    moved.to("cpu", model=True, optimizer=True)  # train_mode() must bring it back itself
    implicit = (train_step(h, moved, batch), train_step(h, stayed, batch))
    moved.close()
    stayed.close()
    assert_weights_close(h, back, kept, "to('cpu') then to('device') changed the weights")
    for how, (got, want) in (("to('device')", explicit), ("train_mode()", implicit)):
        assert_close(h, got.loss, want.loss, f"loss after to('cpu') and {how}")
        assert_weights_close(
            h,
            got.weights,
            want.weights,
            f"optimizer state lost in to('cpu') and {how}: the "
            "next step differs from an engine that never moved",
        )
