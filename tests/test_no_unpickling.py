"""Nothing drivetrain reads may be unpickled: a pickle runs whatever callable it names.

Scans every package's source: ``torch.load`` only with ``weights_only=True``; no ``pickle`` /
``dill`` / ``cloudpickle`` / ``marshal`` loads and no ``Connection.recv()`` (which unpickles)
outside the one allow-listed module that reads DCP metadata through an allow-list."""

from __future__ import annotations

import ast
import os
from pathlib import Path

import pytest

pytestmark = pytest.mark.fault

ROOT = Path(__file__).resolve().parents[1]
ALLOWED = {"packages/runtime/src/drivetrain/runtime/untrusted.py"}
UNPICKLERS = {"pickle", "dill", "cloudpickle", "marshal", "_pickle"}


def sources() -> list[Path]:
    return sorted(ROOT.glob("packages/*/src/**/*.py"))


def violations(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
            continue
        owner = node.func.value
        name = node.func.attr
        where = f"{path.relative_to(ROOT)}:{node.lineno}"
        if isinstance(owner, ast.Name) and owner.id == "torch" and name == "load":
            weights_only = [k for k in node.keywords if k.arg == "weights_only"]
            if not weights_only or not (
                isinstance(weights_only[0].value, ast.Constant) and weights_only[0].value.value
            ):
                found.append(f"{where}: torch.load without weights_only=True")
        if isinstance(owner, ast.Name) and owner.id in UNPICKLERS and name in (
            "load", "loads", "Unpickler"
        ):  # fmt: skip
            found.append(f"{where}: {owner.id}.{name}")
        if name == "recv" and not node.args and not node.keywords:
            found.append(f"{where}: .recv() (multiprocessing.connection unpickles)")
    return found


def test_the_scan_finds_what_it_looks_for(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text(
        "import pickle, torch\n"
        "torch.load(f)\ntorch.load(f, weights_only=False)\npickle.loads(b)\nconn.recv()\n"
        "torch.load(f, weights_only=True)\nsock.recv(4096)\n"
    )
    global ROOT
    saved, ROOT = ROOT, tmp_path
    try:
        assert [v.split(": ", 1)[1] for v in violations(bad)] == [
            "torch.load without weights_only=True",
            "torch.load without weights_only=True",
            "pickle.loads",
            ".recv() (multiprocessing.connection unpickles)",
        ]
    finally:
        ROOT = saved


@pytest.mark.parametrize("path", sources(), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_source_unpickles(path):
    if str(path.relative_to(ROOT)) in ALLOWED:
        return
    assert violations(path) == []


class _RunsACommand:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_libraries_asking_for_full_unpickling_get_weights_only_inside_the_context(tmp_path):
    """DCP's planner calls ``torch.load(..., weights_only=False)`` for non-tensor entries."""
    import torch

    from drivetrain.runtime.untrusted import UnsafeFileError, torch_loads_weights_only

    marker, path = tmp_path / "pwned", tmp_path / "entry.pt"
    torch.save({"lr": 0.1, "evil": _RunsACommand(marker)}, path)
    refused = pytest.raises(UnsafeFileError, match=r"entry\.pt holds more than tensors")
    with refused, torch_loads_weights_only(path):
        torch.load(path, weights_only=False)
    assert not marker.exists()
    assert "TORCH_FORCE_WEIGHTS_ONLY_LOAD" not in os.environ
    torch.save({"lr": 0.1, "t": torch.ones(2)}, path)
    with torch_loads_weights_only(path):
        assert torch.load(path, weights_only=False)["lr"] == 0.1
