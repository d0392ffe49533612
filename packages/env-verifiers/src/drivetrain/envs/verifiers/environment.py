"""A verifiers environment (Prime Intellect's environments hub) as a drivetrain environment.

The environment runs in its own Python (``episode.options.python``: a virtual environment with
verifiers 0.4), served by the hub's own env server (``hub.py``, ``sidecar.py``); each episode is
one run of it (the hub's ``run`` request) whose model is the policy: the hub's agent asks this
adapter's chat endpoint (``endpoint.py``) for every turn, the request's new messages become the
episode's observations, the policy's sampled turn its answer, and the hub's reward (its task's
``@reward`` functions, weighted) the episode's reward when the run ends.

``episode.options`` (``drivetrain grpo env=verifiers episode.options.id=gsm8k
episode.options.python=/opt/vf/bin/python``):

- ``id`` (required): the environment's id: its taskset package as the hub installs it
  (``owner/name@version`` or a module name);
- ``python`` (required): the interpreter of a virtual environment with verifiers 0.4 and the
  environment (``python -m drivetrain.envs.verifiers.venv DIR`` makes one);
- ``config``: the hub's own env config (its ``[env]`` block) as a mapping, e.g.
  ``{agent: {harness: {id: "null"}}, taskset: {num_tasks: 100}}``;
- ``runtime``: where the hub runs its agents' programs when ``config`` does not say:
  ``subprocess`` (default: on this machine), ``docker``, ``prime``... or ``""`` (the hub's own
  default, Prime sandboxes);
- ``pythonpath``: folders the environment's interpreter imports from (a local environment);
- ``val``: taskset settings for validation tasks (``{split: test}``); without it, no
  validation tasks;
- ``workers``: env-server processes (default 1; more: the hub's own pool);
- ``model``: the model name the hub's agent is given (default ``policy``);
- ``timeout_s``: the longest wait for the hub between two turns (default 600);
- ``start_timeout_s``: the longest wait for the server to come up (default 300).
"""

from __future__ import annotations

import json
import logging
import os
import queue
import weakref
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from typing import Any

from drivetrain.api.environment import (
    AssistantTurn,
    Environment,
    Episode,
    Message,
    StepResult,
    Task,
)
from drivetrain.envs.verifiers.endpoint import (
    ChatRequest,
    Conversation,
    Endpoint,
    completion,
    text_of,
)
from drivetrain.envs.verifiers.hub import Hub, VerifiersError
from drivetrain.envs.verifiers.sidecar import KEY_VAR

log = logging.getLogger(__name__)
_told: set[str] = set()  # the episode errors already logged

OPTIONS = (
    "id",
    "python",
    "config",
    "runtime",
    "pythonpath",
    "val",
    "workers",
    "model",
    "timeout_s",
    "start_timeout_s",
)
#: message fields an observation keeps (the chat template reads these)
MESSAGE_FIELDS = ("role", "content", "tool_calls", "tool_call_id", "name")


def as_message(message: Mapping[str, Any]) -> dict[str, Any]:
    """A message of the hub's request as the trainer renders it: text content."""
    kept = {k: message[k] for k in MESSAGE_FIELDS if message.get(k) is not None}
    kept["content"] = text_of(message.get("content"))
    return kept


