"""The OpenAI-compatible agent endpoint on a tiny local model and the in-process hf rollout:
the API key, the loopback address, HTTP errors, the example OpenAI-client agent and a scripted
agent run as real subprocesses through AgentRunner, with every recorded trajectory checked
token by token against what the rollout was asked and sampled; history edits, rewards, and a
failing, silent or hanging agent."""

from __future__ import annotations

import http.client
import json
import logging
import socket
import struct
import sys
import textwrap
import threading
import time
from collections import defaultdict
from functools import partial
from pathlib import Path

import pytest
import torch

from drivetrain.api import FinishReason, SamplingParams
from drivetrain.api.config import RolloutConfig
from drivetrain.api.environment import ToolCall
from drivetrain.api.errors import DrivetrainError
from drivetrain.api.registry import rollouts
from drivetrain.api.requests import Chunk
from drivetrain.runtime.rollout_service import RolloutService
from drivetrain.trainer.agentic.agent_runner import AgentError, AgentRunner
from drivetrain.trainer.agentic.chat_tokens import ChatTokens
from drivetrain.trainer.agentic.endpoint import ChatServer
from drivetrain.trainer.agentic.episodes import EpisodeLimits
from drivetrain.trainer.agentic.tool_parsers import ParsedTurn, tool_parser
from drivetrain.trainer.builtin.char_tokenizer import ROLES, build_char_tokenizer
from drivetrain.trainer.builtin.tiny_model import build_llama_model

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[3]
EXAMPLE_AGENT = ROOT / "examples" / "openai_agent" / "agent.py"
# the char tokenizer's template, plus tool names and assistant tool calls (a new segment's
# first prompt renders a history with calls)
TEMPLATE = (
    "{% if tools %}<|system|>tools:{% for t in tools %} {{ t['function']['name'] }}{% endfor %}"
    "<|end|>{% endif %}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}"
    "{% for c in m.get('tool_calls') or [] %}<tool_call>{{ c['function']['name'] }}"
    "</tool_call>{% endfor %}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
TASKS = [
    {"question": "What is 47*83+12?", "answer": "3913"},
    {"question": "What is 12*10-5?", "answer": "115"},
]
LIMITS = EpisodeLimits(max_turns=6, turn_tokens=10, episode_tokens=0, context=512)
PARAMS = SamplingParams(temperature=1.0, max_new_tokens=10, seed=3)


class Recording:
    """A rollout that remembers every request and the tokens sampled for it."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.requests = {}
        self.sampled = defaultdict(list)
        self.log_probs = defaultdict(list)

    def submit(self, requests):
        self.inner.submit(requests)
        self.requests.update((r.request_id, r) for r in requests)

    def poll(self, timeout_s=0.0):
        chunks = self.inner.poll(timeout_s)
        for chunk in chunks:
            self.sampled[chunk.request_id] += chunk.token_ids
            self.log_probs[chunk.request_id] += chunk.log_probs
        return chunks

    def abort(self, request_ids=None):
        return self.inner.abort(request_ids)

    def of(self, sid):
        """The session's requests in the order they were made."""
        ids = [i for i in self.requests if i.startswith(f"{sid}-")]
        return sorted(ids, key=lambda i: int(i.split("-")[1]))


class AlwaysCalls:
    """A tool parser that reads one calculator call into every turn: multi-turn episodes of
    the example agent without a trained model."""

    name = "always_calls"

    def parse(self, text):
        return ParsedTurn("", (ToolCall("calculator", {"expression": "6*7"}),), ())

    def format(self, calls):
        return ""


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("agent-endpoint") / "model"
    build_char_tokenizer(
        path,
        roles=(*ROLES, "<|tool|>"),
        words=("<tool_call>", "</tool_call>"),
        chat_template=TEMPLATE,
    )
    return build_llama_model(
        path,
        tokenizer_dir=path,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=512,
    )


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


@pytest.fixture(scope="module")
def rollout(model_dir):
    config = rollouts.load_config_class("hf", RolloutConfig)(
        model_path=str(model_dir), max_model_len=512, device="cpu", max_batch_size=16
    )
    return rollouts.load("hf")(config)


@pytest.fixture
def recording(rollout):
    return Recording(rollout)


def runner(recording, tokenizer, command, parser=None, **options):
    options = {"timeout_s": 60.0, **options}
    score = options.pop("score", lambda task, text: 0.0)
    return AgentRunner(
        RolloutService([recording], threads=False),
        tokenizer,
        parser or tool_parser("hermes"),
        command,
        score,
        LIMITS,
        **options,
    )


SCRIPTED = textwrap.dedent(
    """
    import json, os, sys, threading, urllib.request

    MODE = sys.argv[1]
    KEY = os.environ["OPENAI_API_KEY"]
    TOOLS = [{"type": "function", "function": {"name": "calculator", "parameters": {}}}]
    log, lock = {}, threading.Lock()

    def post(url, body):
        request = urllib.request.Request(
            url, json.dumps(body).encode(), method="POST",
            headers={"Authorization": "Bearer " + KEY, "Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as response:
            return json.loads(response.read())

    def ask(episode, messages):
        with lock:
            log.setdefault(episode["session"], []).append(json.loads(json.dumps(messages)))
        reply = post(episode["base_url"] + "/chat/completions",
                     {"model": "any", "temperature": 7, "messages": messages, "tools": TOOLS})
        return reply["choices"][0]["message"]

    def go_on(messages, message):
        # the assistant message as returned, then a fake tool result (or a user turn)
        messages.append(message)
        for call in message.get("tool_calls") or []:
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": "42"})
        if not message.get("tool_calls"):
            messages.append({"role": "user", "content": "result: 42"})

    def play(episode):
        messages = [{"role": "user", "content": episode["task"]["question"]}]
        for turn in range(3):
            message = ask(episode, messages)
            if turn < 2:
                go_on(messages, message)
        if MODE == "edit":  # a summarised history: a new segment, continued once
            messages = [{"role": "user", "content": "Summary: " + episode["task"]["question"]}]
            go_on(messages, ask(episode, messages))
            ask(episode, messages)
        if MODE == "reward" and episode["sample"] == 0:
            post(episode["reward_url"], {"reward": 0.75})

    episodes = json.load(open(os.environ["DRIVETRAIN_EPISODES"]))
    threads = [threading.Thread(target=play, args=(e,)) for e in episodes]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    json.dump(log, open(os.environ["AGENT_LOG"], "w"))
    """
)


@pytest.fixture
def scripted(tmp_path):
    path = tmp_path / "scripted_agent.py"
    path.write_text(SCRIPTED)
    return path


def check_token_exact(played, recording, tokenizer, sid, tools, sent=None):
    """Every turn of the session's segments continues exactly the ids of the turn before:
    prompt + sampled + observation, sampled ids and log-probs as the rollout gave them,
    observations (rendered from the messages the agent sent, when known) unsampled."""
    chat = ChatTokens(tokenizer, tools)
    requests = [recording.requests[i] for i in recording.of(sid)]
    at = 0
    for segment in played:
        trajectory = segment.trajectory
        assert len(trajectory.log_probs) == len(trajectory.token_ids) == len(trajectory.sampled)
        assert len(trajectory.token_versions) == len(trajectory.token_ids)
        start = 0
        for turn, end in enumerate(trajectory.turn_ends):
            request = requests[at + turn]
            assert request.prompt_ids == trajectory.prompt_ids + trajectory.token_ids[:start]
            sampled = recording.sampled[request.request_id]
            assert trajectory.token_ids[start : end + 1] == tuple(sampled)
            assert trajectory.log_probs[start : end + 1] == tuple(
                recording.log_probs[request.request_id]
            )
            assert set(trajectory.sampled[start : end + 1]) == {1}
            following = trajectory.turn_ends[turn + 1] if turn + 1 < segment.turns else None
            if following is None:
                assert end == len(trajectory.token_ids) - 1
                break
            nxt = requests[at + turn + 1]
            observation = nxt.prompt_ids[len(request.prompt_ids) + len(sampled) :]
            assert nxt.prompt_ids == request.prompt_ids + tuple(sampled) + observation
            assert observation and trajectory.token_ids[end + 1 : end + 1 + len(observation)] == (
                observation
            )
            span = slice(end + 1, end + 1 + len(observation))
            assert set(trajectory.sampled[span]) == {0}
            assert set(trajectory.log_probs[span]) == {0.0}
            assert set(trajectory.token_versions[span]) == {-1}
            if sent is not None:  # the new messages after what was sent plus the reply
                before, after = sent[at + turn], sent[at + turn + 1]
                new = after[len(before) + 1 :]
                assert list(observation) == chat.observation(new, sampled)
            start = end + 1 + len(observation)
        if sent is not None:
            assert list(trajectory.prompt_ids) == chat.prompt(sent[at])
        at += segment.turns
    assert at == len(requests)


# ---- the server alone ---------------------------------------------------------------------


def call(server, method, path, body=None, key=None, raw=None):
    connection = http.client.HTTPConnection(server.host, server.port, timeout=30)
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    connection.request(method, path, body=data, headers=headers)
    response = connection.getresponse()
    payload = json.loads(response.read())
    connection.close()
    return response.status, payload


def test_the_key_guards_every_route_and_errors_are_openai_shaped(recording, tokenizer):
    with ChatServer(
        RolloutService([recording], threads=False),
        partial(ChatTokens, tokenizer),
        AlwaysCalls(),
        max_body_bytes=4096,
    ) as server:
        assert server.host == "127.0.0.1" and server.base_url.startswith("http://127.0.0.1:")
        assert len(server.api_key) >= 40
        session = server.open_session(0, 0, 0, TASKS[0], LIMITS, PARAMS, replica=0)
        chat = f"/sessions/{session.sid}/v1/chat/completions"
        body = {"messages": [{"role": "user", "content": "What is 2*3?"}]}
        for key in (None, "wrong", server.api_key + "x", ""):
            status, payload = call(server, "POST", chat, body, key=key)
            assert status == 401 and payload["error"]["code"] == "invalid_api_key"
            assert call(server, "GET", f"/sessions/{session.sid}/v1/models", key=key)[0] == 401
            assert call(server, "GET", "/nothing", key=key)[0] == 401
        assert recording.requests == {} and session.segments == []  # nothing generated

        key = server.api_key
        assert call(server, "POST", chat, key=key, raw=b"{not json")[0] == 400
        assert call(server, "POST", chat, {"messages": "hi"}, key=key)[0] == 400
        assert call(server, "POST", chat, key=key, raw=b"x" * 5000)[0] == 413
        assert call(server, "POST", "/sessions/nope/v1/chat/completions", body, key=key)[0] == 404
        assert call(server, "GET", chat, key=key)[0] == 404
        assert call(server, "GET", "/v1/models", key=key)[0] == 404
        assert (
            call(server, "POST", f"/sessions/{session.sid}/reward", {"reward": "1"}, key=key)[0]
            == 400
        )
        assert recording.requests == {}

        status, models = call(server, "GET", f"/sessions/{session.sid}/v1/models", key=key)
        assert status == 200 and [m["id"] for m in models["data"]] == [server.model]
        status, reply = call(server, "POST", chat, {**body, "max_tokens": 3}, key=key)
        assert status == 200 and reply["object"] == "chat.completion"
        message = reply["choices"][0]["message"]
        assert message["role"] == "assistant" and message["content"] is None
        assert reply["choices"][0]["finish_reason"] in ("tool_calls", "length")
        (tool_call,) = message["tool_calls"]
        assert tool_call["type"] == "function"
        assert tool_call["function"]["name"] == "calculator"
        assert json.loads(tool_call["function"]["arguments"]) == {"expression": "6*7"}
        assert reply["usage"]["completion_tokens"] == 3 == len(session.segments[0].tokens)
        (request,) = recording.requests.values()
        assert request.params.max_new_tokens == 3 and request.params.temperature == 1.0


def test_limits_refuse_a_turn_and_mark_the_truncation(recording, tokenizer):
    limits = EpisodeLimits(max_turns=2, turn_tokens=5, episode_tokens=0, context=64)
    with ChatServer(
        RolloutService([recording], threads=False), partial(ChatTokens, tokenizer), AlwaysCalls()
    ) as server:
        session = server.open_session(0, 0, 0, TASKS[0], limits, PARAMS, replica=0)
        chat, key = f"/sessions/{session.sid}/v1/chat/completions", server.api_key
        messages = [{"role": "user", "content": "What is 2*3?"}]
        for _ in range(2):
            status, reply = call(server, "POST", chat, {"messages": messages}, key=key)
            assert status == 200
            messages += [reply["choices"][0]["message"], {"role": "user", "content": "go on"}]
        status, reply = call(server, "POST", chat, {"messages": messages}, key=key)
        assert status == 400 and reply["error"]["code"] == "max_turns_exceeded"
        assert session.segments[0].truncation == "max_turns" and len(session.segments) == 1
        long = [{"role": "user", "content": "x" * 80}]
        status, reply = call(server, "POST", chat, {"messages": long}, key=key)
        assert status == 400 and reply["error"]["code"] == "context_length_exceeded"
        assert len(session.segments) == 1 and len(recording.requests) == 2


@pytest.mark.fault
def test_a_message_that_cannot_fit_is_refused_before_it_is_tokenised(recording, tokenizer):
    """The drill: 7.8 MB of content (under the 8 MiB body cap) took 31 s to refuse, tokenised
    whole under a lock every session shared. Now the character bound refuses it at once, and
    another session's turn is served meanwhile."""
    with ChatServer(
        RolloutService([recording], threads=False), partial(ChatTokens, tokenizer), AlwaysCalls()
    ) as server:
        big, small = (
            server.open_session(i, 0, i, TASKS[0], LIMITS, PARAMS, replica=0) for i in (0, 1)
        )
        huge = {"messages": [{"role": "user", "content": "7*6 " * 1_950_000}]}
        served = {}

        def other_session():
            body = {"messages": [{"role": "user", "content": "What is 2*3?"}]}
            served["status"], _ = call(
                server, "POST", f"/sessions/{small.sid}/v1/chat/completions", body,
                key=server.api_key,
            )  # fmt: skip

        thread = threading.Thread(target=other_session)
        began = time.monotonic()
        thread.start()
        status, reply = call(
            server, "POST", f"/sessions/{big.sid}/v1/chat/completions", huge, key=server.api_key
        )
        refused_in = time.monotonic() - began
        thread.join(timeout=30)
        assert status == 400 and reply["error"]["code"] == "context_length_exceeded"
        assert "7,800,004 characters" in reply["error"]["message"]
        assert refused_in < 1.0, refused_in
        assert served == {"status": 200} and big.segments == [] and len(small.segments) == 1


def wait_for(condition, timeout_s=5.0):
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.01)


