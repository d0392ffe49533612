"""An OpenEnv environment server as a drivetrain environment: each episode is a session on the
server, each assistant turn one action, the server's per-step rewards the episode's.

``episode.options`` (``drivetrain grpo env=openenv episode.options.url=http://127.0.0.1:8000``):

- ``url`` (required): the server's base URL (``http(s)://host:port``); the job reads its
  ``/schema`` at start and fails in one line if no OpenEnv server answers there;
- ``action_field``: the action field the assistant's text goes in; default: the action's one
  required field (a server whose action has several must be told which);
- ``action_format``: ``text`` (default: the turn's text is that field's value) or ``json``
  (the turn's text is the whole action, a JSON object);
- ``observation_field``: the observation field shown to the policy as the next user message;
  default: the observation's one text field, else the observation as JSON;
- ``system_prompt``: a system message before the first observation; default none;
- ``reset``: keywords for the server's ``reset`` in every episode (``{difficulty: 3}``); a task
  row's own fields are added to them (a row of ``data.train_path`` is a task), and the tasks the
  environment makes itself are ``{"seed": ...}``, reproducible from the run's seed and split;
- ``token_env``: the name of an environment variable holding a bearer token for the server
  (a private Hugging Face Space): the token itself never goes into the job's config;
- ``timeout_s``: how long to wait for the server to answer one message (default 60).

An action the server's schema refuses (a ``guess`` that is not a number) is the policy's
mistake: it becomes an observation naming the field and the episode goes on
(``env/openenv/invalid_actions`` counts them). A server that fails, closes or goes silent fails
the episode in one line naming the URL. Each episode holds one session from its first message to
its last: the server must allow as many at once as there are episodes in flight.
"""

from __future__ import annotations

import json
import os
import weakref
import zlib
from collections.abc import Mapping, Sequence
from typing import Any

from drivetrain.api.environment import (
    AssistantTurn,
    Environment,
    Episode,
    Message,
    StepResult,
    Task,
)
from drivetrain.envs.openenv.protocol import (
    ActionRejected,
    OpenEnvError,
    Session,
    fetch_schema,
    http_base,
)

OPTIONS = (
    "url",
    "action_field",
    "action_format",
    "observation_field",
    "system_prompt",
    "reset",
    "token_env",
    "timeout_s",
)
#: Fields every OpenEnv observation has, none of them for the policy to read.
OBSERVATION_BASE = ("done", "reward", "metadata")


def split_seed(split: str, seed: int) -> int:
    """The first reset seed of a split; far apart for different splits and run seeds."""
    return zlib.crc32(f"drivetrain:openenv:{split}:{seed}".encode()) & 0x7FFFFFFF


def _properties(schema: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in (schema.get("properties") or {}).items() if k != "metadata"}


def choose_action_field(schema: Mapping[str, Any], asked: str | None) -> str:
    """The field the turn's text goes in: the one asked for, or the action's one required field."""
    fields = _properties(schema)
    if asked:
        if asked not in fields:
            raise ValueError(
                f"openenv: the server's action has no field {asked!r}; it has "
                f"{', '.join(fields) or '(none)'}"
            )
        return asked
    required = [f for f in schema.get("required") or () if f in fields]
    if len(required) == 1:
        return required[0]
    raise ValueError(
        f"openenv: the server's action has fields {', '.join(fields) or '(none)'}: set "
        "episode.options.action_field to the one the assistant writes, or action_format=json"
    )


def choose_observation_field(schema: Mapping[str, Any], asked: str | None) -> str | None:
    """The field shown to the policy, or ``None`` for the whole observation as JSON."""
    fields = {k: v for k, v in _properties(schema).items() if k not in OBSERVATION_BASE}
    if asked:
        if asked not in fields:
            raise ValueError(
                f"openenv: the server's observation has no field {asked!r}; it has "
                f"{', '.join(fields) or '(none)'}"
            )
        return asked
    text = [name for name, spec in fields.items() if spec.get("type") == "string"]
    return text[0] if len(text) == 1 else None


