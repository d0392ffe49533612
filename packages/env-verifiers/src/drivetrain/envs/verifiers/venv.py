"""Makes a virtual environment for verifiers environments: ``python -m
drivetrain.envs.verifiers.venv DIR [REQUIREMENT...]`` (``uv venv`` + ``uv pip install
'verifiers==0.4.*'`` and any environments named), then prints the interpreter to give
``episode.options.python``. Its own environment: verifiers' dependencies never meet the
trainer's."""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path

VERIFIERS = "verifiers==0.4.*"


def make_venv(path: Path, *requirements: str, python: str = "3.11") -> Path:
    """Creates (or updates) the environment at ``path``; returns its interpreter."""
    uv = shutil.which("uv")
    if uv is None:
        raise SystemExit("verifiers: this needs uv on PATH (pip install uv)")
    interpreter = path / "bin" / "python"
    if not interpreter.exists():
        subprocess.run([uv, "venv", "-q", "--python", python, str(path)], check=True)
    install = [uv, "pip", "install", "-q", "--python", str(interpreter), VERIFIERS]
    subprocess.run([*install, *requirements], check=True)
    return interpreter


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m drivetrain.envs.verifiers.venv")
    parser.add_argument("path", type=Path, help="the folder of the new virtual environment")
    parser.add_argument("requirements", nargs="*", help="environments to install as well")
    parser.add_argument("--python", default="3.11", help="the Python version (default 3.11)")
    args = parser.parse_args(argv)
    print(make_venv(args.path, *args.requirements, python=args.python))
    return 0


if __name__ == "__main__":
    sys.exit(main())
