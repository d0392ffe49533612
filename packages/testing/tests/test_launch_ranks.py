"""engine-core's rank launcher, fresh ``python`` ranks and ranks forked from a preloaded zygote
alike: each rank sees what ``python script ARGS`` with torchrun's environment would, a failing
rank fails the launch with its log, a hung one is killed at the deadline."""

from __future__ import annotations

import os
import time

import pytest

from drivetrain.testing.torch_engines.ranks import launch_ranks
from drivetrain.testing.torch_engines.zygote_client import ZYGOTE_VAR

WORKER = """
import json, os, sys, threading, atexit
from pathlib import Path
out, mode = Path(sys.argv[1]), sys.argv[2]
rank = os.environ["RANK"]
(out / f"rank{rank}.pid").write_text(str(os.getpid()))
if mode == "fail" and rank == "1":
    raise SystemExit("rank 1 gives up")
if mode == "crash" and rank == "1":
    os.abort()
if mode == "hang" and rank == "1":
    threading.Event().wait()
import helper_module  # found through the launcher's pythonpath
import torch
def report():  # at exit, after the script's non-daemon threads
    (out / f"rank{rank}.json").write_text(json.dumps({
        "argv": sys.argv, "name": __name__, "rank": rank, "world": os.environ["WORLD_SIZE"],
        "threads": torch.get_num_threads(), "helper": helper_module.VALUE,
        "path0": sys.path[0], "late": late, "session": os.getsid(0) == os.getpid(),
    }))
late = []
atexit.register(report)
threading.Thread(target=lambda: (__import__("time").sleep(0.2), late.append(1))).start()
"""


@pytest.fixture(params=["fresh", "zygote"])
def launcher(request, tmp_path, monkeypatch):
    monkeypatch.setenv(ZYGOTE_VAR, "1" if request.param == "zygote" else "0")
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "helper_module.py").write_text("VALUE = 7\n")
    (tmp_path / "worker.py").write_text(WORKER)

    def launch(mode: str, out: str, timeout: float = 60) -> list[dict]:
        (tmp_path / out).mkdir()
        return launch_ranks(
            tmp_path / "worker.py", tmp_path / out, mode, timeout=timeout,
            pythonpath=[tmp_path / "lib"], preload=("torch",),
        )  # fmt: skip

    return launch


@pytest.mark.distributed
@pytest.mark.timeout(180)
def test_ranks_run_as_their_own_python_and_failures_end_the_launch(launcher, tmp_path):
    ranks = launcher("ok", "ok")
    assert [r["rank"] for r in ranks] == ["0", "1"]
    for r in ranks:
        assert r["argv"] == [str(tmp_path / "worker.py"), str(tmp_path / "ok"), "ok"]
        assert (r["name"], r["world"], r["threads"], r["helper"]) == ("__main__", "2", 1, 7)
        assert r["path0"] == str(tmp_path) and r["session"] and r["late"] == [1]

    with pytest.raises(AssertionError, match="rank 1 gives up"):
        launcher("fail", "fail")
    with pytest.raises(AssertionError, match=r"a rank exited with (134|-6)"):
        launcher("crash", "crash")
    begin = time.monotonic()
    with pytest.raises(AssertionError, match="timed out after 3 s"):
        launcher("hang", "hang", timeout=3)
    assert time.monotonic() - begin < 30
    hung = int((tmp_path / "hang" / "rank1.pid").read_text())
    with pytest.raises(ProcessLookupError):  # killed and reaped
        os.kill(hung, 0)