class Stuck:
    """A rollout whose requests run until aborted."""

    def __init__(self) -> None:
        self.submitted, self.aborted, self.to_end = [], [], []

    def submit(self, requests):
        self.submitted += [r.request_id for r in requests]

    def poll(self, timeout_s=0.0):
        time.sleep(timeout_s)
        ended, self.to_end = self.to_end, []
        return [Chunk(i, (), (), 0, FinishReason.ABORT) for i in ended]

    def abort(self, request_ids=None):
        self.aborted += list(request_ids)
        self.to_end += list(request_ids)
        return len(request_ids)


def test_a_deadline_or_close_aborts_the_request_in_flight(tokenizer):
    stuck = Stuck()
    server = ChatServer(
        RolloutService([stuck], threads=False),
        partial(ChatTokens, tokenizer),
        AlwaysCalls(),
        request_timeout_s=0.5,
    )
    session = server.open_session(0, 0, 0, TASKS[0], LIMITS, PARAMS, replica=0)
    chat = f"/sessions/{session.sid}/v1/chat/completions"
    body = {"messages": [{"role": "user", "content": "What is 2*3?"}]}
    status, reply = call(server, "POST", chat, body, key=server.api_key)
    assert status == 504 and reply["error"]["code"] == "timeout"
    wait_for(lambda: stuck.aborted == stuck.submitted)  # the dispatcher aborts it
    assert len(stuck.submitted) == 1

    server.request_timeout_s = 60.0
    answers = []
    asking = threading.Thread(
        target=lambda: answers.append(call(server, "POST", chat, body, key=server.api_key))
    )
    asking.start()
    wait_for(lambda: len(stuck.submitted) == 2)
    started = time.monotonic()
    server.close()
    asking.join(10)
    assert time.monotonic() - started < 5
    ((status, reply),) = answers
    assert status == 503 and stuck.aborted == stuck.submitted
    assert session.segments == []


