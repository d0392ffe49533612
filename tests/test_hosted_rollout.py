"""A third party's rollout installed only in an environment of its own (``rollout.python``).

``acme-rollout`` (rollout ``acme``: drivetrain's hf rollout with a knob of its own,
``separate_process`` declared; ``acme_inline``: the same without it) is installed with
``python -m drivetrain.rollout.env --package ... hf`` into a second environment and never into
this one. ``drivetrain grpo --rollout acme rollout.python=<it>`` must train with it there: the
trainer asks that interpreter for the rollout's spec and config fields and starts it in a
server process. The one-line refusals: not installed there, no ``separate_process``, and an
environment without the weight transport (within 10 s, naming what to install).
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from cli_run import run_cli
from rl_support import make_rl_job, metrics_rows
from sft_support import sft_env

PACKAGES = Path(__file__).resolve().parents[1] / "packages"

pytestmark = pytest.mark.timeout(300)

PYPROJECT = """
[project]
name = "acme-rollout"
version = "1.3.0"
dependencies = ["drivetrain-rollout>=0.1,<0.2"]

[project.entry-points."drivetrain.rollouts"]
acme = "acme_rollout.plugin:ACME"
acme_inline = "acme_rollout.plugin:INLINE"
acme_broken = "acme_rollout.plugin:BROKEN"

[build-system]
requires = ["hatchling"]
build-backend = "hatchling.build"

[tool.hatch.build.targets.wheel]
packages = ["acme_rollout"]
"""

SPEC = """
{variable} = PluginSpec(
    name="{name}",
    factory="acme_rollout.{module}:AcmeRollout",
    config="acme_rollout.config:AcmeConfig",
    api=">=0.1,<0.2",
    capabilities=frozenset({capabilities!r}),
    install_hint="pip install acme-rollout",
)
"""
#: the rollouts acme-rollout declares: (variable, name, rollout module, capabilities)
SPECS = (
    ("ACME", "acme", "rollout", {"separate_process", "device:cpu"}),
    ("INLINE", "acme_inline", "rollout", {"device:cpu"}),  # no separate_process
    ("BROKEN", "acme_broken", "broken", {"separate_process", "device:cpu"}),  # fails to import
)
PLUGIN = "from drivetrain.api import PluginSpec\n" + "".join(
    SPEC.format(variable=v, name=n, module=m, capabilities=sorted(c)) for v, n, m, c in SPECS
)

CONFIG = """
from dataclasses import dataclass

from drivetrain.rollout.config import HFRolloutConfig


@dataclass(frozen=True)
class AcmeConfig(HFRolloutConfig):
    where_file: str = ""  # the rollout writes which process it runs in there
"""

ROLLOUT = """
import json
import os
import sys
from pathlib import Path

from drivetrain.rollout.hf.rollout import HFRollout


class AcmeRollout(HFRollout):
    def __init__(self, config):
        super().__init__(config)
        where = {"pid": os.getpid(), "python": sys.executable, "config": type(config).__name__}
        Path(config.where_file).write_text(json.dumps(where))
