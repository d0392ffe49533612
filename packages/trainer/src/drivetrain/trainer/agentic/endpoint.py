"""An OpenAI-compatible chat-completions endpoint over the trainer's rollouts.

Agent code written against the OpenAI API plays episodes through it; every turn is recorded
token-exactly server-side (:mod:`drivetrain.trainer.agentic.sessions`) and trained on. Each
episode is a *session* with its own base URL; point an OpenAI client at it::

    from openai import OpenAI
    client = OpenAI(base_url=episode["base_url"], api_key=os.environ["OPENAI_API_KEY"])
    reply = client.chat.completions.create(model="policy", messages=..., tools=...)

(:class:`~drivetrain.trainer.agentic.agent_runner.AgentRunner` hands an agent its sessions:
see there.) Routes, all behind ``Authorization: Bearer <api key>`` (401 without it):

- ``POST /sessions/<sid>/v1/chat/completions``: ``messages``, optional ``tools`` and
  ``max_tokens`` / ``max_completion_tokens`` (which may only lower the trainer's per-turn
  budget). ``model``, ``temperature``, ``top_p``, ``n``, ``seed``, ``stop`` and the other
  sampling fields are accepted and **ignored**: the trainer's sampling params apply, so the
  recorded log-probs are those its loss assumes. The answer is a ``chat.completion`` with one
  choice: ``content`` without tool-call markup (``null`` when empty and there are calls),
  ``tool_calls`` as the tool parser read them, ``finish_reason`` ``tool_calls``, ``stop`` or
  ``length``; calls that could not be parsed are listed in the message's extra
  ``tool_call_errors``. A turn the episode's limits leave no room for is refused with 400 and
  code ``context_length_exceeded`` or ``max_turns_exceeded``: the agent should end the episode.
  Text that cannot fit the context by its characters alone is refused before it is tokenised.
- ``GET /sessions/<sid>/v1/models``: one model.
- ``POST /sessions/<sid>/reward`` with ``{"reward": <number>}``: the episode's reward, when the
  agent knows it (else the trainer scores the last turn).

Errors are OpenAI-style JSON (``{"error": {"message", "type", "code"}}``): 400 bad JSON or
request, 401 key, 404 unknown session or route, 411/413 body length, 503 aborted (the play
ended or the server closes), 504 no answer within the request deadline.

Threads: HTTP handlers (one per connection) never touch a rollout. The
:class:`~drivetrain.runtime.rollout_service.RolloutService` owns the rollouts (a rollout has one
poller at a time): it submits the queued requests, polls, and completes each handler's future
when its request finishes. Every wait has a deadline.
Handlers tokenise under their session's lock only, with the endpoint's own tokenizer copy.
"""

from __future__ import annotations

import hmac
import json
import logging
import math
import re
import secrets
import socket
import sys
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlsplit

from drivetrain.api import Completion, FinishReason, SamplingParams
from drivetrain.api.environment import Task
from drivetrain.api.requests import Request, sample_seed
from drivetrain.runtime.rollout_service import SETTLE_S, RolloutService, ServiceClosed
from drivetrain.trainer.agentic.chat_tokens import ChatTokens
from drivetrain.trainer.agentic.episodes import EpisodeLimits
from drivetrain.trainer.agentic.sessions import RequestError, Session, check_messages
from drivetrain.trainer.agentic.tool_parsers import ToolParser

log = logging.getLogger(__name__)

#: a client that sends nothing this long on its connection is dropped (seconds)
SOCKET_TIMEOUT_S = 120.0
#: a session's requests are seeded ``sample_seed(seed, number * SEED_STRIDE + turn)``
SEED_STRIDE = 1 << 16

_ROUTE = re.compile(r"/sessions/([A-Za-z0-9_-]{1,64})/(v1/chat/completions|v1/models|reward)")
_ERROR_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "not_found_error"}


