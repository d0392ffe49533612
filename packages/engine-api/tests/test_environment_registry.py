"""RL environments are plugins like engines: the ``drivetrain.environments`` registry over
real distributions (dist-info folders on sys.path), as in test_registry.py."""

import sys
import textwrap

import pytest

from drivetrain.api import PluginError
from drivetrain.api import registry as reg
from drivetrain.api.environment import AssistantTurn, Environment, StepResult, ToolCall
from drivetrain.api.registry import Status
from drivetrain.testing.environments import EchoEnvironment, echo_task

SPEC = """
from drivetrain.api import PluginSpec
SPEC = PluginSpec(
    name="{name}", factory="{module}.environment:Env", api="{api}",
    install_hint="pip install {dist}",
)
"""
ENVIRONMENT = """
from drivetrain.api.environment import Environment, Episode, StepResult


class Play(Episode):
    def reset(self):
        return [{"role": "user", "content": "hi"}]

    def step(self, turn):
        return StepResult(reward=1.0, done=True)


class Env(Environment):
    def episode(self, task):
        return Play()
"""


@pytest.fixture
def install(tmp_path, monkeypatch):
    """Install a minimal distribution declaring an environment, and refresh the registries."""
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv(reg.ENV_VAR, raising=False)
    installed = []

    def _install(dist, name, *, api=">=0.1,<0.2", environment=ENVIRONMENT):
        module = dist.replace("-", "_")
        package = tmp_path / module
        package.mkdir()
        (package / "__init__.py").write_text("")
        (package / "plugin.py").write_text(
            textwrap.dedent(SPEC.format(name=name, module=module, api=api, dist=dist))
        )
        (package / "environment.py").write_text(textwrap.dedent(environment))
        info = tmp_path / f"{module}-1.2.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 1.2\n")
        (info / "entry_points.txt").write_text(
            f"[drivetrain.environments]\n{name} = {module}.plugin:SPEC\n"
        )
        installed.append(module)
        reg.refresh_all()

    yield _install
    for module in installed:
        for key in [k for k in sys.modules if k == module or k.startswith(module + ".")]:
            del sys.modules[key]
    reg.refresh_all()


def test_environments_are_a_registry_group():
    assert reg.REGISTRIES["environments"] is reg.environments
    assert reg.environments.group == "drivetrain.environments"
    assert "environments" in reg.GROUP_LABELS
    assert reg.environments.base is Environment


def test_load_returns_the_class_once(install):
    install("acme-env", "acme")
    env_class = reg.environments.load("acme")
    assert env_class is reg.environments.load("acme")
    assert issubclass(env_class, Environment) and env_class.__module__ == "acme_env.environment"
    assert env_class({"turns": 2}).episode({}).reset()[0]["content"] == "hi"
    record = {r.name: r for r in reg.environments.inspect()}["acme"]
    assert (record.status, record.distribution, record.version) == (Status.OK, "acme-env", "1.2")
    assert "acme" not in reg.engines.names()  # a group of its own


def test_discovery_and_listing_import_no_environment_code(install):
    install("lazy-env", "lazy")
    assert "lazy" in reg.environments.names()
    assert "lazy_env" not in sys.modules
    listed = {r.name: r for r in reg.environments.inspect(load=False)}  # `drivetrain environments`
    assert listed["lazy"].status is Status.DISCOVERED and listed["lazy"].spec is not None
    assert "lazy_env.plugin" in sys.modules and "lazy_env.environment" not in sys.modules


@pytest.mark.parametrize(
    ("rules", "allowed"),
    [
        ("", True),
        ("acme", True),
        ("environments:acme", True),
        ("engines:fake", True),  # an allow-list of engines leaves environments alone
        ("environments:other", False),
        ("-acme", False),
        ("-environments:acme", False),
        ("-engines:acme", True),
        ("none", False),
        ("acme,-environments:acme", False),
    ],
)
def test_env_var_rules_apply_to_environments(install, monkeypatch, rules, allowed):
    install("acme-env", "acme")
    monkeypatch.setenv(reg.ENV_VAR, rules)
    reg.refresh_all()
    if allowed:
        reg.environments.load("acme")
    else:
        with pytest.raises(PluginError, match=r"environment 'acme' \(acme-env 1.2\).*disabled"):
            reg.environments.load("acme")
        assert "acme_env.environment" not in sys.modules


def test_env_var_names_the_environments_group(install, monkeypatch):
    install("acme-env", "acme")
    monkeypatch.setenv(reg.ENV_VAR, "environment:acme")
    reg.refresh_all()
    with pytest.raises(PluginError, match=r"unknown group 'environment'.*, environments$"):
        reg.environments.load("acme")


def test_a_factory_that_is_no_environment_is_invalid(install):
    install("wrong-env", "wrong", environment="class Env:\n    pass\n")
    with pytest.raises(PluginError) as err:
        reg.environments.load("wrong")
    assert str(err.value).startswith(
        "environment 'wrong' (wrong-env 1.2) cannot be used: invalid: wrong_env.environment:Env "
        "is not a subclass of drivetrain.api.environment.Environment"
    )
    assert {r.name: r.status for r in reg.environments.inspect()}["wrong"] is Status.INVALID


