"""The conformance check that a checkpoint save is atomic: a crash at any point of
``save_checkpoint`` leaves either no directory under the final name, or a complete checkpoint
(the previous one when it overwrote one). Crashes are simulated with :mod:`.crash`, at every
file-system change the save makes, one run per point.
"""

from __future__ import annotations

import tempfile
import unittest
from pathlib import Path

from drivetrain.api.config import MicroBatchConfig
from drivetrain.api.engine import Engine
from drivetrain.testing.crash import crash_at
from drivetrain.testing.harness import EngineHarness
from drivetrain.testing.steps import (
    data,
    make,
    train_step,
    weight_mismatch,
    weights,
    world_size,
)

SPLIT = MicroBatchConfig(micro_batch_size=3)
#: More file-system changes than any sane save makes: the check gives up beyond.
MAX_POINTS = 1000


def _crashed_save(engine: Engine, target: Path, step: int, n: int, root: str) -> str:
    """Save with a crash at the ``n``-th file-system change; where it crashed ("" if the save
    made fewer changes and completed)."""
    with crash_at(n, root) as plan:
        try:
            engine.save_checkpoint(str(target), step=step)
        except BaseException:
            if not plan.crashed_at:  # not our crash (engines may wrap it): a real failure
                raise
    return plan.crashed_at


def _left_behind(
    h: EngineHarness, reader: Engine, target: Path, steps: set[int | None], saved: dict
) -> str:
    """What is wrong with ``target`` after a crash ("" if it is absent, where ``None`` is in
    ``steps``, or a complete checkpoint of one of ``steps``)."""
    if not target.exists():
        return "" if None in steps else "removed the complete checkpoint it was replacing"
    try:
        loaded = reader.load_checkpoint(str(target))
    except Exception as exc:  # any refusal: a partial directory under the final name
        return f"left {target.name} that does not load ({type(exc).__name__}: {exc})"
    if loaded.step not in steps:
        return f"left {target.name} that loads as step {loaded.step}, not {sorted(steps - {None})}"
    mismatch = weight_mismatch(h, weights(h, reader), saved)
    return f"left {target.name} that loads other weights ({mismatch})" if mismatch else ""


def check_checkpoint_atomic(h: EngineHarness) -> None:
    """A save that crashes at any of its file-system changes leaves nothing under the final
    name, or a checkpoint that loads whole; over an existing checkpoint, that one or the new
    one. A later save to the same path succeeds. World size 1 only."""
    writer, reader = make(h, SPLIT), make(h, SPLIT)
    if world_size(h) > 1:  # asked after making engines: they may set up the collectives
        writer.close()
        reader.close()
        raise unittest.SkipTest(
            "run at world size 1 only: a crash on one rank would leave its peers in a collective"
        )
    saved = train_step(h, writer, data(h)).weights
    with tempfile.TemporaryDirectory() as tmp:
        for n in range(1, MAX_POINTS + 1):
            target = Path(tmp) / f"ckpt{n}"
            fresh = _crashed_save(writer, target, 1, n, tmp)
            problem = _left_behind(h, reader, target, {None, 1}, saved)
            assert not problem, f"a new save crashing at {fresh} {problem}"
            writer.save_checkpoint(str(target), step=1)  # over whatever the crash left
            over = _crashed_save(writer, target, 2, n, tmp)
            problem = _left_behind(h, reader, target, {1, 2}, saved)
            assert not problem, f"a save over a checkpoint crashing at {over} {problem}"
            if not fresh and not over:
                break  # n is past the last change a save makes: every point was tried
        else:
            raise AssertionError(f"save_checkpoint makes more than {MAX_POINTS} file changes")
    writer.close()
    reader.close()
