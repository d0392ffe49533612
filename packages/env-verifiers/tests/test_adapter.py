"""The adapter without verifiers: its chat endpoint (what the hub's agent calls), episodes
played against a stand-in sidecar (``fake_sidecar.py``: the adapter's JSON lines, and the hub's
agent's requests), the real sidecar where verifiers is missing or of another series, and the
one-line errors. The hub's real server is ``test_verifiers_hub.py``'s."""

from __future__ import annotations

import json
import os
import stat
import sys
import threading
import tomllib
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from drivetrain.api.environment import AssistantTurn, ToolCall
from drivetrain.api.errors import DrivetrainError
from drivetrain.api.registry import environments
from drivetrain.envs.verifiers.endpoint import ChatRequest, Endpoint, completion, stream_events
from drivetrain.envs.verifiers.environment import VerifiersEnvironment, _observations
from drivetrain.envs.verifiers.hub import Hub, VerifiersError

pytestmark = pytest.mark.timeout(60)

FAKE = Path(__file__).with_name("fake_sidecar.py")
LOCK = Path(__file__).parents[3] / "uv.lock"


@pytest.fixture
def fake_python(tmp_path):
    """An "interpreter" that runs the stand-in sidecar whatever it is asked to run."""
    path = tmp_path / "python"
    path.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{FAKE}"\n')
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


def fake_env(python: str, env_id: str = "echo", **options) -> VerifiersEnvironment:
    return VerifiersEnvironment({"id": env_id, "python": python, "start_timeout_s": 10, **options})


def turn(text: str, index: int = 0, calls: tuple[ToolCall, ...] = ()) -> AssistantTurn:
    return AssistantTurn(index, text, text, calls)


def post(url: str, body: dict, key: str | None, trace: str = "") -> tuple[int, dict | str]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    if trace:
        headers["X-Session-ID"] = trace  # the hub's client names its agent run so
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            raw = response.read().decode()
            return response.status, raw if "event-stream" in response.headers[
                "Content-Type"
            ] else json.loads(raw)
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_the_adapter_installs_nothing_of_verifiers():
    """verifiers lives in its own virtual environment: the workspace lock has the adapter
    depend on the api alone, and no verifiers at all."""
    packages = {p["name"]: p for p in tomllib.loads(LOCK.read_text())["package"]}
    adapter = packages["drivetrain-env-verifiers"]
    assert [d["name"] for d in adapter["dependencies"]] == ["drivetrain-engine-api"]
    assert "verifiers" not in packages


# --- the endpoint ---------------------------------------------------------------------------


def test_a_turn_is_an_openai_completion_and_its_stream():
    call = ToolCall("bash", {"command": "ls"}, "c1")
    body = completion(AssistantTurn(2, "<tool_call>...", "looking", (call,)), "policy")
    message = body["choices"][0]
    assert message["finish_reason"] == "tool_calls"
    assert message["message"]["content"] == "looking"
    assert message["message"]["tool_calls"] == [
        {
            "id": "c1",
            "type": "function",
            "function": {"name": "bash", "arguments": '{"command": "ls"}'},
        }
    ]
    cut = completion(AssistantTurn(0, "abc", "abc", finished=False), "policy")["choices"][0]
    assert cut["finish_reason"] == "length" and cut["message"]["content"] == "abc"
    events = stream_events(body).decode().split("\n\n")
    chunk = json.loads(events[0].removeprefix("data: "))
    assert chunk["object"] == "chat.completion.chunk" and events[1] == "data: [DONE]"
    assert chunk["choices"][0]["delta"]["tool_calls"][0]["index"] == 0


def test_the_endpoint_wants_its_key_and_a_known_episode():
    endpoint = Endpoint("policy", request_timeout_s=5)
    try:
        conversation = endpoint.open()
        url = endpoint.base_url(conversation) + "/chat/completions"
        assert post(url, {"messages": []}, None)[0] == 401
        assert post(url, {"messages": []}, "wrong")[0] == 401
        assert (
            post(url.replace(conversation.eid, "0" * 32), {"messages": []}, endpoint.key)[0] == 404
        )
        assert post(url, {"no": "messages"}, endpoint.key)[0] == 400
        endpoint.forget(conversation)
        status, body = post(url, {"messages": []}, endpoint.key)
        assert status == 404 and body["error"]["code"] == "episode_ended"
    finally:
        endpoint.close()