# ---- agents as subprocesses -----------------------------------------------------------------


def test_the_example_agent_plays_multi_turn_episodes_recorded_token_exactly(recording, tokenizer):
    scored = []

    def score(task, text):
        scored.append((task["answer"], text))
        return 1.0

    command = [sys.executable, str(EXAMPLE_AGENT)]
    with runner(recording, tokenizer, command, parser=AlwaysCalls(), score=score) as agent:
        played = agent.play(TASKS, 2, PARAMS)
        sids = sorted({i.split("-")[0] for i in recording.requests})
        assert agent.server.host == "127.0.0.1"
    assert len(played) == 4 and [p.task for p in played] == [0, 0, 1, 1]
    assert len(scored) == 4 and {answer for answer, _ in scored} == {"3913", "115"}
    by_episode = {_episode_of(recording, sid): sid for sid in sids}
    for k, episode in enumerate(played):
        assert episode.trajectory.prompt_index == k
        assert episode.turns == 4  # a call every turn: the agent stops after its 4 turns
        assert episode.turn_rewards == (0.0, 0.0, 0.0, 1.0) and episode.truncation == ""
        assert episode.info["agent/segments"] == 1 and episode.info["agent/tool_calls"] == 4
        check_token_exact([episode], recording, tokenizer, by_episode[k], _example_tools())


