"""drivetrain-engine-api installs alone and its contracts import nothing outside the standard
library; with drivetrain-runtime (also stdlib-only) the api and the runtime import nothing else
either (the kits, built on both: drivetrain-testing's tests)."""

import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1]
RUNTIME = PACKAGE.parent / "runtime"

CHECK = textwrap.dedent(
    """
    import importlib, pkgutil, sys
    roots = sys.argv[1:]
    names = []
    for root in roots:
        package = importlib.import_module(root)
        names += [m.name for m in pkgutil.walk_packages(package.__path__, root + ".")]
    for name in names:
        importlib.import_module(name)
    found = {m.split(".")[0] for m in sys.modules}
    foreign = sorted(found - set(sys.stdlib_module_names) - {"drivetrain", "__main__"})
    print(len(names), "modules;", "third-party:", foreign)
    sys.exit(1 if foreign else 0)
    """
)


def _venv(tmp_path_factory, name: str, *packages: Path) -> str:
    uv = shutil.which("uv")
    assert uv, "needs the uv executable on PATH"
    venv = tmp_path_factory.mktemp(name) / "venv"
    subprocess.run([uv, "venv", "-q", "--python", sys.executable, str(venv)], check=True)
    python = str(venv / "bin" / "python")
    install = [uv, "pip", "install", "-q", "--python", python, *map(str, packages)]
    subprocess.run(install, check=True, timeout=600)
    return python


@pytest.fixture(scope="module")
def lonely_venv(tmp_path_factory):
    return _venv(tmp_path_factory, "api-only", PACKAGE)


@pytest.fixture(scope="module")
def runtime_venv(tmp_path_factory):
    return _venv(tmp_path_factory, "api-and-runtime", PACKAGE, RUNTIME)


LIST_DISTRIBUTIONS = (
    "import importlib.metadata as m; print(sorted(d.metadata['Name'] for d in m.distributions()))"
)


def _walk(python: str, *roots: str) -> subprocess.CompletedProcess:
    return subprocess.run([python, "-c", CHECK, *roots], capture_output=True, text=True)


def test_installs_without_any_other_distribution(lonely_venv):
    out = subprocess.run(
        [lonely_venv, "-c", LIST_DISTRIBUTIONS], capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "['drivetrain-engine-api']"


def test_the_contracts_import_alone_and_only_the_standard_library(lonely_venv):
    code = (
        "import importlib, pkgutil, sys, drivetrain.api as a; "
        "names = [m.name for m in pkgutil.iter_modules(a.__path__, 'drivetrain.api.') "
        "]; [importlib.import_module(n) for n in names]; "
        "found = {m.split('.')[0] for m in sys.modules}; "
        "print(len(names), sorted(found - set(sys.stdlib_module_names) - {'drivetrain', "
        "'__main__'}))"
    )
    out = subprocess.run([lonely_venv, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    count, foreign = out.stdout.split(maxsplit=1)
    assert foreign.strip() == "[]" and int(count) >= 15


def test_every_module_with_the_runtime_imports_only_the_standard_library(runtime_venv):
    out = _walk(runtime_venv, "drivetrain.api", "drivetrain.runtime")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "third-party: []" in out.stdout
    assert int(out.stdout.split()[0]) >= 30  # walked both packages