class VerifiersEpisode(Episode):
    """One run on the hub's server. The trainer calls one method at a time per episode."""

    def __init__(self, env: VerifiersEnvironment, task: Task) -> None:
        self.env, self.task = env, dict(task)
        self.conversation: Conversation | None = None
        self.request: ChatRequest | None = None
        self.known: list[dict[str, Any]] = []  # the last request's messages
        self.offered_tools: list[dict[str, Any]] = []
        self.info: dict[str, float] = {}  # counted until the next step reports them
        self.rid = 0
        self._closer: weakref.finalize | None = None

    def reset(self) -> Sequence[Message]:
        env = self.env
        conversation = self.conversation = env.endpoint.open()
        self.rid, future = env.hub.submit(
            {
                "op": "run",
                "task": self.task,
                "base_url": env.endpoint.base_url(conversation),
                "model": env.model,
                "sampling": {},  # the trainer's sampling applies: the endpoint ignores the hub's
            }
        )
        future.add_done_callback(lambda done: conversation.inbox.put(("done", done)))
        # a dropped episode (the trainer failed elsewhere) still stops its run on the hub
        self._closer = weakref.finalize(
            self, _stop_run, env.hub, env.endpoint, conversation, self.rid
        )
        kind, item = self._next()
        if kind == "done":
            self.close()
            raise VerifiersError(_no_turn(item, self.task))
        self._asked(item)
        self.offered_tools = item.tools
        return [as_message(m) for m in item.messages]

    def step(self, turn: AssistantTurn) -> StepResult:
        if self.request is None:
            raise VerifiersError("verifiers: step before reset, or after the episode ended")
        if turn.call_errors:
            self._count("verifiers/call_errors", len(turn.call_errors))
        self.request.answer(200, completion(turn, self.env.model))
        self.request = None
        kind, item = self._next()
        if kind == "done":
            self.close()
            return _finished(item, self._flush())
        fresh = _observations(self.known, item.messages)
        if fresh is None:  # the agent rewrote its history (compaction): not one conversation
            self.close()
            self._count("verifiers/history_rewritten")
            return StepResult(done=True, info=self._flush())
        self._asked(item)
        return StepResult(tuple(as_message(m) for m in fresh), info=self._flush())

    def truncated(self, reason: str) -> float:
        self.close()
        return 0.0

    def close(self) -> None:
        self.request = None
        if self._closer is not None:
            self._closer()

    def _asked(self, request: ChatRequest) -> None:
        self.request, self.known = request, request.messages
        rendered = self.env.rendered_tools
        if rendered is not None and request.tools != rendered:
            # the trainer renders the tools once (tools()): these the policy was not shown
            self._count("verifiers/tools_differ")

    def _count(self, key: str, n: float = 1.0) -> None:
        self.info[key] = self.info.get(key, 0.0) + n

    def _flush(self) -> dict[str, float]:
        info, self.info = self.info, {}
        return info

    def _next(self) -> tuple[str, Any]:
        """The next thing the hub did: asked for a turn (``request``) or ended (``done``)."""
        assert self.conversation is not None
        try:
            kind, item = self.conversation.inbox.get(timeout=self.env.timeout_s)
        except queue.Empty:
            self.close()
            raise VerifiersError(
                f"verifiers: the environment neither asked for a turn nor ended within "
                f"{self.env.timeout_s:g} s (episode.options.timeout_s); its log: "
                f"{self.env.hub.log_path}"
            ) from None
        return kind, item


def _stop_run(hub: Hub, endpoint: Endpoint, conversation: Conversation, rid: int) -> None:
    endpoint.forget(conversation)  # a turn still asked for is refused: the agent stops
    hub.cancel(rid)  # a no-op for a run already over


def _observations(known: list[dict[str, Any]], messages: list[dict[str, Any]]) -> list[Any] | None:
    """The messages after the policy's turn in the next request, or ``None`` when the request
    does not extend the last one by that turn (its history was rewritten)."""
    turn = len(known)
    if len(messages) <= turn + 1 or messages[turn].get("role") != "assistant":
        return None
    if [m.get("role") for m in messages[:turn]] != [m.get("role") for m in known]:
        return None
    return messages[turn + 1 :]


def _reply(done: Future[dict[str, Any]]) -> dict[str, Any]:
    """The run's reply; a sidecar that died or a run the hub refused raise one line."""
    reply = done.result()  # done already (its callback queued it); raises if the sidecar died
    if "error" in reply:
        raise VerifiersError(f"verifiers: the hub refused the run: {reply['error']}")
    return reply


def _no_turn(done: Future[dict[str, Any]], task: Mapping[str, Any]) -> str:
    reply = _reply(done)
    errors = "; ".join(reply.get("errors") or []) or "no error recorded"
    row = json.dumps(dict(task))[:120]
    return f"verifiers: the environment's run of {row} ended before it asked the model: {errors}"