class OpenEnvEpisode(Episode):
    """One session on the server. The trainer calls one method at a time per episode."""

    def __init__(self, env: OpenEnvEnvironment, reset: Mapping[str, Any]) -> None:
        self.env, self.reset_options = env, dict(reset)
        self.session: Session | None = None
        self._closer: weakref.finalize | None = None

    def reset(self) -> Sequence[Message]:
        self.session = Session(self.env.base, self.env.headers(), self.env.timeout_s)
        # an episode the trainer drops (a failed step elsewhere) still frees its server session
        self._closer = weakref.finalize(self, self.session.close)
        reply = self.session.reset(self.reset_options)
        system = [{"role": "system", "content": self.env.system}] if self.env.system else []
        return [*system, {"role": "user", "content": self.env.render(reply)}]

    def step(self, turn: AssistantTurn) -> StepResult:
        if self.session is None:
            raise OpenEnvError(
                "openenv: step without an open session (before reset, or after the end)"
            )
        try:
            action = self.env.action(turn.content)
            reply = self.session.step(action)
        except ActionRejected as exc:
            message = f"Invalid action: {exc.detail}"
            return StepResult(
                ({"role": "user", "content": message},), info={"openenv/invalid_actions": 1.0}
            )
        except OpenEnvError:
            self.close()
            raise
        reward = float(reply.get("reward") or 0.0)
        if reply.get("done"):
            self.close()
            return StepResult(reward=reward, done=True)
        content = self.env.render(reply)
        return StepResult(({"role": "user", "content": content},), reward=reward)

    def truncated(self, reason: str) -> float:
        self.close()
        return 0.0

    def close(self) -> None:
        self.session = None
        if self._closer is not None:
            self._closer()


class OpenEnvEnvironment(Environment):
    """``env=openenv``; options in the module docstring."""

    def __init__(self, options: Mapping[str, Any] | None = None) -> None:
        super().__init__(options)
        unknown = sorted(set(self.options) - set(OPTIONS))
        if unknown:
            raise ValueError(
                f"openenv: no option {', '.join(unknown)}; it takes {', '.join(OPTIONS)}"
            )
        if not self.options.get("url"):
            raise ValueError(
                "openenv: set episode.options.url to the OpenEnv server's http(s)://host:port"
            )
        self.base = http_base(str(self.options["url"]))
        self.timeout_s = float(self.options.get("timeout_s", 60.0))
        if self.timeout_s <= 0:
            raise ValueError(f"openenv: timeout_s must be > 0, got {self.timeout_s:g}")
        self.token_env = str(self.options.get("token_env") or "")
        if self.token_env and not os.environ.get(self.token_env):
            raise ValueError(f"openenv: token_env names {self.token_env}, which is not set")
        self.format = str(self.options.get("action_format", "text"))
        if self.format not in ("text", "json"):
            raise ValueError(f"openenv: action_format is text or json, got {self.format!r}")
        reset = self.options.get("reset") or {}
        if not isinstance(reset, Mapping):
            raise ValueError(f"openenv: reset must be a mapping of keywords, got {reset!r}")
        self.reset_options = dict(reset)
        self.system = str(self.options.get("system_prompt") or "")
        schema = fetch_schema(self.base, self.headers(), self.timeout_s)
        asked = self.options.get("action_field")
        self.action_field = (
            None if self.format == "json" else choose_action_field(schema["action"], asked)
        )
        self.observation_field = choose_observation_field(
            schema.get("observation") or {}, self.options.get("observation_field")
        )

    def headers(self) -> dict[str, str]:
        token = os.environ.get(self.token_env, "") if self.token_env else ""
        return {"Authorization": f"Bearer {token}"} if token else {}

    def action(self, text: str) -> dict[str, Any]:
        """The action the turn's text is (``ActionRejected`` if it is not a JSON object when
        it must be one)."""
        if self.action_field is not None:
            return {self.action_field: text.strip()}
        try:
            action = json.loads(text)
        except ValueError:
            action = None
        if not isinstance(action, dict):
            raise ActionRejected("the action must be one JSON object of the action's fields")
        return action

    def render(self, reply: Mapping[str, Any]) -> str:
        """The observation as the policy reads it."""
        observation = reply.get("observation") or {}
        if self.observation_field is not None:
            return str(observation.get(self.observation_field, ""))
        shown = {k: v for k, v in observation.items() if k not in OBSERVATION_BASE}
        return json.dumps(shown, sort_keys=True)

    def episode(self, task: Task) -> Episode:
        return OpenEnvEpisode(self, {**self.reset_options, **task})

    def tasks(self, split: str, count: int, seed: int) -> list[Task]:
        first = split_seed(split, seed)
        return [{"seed": first + i} for i in range(count)]
