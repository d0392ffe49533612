"""Simulate a process dying part-way through writing a directory, without killing anything.

An audit hook (:func:`sys.addaudithook`) sees every file the process opens for writing
through Python (``open``, ``os.open``) and every rename, removal and directory creation. Not
seen: files a C library opens itself (``torch.save`` to a path), system calls made through
ctypes, and writes of forked worker processes (a simulated crash there would leave the parent
waiting for its worker, not dead); the renames that publish such files are seen. While
:func:`crash_at` is armed it lets the first ``n - 1`` operations under ``root`` happen and
refuses the ``n``-th and every later one with :class:`Crashed`: what is on disk afterwards is
what a crash at that point leaves (cleanup code in ``except``/``finally`` blocks cannot touch
the disk either). Audit hooks cannot be removed: this one is installed on first use and does
nothing while disarmed.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: Audit events that change the file system, and which of their arguments are paths.
_PATH_ARGS = {
    "os.rename": (0, 1),  # also os.replace
    "os.remove": (0,),
    "os.rmdir": (0,),
    "os.mkdir": (0,),
    "os.truncate": (0,),
    "os.link": (0, 1),
    "os.symlink": (0, 1),
    "shutil.rmtree": (0,),
    "shutil.move": (0, 1),
    "shutil.copyfile": (1,),
}
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND


class Crashed(BaseException):
    """The simulated crash: raised by the operation that "did not happen"."""


@dataclass
class _Plan:
    root: str
    at: int
    pid: int
    seen: int = 0
    crashed_at: str = ""


_armed: list[_Plan] = []
_installed = False


def _as_path(value: Any) -> str | None:
    if isinstance(value, int) or value is None:
        return None  # a file descriptor: opened earlier, already counted
    with contextlib.suppress(TypeError, ValueError):
        return os.path.abspath(os.fsdecode(value))
    return None


def _writes(event: str, args: tuple[Any, ...]) -> list[str]:
    """The paths an event changes (empty when it reads or is not about files)."""
    if event == "open":
        path, mode, flags = args
        writing = any(c in mode for c in "wax+") if isinstance(mode, str) else False
        writing = writing or bool(isinstance(flags, int) and flags & _WRITE_FLAGS)
        return [p for p in (_as_path(path),) if p] if writing else []
    positions = _PATH_ARGS.get(event, ())
    return [p for i in positions if i < len(args) and (p := _as_path(args[i]))]


def _hook(event: str, args: tuple[Any, ...]) -> None:
    if not _armed:
        return
    plan = _armed[-1]
    if os.getpid() != plan.pid:
        return  # a forked writer (a pool worker): a crash in it would hang its parent, not kill it
    touched = [p for p in _writes(event, args) if p.startswith(plan.root)]
    if not touched:
        return
    plan.seen += 1
    if plan.crashed_at:
        raise Crashed(f"crashed earlier, at {plan.crashed_at}")
    if plan.seen >= plan.at:
        plan.crashed_at = f"{event} {', '.join(touched)} (file-system operation {plan.seen})"
        raise Crashed(plan.crashed_at)


@contextlib.contextmanager
def crash_at(n: int, root: str | os.PathLike[str]) -> Iterator[_Plan]:
    """Within the block, the ``n``-th file-system change under ``root`` and all later ones
    raise :class:`Crashed`. The plan yielded says where it crashed (``crashed_at``, empty if
    the block made fewer than ``n`` changes)."""
    global _installed
    if not _installed:
        sys.addaudithook(_hook)
        _installed = True
    plan = _Plan(str(Path(root).absolute()), n, os.getpid())
    _armed.append(plan)
    try:
        yield plan
    finally:
        _armed.remove(plan)
