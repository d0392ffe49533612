"""Golden metrics: a job's first steps, recorded once, compared bit for bit afterwards.

The trainer's restructurings must leave what a job computes unchanged. Each test that runs a
job already passes its metric rows here; the first ``steps`` rows, without the wall-clock
entries, must equal ``tests/data/golden/<name>.json`` exactly (JSON floats round-trip; fixed seeds,
one thread per process).

Where a job is not bit-reproducible run to run, the test names the keys that vary and by how
much (measured on two runs of the same code), and those are compared within that spread.

``DRIVETRAIN_RECORD_GOLDEN=1`` writes the file instead (record before changing the trainer,
on a tree whose behaviour is the reference; the file names the commit it was recorded at)."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Mapping
from pathlib import Path
from typing import Any

GOLDEN = Path(__file__).resolve().parent / "data" / "golden"
#: entries that measure the machine, not the computation
WALL_CLOCK = ("time/", "perf/", "weight_sync/")


def computed(row: dict[str, Any]) -> dict[str, Any]:
    """``row`` without its wall-clock entries."""
    return {
        k: v
        for k, v in row.items()
        if not k.startswith(WALL_CLOCK) and not k.endswith(("per_s", "_seconds", "_s"))
    }


def _same(key: str, mine: Any, recorded: Any, spread: Mapping[str, float]) -> bool:
    if key in spread and isinstance(mine, float) and isinstance(recorded, float):
        return abs(mine - recorded) <= spread[key]
    return mine == recorded


def check_golden(
    name: str, rows: list[dict[str, Any]], *, steps: int, spread: Mapping[str, float] | None = None
) -> None:
    """Assert that the first ``steps`` metric rows (those with a step) hold the recorded ones:
    bit for bit, except the keys of ``spread``, within their measured run-to-run spread. A
    recorded key that is gone fails; a key recorded nowhere (a metric added since) is not
    compared."""
    spread = spread or {}
    got = [computed(r) for r in rows if "step" in r][:steps]
    assert len(got) == steps, f"{name}: {len(got)} metric rows, {steps} recorded"
    path = GOLDEN / f"{name}.json"
    if os.environ.get("DRIVETRAIN_RECORD_GOLDEN") == "1":
        GOLDEN.mkdir(parents=True, exist_ok=True)
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
            cwd=GOLDEN, check=False,
        ).stdout.strip()  # fmt: skip
        path.write_text(json.dumps({"recorded_at": commit, "rows": got}, indent=1) + "\n")
        return
    want = json.loads(path.read_text())["rows"]
    for index, (mine, recorded) in enumerate(zip(got, want, strict=True)):
        keys = sorted(recorded)  # a metric added since is new output, not a change
        differ = [
            k
            for k in keys
            if not _same(k, mine.get(k, "absent"), recorded.get(k, "absent"), spread)
        ]
        if differ:
            detail = {k: (recorded.get(k, "absent"), mine.get(k, "absent")) for k in differ[:6]}
            raise AssertionError(
                f"{name}: row {index} differs from {path.name} (recorded, now): {detail}"
            )
