"""How a test session runs here: on every core, with the tests that need the machine alone.

pytest-xdist runs the tests in one worker process per core (``-n auto --dist loadgroup`` in
``pyproject.toml``). A module's tests go to one worker, so its module fixtures (a 2-rank run
whose results several tests read, a model built once) are built once; tests marked
``xdist_group("name")`` share a worker across modules (one end-to-end run read by several).

Tests run two (or more) at a time only where that is safe. A test marked ``serial`` (or
``distributed``: several busy processes; or ``gpu``: one device) runs alone: it waits until
the running tests finish, and no test starts beside it. That is a readers-writer lock over
files shared by the workers; a turnstile keeps a waiting ``serial`` test from being overtaken
by light tests forever.

Light tests run with one torch thread (``OMP_NUM_THREADS=1``, inherited by the processes they
start), since two processes with two threads each on two cores run several times slower; a
``serial`` test gets the machine's threads back.

With ``CI`` set, the session prints its slowest tests and the default-set tests over the
per-test budget (``TEST_BUDGET_S``, unless marked slow).
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import sys
import tempfile
from collections import Counter
from collections.abc import Generator
from pathlib import Path
from typing import IO

import pytest

# This machine's environment sets PYTHONDONTWRITEBYTECODE=1: no process then kept the bytecode
# it compiled, and every one a test starts (a rank, a rollout server, a job, Ray's actors,
# vLLM's engine) compiled torch, transformers and the rest from source again: ~8 s of CPU
# apiece, a tiny GRPO job 30 s instead of 14, CI 51 minutes instead of 37. The workers and
# what they start inherit this.
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
sys.dont_write_bytecode = False

#: a test of the default set (not marked slow) should take at most this long on a 2-core machine
TEST_BUDGET_S = 30.0
#: markers whose tests run alone
ALONE_MARKERS = ("serial", "distributed", "gpu")  # gpu: one device, shared by every worker
#: the folder of the lock's files, made by the controller for its workers
ROOM_VAR = "DRIVETRAIN_PYTEST_ROOM"


def _cores() -> int:
    return len(os.sched_getaffinity(0))


@pytest.hookimpl(optionalhook=True)  # xdist's hooks: pytest runs without xdist too
def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    return _cores()


#: how many xdist workers share the machine, in a worker (0 elsewhere, a pytest a test starts
#: included: its environment says "worker" too, but it must not take the workers' lock)
_workers = 0


def pytest_configure(config: pytest.Config) -> None:
    if os.environ.get("CI") and config.option.durations is None:
        config.option.durations = 25
    global _workers
    worker = getattr(config, "workerinput", {})
    _workers = worker.get("workercount", 0)
    if "columns" in worker:
        _set_env("COLUMNS", worker["columns"])
    if _workers > 1:
        # before any test imports torch: its thread pool reads this once
        os.environ["OMP_NUM_THREADS"] = "1"
    elif not hasattr(config, "workerinput") and getattr(config.option, "numprocesses", None):
        # the controller: the lock's files, for the workers it starts (they inherit the env)
        os.environ[ROOM_VAR] = tempfile.mkdtemp(prefix="drivetrain-pytest-")


def _set_env(name: str, value: str | None) -> None:
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node: object) -> None:
    """The controller hands each worker its ``COLUMNS``: xdist's worker start sets it to 80,
    and rich consoles created at import would then wrap what tests read as one line."""
    node.workerinput["columns"] = os.environ.get("COLUMNS")  # type: ignore[attr-defined]


# ---- scheduling: a module's tests on one worker ------------------------------------------
#: the file in the room's folder where a worker leaves each test's scope for the controller
SCOPES_FILE = "scopes.json"


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    from xdist.scheduler import LoadGroupScheduling

    config.option.loadscopereorder = False  # keep the order pytest_collection_modifyitems sets
    scopes: dict[str, str] = {}

    class ModuleOrGroupScheduling(LoadGroupScheduling):
        """xdist's loadgroup, with a test's module as its group when it names none. The
        groups come from the workers' collection (``SCOPES_FILE``): xdist 3.8 marks a group
        by renaming the test, which pytest 9 ignores, so its own loadgroup splits groups."""

        def _split_scope(self, nodeid: str) -> str:
            if not scopes and (_room_dir() / SCOPES_FILE).is_file():
                scopes.update(json.loads((_room_dir() / SCOPES_FILE).read_text()))
            return scopes.get(nodeid) or nodeid.split("::", 1)[0]

        def _reschedule(self, node: object) -> None:
            """A worker gets its next scope when one test of its current scope is left (it
            holds a test until it knows the next), not two: the next scope would wait behind
            a long test while the other worker idles."""
            if self.workqueue and self._pending_of(self.assigned_work[node]) > 1:
                return
            super()._reschedule(node)

    return ModuleOrGroupScheduling(config, log)


def _room_dir() -> Path:
    return Path(os.environ[ROOM_VAR])


def _group(item: pytest.Item) -> str:
    """The item's xdist group, else its module."""
    groups = sorted(
        str(mark.args[0] if mark.args else mark.kwargs.get("name", "default"))
        for mark in item.iter_markers("xdist_group")
    )
    return "@" + "_".join(groups) if groups else item.nodeid.split("::", 1)[0]