def test_a_request_waits_for_the_policys_answer_and_a_second_agent_run_is_refused():
    endpoint = Endpoint("policy", request_timeout_s=5)
    try:
        conversation = endpoint.open()
        url = endpoint.base_url(conversation) + "/chat/completions"
        answers = []
        body = {"messages": [{"role": "user", "content": "hi"}], "stream": True}
        thread = threading.Thread(
            target=lambda: answers.append(post(url, body, endpoint.key, "t1"))
        )
        thread.start()
        kind, request = conversation.inbox.get(timeout=5)
        assert kind == "request" and isinstance(request, ChatRequest) and request.stream
        status, refused = post(url, body, endpoint.key, "t2")  # another agent run's call
        assert status == 409 and refused["error"]["code"] == "one_conversation"
        request.answer(200, completion(turn("hello"), "policy"))
        thread.join(5)
        status, events = answers[0]
        assert status == 200 and '"content": "hello"' in events and events.endswith("[DONE]\n\n")
        assert conversation.inbox.empty()
    finally:
        endpoint.close()


def test_observations_are_what_follows_the_policys_turn():
    known = [{"role": "user", "content": "q"}]
    grown = [*known, {"role": "assistant", "content": "a"}, {"role": "tool", "content": "out"}]
    assert _observations(known, grown) == [{"role": "tool", "content": "out"}]
    assert _observations(known, known) is None  # nothing new: not a continuation
    compacted = [{"role": "user", "content": "summary"}, {"role": "assistant"}, {"role": "user"}]
    assert _observations([*known, *known], compacted) is None


# --- episodes against the stand-in sidecar --------------------------------------------------


def test_the_plugin_is_found_and_options_are_checked(fake_python):
    assert environments.load("verifiers") is VerifiersEnvironment
    with pytest.raises(ValueError, match=r"^verifiers: set episode.options.python \("):
        VerifiersEnvironment({"id": "x"})
    with pytest.raises(ValueError, match=r"no option colour; it takes id, python"):
        VerifiersEnvironment({"id": "x", "python": fake_python, "colour": 1})
    with pytest.raises(ValueError, match=r"no Python interpreter at '/nonexistent/python'"):
        VerifiersEnvironment({"id": "x", "python": "/nonexistent/python"})
    with pytest.raises(ValueError, match=r"timeout_s must be > 0"):
        fake_env(fake_python, timeout_s=0)


def test_an_episode_is_one_run_of_the_hub_multi_turn_with_tools(fake_python):
    env = fake_env(fake_python)
    try:
        tasks = env.tasks("train", 2, seed=0)
        assert tasks == [
            {"prompt": "Say apple.", "word": "apple"},
            {"prompt": "Say pear.", "word": "pear"},
        ]
        assert [t["function"]["name"] for t in env.tools()] == ["bash"]  # a probe episode's
        episode = env.episode(tasks[0])
        assert episode.reset() == [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Say apple."},
        ]
        call = ToolCall("bash", {"command": "echo apple"}, "c7")
        first = episode.step(turn("", 0, (call,)))
        assert not first.done and first.observations == (
            {"role": "tool", "content": "apple\n", "tool_call_id": "c7"},
        )
        last = episode.step(turn("apple it is", 1))
        assert last.done and last.reward == 1.0
        assert last.info == {"verifiers/reward/said_it": 1.0, "verifiers/metric/turns": 1.0}
        wrong = env.episode(tasks[1])
        wrong.reset()
        assert wrong.step(turn("apple")).reward == 0.0
        with pytest.raises(NotImplementedError, match="no validation tasks"):
            env.tasks("val", 2, seed=0)
    finally:
        env.close()


