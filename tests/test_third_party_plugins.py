"""A third party publishes engines as ordinary distributions; drivetrain finds and checks them.

Three throwaway projects are built and installed with the real engine-api and trainer into an
isolated environment: one that works, one whose code fails to import, and one implementing a
future engine-api. ``drivetrain engines`` and the registry must show and treat each correctly.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

PACKAGES = Path(__file__).resolve().parents[1] / "packages"

PYPROJECT = """
[project]
name = "{dist}"
version = "2.0.1"
dependencies = ["drivetrain-engine-api>=0.1,<0.2"]

[project.entry-points."drivetrain.engines"]
{name} = "{module}.plugin:SPEC"

[build-system]
requires = ["hatchling"]
build-backend = "hatchling.build"

[tool.hatch.build.targets.wheel]
packages = ["{module}"]
"""

PLUGIN = """
from drivetrain.api import PluginSpec

SPEC = PluginSpec(
    name="{name}",
    factory="{module}.engine:AcmeEngine",
    api="{api}",
    capabilities=frozenset({{"dynamic_batch", "device:cpu"}}),
    install_hint="pip install {dist}",
)
"""

ENGINE = """
{preamble}
from drivetrain.api.testing import FakeEngine


class AcmeEngine(FakeEngine):
    \"\"\"A third-party engine: the fake engine under another name.\"\"\"
"""


def make_project(
    root: Path, dist: str, name: str, *, api: str = ">=0.1,<0.2", preamble: str = ""
) -> Path:
    module = dist.replace("-", "_")
    project = root / dist
    (project / module).mkdir(parents=True)
    fields = {"dist": dist, "name": name, "module": module, "api": api}
    (project / "pyproject.toml").write_text(textwrap.dedent(PYPROJECT.format(**fields)))
    (project / module / "__init__.py").write_text("")
    (project / module / "plugin.py").write_text(textwrap.dedent(PLUGIN.format(**fields)))
    (project / module / "engine.py").write_text(textwrap.dedent(ENGINE.format(preamble=preamble)))
    return project


@pytest.fixture(scope="module")
def env(venv_factory, tmp_path_factory):
    root = tmp_path_factory.mktemp("projects")
    venv = venv_factory("third-party")
    venv.install(
        PACKAGES / "engine-api",
        PACKAGES / "trainer",
        make_project(root, "acme-engine", "acme"),
        make_project(root, "broken-engine", "broken", preamble="import megatron.core"),
        make_project(root, "future-engine", "future", api=">=0.2,<0.3"),
    )
    return venv


def row(table: str, name: str) -> str:
    lines = [line for line in table.splitlines() if line.startswith(f"│ {name} ")]
    assert lines, f"no row for {name!r} in:\n{table}"
    return lines[0]


def test_cli_lists_every_plugin_with_its_status(env):
    table = env.script("drivetrain", "engines").stdout
    acme = row(table, "acme")
    assert "acme-engine 2.0.1" in acme and ">=0.1,<0.2" in acme and "dynamic_batch" in acme
    assert acme.rstrip(" │").endswith("ok")
    broken = row(table, "broken")
    assert "failed to import: ModuleNotFoundError: No module named 'megatron'" in broken
    assert "pip install broken-engine" in broken
    future = row(table, "future")
    assert "incompatible: implements engine-api >=0.2,<0.3" in future
    assert "ok" in row(table, "fake")


def test_version_lists_drivetrain_distributions(env):
    out = env.script("drivetrain", "--version").stdout.split("\n")
    assert "drivetrain-engine-api 0.1.0" in out and "drivetrain-trainer 0.1.0" in out


LOAD = """
import sys
from drivetrain.api import PluginError, registry
name = sys.argv[1]
try:
    engine_class = registry.engines.load(name)
except PluginError as exc:
    print("ERROR", exc)
else:
    print("LOADED", engine_class.__module__, engine_class.__name__)
"""


def test_registry_loads_the_working_plugin_by_name(env):
    assert env.run("-c", LOAD, "acme").stdout.strip() == "LOADED acme_engine.engine AcmeEngine"


def test_broken_plugin_is_rejected_with_reason_and_hint(env):
    out = env.run("-c", LOAD, "broken").stdout
    assert out.startswith(
        "ERROR engine 'broken' (broken-engine 2.0.1) is installed but failed to import"
    )
    assert "No module named 'megatron'" in out and "pip install broken-engine" in out
    assert "acme-engine 2.0.1  ok" in out  # lists the alternatives


def test_incompatible_plugin_is_rejected_before_import(env):
    code = LOAD + "\nprint('IMPORTED' if 'future_engine.engine' in sys.modules else 'NOT IMPORTED')"
    out = env.run("-c", code, "future").stdout
    assert "ERROR engine 'future' (future-engine 2.0.1) cannot be used: incompatible" in out
    assert "drivetrain-engine-api 0.1.0 is installed" in out
    assert out.strip().endswith("NOT IMPORTED")


def test_unknown_name_lists_what_is_installed(env):
    out = env.run("-c", LOAD, "acmee").stdout
    assert out.startswith("ERROR unknown engine 'acmee'. Installed engines:")
    for name in ("acme", "broken", "future", "fake"):
        assert f"\n  {name} " in out


def test_env_var_disables_a_plugin(env):
    code = "import os; os.environ['DRIVETRAIN_PLUGINS'] = '-acme'\n" + LOAD
    out = env.run("-c", code, "acme").stdout
    assert "cannot be used: disabled: denied by DRIVETRAIN_PLUGINS=-acme" in out