def _scopes(items: list[pytest.Item]) -> dict[str, str]:
    """What the scheduler keeps on one worker, per test: its group (or module), the tests
    that run alone split off into a scope of their own. Otherwise a light test of their
    module, run by one worker, holds up the other worker's lone tests (vLLM's module: 15
    light tests of ~25 s beside its two serial ones). A module fixture both parts use is
    built once on each worker that runs them: today only tiny model directories."""
    return {item.nodeid: _group(item) + ("::alone" if runs_alone(item) else "") for item in items}


def _deselect_slow(config: pytest.Config, items: list[pytest.Item]) -> None:
    """``slow`` tests run when ``-m`` names them, or in CI: there the README's one command
    runs every test in one session, so the slow jobs share the cores with the rest."""
    if config.option.markexpr or os.environ.get("CI"):
        return
    slow = [item for item in items if item.get_closest_marker("slow")]
    if slow:
        config.hook.pytest_deselected(items=slow)
        items[:] = [item for item in items if not item.get_closest_marker("slow")]


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Scopes holding tests that run alone go first, those tests first within them: such a
    test waits for the other worker's running test, and at the start that is another one of
    them. Then the scopes holding slow tests, the most first, so that the long light jobs
    start early and the session ends on short tests; the rest after."""
    _deselect_slow(config, items)
    worker = getattr(config, "workerinput", None)
    if worker is None:  # not under xdist: collection order
        return
    scopes = _scopes(items)
    with_alone = {scopes[item.nodeid] for item in items if runs_alone(item)}
    slow = Counter(scopes[item.nodeid] for item in items if item.get_closest_marker("slow"))

    def rank(item: pytest.Item) -> tuple[bool, int, bool]:
        scope = scopes[item.nodeid]
        return scope not in with_alone, -slow[scope], not runs_alone(item)

    items.sort(key=rank)
    if worker["workerid"] == "gw0":
        written = _room_dir() / f".{SCOPES_FILE}.{os.getpid()}"
        written.write_text(json.dumps(scopes))
        written.replace(_room_dir() / SCOPES_FILE)  # whole, before gw0 reports its collection


# ---- running alone: a readers-writer lock shared by the workers --------------------------
class _Room:
    """Light tests hold ``room`` shared, a serial test holds it exclusively; everyone passes
    ``gate`` to ask, and a serial test keeps ``gate`` while it waits, so no light test gets in
    ahead of it."""

    def __init__(self, directory: Path) -> None:
        self.gate: IO[str] = open(directory / "gate", "a")  # noqa: SIM115 (held all session)
        self.room: IO[str] = open(directory / "room", "a")  # noqa: SIM115
        self.held = False

    def enter(self, alone: bool) -> None:
        fcntl.flock(self.gate, fcntl.LOCK_EX)
        try:
            fcntl.flock(self.room, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
            self.held = True
        finally:
            fcntl.flock(self.gate, fcntl.LOCK_UN)

    def leave(self) -> None:
        fcntl.flock(self.room, fcntl.LOCK_UN)
        self.held = False


_room: _Room | None = None


def runs_alone(item: pytest.Item) -> bool:
    return any(item.get_closest_marker(name) for name in ALONE_MARKERS)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Generator:
    """Setup, call and teardown (module fixtures included) inside the lock; waiting for it
    counts neither in the test's duration nor against its timeout. A test that runs alone
    and is followed by another on this worker keeps the room for it: released in between,
    the other worker's light test would get in first and the next one would wait for it."""
    global _room
    if _workers < 2:
        yield
        return
    if _room is None:
        _room = _Room(_room_dir())
    alone = runs_alone(item)
    if not _room.held:
        _room.enter(alone)
    threads = _AllThreads() if alone else None
    try:
        yield
    finally:
        if threads is not None:
            threads.close()
        if not (alone and nextitem is not None and runs_alone(nextitem)):
            _room.leave()


class _AllThreads:
    """The machine's threads for a test that runs alone, one thread again afterwards."""

    def __init__(self) -> None:
        self.env = os.environ.get("OMP_NUM_THREADS")
        os.environ["OMP_NUM_THREADS"] = str(_cores())
        self.torch = sys.modules.get("torch")  # a test that has not imported it: env above
        if self.torch is not None:
            self.torch.set_num_threads(_cores())

    def close(self) -> None:
        os.environ["OMP_NUM_THREADS"] = self.env or "1"
        if self.torch is not None:
            self.torch.set_num_threads(1)


def pytest_unconfigure(config: pytest.Config) -> None:
    if not hasattr(config, "workerinput") and ROOM_VAR in os.environ:
        shutil.rmtree(os.environ.pop(ROOM_VAR), ignore_errors=True)


# ---- the per-test budget -----------------------------------------------------------------
_durations: dict[str, float] = {}
_slow: set[str] = set()


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _durations[report.nodeid] = _durations.get(report.nodeid, 0.0) + report.duration
    if "slow" in report.keywords:
        _slow.add(report.nodeid)


def pytest_terminal_summary(terminalreporter: object, config: pytest.Config) -> None:
    if not os.environ.get("CI") or hasattr(config, "workerinput"):
        return
    if not set(_durations) - _slow:  # `pytest -m slow`: no default-set test ran
        return
    over = sorted(
        ((s, n) for n, s in _durations.items() if s > TEST_BUDGET_S and n not in _slow),
        reverse=True,
    )
    write = terminalreporter.write_line  # type: ignore[attr-defined]
    terminalreporter.section(f"default-set tests over {TEST_BUDGET_S:.0f} s")  # type: ignore[attr-defined]
    if not over:
        write("none")
    for seconds, nodeid in over:
        write(f"{seconds:7.1f} s  {nodeid}")
