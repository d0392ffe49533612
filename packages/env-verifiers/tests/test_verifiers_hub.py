"""Episodes of a real verifiers environment, served by the hub's real server: a virtual
environment with verifiers from PyPI (the package's own ``venv`` helper; uv's cache makes it
seconds after the first time), ``hub_envs/drivetrain_echo.py`` written with verifiers' own
classes, the hub's default ``bash`` harness on the local ``subprocess`` runtime: tasks from the
hub's taskset, the tools its agent offers, single- and multi-turn episodes rewarded by the
hub, cut episodes, episodes at once, and one-line errors. One environment for the module (each
verifiers process imports for ~10 s here): its tests stay on one worker, in order."""

from __future__ import annotations

import os
import threading
import time
import urllib.request
from pathlib import Path

import psutil
import pytest

from drivetrain.api.environment import AssistantTurn, ToolCall
from drivetrain.envs.verifiers.environment import VerifiersEnvironment
from drivetrain.envs.verifiers.hub import VerifiersError
from drivetrain.envs.verifiers.venv import make_venv

pytestmark = [pytest.mark.xdist_group("verifiers"), pytest.mark.timeout(120)]

ENVS = Path(__file__).with_name("hub_envs")


def pypi_reachable() -> bool:
    try:
        with urllib.request.urlopen("https://pypi.org/simple/verifiers/", timeout=10):
            return True
    except OSError:
        return False


@pytest.fixture(scope="module")
def python(tmp_path_factory) -> str:
    """A virtual environment with verifiers 0.4 (its own: unconstrained by the workspace)."""
    started = time.monotonic()
    try:
        interpreter = make_venv(tmp_path_factory.mktemp("verifiers") / "venv")
    except Exception as exc:
        if not pypi_reachable():
            pytest.skip(f"verifiers cannot be installed: PyPI is unreachable ({exc})")
        raise
    print(f"verifiers venv: {time.monotonic() - started:.1f} s")
    return str(interpreter)


@pytest.fixture(scope="module")
def env(python):
    started = time.monotonic()
    env = VerifiersEnvironment(
        {
            "id": "drivetrain_echo",
            "python": python,
            "pythonpath": str(ENVS),
            "val": {"split": "val"},
        }
    )
    print(f"environment up: {time.monotonic() - started:.1f} s")
    yield env
    env.close()


def say(text: str, index: int = 0, calls: tuple[ToolCall, ...] = ()) -> AssistantTurn:
    return AssistantTurn(index, text, text, calls)


def test_tasks_come_from_the_hubs_taskset_shuffled_by_the_seed(env):
    tasks = env.tasks("train", 4, seed=0)
    assert len(tasks) == 4 and all(set(t) == {"idx", "prompt", "word"} for t in tasks)
    assert tasks == env.tasks("train", 4, seed=0)
    assert {t["word"] for t in env.tasks("train", 6, seed=1)} == {
        t["word"] for t in env.tasks("train", 6, seed=0)
    }
    assert tasks[0]["prompt"] == f"Say {tasks[0]['word']}."
    assert sorted(t["word"] for t in env.tasks("val", 5, seed=0)) == ["date", "yuzu"]


def test_the_tools_are_those_the_hubs_agent_offers(env):
    assert [tool["function"]["name"] for tool in env.tools()] == ["bash", "edit"]


def test_a_single_turn_episode_is_rewarded_by_the_hub(env):
    right = env.episode({"prompt": "Say fig.", "word": "fig"})
    messages = right.reset()
    assert messages[-1] == {"role": "user", "content": "Say fig."}
    assert messages[0]["role"] == "system" and "bash tool" in messages[0]["content"]
    done = right.step(say("fig!"))
    assert done.done and done.reward == 1.0 and done.info == {"verifiers/reward/said_it": 1.0}
    wrong = env.episode({"prompt": "Say fig.", "word": "fig"})
    wrong.reset()
    assert wrong.step(say("pear")).reward == 0.0


def test_a_tool_call_runs_in_the_hub_and_its_output_is_the_observation(env):
    episode = env.episode(env.tasks("train", 1, seed=3)[0])
    word = episode.task["word"]
    episode.reset()
    call = ToolCall("bash", {"command": f"echo {word[::-1]} | rev"}, "call_1")
    observed = episode.step(say("", 0, (call,)))
    assert not observed.done and observed.observations == (
        {"role": "tool", "content": f"{word}\n", "tool_call_id": "call_1", "name": "bash"},
    )
    last = episode.step(say(f"it says {word}", 1))
    assert last.done and last.reward == 1.0


def test_a_cut_episode_frees_its_run_and_episodes_play_at_once(env):
    cut = env.episode({"prompt": "Say kiwi.", "word": "kiwi"})
    cut.reset()
    assert cut.truncated("max_turns") == 0.0
    rewards: dict[str, float] = {}

    def play(word: str) -> None:
        episode = env.episode({"prompt": f"Say {word}.", "word": word})
        episode.reset()
        rewards[word] = episode.step(say(word)).reward

    started = time.monotonic()
    threads = [threading.Thread(target=play, args=(w,)) for w in ("apple", "pear", "plum", "lime")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert rewards == {"apple": 1.0, "pear": 1.0, "plum": 1.0, "lime": 1.0}
    print(f"4 episodes at once: {time.monotonic() - started:.1f} s")


def test_an_unknown_environment_is_one_line(python):
    with pytest.raises(VerifiersError) as exc:
        VerifiersEnvironment({"id": "no_such_env_here", "python": python})
    message = str(exc.value)
    assert "\n" not in message
    assert message.startswith(f"verifiers: no environment 'no_such_env_here' in {python}: ")
    assert "not found (tried to import 'no_such_env_here')" in message


def test_a_server_that_dies_fails_its_episodes_and_nothing_is_left(env):
    """Last: it kills the module's server (the hub's process, spawned by the sidecar)."""
    sidecar = psutil.Process(env.hub.process.pid)
    (server,) = sidecar.children()  # the hub's server: `sidecar.py serve`
    episode = env.episode({"prompt": "Say fig.", "word": "fig"})
    episode.reset()
    server.kill()
    with pytest.raises(VerifiersError) as exc:
        episode.step(say("fig"))
    assert "the environment server exited (code 4); its log: " in str(exc.value)
    env.close()
    assert env.hub.process.poll() is not None and not os.path.exists(env.hub.folder)
    assert not psutil.pid_exists(server.pid) or server.status() == psutil.STATUS_ZOMBIE
