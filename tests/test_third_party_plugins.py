"""A third party publishes engines as ordinary distributions; drivetrain finds and checks them.

Throwaway projects are built and installed with the real engine-api and trainer into an
isolated environment: one that works, one whose code fails to import, and one implementing a
future engine-api. ``drivetrain engines`` and the registry must show and treat each correctly.
Two more are engine-fsdp under other names declaring no capabilities, or only ``device:cpu``:
``drivetrain sft`` trains with them on padded batches and fixed-size micro-batches.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from sft_support import make_job

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
    config="{config}",
    api="{api}",
    capabilities=frozenset({capabilities}),
    install_hint="pip install {dist}",
)
"""

ENGINE = """
{preamble}
from drivetrain.testing import FakeEngine


class AcmeEngine(FakeEngine):
    \"\"\"A third-party engine: the fake engine under another name.\"\"\"
"""

FSDP_ENGINE = """
from drivetrain.api.batch import Layout
from drivetrain.engine.fsdp.engine import FSDP2Engine


class AcmeEngine(FSDP2Engine):
    \"\"\"fsdp2 under another name, failing on what its spec does not declare.\"\"\"

    def _undeclared(self, batch):
        if batch.layout is Layout.PACKED:
            raise RuntimeError("a packed batch reached an engine without 'packed'")
        if self.config.micro_batch.max_tokens is not None:
            raise RuntimeError("a token budget reached an engine without 'dynamic_batch'")

    def forward_backward(self, batch, loss_fn, *, outputs=None):
        self._undeclared(batch)
        return super().forward_backward(batch, loss_fn, outputs=outputs)

    def infer(self, batch, outputs):
        self._undeclared(batch)
        return super().infer(batch, outputs)
"""
FSDP_CONFIG = "drivetrain.engine.fsdp.config:FSDPConfig"


def make_project(
    root: Path,
    dist: str,
    name: str,
    *,
    api: str = ">=0.1,<0.2",
    preamble: str = "",
    capabilities: tuple[str, ...] = ("dynamic_batch", "device:cpu"),
    engine: str = "",
    config: str = "",
) -> Path:
    module = dist.replace("-", "_")
    project = root / dist
    (project / module).mkdir(parents=True)
    fields = {"dist": dist, "name": name, "module": module, "api": api, "config": config}
    fields["capabilities"] = repr(sorted(capabilities))
    (project / "pyproject.toml").write_text(textwrap.dedent(PYPROJECT.format(**fields)))
    (project / module / "__init__.py").write_text("")
    (project / module / "plugin.py").write_text(textwrap.dedent(PLUGIN.format(**fields)))
    engine = engine or ENGINE.format(preamble=preamble)
    (project / module / "engine.py").write_text(textwrap.dedent(engine))
    return project


@pytest.fixture(scope="module")
def env(venv_factory, tmp_path_factory):
    root = tmp_path_factory.mktemp("projects")
    venv = venv_factory("third-party")
    venv.install(
        PACKAGES / "engine-api",
        PACKAGES / "runtime",
        PACKAGES / "testing",  # the acme engine is the kit's FakeEngine
        PACKAGES / "trainer",
        make_project(root, "acme-engine", "acme"),
        make_project(root, "broken-engine", "broken", preamble="import megatron.core"),
        make_project(root, "future-engine", "future", api=">=0.2,<0.3"),
        PACKAGES / "engine-core",
        PACKAGES / "engine-fsdp",
        make_project(root, "bare-engine", "bare", capabilities=(), **FSDP),
        make_project(root, "cpu-engine", "cpuonly", capabilities=("device:cpu",), **FSDP),
    )
    return venv


def row(table: str, name: str) -> str:
    lines = [line for line in table.splitlines() if line.startswith(f"│ {name} ")]
    assert lines, f"no row for {name!r} in:\n{table}"
    return lines[0]


def test_cli_lists_every_plugin_with_its_status(env):
    listed = env.script("drivetrain", "engines").stdout  # metadata and specs: no plugin code
    assert row(listed, "broken").rstrip(" │").endswith("installed")
    assert "incompatible: implements engine-api >=0.2,<0.3" in row(listed, "future")
    table = env.script("drivetrain", "engines", "--check").stdout
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
    assert "other installed engines: acme, " in out  # lists the alternatives


def test_incompatible_plugin_is_rejected_before_import(env):
    code = LOAD + "\nprint('IMPORTED' if 'future_engine.engine' in sys.modules else 'NOT IMPORTED')"
    out = env.run("-c", code, "future").stdout
    assert "ERROR engine 'future' (future-engine 2.0.1) cannot be used: incompatible" in out
    assert "drivetrain-engine-api 0.1.0 is installed" in out
    assert out.strip().endswith("NOT IMPORTED")


def test_unknown_name_lists_what_is_installed(env):
    out = env.run("-c", LOAD, "acmee").stdout
    assert out.startswith("ERROR unknown engine 'acmee': did you mean 'acme'? installed engines:")
    for name in ("acme", "broken", "future", "fake"):
        assert f" {name}," in out or f" {name} " in out
    assert "entry-point group drivetrain.engines" in out  # how a third-party one is found


def test_env_var_disables_a_plugin(env):
    code = "import os; os.environ['DRIVETRAIN_PLUGINS'] = '-acme'\n" + LOAD
    out = env.run("-c", code, "acme").stdout
    assert "cannot be used: disabled: denied by DRIVETRAIN_PLUGINS=-acme" in out


FSDP = {"engine": FSDP_ENGINE, "config": FSDP_CONFIG}


def sft_job(root: Path) -> list[str]:
    """A tiny model, addition data and a short run; ``data.max_length`` 2048 makes the job's
    8192-token budget 4 samples per micro-batch: 2 micro-batches of the 8 samples a step."""
    base = [a for a in make_job(root) if not a.startswith("engine.micro_batch.")]
    return [*base, "run.max_steps=2", "data.max_length=2048", "engine.device=cpu"]


@pytest.mark.parametrize("engine", ["bare", "cpuonly"])
def test_an_engine_declaring_nothing_trains_sft_padded_with_fixed_micro_batches(
    env, tmp_path, engine
):
    """The engine fails on a packed batch or a token budget (the bug of issue 22: a device:cpu
    engine got packed batches cut by a budget); it trains two steps instead."""
    out = tmp_path / "out"
    done = env.script("drivetrain", "sft", "--engine", engine, *sft_job(tmp_path),
                      f"run.output_dir={out}", check=False)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    config = (out / "config.yaml").read_text()
    assert "packing: false" in config and "micro_batch_size: 4" in config, config
    assert "max_tokens: null" in config


def test_a_token_budget_the_user_sets_is_refused_without_dynamic_batch(env, tmp_path):
    args = [*sft_job(tmp_path), "engine.micro_batch.micro_batch_size=null"]
    done = env.script("drivetrain", "sft", "--engine", "cpuonly", *args,
                      "engine.micro_batch.max_tokens=64", check=False)  # fmt: skip
    assert done.returncode == 2, done.stdout + done.stderr
    assert (
        "error: engine.micro_batch.max_tokens=64 needs the 'dynamic_batch' capability, which "
        "engine 'cpuonly' does not declare (it declares device:cpu)"
    ) in done.stdout + done.stderr