def test_an_engine_registered_as_an_environment_is_invalid(install):
    install("confused-env", "confused", environment="from drivetrain.testing import "
            "FakeEngine as Env\n")  # fmt: skip
    with pytest.raises(PluginError, match="not a subclass of drivetrain.api.environment"):
        reg.environments.load("confused")


def test_another_engine_api_is_incompatible_before_import(install):
    install("future-env", "future", api=">=0.2,<0.3")
    with pytest.raises(PluginError) as err:
        reg.environments.load("future")
    assert str(err.value).startswith(
        "environment 'future' (future-env 1.2) cannot be used: incompatible: implements "
        "engine-api >=0.2,<0.3, but drivetrain-engine-api 0.1.0 is installed"
    )
    assert {r.name: r.status for r in reg.environments.inspect()}["future"] is Status.INCOMPATIBLE
    assert "future_env.environment" not in sys.modules


def test_failed_import_names_the_reason_and_the_install_hint(install):
    install("broken-env", "broken", environment="import acme_sandbox_never_installed\n")
    with pytest.raises(PluginError) as err:
        reg.environments.load("broken")
    text = str(err.value)
    assert text.startswith(
        "environment 'broken' (broken-env 1.2) is installed but failed to import: "
        "ModuleNotFoundError: No module named 'acme_sandbox_never_installed' "
        "(pip install broken-env); other installed environments: "
    )
    assert "\n" not in text


def test_unknown_environment_reads_well(install):
    install("acme-env", "acme")
    with pytest.raises(PluginError) as err:
        reg.environments.load("acmee")
    text = str(err.value)
    assert text.startswith(
        "unknown environment 'acmee': did you mean 'acme'? installed environments: "
    )
    assert "(`drivetrain environments` shows their status)" in text
    assert text.endswith(
        "a third-party environment is found once the distribution that declares it in "
        "entry-point group drivetrain.environments is installed"
    )
    assert "\n" not in text and "acme_env.environment" not in sys.modules


def test_the_builtin_environment_missing_names_its_install_command(monkeypatch):
    monkeypatch.setattr(reg.metadata, "entry_points", lambda group: [])  # nothing installed
    reg.refresh_all()
    try:
        with pytest.raises(PluginError) as err:
            reg.environments.spec("calculator")
        assert str(err.value) == (
            "unknown environment 'calculator': install it with pip install drivetrain-trainer; "
            "no environments are installed (entry-point group drivetrain.environments)"
        )
    finally:
        monkeypatch.undo()
        reg.refresh_all()


# ---- the echo test double -----------------------------------------------------------------
def test_echo_is_a_test_double_hidden_from_users(monkeypatch):
    reg.refresh_all()  # pytest runs with DRIVETRAIN_TEST_PLUGINS=1 (the api's pytest plugin)
    assert reg.environments.load("echo") is EchoEnvironment
    monkeypatch.delenv(reg.TEST_PLUGINS_VAR)
    reg.refresh_all()
    try:
        assert "echo" not in reg.environments.names()
        with pytest.raises(PluginError, match=r"^unknown environment 'echo': a test double, "):
            reg.environments.load("echo")
    finally:
        monkeypatch.undo()
        reg.refresh_all()


def turn(content, *calls, errors=(), index=0):
    return AssistantTurn(index, content, content, tuple(ToolCall(*c) for c in calls), errors)


def test_echo_tasks_are_reproducible_and_differ_by_split():
    env = EchoEnvironment()
    train = env.tasks("train", 8, seed=3)
    assert train == env.tasks("train", 8, seed=3) != env.tasks("val", 8, seed=3)
    assert all(t["prompt"] == f"say {t['answer']}" for t in train)
    assert [t["function"]["name"] for t in env.tools()] == ["echo"]


def test_echo_answer_without_a_tool_call_ends_the_episode():
    env = EchoEnvironment()
    episode = env.episode(echo_task(7))
    assert episode.reset() == [{"role": "user", "content": "say 7"}]
    assert episode.step(turn(" 7 ")) == StepResult(reward=1.0, done=True)
    assert env.episode(echo_task(7)).step(turn("8")) == StepResult(reward=0.0, done=True)


def test_echo_tool_calls_observe_until_the_last_tool_turn():
    episode = EchoEnvironment({"turns": 2}).episode(echo_task(7))
    first = episode.step(turn("", ("echo", {"text": "7"}, "call_0")))
    assert not first.done and first.reward == 0.0
    assert first.observations == (
        {"role": "tool", "name": "echo", "tool_call_id": "call_0", "content": "7"},
    )
    assert first.info["tools/succeeded"] == 1.0
    last = episode.step(turn("7", ("echo", {"txt": 7}), errors=("tool call 1: bad JSON",)))
    assert last.done and last.reward == 1.0  # the turn that ends it is scored
    assert [o["content"].startswith("error: ") for o in last.observations] == [True, True]
    assert last.info["tools/failed"] == 2.0


@pytest.mark.parametrize("options", [{"turns": 0}, {"turns": "3"}, {"rounds": 3}])
def test_echo_rejects_bad_options(options):
    with pytest.raises(ValueError, match="echo environment: "):
        EchoEnvironment(options)
