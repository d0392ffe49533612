"""Work that never returns is abandoned, not waited for; hung tools cost bounded threads."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest

from drivetrain.api.environment import AssistantTurn, ToolCall
from drivetrain.api.tools import Tool
from drivetrain.runtime import tool_calls
from drivetrain.runtime.daemon_pool import DaemonPool

pytestmark = pytest.mark.timeout(60)


def test_results_and_errors_reach_their_futures():
    pool = DaemonPool(2, name="t")
    assert pool.submit(lambda a, b: a + b, 2, 3).result(5) == 5
    with pytest.raises(ZeroDivisionError):
        pool.submit(lambda: 1 / 0).result(5)
    pool.abandon()
    with pytest.raises(RuntimeError, match="closed"):
        pool.submit(print)


def test_abandon_cancels_queued_work_and_returns_at_once():
    never = threading.Event()
    pool = DaemonPool(1, name="t")
    hung = pool.submit(never.wait)
    queued = pool.submit(lambda: 1)
    while not hung.running():  # the worker took it: the other one waits in the queue
        time.sleep(0.001)
    began = time.monotonic()
    pool.abandon()
    assert time.monotonic() - began < 1
    assert queued.cancelled() and not hung.done()


def test_a_process_with_a_hung_call_exits():
    """ThreadPoolExecutor's workers are joined at exit: one hung call kept the process alive."""
    code = (
        "import threading\n"
        "from drivetrain.runtime.daemon_pool import DaemonPool\n"
        "pool = DaemonPool(1, name='t'); pool.submit(threading.Event().wait); pool.abandon()\n"
        "print('done')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0 and done.stdout.strip() == "done", done.stderr


def test_a_slow_tool_within_its_timeout_holds_no_slot(monkeypatch):
    monkeypatch.setattr(tool_calls, "TOOL_SLOTS", 1)
    monkeypatch.setattr(tool_calls, "_abandoned", 0)
    slow = Tool("slow", "", {"type": "object", "properties": {}}, lambda: time.sleep(0.2), 5.0)
    calls = tuple(ToolCall(id=f"c{k}", name="slow", arguments={}) for k in range(3))
    turn = AssistantTurn(0, "", "", calls)
    results = []
    threads = [
        threading.Thread(
            target=lambda: results.append(tool_calls.run_tool_calls({"slow": slow}, turn))
        )
        for _ in range(4)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert len(results) == 4 and all(m["tools/succeeded"] == 3 for _, m in results)


def test_hung_tools_hold_their_slots_and_then_the_next_call_fails(monkeypatch):
    monkeypatch.setattr(tool_calls, "TOOL_SLOTS", 3)
    monkeypatch.setattr(tool_calls, "_abandoned", 0)
    never, before = threading.Event(), threading.active_count()
    hang = Tool("hang", "", {"type": "object", "properties": {}}, lambda: never.wait(), 0.01)
    quick = Tool("quick", "", {"type": "object", "properties": {}}, lambda: "ok", 1.0)
    calls = tuple(ToolCall(id=f"c{k}", name="hang", arguments={}) for k in range(3))
    observations, metrics = tool_calls.run_tool_calls(
        {"hang": hang}, AssistantTurn(0, "", "", calls)
    )
    assert metrics["tools/failed"] == 3
    assert all("timed out after 0.01 s" in o["content"] for o in observations)
    assert threading.active_count() == before + 3  # each hung call: one thread, kept
    one = AssistantTurn(0, "", "", (ToolCall(id="c", name="quick", arguments={}),))
    with pytest.raises(tool_calls.ToolSlotsExhausted, match="all 3 tool slots are held by"):
        tool_calls.run_tool_calls({"quick": quick}, one)
    assert threading.active_count() == before + 3
    never.set()  # the hung calls return: their slots come back
    deadline = time.monotonic() + 10
    while tool_calls._abandoned and time.monotonic() < deadline:
        time.sleep(0.01)
    assert tool_calls._abandoned == 0
    assert tool_calls.run_tool_calls({"quick": quick}, one)[0][0]["content"] == "ok"