def test_episodes_run_at_once_and_a_cut_one_frees_its_run(fake_python):
    env = fake_env(fake_python)
    try:
        cut = env.episode({"prompt": "Say plum.", "word": "plum", "turns": 5})
        cut.reset()
        assert cut.truncated("max_turns") == 0.0 and cut.conversation.closed
        results = []

        def play(word):
            episode = env.episode({"prompt": f"Say {word}.", "word": word})
            episode.reset()
            results.append(episode.step(turn(word)).reward)

        threads = [threading.Thread(target=play, args=(w,)) for w in ("a", "b", "c", "d")]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(20)
        assert results == [1.0] * 4
    finally:
        env.close()
    assert env.hub.process.poll() is not None and not os.path.exists(env.hub.folder)


# --- one-line errors ------------------------------------------------------------------------


def one_line(exc: pytest.ExceptionInfo) -> str:
    message = str(exc.value)
    assert isinstance(exc.value, DrivetrainError) and "\n" not in message, message
    return message


def test_a_server_that_dies_at_start_names_its_log(fake_python):
    with pytest.raises(VerifiersError) as exc:
        fake_env(fake_python, "die")
    message = one_line(exc)
    assert "exited (code 1) before it was ready; its log: /" in message
    assert message.endswith(": boom: the fake server fell over")


def test_a_silent_server_times_out(fake_python):
    with pytest.raises(VerifiersError) as exc:
        fake_env(fake_python, "silent", start_timeout_s=1)
    assert "was not ready within 1 s (episode.options.start_timeout_s)" in one_line(exc)


def test_an_unknown_environment_says_where_it_looked(fake_python):
    with pytest.raises(VerifiersError) as exc:
        fake_env(fake_python, "unknown")
    assert one_line(exc).startswith(f"verifiers: no environment 'unknown' in {fake_python}: ")


def test_a_server_that_dies_mid_run_fails_the_episode_in_one_line(fake_python):
    env = fake_env(fake_python, "crash")
    try:
        with pytest.raises(VerifiersError) as exc:
            env.episode({"prompt": "p", "word": "w"}).reset()
        assert "the environment server exited (code 5); its log: " in one_line(exc)
    finally:
        env.close()


def fake_verifiers(site: Path, version: str) -> str:
    """A "verifiers" of ``version`` with no API at all (what the sidecar reads first is the
    distribution's metadata)."""
    info = site / f"verifiers-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: verifiers\nVersion: {version}\n")
    (site / "verifiers").mkdir()
    (site / "verifiers" / "__init__.py").write_text("")
    return str(site)


def test_the_real_sidecar_names_the_install_line(tmp_path):
    """The package's own sidecar, under an interpreter without verifiers, with a verifiers of
    another series, and with one of this series that lacks the API it speaks the hub with."""
    with pytest.raises(VerifiersError) as exc:
        Hub(sys.executable, {"id": "x"}, env={}, start_timeout_s=30)
    assert one_line(exc) == (
        f"verifiers: verifiers is not installed in {sys.executable}: "
        f"uv pip install --python {sys.executable} 'verifiers==0.4.*'"
    )
    newer = fake_verifiers(tmp_path / "newer", "0.5.1")
    with pytest.raises(VerifiersError) as exc:
        Hub(sys.executable, {"id": "x"}, env={}, pythonpath=newer, start_timeout_s=30)
    assert one_line(exc).startswith(
        f"verifiers: {sys.executable} has verifiers 0.5.1; this adapter speaks the env-server "
        "protocol of verifiers 0.4.x: uv pip install"
    )
    hollow = fake_verifiers(tmp_path / "hollow", "0.4.9")
    with pytest.raises(VerifiersError) as exc:
        Hub(sys.executable, {"id": "x"}, env={}, pythonpath=hollow, start_timeout_s=30)
    assert one_line(exc) == (
        f"verifiers: the verifiers in {sys.executable} lacks the env-server API this adapter "
        "uses (ModuleNotFoundError: No module named 'verifiers.v1'): "
        f"uv pip install --python {sys.executable} 'verifiers==0.4.*'"
    )
