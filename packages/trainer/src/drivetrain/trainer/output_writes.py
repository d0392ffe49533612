"""An output directory that stops taking writes mid-run ends the run in one line.

Remounted read-only, its permissions taken away, over quota or full: TensorBoard's writer
thread, the metrics file or a checkpoint's staging directory fails with an ``OSError``, and
the run ended in a 200-400 line traceback (the writer's thread printing its own first). Such
an error, raised while the run writes into its output directory, becomes one
:class:`OutputWriteError` naming the path, the step the run got to and the last complete
checkpoint, which ``--resume auto`` continues from once the directory is fixed: nothing is
torn, since a checkpoint is published by a rename only once complete and a partial one is
never resumed from (the next start removes what this one could not).

A full disk while a checkpoint is written keeps its own line, saying how much to free
(:mod:`drivetrain.trainer.checkpoint_space`, inside this).
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

from drivetrain.trainer.errors import CheckpointError, OutputWriteError, RunStopped
from drivetrain.trainer.stopping import Position

#: what a directory that stopped taking writes raises
UNWRITABLE = (errno.EROFS, errno.EACCES, errno.ENOSPC, errno.EDQUOT)
#: the same, as a worker's or torch's distributed checkpoint's error quotes it (no errno left)
_QUOTED = tuple(os.strerror(code) for code in UNWRITABLE)
#: errors that say what happened already
_OWN = (KeyboardInterrupt, SystemExit, RunStopped, CheckpointError, OutputWriteError)


def _inside(path: str | bytes, out: Path) -> bool:
    where = Path(os.path.abspath(os.fsdecode(path)))
    home = Path(os.path.abspath(out))
    return where == home or home in where.parents


def unwritable(
    exc: BaseException, out: Path, staging: Path | None = None
) -> tuple[str, str] | None:
    """``(path, why)`` when ``exc`` (or an error in its chain) is an ``OSError`` of
    :data:`UNWRITABLE` about a path in ``out``; else None. Around a checkpoint save
    (``staging``), also an error naming no path or only quoting one (a worker's, DCP's): the
    staging directory is what failed."""
    seen: BaseException | None = exc
    elsewhere = False  # an error of the chain names a path outside the run: not ours to blame
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in UNWRITABLE:
            path = seen.filename if seen.filename is not None else staging
            if path is not None and _inside(path, out):
                return os.fsdecode(path), seen.strerror or os.strerror(seen.errno)
            elsewhere = elsewhere or path is not None
        seen = seen.__cause__ or seen.__context__
    if staging is not None and not elsewhere:
        quoted = [why for why in _QUOTED if why in str(exc)]
        if quoted:
            return str(staging), quoted[0]
    return None


def failed_write_line(path: str, why: str, position: Position) -> str:
    """What the run says when ``path`` could not be written (``why``) at ``position``."""
    if position.saved is None:
        last = "no checkpoint was written yet (a rerun starts from step 0)"
    else:
        step_path = position.checkpoints.step_path(position.saved)
        last = f"the last complete checkpoint is step {position.saved} ({step_path})"
    return (
        f"cannot write {path} ({why}) after {position.done} steps; nothing is torn: {last}, "
        "and a partial checkpoint is never resumed from; rerun with --resume auto after "
        "fixing it"
    )


@contextlib.contextmanager
def output_writes(out: Path, position: Position, staging: Path | None = None) -> Iterator[None]:
    """Around the part of a run that writes into ``out``: an error of :func:`unwritable`
    becomes one :class:`OutputWriteError` (:func:`failed_write_line`); ``staging``: the
    checkpoint being written, removed where the directory still allows it."""
    try:
        yield
    except BaseException as exc:
        failed = None if isinstance(exc, _OWN) else unwritable(exc, out, staging)
        if failed is None:
            raise
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)
        raise OutputWriteError(failed_write_line(*failed, position)) from None
