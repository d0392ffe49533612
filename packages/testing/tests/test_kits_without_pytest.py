"""The kits and fakes need only the standard library, drivetrain-engine-api and
drivetrain-runtime: a plugin's own test runner (or none) can run them; pytest is for the
``EngineConformance`` base classes, torch for ``torch_engines`` alone."""

import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from drivetrain.testing.conformance import ENGINE_CHECKS

PACKAGES = Path(__file__).resolve().parents[2]

WALK = textwrap.dedent(
    """
    import importlib, pkgutil, sys
    import drivetrain.testing as t
    names = [m.name for m in pkgutil.walk_packages(t.__path__, "drivetrain.testing.")
             if ".torch_engines" not in m.name]
    for name in names:
        importlib.import_module(name)
    found = {m.split(".")[0] for m in sys.modules}
    foreign = sorted(found - set(sys.stdlib_module_names) - {"drivetrain", "__main__"})
    print(len(names), "modules;", "third-party:", foreign)
    """
)


@pytest.fixture(scope="module")
def bare_venv(tmp_path_factory):
    """api, runtime and testing, without the dependencies testing declares (pytest)."""
    uv = shutil.which("uv")
    assert uv, "needs the uv executable on PATH"
    venv = tmp_path_factory.mktemp("kits-bare") / "venv"
    subprocess.run([uv, "venv", "-q", "--python", sys.executable, str(venv)], check=True)
    python = str(venv / "bin" / "python")
    packages = [PACKAGES / name for name in ("engine-api", "runtime", "testing")]
    install = [uv, "pip", "install", "-q", "--no-deps", "--python", python, *map(str, packages)]
    subprocess.run(install, check=True, timeout=600)
    return python


def test_the_kits_import_only_the_standard_library(bare_venv):
    out = subprocess.run([bare_venv, "-c", WALK], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "third-party: []" in out.stdout
    assert int(out.stdout.split()[0]) >= 25


def test_kit_and_fakes_run_without_pytest(bare_venv):
    code = (
        "from drivetrain.testing import FakeHarness, run_conformance; "
        "r = run_conformance(FakeHarness()); print(all(x.passed for x in r), len(r))"
    )
    out = subprocess.run([bare_venv, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["True", str(len(ENGINE_CHECKS))]
