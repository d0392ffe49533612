"""A Python that imports the heavy modules once and forks every rank a test launches.

Each rank of a multi-process engine test used to be a fresh ``python script`` that spent most
of its first seconds importing torch, transformers and megatron-core (11 s of CPU for a
megatron rank on a 2-core CI machine, against a few seconds of test). ``launch_ranks`` starts
this process once per test process and preload set; it imports ``argv[1:]`` (the ones
installed), then for each request on stdin forks a child that becomes what ``python script
ARGS`` would have been: its own session, the request's environment, ``sys.path`` and
``sys.argv``, stdout and stderr into the log, the script run as ``__main__`` and the interpreter's
exit steps (threads joined, atexit) at the end. Forking after ``import torch`` and before any
torch work is what PyTorch's DataLoader workers do.

Protocol, one JSON object a line: in ``{"argv": [script, *args], "env": {...}, "log": path}``;
out ``{"ready": true}`` once, then ``{"started": pid}`` for each request, in order, and
``{"exited": pid, "code": n}`` when a child ends (``-signal`` when killed by one). Nothing is
unpickled. The process ends when its stdin closes.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import select
import sys
from typing import Any


def _preload(modules: list[str]) -> None:
    for name in modules:
        with contextlib.suppress(ImportError):  # not installed here: the rank imports less
            importlib.import_module(name)


def _say(message: dict[str, Any]) -> None:
    os.write(1, (json.dumps(message) + "\n").encode())


def _become_rank(request: dict[str, Any]) -> None:
    """In the forked child: run the script as ``python script ARGS`` would; never returns."""
    code = 1
    try:
        os.setsid()  # its own session: the launcher kills a hung rank as a group
        os.environ.clear()
        os.environ.update(request["env"])
        log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
        script = request["argv"][0]
        sys.argv = list(request["argv"])
        extra = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        sys.path[:1] = [os.path.dirname(os.path.abspath(script)), *extra]
        if os.environ.get("PYTHONFAULTHANDLER"):
            import faulthandler

            faulthandler.enable()
        if "torch" in sys.modules and os.environ.get("OMP_NUM_THREADS"):
            sys.modules["torch"].set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
        code = _run_main(script)
    except BaseException:  # anything before the script ran: report and leave
        import traceback

        traceback.print_exc()
    finally:
        os._exit(code)


def _run_main(script: str) -> int:
    """Run ``script`` as ``__main__``; its exit code, after the interpreter's own exit steps."""
    import atexit
    import runpy
    import threading
    import traceback

    code = 0
    try:
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
    _preload(modules)
    _say({"ready": True})
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