def _example_tools():
    namespace = {}
    source = EXAMPLE_AGENT.read_text()
    block = source[source.index("TOOLS = ") : source.index("OPERATIONS = ")]
    exec(block, namespace)  # the literal schema list
    return namespace["TOOLS"]


def test_a_scripted_agent_continues_and_an_edited_history_starts_a_segment(
    recording, tokenizer, scripted, tmp_path
):
    log = tmp_path / "log.json"
    command = [sys.executable, str(scripted), "edit"]
    with runner(recording, tokenizer, command, env={"AGENT_LOG": str(log)}) as agent:
        played = agent.play(TASKS, 2, PARAMS)
    sent = json.loads(log.read_text())
    assert len(sent) == 4 and len(played) == 8  # two segments per episode
    tools = [{"type": "function", "function": {"name": "calculator", "parameters": {}}}]
    for k in range(4):
        first, second = played[2 * k], played[2 * k + 1]
        assert first.task == second.task == k // 2
        assert (first.turns, second.turns) == (3, 2)
        assert first.info["agent/segments"] == 2 and second.info["agent/segment"] == 1
        assert first.turn_rewards == (0.0, 0.0, 0.0) and second.turn_rewards == (0.0, 0.0)
        sid = next(s for s in sent if _episode_of(recording, s) == k)
        check_token_exact([first, second], recording, tokenizer, sid, tools, sent=sent[sid])
        assert "Summary" in tokenizer.decode(second.trajectory.prompt_ids)