"""


def acme_project(root: Path) -> Path:
    project = root / "acme-rollout"
    (project / "acme_rollout").mkdir(parents=True)
    (project / "pyproject.toml").write_text(PYPROJECT)
    (project / "acme_rollout" / "__init__.py").write_text("")
    files = [("plugin", PLUGIN), ("config", CONFIG), ("rollout", ROLLOUT)]
    files.append(("broken", "import acme_missing_dependency\n"))
    for name, text in files:
        (project / "acme_rollout" / f"{name}.py").write_text(textwrap.dedent(text))
    return project


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    return acme_project(tmp_path_factory.mktemp("projects"))


@pytest.fixture(scope="module")
def acme_python(project, tmp_path_factory) -> str:
    """The environment a user makes for it: the hf recipe and the package, nothing else."""
    path = tmp_path_factory.mktemp("acme-env") / "venv"
    command = [sys.executable, "-m", "drivetrain.rollout.env", "--package", str(project), "hf",
               str(path), "--python", sys.executable]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "rollouts acme, acme_broken, acme_inline, hf, sglang, vllm" in done.stdout, done.stdout
    return str(path / "bin" / "python")


@pytest.fixture(scope="module")
def job(tmp_path_factory) -> list[str]:
    return make_rl_job(tmp_path_factory.mktemp("job"), rows=16)


def grpo(tmp_path: Path, job: list[str], *args: str, timeout: float = 240):
    out = tmp_path / "run"
    return run_cli("grpo", *job, f"run.output_dir={out}", "run.steps=3", *args,
                   env=sft_env(tmp_path), timeout=timeout)  # fmt: skip


def error_line(done: subprocess.CompletedProcess[str]) -> str:
    assert done.returncode == 2, (done.returncode, done.stderr[-3000:])
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    line = done.stderr.strip().splitlines()[-1]
    print(line)
    assert line.startswith("error: "), line
    return line


def test_grpo_trains_with_a_rollout_installed_only_in_its_own_environment(
    tmp_path, job, acme_python
):
    assert importlib.util.find_spec("acme_rollout") is None  # never here: it cannot run here
    where = tmp_path / "where.json"
    done = grpo(tmp_path, job, "--rollout", "acme", f"rollout.python={acme_python}",
                f"rollout.where_file={where}", "rollout.max_batch_size=8")  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    assert json.loads(done.stdout.strip().splitlines()[-1])["steps"] == 3
    assert f"rollout acme in {acme_python}" in done.stderr
    # built in the server process of that environment, from its own config class
    ran = json.loads(where.read_text())
    assert ran["python"] == acme_python and ran["config"] == "AcmeConfig", ran
    assert not Path(f"/proc/{ran['pid']}").exists()  # the server exited with the run
    steps = [r for r in metrics_rows(tmp_path / "run") if "reward/mean" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]


def test_a_rollout_missing_in_that_environment_is_refused_in_one_line(tmp_path, job):
    # this environment (the trainer's) has drivetrain-rollout but not acme
    done = grpo(tmp_path, job, "--rollout", "acme", f"rollout.python={sys.executable}")
    line = error_line(done)
    assert (
        f"rollout 'acme' is not installed in the environment of rollout.python={sys.executable}"
        in line
    ), line
    assert f"uv pip install --python {sys.executable}" in line, line


def test_a_rollout_without_separate_process_is_refused_in_one_line(tmp_path, job, acme_python):
    done = grpo(tmp_path, job, "--rollout", "acme_inline", f"rollout.python={acme_python}")
    line = error_line(done)
    assert f"rollout.python={acme_python} needs the 'separate_process' capability" in line, line
    assert "rollout 'acme_inline' does not declare" in line, line


def test_the_servers_own_import_error_is_the_one_line(tmp_path, job, acme_python):
    """It fails to import there, once its server started: that line, not a connect timeout."""
    done = grpo(tmp_path, job, "--rollout", "acme_broken", f"rollout.python={acme_python}")
    line = error_line(done)
    assert "rollout 'acme_broken' (acme-rollout 1.3.0) is installed but failed to import" in line
    assert "No module named 'acme_missing_dependency'" in line, line


@pytest.mark.serial  # a 10 s bound
def test_an_environment_without_the_transport_fails_in_one_line_at_once(
    tmp_path, job, project, venv_factory
):
    venv = venv_factory("no-transport")  # no drivetrain-ckpt-engine
    venv.install(PACKAGES / "engine-api", PACKAGES / "runtime", PACKAGES / "rollout", project)
    began = time.monotonic()
    done = grpo(tmp_path, job, "--rollout", "acme", f"rollout.python={venv.python}")
    elapsed = time.monotonic() - began
    line = error_line(done)
    assert "cannot receive the weights over colocated" in line, line
    assert "pip install drivetrain-ckpt-engine" in line, line
    assert elapsed < 10, f"{elapsed:.1f} s: {line}"
