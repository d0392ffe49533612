"""``benchmarks/gpu/mfu.py`` measures each configuration with nothing left of the one before:
an engine whose objects sit in reference cycles (megatron's do) is collected by the time
``measure`` returns. It once survived in the frame's locals past ``gc.collect()`` and added 10
bytes a parameter (10 GiB at 1.07B) to the next configuration's peak on the H200."""

from __future__ import annotations

import sys
import weakref
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks" / "gpu"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))


class CyclicEngine:
    def __init__(self) -> None:
        self.me = self  # a reference cycle: only the collector frees it
        self.steps = 0

    def step(self) -> None:
        self.steps += 1

    def close(self) -> None:
        pass


def test_nothing_of_a_measured_configuration_outlives_measure():
    from mfu import measure

    made: list[weakref.ref] = []

    def build():
        engine = CyclicEngine()
        made.append(weakref.ref(engine))
        return engine.step, engine.close

    result = measure(build, "cpu", warmup=1, timed=2)
    assert result["s_per_step"] >= 0
    assert made[0]() is None, "the configuration's engine is still alive"
