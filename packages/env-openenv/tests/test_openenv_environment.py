"""OpenEnv servers as episodes, played against a real OpenEnv server (``openenv_servers.py``:
OpenEnv's ``create_app`` under uvicorn, in its own process, behind a bearer token): multi-turn
sessions, the server's rewards, reset keywords, invalid actions as observations, sessions freed,
and one-line errors for bad options and failing servers."""

from __future__ import annotations

import importlib.util
import random
import socket
import threading
import time
from pathlib import Path

import pytest

from drivetrain.api.environment import AssistantTurn
from drivetrain.api.registry import environments
from drivetrain.envs.openenv.environment import OpenEnvEnvironment
from drivetrain.envs.openenv.protocol import OpenEnvError, Session

# one server for the module (OpenEnv takes seconds to import): keep its tests on one worker
pytestmark = [pytest.mark.xdist_group("openenv"), pytest.mark.timeout(120)]

SERVERS = Path(__file__).with_name("openenv_servers.py")
_spec = importlib.util.spec_from_file_location("openenv_servers", SERVERS)
openenv_servers = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(openenv_servers)

TOKEN = "s3cret-for-the-test"
SESSIONS = 3


@pytest.fixture(scope="module")
def url():
    with openenv_servers.serve(max_sessions=SESSIONS, token=TOKEN) as base:
        yield base


@pytest.fixture
def env(url, monkeypatch):
    monkeypatch.setenv("GUESS_TOKEN", TOKEN)
    return OpenEnvEnvironment({"url": url, "token_env": "GUESS_TOKEN"})


def turn(text: str, index: int = 0) -> AssistantTurn:
    return AssistantTurn(index, text, text)


def secret(seed: int, high: int = openenv_servers.HIGH) -> int:
    return random.Random(seed).randint(1, high)  # what the server draws


def test_the_plugin_is_found_by_name_and_reads_the_servers_schema(env):
    assert environments.load("openenv") is OpenEnvEnvironment
    assert env.action_field == "guess" and env.observation_field == "prompt"


def test_an_episode_is_a_multi_turn_session_rewarded_by_the_server(env):
    seed = 7
    episode = env.episode({"seed": seed})
    assert episode.reset() == [
        {"role": "user", "content": "I picked a number from 1 to 10. Your guess?"}
    ]
    wrong = secret(seed) % 10 + 1
    first = episode.step(turn(str(wrong)))
    assert not first.done and first.reward == 0.0
    assert first.observations[0]["content"] == ("Higher." if wrong < secret(seed) else "Lower.")
    last = episode.step(turn(f" {secret(seed)}\n", 1))
    assert last.done and last.reward == 1.0 and episode.session is None  # closed when done


def test_an_action_the_schema_refuses_is_an_observation_and_the_episode_goes_on(env):
    episode = env.episode({"seed": 3})
    episode.reset()
    refused = episode.step(turn("seven"))
    assert not refused.done and refused.info == {"openenv/invalid_actions": 1.0}
    assert refused.observations[0]["content"].startswith("Invalid action: guess: ")
    assert episode.step(turn(str(secret(3)), 1)).reward == 1.0  # the same session


def test_reset_keywords_come_from_the_options_and_the_task(url, monkeypatch):
    monkeypatch.setenv("GUESS_TOKEN", TOKEN)
    env = OpenEnvEnvironment(
        {"url": url, "token_env": "GUESS_TOKEN", "reset": {"high": 1}, "system_prompt": "Play."}
    )
    episode = env.episode({"seed": 1})
    messages = episode.reset()
    assert messages[0] == {"role": "system", "content": "Play."}
    assert "from 1 to 1" in messages[1]["content"]
    assert episode.step(turn("1")).reward == 1.0
    wider = env.episode({"seed": 1, "high": 3})  # a task row's own field wins
    assert "from 1 to 3" in wider.reset()[-1]["content"]
    wider.truncated("max_turns")


def test_json_actions(url, monkeypatch):
    monkeypatch.setenv("GUESS_TOKEN", TOKEN)
    env = OpenEnvEnvironment({"url": url, "token_env": "GUESS_TOKEN", "action_format": "json"})
    episode = env.episode({"seed": 5})
    episode.reset()
    assert "JSON object" in episode.step(turn("5?")).observations[0]["content"]
    assert episode.step(turn(f'{{"guess": {secret(5)}}}', 1)).reward == 1.0


