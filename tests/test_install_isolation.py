"""Installing only ``drivetrain-engine-fsdp`` pulls nothing of Megatron, and the trainer no
environment plugin: each one's dependency closure in ``uv.lock`` (offline: the lock file is the
resolution every install uses)."""

import tomllib
from pathlib import Path

LOCK = Path(__file__).resolve().parents[1] / "uv.lock"
MEGATRON = {"megatron-core", "megatron-fsdp", "drivetrain-engine-megatron"}


def closure(root: str) -> set[str]:
    """Every package a plain install of ``root`` resolves to (extras a dependency asks for
    included, the root's own optional extras not)."""
    packages = {p["name"]: p for p in tomllib.loads(LOCK.read_text())["package"]}
    seen, todo = set(), [(root, ())]
    while todo:
        name, extras = todo.pop()
        key = (name, extras)
        if key in seen:
            continue
        seen.add(key)
        package = packages[name]
        deps = list(package.get("dependencies", []))
        for extra in extras:
            deps += package.get("optional-dependencies", {}).get(extra, [])
        todo += [(d["name"], tuple(d.get("extra", ()))) for d in deps]
    return {name for name, _ in seen}


def test_engine_fsdp_installs_no_megatron():
    names = closure("drivetrain-engine-fsdp")
    assert "torch" in names and "transformers" in names  # the walk follows the graph
    assert not names & MEGATRON, sorted(names & MEGATRON)


def test_engine_megatron_fsdp_installs_megatron():  # the check can fail
    assert {"megatron-core", "megatron-fsdp"} <= closure("drivetrain-engine-megatron-fsdp")


OPENENV_SERVER = {"openenv-core", "openenv", "gradio", "fastmcp"}  # OpenEnv's server framework


def test_the_trainer_installs_no_environment_plugin():
    """reasoning-gym (and what it pins: sympy, pyfiglet, cellpylib...) come with its plugin's
    distribution only, as does the OpenEnv adapter."""
    plugin = closure("drivetrain-env-reasoning-gym")
    assert {"reasoning-gym", "pyfiglet", "cellpylib"} <= plugin  # the walk finds them there
    trainer = closure("drivetrain-trainer")
    for extra in ("fsdp", "gguf"):  # the trainer's extras pull none either
        trainer |= closure_with_extra("drivetrain-trainer", extra)
    plugins = {"drivetrain-env-reasoning-gym", "drivetrain-env-openenv", "drivetrain-env-verifiers"}
    assert not trainer & (plugins | {"reasoning-gym", "pyfiglet", "cellpylib"} | OPENENV_SERVER)


def test_the_openenv_adapter_installs_a_websocket_client_not_openenvs_server():
    """The adapter speaks OpenEnv's protocol itself: OpenEnv's package (FastAPI, Gradio, MCP)
    is the tests' server, never the adapter's dependency."""
    adapter = closure("drivetrain-env-openenv")
    assert "websockets" in adapter and "drivetrain-engine-api" in adapter
    assert not adapter & OPENENV_SERVER, sorted(adapter & OPENENV_SERVER)
    assert len(adapter) <= 3, sorted(adapter)  # itself, the api, websockets


def test_the_verifiers_adapter_installs_nothing_but_the_api():
    """verifiers and its dependencies live in the hub's own venv (episode.options.python):
    the adapter speaks to its sidecar over pipes, so the lock has no verifiers at all."""
    assert closure("drivetrain-env-verifiers") == {
        "drivetrain-env-verifiers",
        "drivetrain-engine-api",
    }
    packages = {p["name"] for p in tomllib.loads(LOCK.read_text())["package"]}
    assert "verifiers" not in packages


def closure_with_extra(root: str, extra: str) -> set[str]:
    packages = {p["name"]: p for p in tomllib.loads(LOCK.read_text())["package"]}
    names = set()
    for dep in packages[root].get("optional-dependencies", {}).get(extra, []):
        names |= closure(dep["name"])
    return names