def _episode_of(recording, sid):
    return recording.requests[recording.of(sid)[0]].prompt_index


def test_a_reported_reward_wins_over_the_score(recording, tokenizer, scripted, tmp_path):
    command = [sys.executable, str(scripted), "reward"]
    env = {"AGENT_LOG": str(tmp_path / "log.json")}
    texts = []

    def score(task, text):
        texts.append(text)
        return 0.25

    with runner(recording, tokenizer, command, env=env, score=score) as agent:
        played = agent.play(TASKS, 2, PARAMS)
        again = agent.play(TASKS[:1], 1, PARAMS)  # the server is reused
    assert [p.reward for p in played] == [0.75, 0.25, 0.75, 0.25]
    assert [p.info["agent/reported_reward"] for p in played] == [1.0, 0.0, 1.0, 0.0]
    assert [p.turns for p in played] == [3] * 4 and len(texts) == 2
    assert [p.reward for p in again] == [0.75]


@pytest.mark.fault
def test_a_failing_silent_or_hanging_agent_is_one_clear_error(recording, tokenizer):
    fails = [
        sys.executable,
        "-c",
        "import sys; print('boom: no model', file=sys.stderr); sys.exit(3)",
    ]
    with runner(recording, tokenizer, fails) as agent, pytest.raises(AgentError) as error:
        agent.play(TASKS, 1, PARAMS)
    assert "status 3" in str(error.value) and "boom: no model" in str(error.value)
    assert "\n" not in str(error.value)
    assert isinstance(error.value, DrivetrainError)  # the commands print it as one line

    silent = [sys.executable, "-c", "pass"]
    with runner(recording, tokenizer, silent) as agent, pytest.raises(AgentError) as error:
        agent.play(TASKS, 1, PARAMS)
    assert "played no turn of session" in str(error.value) and "task 0" in str(error.value)

    hangs = [sys.executable, "-c", "import time; time.sleep(60)"]
    with (
        runner(recording, tokenizer, hangs, timeout_s=1.0) as agent,
        pytest.raises(AgentError, match="timed out after 1 s"),
    ):
        agent.play(TASKS, 1, PARAMS)