def test_tasks_are_reproducible_and_the_splits_differ(env):
    train = env.tasks("train", 8, seed=1)
    assert train == env.tasks("train", 8, seed=1) and len({t["seed"] for t in train}) == 8
    assert not {t["seed"] for t in train} & {t["seed"] for t in env.tasks("val", 8, seed=1)}
    assert train != env.tasks("train", 8, seed=2)


def test_sessions_are_freed_when_episodes_end_and_capacity_is_a_one_line_error(env):
    for round_ in range(2):  # twice the server's capacity: ended episodes freed theirs
        episodes = [env.episode({"seed": round_ * SESSIONS + i}) for i in range(SESSIONS)]
        for episode in episodes:
            episode.reset()
        if round_ == 1:
            with pytest.raises(OpenEnvError, match=r"at most 3 .*max_concurrent_envs") as refused:
                env.episode({"seed": 99}).reset()
            assert "\n" not in str(refused.value)
        for i, episode in enumerate(episodes):
            if i % 2:
                episode.truncated("max_turns")
            else:
                assert episode.step(turn(str(secret(round_ * SESSIONS + i)))).done


def test_a_failing_server_fails_the_episode_in_one_line(env):
    episode = env.episode({"seed": 0})
    episode.reset()
    with pytest.raises(OpenEnvError, match=r"failed \(EXECUTION_ERROR\): the referee fell over"):
        episode.step(turn(str(openenv_servers.CRASH)))
    assert episode.session is None  # the session was given up


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.mark.parametrize(
    ("options", "error"),
    [
        ({}, "set episode.options.url"),
        ({"url": "ws://x"}, "url must be http"),
        ({"url": "URL", "seed": 1}, "no option seed; it takes url"),
        ({"url": "URL", "action_format": "yaml"}, "action_format is text or json"),
        ({"url": "URL", "timeout_s": 0}, "timeout_s must be > 0"),
        ({"url": "URL", "token_env": "NO_SUCH_VARIABLE_HERE"}, "which is not set"),
        ({"url": "URL", "token_env": "GUESS_TOKEN", "action_field": "move"}, "no field 'move'"),
        ({"url": "URL", "token_env": "GUESS_TOKEN", "observation_field": "x"}, "no field 'x'"),
        ({"url": "URL"}, "answered HTTP 401"),  # no token: the proxy refuses
        ({"url": "DEAD"}, "no OpenEnv server at"),
    ],
)
def test_bad_options_and_unreachable_servers_are_one_line_errors(url, monkeypatch, options, error):
    monkeypatch.setenv("GUESS_TOKEN", TOKEN)
    dead = f"http://127.0.0.1:{free_port()}"
    options = {k: {"URL": url, "DEAD": dead}.get(v, v) for k, v in options.items()}
    with pytest.raises((ValueError, OpenEnvError), match=error) as failed:
        OpenEnvEnvironment(options)
    assert "\n" not in str(failed.value)


@pytest.mark.parametrize(
    ("behaviour", "error"),
    [
        ("silent", r"sent no answer to reset within 0.5 s \(episode.options.timeout_s\)"),
        ("hang_up", "closed the session"),
        ("garbage", "answered 'hello': not OpenEnv"),
    ],
)
def test_a_server_that_goes_silent_hangs_up_or_talks_nonsense_fails_in_one_line(behaviour, error):
    """Faults a real server will not make on demand, planted in a bare WebSocket server."""
    from websockets.sync.server import serve

    def handler(connection):
        connection.recv()
        if behaviour == "garbage":
            connection.send("hello")
        elif behaviour == "silent":
            connection.recv()  # until the client gives up and closes

    with serve(handler, "127.0.0.1", 0) as server:
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        session = Session(f"http://127.0.0.1:{server.socket.getsockname()[1]}", {}, 0.5)
        started = time.monotonic()
        with pytest.raises(OpenEnvError, match=error) as failed:
            session.reset({})
        assert time.monotonic() - started < 5 and "\n" not in str(failed.value)
        session.close()  # already given up: closing again is harmless
        server.shutdown()
