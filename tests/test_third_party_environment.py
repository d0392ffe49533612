"""A third party publishes an RL environment as an ordinary distribution; drivetrain finds it.

examples/third_party_environment (``acme-env``, environment ``acme_lookup``) is built and
installed with the real engine-api and trainer, engine-fsdp and the hf rollout (what a run
needs) into an isolated environment. ``drivetrain environments`` must list it beside the
built-in ``calculator`` without importing it, the registry must load it, and
``drivetrain grpo env=acme_lookup`` must train on its own tasks with its ``lookup`` tool.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ROOT / "packages"
EXAMPLE = ROOT / "examples" / "third_party_environment"


@pytest.fixture(scope="module")
def env(venv_factory):
    venv = venv_factory("third-party-environment")
    venv.install(
        PACKAGES / "engine-api",
        PACKAGES / "runtime",
        PACKAGES / "testing",  # the environment kit the test runs there
        PACKAGES / "trainer",
        PACKAGES / "engine-core",
        PACKAGES / "engine-fsdp",
        PACKAGES / "rollout",
        EXAMPLE,
    )
    return venv


def row(table: str, name: str) -> str:
    lines = [line for line in table.splitlines() if line.startswith(f"│ {name} ")]
    assert lines, f"no row for {name!r} in:\n{table}"
    return lines[0]


#: ``drivetrain environments`` in one interpreter, then whether it imported the environment
LISTING = """
import sys
from drivetrain.trainer.cli import app
try:
    app(["environments"])
except SystemExit as exit:
    assert not exit.code, exit.code
print("IMPORTED" if "acme_env.environment" in sys.modules else "NOT IMPORTED")
"""


def test_listing_shows_it_beside_the_builtin_from_metadata_only(env):
    out = env.run("-c", LISTING).stdout
    acme = row(out, "acme_lookup")
    assert "acme-env 1.0.0" in acme and ">=0.1,<0.2" in acme
    assert acme.rstrip(" │").endswith("installed")
    assert "drivetrain-trainer 0.1.0" in row(out, "calculator")
    assert out.strip().endswith("NOT IMPORTED")
    assert "drivetrain environments (drivetrain.environments)" in out


def test_check_imports_it(env):
    table = env.script("drivetrain", "environments", "--check").stdout
    assert row(table, "acme_lookup").rstrip(" │").endswith("ok")
    row(table, "calculator")


def test_env_var_disables_it(env, monkeypatch):
    monkeypatch.setenv("DRIVETRAIN_PLUGINS", "-environments:acme_lookup")
    table = env.script("drivetrain", "environments").stdout
    assert "disabled: denied by DRIVETRAIN_PLUGINS=-environments:acme_lookup" in row(
        table, "acme_lookup"
    )
    assert row(table, "calculator").rstrip(" │").endswith("installed")


#: load it by name and play one episode with scripted turns
PLAY = """
from drivetrain.api import registry
from drivetrain.api.environment import AssistantTurn, Environment, ToolCall
env_class = registry.environments.load("acme_lookup")
assert issubclass(env_class, Environment), env_class
env = env_class({"max_lookups": 3})
task = env.tasks("train", 4, seed=0)[0]
assert task == env_class().tasks("train", 4, seed=0)[0] != env.tasks("val", 4, seed=0)[0]
episode = env.episode(task)
print("PROMPT", episode.reset()[-1]["content"])
first, second = task["prompt"].split("How many ")[1].split(" are")[0].split(" and ")
calls = (ToolCall("lookup", {"item": first[:-1]}, "call_0"),
         ToolCall("lookup", {"item": second[:-1]}, "call_1"))
looked = episode.step(AssistantTurn(0, "", "", calls))
print("OBSERVED", [o["content"] for o in looked.observations], looked.done)
total = sum(int(o["content"]) for o in looked.observations)
answer = episode.step(AssistantTurn(1, f"{total}", f"{total}"))
print("ANSWERED", answer.done, answer.reward, total == int(task["answer"]))
print("TOOLS", [t["function"]["name"] for t in env.tools()], env_class.__module__)
"""


#: the environment kit over it, its solution as in PLAY
KIT = """
import json
from drivetrain.api.environment import AssistantTurn, ToolCall
from drivetrain.testing.environment_kit import EnvironmentHarness, run_environment_conformance
from acme_env.environment import LookupEnvironment

class Harness(EnvironmentHarness):
    def make_environment(self, options=None):
        return LookupEnvironment(options)

    def solution(self, task):
        first, second = task["prompt"].split("How many ")[1].split(" are")[0].split(" and ")
        calls = (ToolCall("lookup", {"item": first[:-1]}, "c0"),
                 ToolCall("lookup", {"item": second[:-1]}, "c1"))
        answer = task["answer"]
        return [AssistantTurn(0, "", "", calls), AssistantTurn(1, answer, answer)]

    def bad_options(self):
        return [{"max_lookups": 0}]

print(json.dumps({r.name: r.error for r in run_environment_conformance(Harness())}))
"""


def test_it_passes_the_environment_kit(env):
    results = json.loads(env.run("-c", KIT).stdout.splitlines()[-1])
    assert len(results) == 7 and not any(results.values()), results


def test_registry_loads_it_and_an_episode_uses_the_lookup_tool(env):
    out = env.run("-c", PLAY).stdout.splitlines()
    assert out[0].startswith("PROMPT How many ") and out[0].endswith(" in stock together?")
    observed = out[1]
    assert observed.startswith("OBSERVED ['") and observed.endswith("] False")
    assert out[2:] == ["ANSWERED True 1.0 True", "TOOLS ['lookup'] acme_env.environment"]


def test_grpo_trains_on_its_tasks(env, tmp_path, monkeypatch):
    """A tiny chat model, no dataset: the environment's own tasks, one step of 2 prompts x 2
    samples, in this process (the engine streams weights straight into the hf rollout)."""
    from drivetrain.trainer.builtin.tiny_model import build_tiny_chat_model

    model = build_tiny_chat_model(tmp_path / "model")
    out = tmp_path / "run"
    for key, value in (("OMP_NUM_THREADS", "1"), ("RAY_AUTH_MODE", "disabled")):
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("DRIVETRAIN_CACHE", str(tmp_path / "cache"))
    done = env.script(
        "drivetrain", "grpo", "env=acme_lookup", f"actor.model.path={model}",
        f"run.output_dir={out}", "run.steps=1", "run.prompts_per_step=2", "sampling.n=2",
        "sampling.max_new_tokens=8", "logging.progress=false", "logging.tensorboard=false",
        "run.export_hf=false", check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1])["steps"] == 1
    assert "env: acme_lookup" in (out / "config.yaml").read_text()
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    step = next(r for r in rows if "reward/mean" in r)
    assert step["step"] == 1
    assert any(key.startswith("episode/") for key in step), sorted(step)
