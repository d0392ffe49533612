"""drivetrain-engine-api installs alone and imports nothing outside the standard library."""

import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from drivetrain.api.testing.conformance import ENGINE_CHECKS

PACKAGE = Path(__file__).resolve().parents[1]

CHECK = textwrap.dedent(
    """
    import importlib, pkgutil, sys
    import drivetrain.api
    names = [m.name for m in pkgutil.walk_packages(drivetrain.api.__path__, "drivetrain.api.")]
    for name in names:
        importlib.import_module(name)
    roots = {m.split(".")[0] for m in sys.modules}
    foreign = sorted(roots - set(sys.stdlib_module_names) - {"drivetrain", "__main__"})
    print(len(names), "modules;", "third-party:", foreign)
    sys.exit(1 if foreign else 0)
    """
)


@pytest.fixture(scope="module")
def lonely_venv(tmp_path_factory):
    uv = shutil.which("uv")
    assert uv, "needs the uv executable on PATH"
    venv = tmp_path_factory.mktemp("api-only") / "venv"
    subprocess.run([uv, "venv", "-q", "--python", sys.executable, str(venv)], check=True)
    python = str(venv / "bin" / "python")
    subprocess.run(
        [uv, "pip", "install", "-q", "--python", python, str(PACKAGE)], check=True, timeout=600
    )
    return python


LIST_DISTRIBUTIONS = (
    "import importlib.metadata as m; print(sorted(d.metadata['Name'] for d in m.distributions()))"
)


def test_installs_without_any_other_distribution(lonely_venv):
    out = subprocess.run(
        [lonely_venv, "-c", LIST_DISTRIBUTIONS], capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "['drivetrain-engine-api']"


def test_every_module_imports_only_the_standard_library(lonely_venv):
    out = subprocess.run([lonely_venv, "-c", CHECK], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "third-party: []" in out.stdout
    assert int(out.stdout.split()[0]) >= 20  # walked the whole package, testing kit included


def test_kit_and_fakes_run_without_pytest(lonely_venv):
    code = (
        "from drivetrain.api.testing import FakeHarness, run_conformance; "
        "r = run_conformance(FakeHarness()); print(all(x.passed for x in r), len(r))"
    )
    out = subprocess.run([lonely_venv, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["True", str(len(ENGINE_CHECKS))]
