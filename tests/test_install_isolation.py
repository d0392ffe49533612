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


def test_the_trainer_installs_no_environment_plugin():
    """reasoning-gym (and what it pins: sympy, pyfiglet, cellpylib...) come with its plugin's
    distribution only."""
    plugin = closure("drivetrain-env-reasoning-gym")
    assert {"reasoning-gym", "pyfiglet", "cellpylib"} <= plugin  # the walk finds them there
    trainer = closure("drivetrain-trainer")
    for extra in ("fsdp", "gguf"):  # the trainer's extras pull none either
        trainer |= closure_with_extra("drivetrain-trainer", extra)
    assert not trainer & {"drivetrain-env-reasoning-gym", "reasoning-gym", "pyfiglet", "cellpylib"}


def closure_with_extra(root: str, extra: str) -> set[str]:
    packages = {p["name"]: p for p in tomllib.loads(LOCK.read_text())["package"]}
    names = set()
    for dep in packages[root].get("optional-dependencies", {}).get(extra, []):
        names |= closure(dep["name"])
    return names
