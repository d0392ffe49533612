"""``drivetrain new-plugin environment NAME`` makes a package that a third party installs on
its own (engine-api and runtime from the workspace, nothing else of ours) and whose
environment kit passes on the stub as generated; the registry finds it by its entry point."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ROOT / "packages"


def new_plugin(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "drivetrain.trainer", "new-plugin", *args]
    return subprocess.run(command, capture_output=True, text=True, cwd=cwd, timeout=120)


@pytest.mark.timeout(600)
def test_a_generated_environment_installs_alone_and_passes_its_kit(tmp_path, venv_factory):
    made = new_plugin("environment", "acme-words", "--into", str(tmp_path), cwd=tmp_path)
    assert made.returncode == 0, made.stderr
    package = tmp_path / "acme-words"
    venv = venv_factory("new-plugin")
    venv.install(
        PACKAGES / "engine-api", PACKAGES / "runtime", PACKAGES / "testing", f"{package}[test]"
    )
    kit = venv.run("-m", "pytest", "-q", "-p", "no:cacheprovider", str(package / "tests"))
    assert "7 passed" in kit.stdout, kit.stdout[-3000:]
    found = venv.run("-c", "from drivetrain.api import registry; "
                     "print(registry.environments.load('acme_words').__name__)")  # fmt: skip
    assert found.stdout.strip() == "AcmeWordsEnvironment"
    files = {p.relative_to(package).as_posix() for p in package.rglob("*") if p.is_file()}
    assert not any("drivetrain" in f for f in files)  # its own package, no copy of ours


def test_bad_requests_fail_in_one_line(tmp_path):
    (tmp_path / "taken").mkdir()
    for args, message in [
        (("engine", "acme"), "no template for 'engine'; kinds: environment"),
        (("environment", "Acme_Words"), "plugin name 'Acme_Words': lowercase"),
        (("environment", "taken", "--into", str(tmp_path)), "exists: choose another name"),
    ]:
        done = new_plugin(*args, cwd=tmp_path)
        assert done.returncode == 2 and message in done.stderr, done.stderr