class _HTTPError(Exception):
    def __init__(self, status: int, message: str, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.code = status, code


class _HTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    #: socketserver's default backlog of 5 made the 6th of many agents connecting at once
    #: wait out a SYN retry (1 s, then 3 s)
    request_queue_size = 1024
    app: ChatServer

    def __init__(self, address: tuple[str, int], app: ChatServer) -> None:
        if ":" in address[0]:
            self.address_family = socket.AF_INET6
        self.app = app
        self._dropped = _DroppedConnections()
        super().__init__(address, _Handler)

    def handle_error(
        self, request: Any, client_address: Any, exc: BaseException | None = None
    ) -> None:
        """A connection the client dropped mid-request or mid-answer: one rate-limited line,
        not a traceback each (300 half-open connections closing printed 6,400 lines into the
        trainer's log)."""
        self._dropped.note(exc or sys.exc_info()[1], client_address)


class _DroppedConnections:
    """Logs dropped connections at most once per ``every_s``, counting the ones in between."""

    def __init__(self, every_s: float = 10.0) -> None:
        self.every_s, self._lock = every_s, threading.Lock()
        self._last, self._unsaid, self.count = -math.inf, 0, 0

    def note(self, exc: BaseException | None, client: Any) -> None:
        with self._lock:
            self.count += 1
            now = time.monotonic()
            if now - self._last < self.every_s:
                self._unsaid += 1
                return
            unsaid, self._unsaid, self._last = self._unsaid, 0, now
        more = f" (and {unsaid} more since the last such line)" if unsaid else ""
        log.warning(
            "agent endpoint: dropped a connection from %s: %s%s",
            client,
            f"{type(exc).__name__}: {exc}" if exc else "closed",
            more,
        )


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "drivetrain-agent-endpoint"
    timeout = SOCKET_TIMEOUT_S
    server: _HTTPServer

    def log_message(self, fmt: str, *args: Any) -> None:
        log.debug("%s " + fmt, self.address_string(), *args)

    def do_GET(self) -> None:
        self._handle()

    do_POST = do_PUT = do_PATCH = do_DELETE = do_GET

    def _handle(self) -> None:
        try:
            status, body = self.server.app.handle(
                self.command, self.path, self.headers.get("Authorization"), self._body
            )
        except _HTTPError as exc:
            status = exc.status
            body = {
                "error": {
                    "message": str(exc),
                    "type": _ERROR_TYPES.get(status, "server_error"),
                    "param": None,
                    "code": exc.code,
                }
            }
            self.close_connection = True  # the request's body may be unread
        except (ConnectionError, TimeoutError) as exc:  # the client went away mid-request
            self.server.handle_error(self.request, self.client_address, exc)
            self.close_connection = True
            return
        except Exception as exc:  # a bug, or a chat template the endpoint cannot extend
            log.exception("the chat endpoint failed on %s %s", self.command, self.path)
            status = 500
            body = {
                "error": {
                    "message": f"{type(exc).__name__}: {exc}",
                    "type": "server_error",
                    "param": None,
                    "code": None,
                }
            }
            self.close_connection = True
        data = json.dumps(body, ensure_ascii=False).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        if status == 401:
            self.send_header("WWW-Authenticate", "Bearer")
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(data)

    def _body(self, limit: int) -> Any:
        """The request's JSON body (read only once the caller is authorised)."""
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            raise _HTTPError(411, "send a Content-Length, not a chunked body")
        length = self.headers.get("Content-Length")
        if length is None or not length.isdigit():
            raise _HTTPError(411, "a Content-Length header is required")
        if int(length) > limit:
            raise _HTTPError(413, f"request body of {length} bytes; the limit is {limit}")
        data = self.rfile.read(int(length))
        try:
            return json.loads(data)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise _HTTPError(400, f"the body is not JSON: {exc}") from None


class ChatServer:
    """The endpoint (see the module docstring), serving on ``host:port`` (port 0: a free one)
    at :attr:`base_url`. ``chat_for(tools)`` gives the :class:`ChatTokens` of a conversation
    with those tools; ``parser`` reads the model's tool calls. ``api_key``: generated unless
    given (:attr:`api_key`). Sessions are opened with :meth:`open_session` and collected with
    :meth:`end_sessions`; :meth:`close` stops everything, aborting requests in flight."""

    def __init__(
        self,
        rollouts: RolloutService,
        chat_for: Callable[[Sequence[Mapping[str, Any]]], ChatTokens],
        parser: ToolParser,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        api_key: str | None = None,
        model: str = "drivetrain-policy",
        request_timeout_s: float = 600.0,
        max_body_bytes: int = 8 << 20,
    ) -> None:
        self.replicas = len(rollouts.rollouts)
        self.parser, self.model = parser, model
        self.api_key = api_key or secrets.token_urlsafe(32)
        self._key = self.api_key.encode()
        self.request_timeout_s, self.max_body_bytes = request_timeout_s, max_body_bytes
        self._chat_for, self._chats = chat_for, {}
        self._chats_lock = threading.Lock()  # the cache, not the tokenizing (see _complete)
        self._sessions: dict[str, Session] = {}
        self._sessions_lock = threading.Lock()
        self._rollouts = rollouts  # the placement's service, polled in its threads meanwhile
        self._closed = False  # a handler answering at close submits nothing more
        self._http = _HTTPServer((host, port), self)
        rollouts.poll_in_threads()  # once the socket is ours: a failed bind leaves it idle
        self.host, self.port = self._http.server_address[:2]
        self._serving = threading.Thread(
            target=self._http.serve_forever, kwargs={"poll_interval": 0.2}, daemon=True
        )
        self._serving.start()

    @property
    def base_url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def session_url(self, sid: str) -> str:
        """The OpenAI base URL of session ``sid``."""
        return f"{self.base_url}/sessions/{sid}/v1"

    # ---- sessions -------------------------------------------------------------------------
    def open_session(
        self,
        number: int,
        task: int,
        sample: int,
        task_data: Task,
        limits: EpisodeLimits,
        params: SamplingParams,
        *,
        replica: int,
    ) -> Session:
        """A new session: episode ``number`` of a play, sample ``sample`` of task ``task``,
        generated on ``replica`` (the play's choice: ``runtime.replicas.replica_slots``)."""
        if not 0 <= replica < self.replicas:
            raise ValueError(f"replica {replica} of {self.replicas}")
        sid = secrets.token_hex(8)
        session = Session(sid, number, task, sample, replica, task_data, limits, params)
        with self._sessions_lock:
            self._sessions[sid] = session
        return session

    def end_sessions(self, sids: Sequence[str], timeout_s: float = SETTLE_S) -> list[Session]:
        """Close sessions (their requests get 404 from now on, running ones are aborted) and
        forget them; returns them once no request of theirs is being answered."""
        with self._sessions_lock:
            sessions = [self._sessions.pop(sid) for sid in sids]
        for session in sessions:
            session.closed = True
            if session.running:
                self._rollouts.abort(session.running)
        deadline = time.monotonic() + timeout_s
        for session in sessions:
            # not raised: this runs after a play, failed or not, whose own error is the one
            # to see; the request left is aborted and its handler ends at its own deadline
            if not session.lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
                log.warning("session %s is still answering a request", session.sid)
                continue
            session.lock.release()
        return sessions

    def close(self) -> None:
        """Stop serving and release the rollout service; requests in flight are aborted (their
        agents get 503)."""
        self._http.shutdown()  # no new request first; those being answered fail at the stop
        self._closed = True
        self._rollouts.release()
        self._http.server_close()
        self._serving.join(5.0)

    def __enter__(self) -> ChatServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- requests (in handler threads) --------------------------------------------------
    def handle(
        self, method: str, path: str, authorization: str | None, body: Callable[[int], Any]
    ) -> tuple[int, Any]:
        """Answer one HTTP request: (status, JSON body); errors raise :class:`_HTTPError`."""
        scheme, _, token = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(
            token.strip().encode("utf-8", "replace"), self._key
        ):
            raise _HTTPError(
                401, "missing or wrong API key (Authorization: Bearer)", "invalid_api_key"
            )
        route = _ROUTE.fullmatch(urlsplit(path).path)
        want = {"v1/chat/completions": "POST", "v1/models": "GET", "reward": "POST"}
        if route is None or want[route[2]] != method:
            raise _HTTPError(404, f"no route {method} {urlsplit(path).path}")
        with self._sessions_lock:
            session = self._sessions.get(route[1])
        if session is None:
            raise _HTTPError(404, f"unknown session {route[1]!r}", "session_not_found")
        if route[2] == "v1/models":
            return 200, {"object": "list", "data": [self._model_entry()]}
        payload = body(self.max_body_bytes)
        if not isinstance(payload, dict):
            raise _HTTPError(400, "the body must be a JSON object")
        try:
            if route[2] == "reward":
                return 200, self._reward(session, payload)
            return 200, self._complete(session, payload)
        except RequestError as exc:
            raise _HTTPError(400, str(exc), exc.code) from None

    def _model_entry(self) -> dict[str, Any]:
        return {"id": self.model, "object": "model", "created": 0, "owned_by": "drivetrain"}

    def _reward(self, session: Session, payload: Mapping[str, Any]) -> dict[str, Any]:
        reward = payload.get("reward")
        if isinstance(reward, bool) or not isinstance(reward, (int, float)):
            raise RequestError("'reward' must be a number")
        if not math.isfinite(reward):
            raise RequestError("'reward' must be finite")
        if session.closed:
            raise _HTTPError(404, f"session {session.sid!r} has ended", "session_not_found")
        session.reward = float(reward)
        return {"session": session.sid, "reward": session.reward}

    def _chat(self, tools: Sequence[Mapping[str, Any]]) -> ChatTokens:
        key = json.dumps(list(tools), sort_keys=True)
        with self._chats_lock:
            if key not in self._chats:
                self._chats[key] = self._chat_for(tools)
            return self._chats[key]

    def _refuse_certainly_too_long(
        self, session: Session, messages: Sequence[Any], tools: Sequence[Any]
    ) -> None:
        """Refuse, before tokenising anything, a request whose text cannot fit the context:
        ``n`` characters are at least ``n / longest_token`` tokens (halved again for
        normalisers that merge characters). A 7.8 MB message took 31 s to tokenise before
        this; the bound costs one pass over the strings."""
        chars = _characters(messages) + _characters(tools)
        fewest = chars // (2 * self._chat(()).longest_token)
        if fewest > session.limits.context:
            raise RequestError(
                f"the request holds {chars:,} characters, at least {fewest:,} tokens: more "
                f"than the context of {session.limits.context}",
                "context_length_exceeded",
            )

    def _complete(self, session: Session, payload: Mapping[str, Any]) -> dict[str, Any]:
        messages = check_messages(payload.get("messages"))
        tools = payload.get("tools") or []
        if not isinstance(tools, list) or not all(isinstance(t, Mapping) for t in tools):
            raise RequestError("'tools' must be a list of objects")
        max_tokens = payload.get("max_completion_tokens", payload.get("max_tokens"))
        if max_tokens is not None and (
            isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1
        ):
            raise RequestError("max_tokens must be a positive integer")
        self._refuse_certainly_too_long(session, messages, tools)
        deadline = time.monotonic() + self.request_timeout_s
        if not session.lock.acquire(timeout=self.request_timeout_s):
            raise _HTTPError(504, "another request of this session is still running", "timeout")
        try:
            if session.closed:
                raise _HTTPError(404, f"session {session.sid!r} has ended", "session_not_found")
            # tokenised under this session's lock only: another session's turn goes on meanwhile
            # (a fast tokenizer encodes outside the GIL, and nothing here changes its settings)
            turn = session.plan(messages, tools, max_tokens, self._chat)
            params: SamplingParams = session.params
            seed = params.seed
            if seed is not None:
                seed = sample_seed(seed, session.number * SEED_STRIDE + session.requests)
            request = Request(
                f"{session.sid}-{session.requests}-{uuid.uuid4().hex[:8]}",
                turn.prompt_ids,
                replace(params, n=1, max_new_tokens=turn.budget, seed=seed),
                prompt_index=session.number,
            )
            session.running = request.request_id
            if self._closed:
                raise _HTTPError(503, "the endpoint is closing", "aborted")
            future = self._rollouts.submit(session.replica, request)
            if session.closed:  # ended while this was planned: end_sessions may not have seen
                self._rollouts.abort(request.request_id)  # it running (queued after submit)
            completion = self._wait(future, deadline)
            if completion is None:
                self._rollouts.abort(request.request_id)
                raise _HTTPError(504, "no answer within the request deadline", "timeout")
            if completion.finish_reason is FinishReason.ABORT or not completion.token_ids:
                raise _HTTPError(503, "the request was aborted (the episode ended)", "aborted")
            text = turn.chat.decode(completion.token_ids)
            parsed = self.parser.parse(text)
            message = session.record(turn, completion, text, parsed)
        finally:
            session.running = None
            session.lock.release()
        return self._response(message, completion, len(turn.prompt_ids))

    @staticmethod
    def _wait(future: Future[Completion], deadline: float) -> Completion | None:
        try:
            return future.result(timeout=max(0.0, deadline - time.monotonic()))
        except FutureTimeout:
            return None
        except ServiceClosed as exc:
            raise _HTTPError(503, str(exc), "server_closed") from None
        except ValueError as exc:  # the rollout refused the request
            raise _HTTPError(400, f"the rollout refused the request: {exc}") from None
        except Exception as exc:
            raise _HTTPError(500, f"generation failed: {type(exc).__name__}: {exc}") from None

    def _response(
        self, message: Mapping[str, Any], completion: Completion, prompt_tokens: int
    ) -> dict[str, Any]:
        if completion.finish_reason is FinishReason.LENGTH:
            finish = "length"
        else:
            finish = "tool_calls" if message.get("tool_calls") else "stop"
        sampled = len(completion.token_ids)
        return {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": self.model,
            "choices": [
                {"index": 0, "message": dict(message), "finish_reason": finish, "logprobs": None}
            ],
            "usage": {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": sampled,
                "total_tokens": prompt_tokens + sampled,
            },
        }


def _characters(value: Any) -> int:
    """The characters of every string value in a JSON value (keys are not rendered text)."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, Mapping):
        return sum(_characters(v) for v in value.values())
    if isinstance(value, list | tuple):
        return sum(_characters(v) for v in value)
    return 0
