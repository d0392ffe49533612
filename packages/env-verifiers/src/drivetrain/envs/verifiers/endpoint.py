"""An OpenAI-compatible chat-completions endpoint whose answers are the policy's turns.

A verifiers environment drives its model itself: its harness's program asks for completions
through the hub's interception server, which relays them (the hub's ``EvalClient``) to the
``base_url`` of the run's client. That ``base_url`` is here, one per episode
(``/episodes/<eid>/v1``): a request waits in its episode's inbox until the trainer's episode
answers it with the policy's sampled turn (``Episode.step``), so the trainer tokenises and
samples every turn itself, token-exact, and the hub never sees a token.

Routes, all behind ``Authorization: Bearer <key>`` (a fresh key; 401 without it), bound to
loopback on a free port:

- ``POST /episodes/<eid>/v1/chat/completions``: ``messages`` and ``tools`` are read;
  ``stream: true`` is answered as server-sent events (one ``chat.completion.chunk`` holding the
  whole turn, then ``[DONE]``: the hub's harness programs stream); the sampling fields are
  ignored (the trainer's sampling applies, so the log-probs are those its loss assumes).
- ``GET /episodes/<eid>/v1/models``: one model.

Errors are OpenAI-style JSON (``{"error": {"message", "type", "code"}}``).
"""

from __future__ import annotations

import hmac
import json
import queue
import re
import secrets
import threading
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from drivetrain.api.environment import AssistantTurn

ROUTE = re.compile(r"^/episodes/([0-9a-f]{32})/v1/(chat/completions|models)$")
MAX_BODY = 64 << 20
#: the hub's client names the agent run (its trace) a request belongs to in this header
SESSION_HEADER = "X-Session-ID"


@dataclass
class ChatRequest:
    """One chat-completions request, waiting for its answer."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]]
    stream: bool
    model: str
    _answered: threading.Event = field(default_factory=threading.Event)
    _reply: tuple[int, dict[str, Any]] = (503, {})

    def answer(self, status: int, body: dict[str, Any]) -> None:
        if not self._answered.is_set():
            self._reply = (status, body)
            self._answered.set()

    def wait(self, timeout_s: float) -> tuple[int, dict[str, Any]] | None:
        return self._reply if self._answered.wait(timeout_s) else None


def error_body(message: str, code: str, kind: str = "invalid_request_error") -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "code": code}}


def completion(turn: AssistantTurn, model: str) -> dict[str, Any]:
    """The policy's turn as a ``chat.completion``: its text without tool-call markup, and the
    calls the trainer's tool parser read, in OpenAI's form."""
    calls = [
        {
            "id": call.id or f"call_{turn.index}_{k}",
            "type": "function",
            "function": {"name": call.name, "arguments": json.dumps(dict(call.arguments))},
        }
        for k, call in enumerate(turn.tool_calls)
    ]
    message: dict[str, Any] = {"role": "assistant", "content": turn.content or None}
    if calls:
        message["tool_calls"] = calls
    elif message["content"] is None:
        message["content"] = ""
    finish = "tool_calls" if calls else ("stop" if turn.finished else "length")
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "message": message, "finish_reason": finish}],
    }


def stream_events(body: Mapping[str, Any]) -> bytes:
    """A completion as server-sent events, the way the hub's own chat dialect replays one."""
    choice = body["choices"][0]
    delta = dict(choice["message"])
    if delta.get("tool_calls"):
        delta["tool_calls"] = [{**c, "index": i} for i, c in enumerate(delta["tool_calls"])]
    chunk = {
        **{k: v for k, v in body.items() if k != "choices"},
        "object": "chat.completion.chunk",
        "choices": [{"index": 0, "delta": delta, "finish_reason": choice["finish_reason"]}],
    }
    return f"data: {json.dumps(chunk)}\n\ndata: [DONE]\n\n".encode()


class Conversation:
    """One episode's inbox: its chat requests (``("request", ChatRequest)``) and the end of its
    run (``("done", reply)``), in the order they happened."""

    def __init__(self, eid: str) -> None:
        self.eid = eid
        self.inbox: queue.Queue[tuple[str, Any]] = queue.Queue()
        self.waiting: list[ChatRequest] = []
        self.closed = False
        self.trace = ""  # the hub's trace (one agent run) this conversation is
        self.lock = threading.Lock()

    def put_request(self, request: ChatRequest, trace: str) -> str:
        """``""`` when queued; else why not (``ended``, or ``other`` for a second agent run of
        the episode: one conversation an episode)."""
        with self.lock:
            if self.closed:
                return "ended"
            self.trace = self.trace or trace
            if trace and trace != self.trace:
                return "other"
            self.waiting.append(request)
        self.inbox.put(("request", request))
        return ""

    def close(self, message: str = "the episode has ended") -> None:
        """No more requests: those waiting are refused (the hub's agent stops there)."""
        with self.lock:
            self.closed = True
            waiting, self.waiting = self.waiting, []
        for request in waiting:
            request.answer(400, error_body(message, "episode_ended"))


