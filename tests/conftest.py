"""Fixtures for cross-package tests: throwaway virtual environments built with uv, and the
built-in GRPO job run once for every test that reads it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).parent))  # helper modules beside the tests

from builtin_run import BuiltinRun, run_builtin_grpo  # noqa: E402 (found through the line above)


class Venv:
    """A fresh virtual environment; ``install`` takes requirement strings or local paths."""

    def __init__(self, path: Path) -> None:
        self.uv = shutil.which("uv")
        assert self.uv, "these tests need the uv executable on PATH (pip install uv)"
        self.path = path
        self.python = str(path / "bin" / "python")
        subprocess.run([self.uv, "venv", "-q", "--python", sys.executable, str(path)], check=True)

    def install(self, *requirements: str | Path) -> None:
        """Install with every third-party version pinned to the workspace lock, so the result
        is the tested stack and comes from uv's cache (the trainer pulls in torch and Ray)."""
        constraints = self.path.parent / "lock-constraints.txt"
        if not constraints.exists():
            export = [self.uv, "export", "--frozen", "--no-hashes", "--all-packages"]
            export += ["--no-emit-workspace", "--no-header", "-o", str(constraints)]
            subprocess.run(export, check=True, timeout=300, cwd=ROOT, capture_output=True)
        args = [self.uv, "pip", "install", "-q", "--python", self.python, "-c", str(constraints)]
        subprocess.run([*args, *map(str, requirements)], check=True, timeout=600)

    def run(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        # nothing of this session's interpreter or pytest options reaches the venv's commands
        skip = ("VIRTUAL_ENV", "PYTHONPATH", "PYTEST_ADDOPTS")
        env = {k: v for k, v in os.environ.items() if k not in skip}
        env["COLUMNS"] = "250"  # rich tables: keep rows on one line
        return subprocess.run(
            [self.python, *args], capture_output=True, text=True, check=check, timeout=300, env=env
        )

    def script(self, name: str, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return self.run(str(self.path / "bin" / name), *args, check=check)


@pytest.fixture(scope="module")
def venv_factory(tmp_path_factory):
    def make(name: str) -> Venv:
        return Venv(tmp_path_factory.mktemp(name) / "venv")

    return make


@pytest.fixture(scope="session")
def builtin_addition(tmp_path_factory) -> BuiltinRun:
    """The README's main job, once per session (``builtin_run.py``). Tests that use it carry
    ``BUILTIN_ADDITION``, so one xdist worker runs them all and this runs once."""
    return run_builtin_grpo(tmp_path_factory.mktemp("builtin-addition"))
