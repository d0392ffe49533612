import os
import subprocess
import sys
import time

import pytest
from typer.testing import CliRunner

from drivetrain.api import registry
from drivetrain.trainer.cli import app

runner = CliRunner()


def test_no_arguments_shows_help():
    result = runner.invoke(app, [])
    assert "engines" in result.output and "rollouts" in result.output


def test_version_lists_installed_distributions():
    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0
    assert "drivetrain-engine-api 0.1.0" in result.output
    assert "drivetrain-trainer 0.1.0" in result.output


def test_plugin_tables(monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    for command, title in (
        ("engines", "drivetrain.engines"),
        ("rollouts", "drivetrain.rollouts"),
        ("ckpt-engines", "drivetrain.ckpt_engines"),
        ("environments", "drivetrain.environments"),
    ):
        result = runner.invoke(app, [command])
        assert result.exit_code == 0, result.output
        assert title in result.output
    engines = runner.invoke(app, ["engines", "--check"]).output
    fake_row = next(line for line in engines.splitlines() if "│ fake" in line)
    assert "drivetrain-testing 0.1.0" in fake_row and fake_row.rstrip(" │").endswith("ok")
    assert "each plugin's code imported" in engines


#: runs `drivetrain <command>` in a fresh interpreter, then reports which plugin code it imported
LISTING = """
import sys
from drivetrain.api import registry
from drivetrain.trainer.cli import app
try:
    app(sys.argv[1:])
except SystemExit as exit:
    assert not exit.code, exit.code
records = [r for g in registry.REGISTRIES.values() for r in g.inspect(load=False) if r.spec]
# a factory that lives beside its spec (the api's direct transport) is imported with it
factories = {r.spec.factory.partition(":")[0] for r in records} - {
    r.target.partition(":")[0] for r in records
}
print("IMPORTED", sorted((factories | {"torch", "transformers", "ray"}) & set(sys.modules)))
"""


def _listing(*args: str, test_plugins: bool = False) -> tuple[str, float]:
    env = {k: v for k, v in os.environ.items() if k != registry.TEST_PLUGINS_VAR}
    env["COLUMNS"] = "250"
    if test_plugins:
        env[registry.TEST_PLUGINS_VAR] = "1"
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-c", LISTING, *args], capture_output=True, text=True, timeout=120, env=env
    )
    seconds = time.perf_counter() - start
    assert done.returncode == 0, done.stderr
    return done.stdout, seconds


@pytest.mark.serial  # times a fresh interpreter
@pytest.mark.parametrize("command", ["engines", "rollouts", "ckpt-engines", "environments"])
def test_listing_reads_metadata_and_specs_only(command):
    """The listing imports no plugin's code (no torch): 0.5 s here where importing every
    plugin took 12 s; the bound leaves room for a loaded machine."""
    out, seconds = _listing(command)
    assert "IMPORTED []" in out
    assert "│ installed" in out or "installed │" in out
    assert "--check imports each plugin's code" in out
    assert seconds < 4, f"`drivetrain {command}` took {seconds:.1f} s"


def test_listing_with_check_imports_each_plugin():
    out, _ = _listing("engines", "--check", test_plugins=True)
    assert "drivetrain.testing.fake_engine" in out.rpartition("IMPORTED")[2]
    assert "│ fake " in out


def test_fake_plugins_are_listed_only_for_tests():
    assert "│ fake " not in _listing("engines")[0]
    assert "│ fake " not in _listing("rollouts")[0]
    assert "│ fake " in _listing("engines", test_plugins=True)[0]
    assert "│ echo " not in _listing("environments")[0]
    assert "│ echo " in _listing("environments", test_plugins=True)[0]


def test_cli_import_stays_light():
    """`drivetrain engines` must not pay for torch, transformers or Ray (seconds each)."""
    heavy = "{'torch', 'transformers', 'ray'}"
    code = f"import sys, drivetrain.trainer.cli; print(sorted({heavy} & set(sys.modules)))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
