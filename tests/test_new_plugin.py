"""``drivetrain new-plugin KIND NAME`` makes a package that a third party installs on its own
(drivetrain's public distributions only: engine-api, runtime, testing) and whose kit passes on
the stub as generated; the registry finds it by its entry point.

For the engine, rollout and transport templates the commands of the generated README run as
written, in order, in a fresh venv: the install, the kit (``pytest``: while only the public
distributions are installed), the listing command and a short training run with the plugin.
Two things stand in for what a user has: drivetrain's distributions are not on an index, so a
README line that installs one by name finds it installed from the workspace first
(:func:`stand_in`); and ``pip`` is ``uv pip`` pinned to the workspace lock (the venvs have no
pip). The GRPO runs start from the built-in SFT model, which the job trains first when it is
not cached (minutes): :func:`sft_cache` caches the untrained built-in model in its place.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ROOT / "packages"
#: what a generated package may depend on, and all of drivetrain its kit runs with
PUBLIC = ("drivetrain-engine-api", "drivetrain-runtime", "drivetrain-testing")
#: the workspace's distributions by name, with the drivetrain distributions each depends on
WORKSPACE = {
    project["name"]: (
        path.parent,
        [d for d in project["dependencies"] if d.startswith("drivetrain-")],
    )
    for path in sorted(PACKAGES.glob("*/pyproject.toml"))
    for project in [tomllib.loads(path.read_text())["project"]]
}


def new_plugin(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "drivetrain.trainer", "new-plugin", *args]
    return subprocess.run(command, capture_output=True, text=True, cwd=cwd, timeout=120)


def stand_in(names: list[str]) -> list[Path]:
    """The workspace folders of the named distributions and of the drivetrain ones they need."""
    found: dict[str, Path] = {}
    while names:
        name = re.match(r"[\w-]+", names.pop()).group(0)
        if name not in found:
            path, needs = WORKSPACE[name]
            found[name] = path
            names += needs
    return list(found.values())


def installed_drivetrain(venv) -> list[str]:
    code = (
        "import json; from importlib import metadata; print(json.dumps(sorted(d.metadata['Name'] "
        "for d in metadata.distributions() if d.metadata['Name'].startswith('drivetrain-'))))"
    )
    return json.loads(venv.run("-c", code).stdout)


def readme_commands(package: Path) -> list[str]:
    """Every line of the README's first bash block, as written."""
    block = re.search(r"```bash\n(.*?)```", (package / "README.md").read_text(), re.S)
    assert block, "the README has no bash block"
    return [line for line in block.group(1).splitlines() if line.strip()]


def run_readme_line(venv, package: Path, line: str, cache: Path) -> subprocess.CompletedProcess:
    """``line`` in bash, in the package's folder, with the venv first on PATH."""
    if line.startswith("pip install"):
        named = re.findall(r"(?<![\w/.-])drivetrain-[a-z-]+", line)
        if named:
            venv.install(*stand_in(named))
    constraints = venv.path.parent / "lock-constraints.txt"  # written by venv.install
    pip = f'pip() {{ "{venv.uv}" pip "$@" --python "{venv.python}" -c "{constraints}"; }}'
    skip = ("VIRTUAL_ENV", "PYTHONPATH", "PYTEST_ADDOPTS")
    env = {k: v for k, v in os.environ.items() if k not in skip}
    env.update(
        PATH=f"{venv.path / 'bin'}{os.pathsep}{env['PATH']}",
        VIRTUAL_ENV=str(venv.path),
        DRIVETRAIN_CACHE=str(cache),
        OMP_NUM_THREADS="1",  # one torch thread per process (the 2-core machine)
        COLUMNS="250",  # rich tables: keep rows on one line
    )
    return subprocess.run(
        ["bash", "-c", f"{pip}\n{line}"],
        cwd=package,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.fixture(scope="module")
def sft_cache(tmp_path_factory) -> Path:
    """A DRIVETRAIN_CACHE holding the built-in assets, with the untrained built-in model as
    the cached SFT model (GRPO from it runs; what it learns does not matter here)."""
    from drivetrain.trainer.builtin import addition

    cache = tmp_path_factory.mktemp("drivetrain-cache")
    assets = addition.ensure_assets(cache)
    addition.cache_sft_model(assets, assets.model_dir, {"stand_in": "untrained"})
    return cache


# kind, name, registry group, class, the kit's pytest summary, what the README's last line
# (a training run) prints when it trained with the plugin
KINDS = [
    ("engine", "acme-torch", "engines", "AcmeTorchEngine", "15 passed, 2 skipped",
     ("engine acme_torch: ", '"steps": 3')),
    ("rollout", "acme-sampler", "rollouts", "AcmeSamplerRollout", "14 passed, 2 skipped",
     ("; rollout acme_sampler;", '"steps": 2')),
    ("transport", "acme-sockets", "ckpt_engines", "AcmeSocketsTransport", "5 passed",
     ("weights via acme_sockets", '"steps": 2')),
]  # fmt: skip


@pytest.mark.slow  # 1.5 to 2 minutes each: a venv, the kit, a training run
@pytest.mark.serial  # the kits' deadlines and the training runs' processes want the cores
@pytest.mark.timeout(420)
@pytest.mark.parametrize(
    ("kind", "name", "group", "cls", "kit", "trained"), KINDS, ids=[k[0] for k in KINDS]
)
def test_a_generated_plugin_follows_its_readme(
    kind, name, group, cls, kit, trained, tmp_path, venv_factory, sft_cache
):
    made = new_plugin(kind, name, "--into", str(tmp_path), cwd=tmp_path)
    assert made.returncode == 0, made.stderr
    package, plugin = tmp_path / name, name.replace("-", "_")
    files = {p.relative_to(package).as_posix() for p in package.rglob("*") if p.is_file()}
    assert not any("drivetrain" in f for f in files)  # its own package, no copy of ours
    venv = venv_factory(f"new-{kind}")
    venv.install(*stand_in(list(PUBLIC)))
    commands = readme_commands(package)
    install, pytest_line = commands[:2]
    assert install.startswith("pip install -e ") and pytest_line.startswith("pytest"), commands
    for line in commands:
        if line is pytest_line:  # the kit runs with drivetrain's public distributions only
            assert installed_drivetrain(venv) == sorted(PUBLIC)
        began = time.monotonic()
        done = run_readme_line(venv, package, line, sft_cache)
        print(f"{time.monotonic() - began:5.1f} s  {line}")  # where the time goes (pytest -s)
        assert done.returncode == 0, f"{line}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        if line is pytest_line:
            assert f"{kit} in " in done.stdout, done.stdout[-3000:]
        elif re.fullmatch(r"drivetrain [a-z-]+", line.split("#")[0].strip()):  # the listing
            assert f"│ {plugin} " in done.stdout, done.stdout
    said = done.stdout + done.stderr  # the last line: a training run with the plugin
    assert all(words in said for words in trained), said[-3000:]
    load = f"from drivetrain.api import registry; print(registry.{group}.load('{plugin}').__name__)"
    assert venv.run("-c", load).stdout.strip() == cls


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
    kinds = "no template for 'trainer'; kinds: engine, environment, rollout, transport"
    for args, message in [
        (("trainer", "acme"), kinds),
        (("environment", "Acme_Words"), "plugin name 'Acme_Words': lowercase"),
        (("environment", "taken", "--into", str(tmp_path)), "exists: choose another name"),
    ]:
        done = new_plugin(*args, cwd=tmp_path)
        assert done.returncode == 2 and message in done.stderr, done.stderr