def _finished(done: Future[dict[str, Any]], info: dict[str, float]) -> StepResult:
    reply = _reply(done)
    if reply.get("cancelled"):
        return StepResult(done=True, info=info)
    for name, value in (reply.get("rewards") or {}).items():
        info[f"verifiers/reward/{name}"] = float(value)
    for name, value in (reply.get("metrics") or {}).items():
        info[f"verifiers/metric/{name}"] = float(value)
    if not reply.get("ok", True):
        info["verifiers/failed"] = 1.0  # counted every time, told once per kind of error
        errors = "; ".join(reply.get("errors") or []) or "no error recorded"
        if errors not in _told:
            _told.add(errors)
            log.warning("verifiers: an episode ended with errors: %s", errors)
    return StepResult(reward=float(reply.get("reward") or 0.0), done=True, info=info)


class VerifiersEnvironment(Environment):
    """``env=verifiers``; options in the module docstring."""

    def __init__(self, options: Mapping[str, Any] | None = None) -> None:
        super().__init__(options)
        o = self.options
        unknown = sorted(set(o) - set(OPTIONS))
        if unknown:
            raise ValueError(
                f"verifiers: no option {', '.join(unknown)}; it takes {', '.join(OPTIONS)}"
            )
        for required in ("id", "python"):
            if not o.get(required):
                raise ValueError(f"verifiers: set episode.options.{required} ({_HELP[required]})")
        for name in ("config", "val"):
            if not isinstance(o.get(name) or {}, Mapping):
                raise ValueError(f"verifiers: {name} must be a mapping, got {o[name]!r}")
        self.timeout_s = _positive(o, "timeout_s", 600.0)
        start_timeout_s = _positive(o, "start_timeout_s", 300.0)
        workers = int(o.get("workers", 1))
        if workers < 1:
            raise ValueError(f"verifiers: workers must be >= 1, got {workers}")
        self.model = str(o.get("model") or "policy")
        self.val = dict(o.get("val") or {})
        paths = o.get("pythonpath") or []
        pythonpath = os.pathsep.join([paths] if isinstance(paths, str) else map(str, paths))
        self.endpoint = Endpoint(self.model, request_timeout_s=self.timeout_s)
        try:
            self.hub = Hub(
                str(o["python"]),
                {
                    "id": str(o["id"]),
                    "config": dict(o.get("config") or {}),
                    "runtime": str(o.get("runtime", "subprocess")),
                    "workers": workers,
                    "start_timeout_s": start_timeout_s,
                },
                env={KEY_VAR: self.endpoint.key},
                pythonpath=pythonpath,
                start_timeout_s=start_timeout_s,
            )
        except BaseException:
            self.endpoint.close()
            raise
        self.env_id = str(self.hub.info.get("env_id") or o["id"])
        #: the tools the trainer renders for the policy, once tools() has read them
        self.rendered_tools: list[dict[str, Any]] | None = None
        self._finalizer = weakref.finalize(self, _shutdown, self.hub, self.endpoint)

    def close(self) -> None:
        """Stops the hub's server and the endpoint (also done at exit)."""
        self._finalizer()

    def episode(self, task: Task) -> Episode:
        return VerifiersEpisode(self, task)

    def tasks(self, split: str, count: int, seed: int) -> list[Task]:
        if split != "train" and not self.val:
            raise NotImplementedError(
                "verifiers: no validation tasks without episode.options.val (taskset settings)"
            )
        request = {"op": "tasks", "split": split, "count": count, "seed": seed, "val": self.val}
        return self.hub.call(request, self.timeout_s)["tasks"]

    def tools(self) -> Sequence[Mapping[str, Any]]:
        """The tools the hub's agent offers, read from the first request of a probe episode
        (the first training task; stopped there): the hub's harness and its tool servers
        decide them at run time, and the trainer renders them once."""
        if self.rendered_tools is None:
            probe = VerifiersEpisode(self, self.tasks("train", 1, 0)[0])
            try:
                probe.reset()
            finally:
                probe.close()
            self.rendered_tools = list(probe.offered_tools)
        return self.rendered_tools


_HELP = {
    "id": "the environment's id: its taskset package, as installed in episode.options.python",
    "python": "the interpreter of a virtual environment with verifiers 0.4; "
    "python -m drivetrain.envs.verifiers.venv DIR makes one",
}


def _positive(options: Mapping[str, Any], name: str, default: float) -> float:
    value = float(options.get(name, default))
    if value <= 0:
        raise ValueError(f"verifiers: {name} must be > 0, got {value:g}")
    return value


def _shutdown(hub: Hub, endpoint: Endpoint) -> None:
    endpoint.close()
    hub.close()