@pytest.mark.fault
def test_dropped_connections_are_a_line_at_most_not_a_traceback_each(recording, tokenizer, caplog):
    """The drill: 300 clients that went away mid-request printed ~300 tracebacks (6,400 log
    lines) into the trainer's log. Each here sends a request's headers and part of its body,
    then resets the connection."""
    with ChatServer(
        RolloutService([recording], threads=False), partial(ChatTokens, tokenizer), AlwaysCalls()
    ) as server:
        session = server.open_session(0, 0, 0, TASKS[0], LIMITS, PARAMS, replica=0)
        head = (
            f"POST /sessions/{session.sid}/v1/chat/completions HTTP/1.1\r\n"
            f"Authorization: Bearer {server.api_key}\r\nContent-Length: 100000\r\n\r\n"
        ).encode()
        dropped = server._http._dropped
        with caplog.at_level(logging.WARNING, logger="drivetrain.trainer.agentic.endpoint"):
            for _ in range(300):
                client = socket.create_connection((server.host, server.port))
                client.sendall(head + b'{"messages": [')
                client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                client.close()  # a reset, mid-body
            wait_for(lambda: dropped.count == 300, timeout_s=30)
        lines = [r.getMessage() for r in caplog.records]
        assert len(lines) == 1 and "dropped a connection from" in lines[0], lines
        assert not any(r.exc_info for r in caplog.records)
        body = {"messages": [{"role": "user", "content": "What is 2*3?"}]}
        chat = f"/sessions/{session.sid}/v1/chat/completions"
        assert call(server, "POST", chat, body, key=server.api_key)[0] == 200  # still serving
