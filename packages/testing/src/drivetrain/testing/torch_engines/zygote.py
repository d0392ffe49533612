"""A Python that imports the heavy modules once and forks every process a test starts.

A test's ``python script`` or ``python -m drivetrain.trainer ...`` used to spend most of its
first seconds importing torch, transformers and megatron-core: 11 s of CPU for a megatron rank,
10 of a tiny job's 13 s for ``drivetrain sft``, on the 2-core CI machine.
:mod:`drivetrain.testing.torch_engines.zygote_client` starts this process once per test process,
preload set and import-time environment; it imports ``argv[1:]`` (the ones installed), then for
each request on stdin forks a child that becomes what ``python ARGV`` would have been: its own
session, the request's environment, working directory, ``sys.path`` and ``sys.argv``, stdout and
stderr into files, the script (or ``-m`` module) run as ``__main__`` and the interpreter's exit
steps (threads joined, atexit) at the end. Forking after ``import torch`` and before any torch
work is what PyTorch's DataLoader workers do.

Protocol, one JSON object a line: in ``{"argv": [script | "-m", module, *args], "env": {...},
"cwd": dir, "stdout": path, "stderr": path}``; out ``{"started": pid}`` for each request, in
order, and ``{"exited": pid, "code": n}`` when a child ends (``-signal`` when killed by one).
Nothing is unpickled. The process ends when its stdin closes.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import select
import sys
import tempfile
from typing import Any


def _preload(modules: list[str]) -> None:
    for name in modules:
        with contextlib.suppress(ImportError):  # not installed here: the rank imports less
            importlib.import_module(name)


#: the protocol's output: stdout as the launcher gave it (fd 1 itself goes to stderr, so that
#: what an imported module prints never reaches the launcher as a message)
_protocol = 1


def _say(message: dict[str, Any]) -> None:
    os.write(_protocol, (json.dumps(message) + "\n").encode())


def _become_rank(request: dict[str, Any]) -> None:
    """In the forked child: run the script as ``python script ARGS`` would; never returns."""
    code = 1
    try:
        os.setsid()  # its own session: the launcher kills a hung rank as a group
        os.close(_protocol)
        os.environ.clear()
        os.environ.update(request["env"])
        tempfile.tempdir = None  # from this environment's TMPDIR, not the zygote's
        os.chdir(request.get("cwd") or os.getcwd())
        for fd, key in ((1, "stdout"), (2, "stderr")):
            out = os.open(request[key], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            os.dup2(out, fd)
            os.close(out)
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
        argv = list(request["argv"])
        module = argv[1] if argv[0] == "-m" else None
        sys.argv = argv[1:] if module else argv  # runpy sets argv[0] to the module's file
        first = os.getcwd() if module else os.path.dirname(os.path.abspath(argv[0]))
        extra = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        sys.path[:1] = [first, *extra]
        if os.environ.get("PYTHONFAULTHANDLER"):
            import faulthandler

            faulthandler.enable()
        if "torch" in sys.modules and os.environ.get("OMP_NUM_THREADS"):
            sys.modules["torch"].set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
        code = _run_main(module, argv[0])
    except BaseException:  # anything before the script ran: report and leave
        import traceback

        traceback.print_exc()
    finally:
        os._exit(code)


def _run_main(module: str | None, script: str) -> int:
    """Run ``module`` (``-m``) or else ``script`` as ``__main__``; its exit code, after the
    interpreter's own exit steps."""
    import atexit
    import runpy
    import threading
    import traceback

    code = 0
    try:
        if module:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(script, run_name="__main__")
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            code = exc.code or 0
        else:
            print(exc.code, file=sys.stderr)
            code = 1
    except BaseException:  # the script's uncaught error: what python prints
        traceback.print_exc()
        code = 1
    threading._shutdown()  # type: ignore[attr-defined]  # join non-daemon threads, as at exit
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    return code


def serve(modules: list[str]) -> None:
    global _protocol
    _protocol = os.dup(1)
    os.dup2(2, 1)
    _preload(modules)
    pending = b""
    children: set[int] = set()
    while True:
        readable, _, _ = select.select([0], [], [], 0.05)
        if readable:
            chunk = os.read(0, 65536)
            if not chunk:
                return  # the launcher is gone; its ranks are killed by their deadline owner
            pending += chunk
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                sys.stdout.flush()  # a child starts with nothing of the zygote's buffered
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:
                    _become_rank(json.loads(line))
                children.add(pid)
                _say({"started": pid})
        while children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            children.discard(pid)
            _say({"exited": pid, "code": os.waitstatus_to_exitcode(status)})


if __name__ == "__main__":
    serve(sys.argv[1:])