class Endpoint:
    """The HTTP server (a thread of its own); episodes :meth:`open` conversations on it."""

    def __init__(self, model: str, request_timeout_s: float, host: str = "127.0.0.1") -> None:
        self.model, self.request_timeout_s = model, request_timeout_s
        self.key = secrets.token_urlsafe(32)
        self._conversations: dict[str, Conversation] = {}
        self._lock = threading.Lock()
        self.server = _Server((host, 0), _Handler)
        self.server.endpoint = self
        self.base = f"http://{host}:{self.server.server_address[1]}"
        self._thread = threading.Thread(
            target=self.server.serve_forever,
            kwargs={"poll_interval": 0.1},  # how long close() waits for it
            name="verifiers-endpoint",
            daemon=True,
        )
        self._thread.start()

    def open(self) -> Conversation:
        conversation = Conversation(uuid.uuid4().hex)
        with self._lock:
            self._conversations[conversation.eid] = conversation
        return conversation

    def forget(self, conversation: Conversation) -> None:
        conversation.close()
        with self._lock:
            self._conversations.pop(conversation.eid, None)

    def find(self, eid: str) -> Conversation | None:
        with self._lock:
            return self._conversations.get(eid)

    def base_url(self, conversation: Conversation) -> str:
        return f"{self.base}/episodes/{conversation.eid}/v1"

    def close(self) -> None:
        with self._lock:
            conversations, self._conversations = list(self._conversations.values()), {}
        for conversation in conversations:
            conversation.close("the environment is closing")
        self.server.shutdown()
        self.server.server_close()


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    endpoint: Endpoint


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    server_version = "drivetrain-verifiers"

    def log_message(self, format: str, *args: Any) -> None:
        pass  # a line per request would drown the trainer's log

    def do_GET(self) -> None:
        route = self._route()
        if route is None:
            return
        if route[1] == "models":
            model = {"id": self.server.endpoint.model, "object": "model"}
            self._json(200, {"object": "list", "data": [model]})
        else:
            self._json(404, error_body(f"no route GET {self.path}", "not_found"))

    def do_POST(self) -> None:
        route = self._route()
        if route is None:
            return
        if route[1] != "chat/completions":
            self._json(404, error_body(f"no route POST {self.path}", "not_found"))
            return
        body = self._body()
        if body is None:
            return
        endpoint = self.server.endpoint
        trace = self.headers.get(SESSION_HEADER, "")
        request = ChatRequest(
            messages=list(body["messages"]),
            tools=list(body.get("tools") or []),
            stream=bool(body.get("stream")),
            model=str(body.get("model") or endpoint.model),
        )
        conversation = endpoint.find(route[0])
        refused = "ended" if conversation is None else conversation.put_request(request, trace)
        if refused == "ended":
            self._json(404, error_body("no such episode (it has ended)", "episode_ended"))
            return
        if refused:
            message = "one agent run an episode plays the policy; this is another"
            self._json(409, error_body(message, "one_conversation"))
            return
        reply = request.wait(endpoint.request_timeout_s)
        if reply is None:
            self._json(504, error_body("the policy gave no answer in time", "timeout"))
        elif reply[0] == 200 and request.stream:
            self._send(200, stream_events(reply[1]), "text/event-stream")
        else:
            self._json(*reply)

    def _route(self) -> tuple[str, str] | None:
        """``(episode id, route)`` of an authorised request to a known path; else ``None``, the
        error already sent."""
        supplied = self.headers.get("Authorization", "").encode()
        if not hmac.compare_digest(supplied, f"Bearer {self.server.endpoint.key}".encode()):
            self._json(401, error_body("a valid API key is required", "invalid_api_key"))
            return None
        match = ROUTE.match(self.path.split("?", 1)[0])
        if match is None:
            self._json(404, error_body(f"no route {self.path}", "not_found"))
            return None
        return match.group(1), match.group(2)

    def _body(self) -> dict[str, Any] | None:
        length = int(self.headers.get("Content-Length") or -1)
        if not 0 <= length <= MAX_BODY:
            self._json(413, error_body("the body needs a length of at most 64 MiB", "size"))
            return None
        try:
            body = json.loads(self.rfile.read(length))
        except ValueError:
            body = None
        if not isinstance(body, dict) or not isinstance(body.get("messages"), list):
            self._json(400, error_body("the body must be a JSON object with messages", "bad"))
            return None
        return body

    def _json(self, status: int, body: Mapping[str, Any]) -> None:
        self._send(status, json.dumps(body).encode(), "application/json")

    def _send(self, status: int, data: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


def text_of(content: Any) -> str:
    """A message's content as text: OpenAI's list of parts joined (images dropped)."""
    if isinstance(content, str) or content is None:
        return content or ""
    if isinstance(content, Sequence):
        return "".join(str(p.get("text", "")) for p in content if isinstance(p, Mapping))
    return str(content)
