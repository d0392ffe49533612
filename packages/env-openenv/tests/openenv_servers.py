"""Real OpenEnv environments, served by OpenEnv's own server (``create_app`` under uvicorn) in
a process of their own, for the adapter's tests:

- ``guess``: guess a number, told higher or lower; rewarded 1 when right (multi-turn, ends);
- ``echo``: the rule of the environment ``openenv init`` writes: the message comes back,
  rewarded ``min(0.1 x its length, 1)``, never done; a reward an untrained model's text varies
  on, so a GRPO step has something to learn from.

Written as an OpenEnv author writes one (typed ``Action``/``Observation``, an ``Environment``
with ``reset``/``step``), so the tests play the protocol OpenEnv's framework speaks, not a
double of it. ``python openenv_servers.py --env guess --fd N`` serves on an inherited listening
socket (no port race); the ``GUESS_TOKEN`` variable stands in for a private Space's proxy:
every request and socket without ``Authorization: Bearer <it>`` is refused. :func:`serve`
starts one and waits for it.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

HIGH = 10  # numbers from 1 to HIGH unless reset says otherwise
TRIES = 4  # wrong guesses before the episode ends with no reward
CRASH = -1  # a guess the referee cannot take: the environment raises (a server-side failure)


def build_app(kind: str, max_sessions: int, token: str = "") -> Any:
    from openenv.core.env_server.http_server import create_app

    environment, action, observation = {"guess": guess_env, "echo": echo_env}[kind]()
    app = create_app(
        environment, action, observation, env_name=kind, max_concurrent_envs=max_sessions
    )
    return _require_token(app, token) if token else app


def guess_env() -> tuple[type, type, type]:
    from openenv.core.env_server.interfaces import Environment
    from openenv.core.env_server.types import Action, Observation, State
    from pydantic import Field

    class GuessAction(Action):
        guess: int = Field(..., description="your guess")

    class GuessObservation(Observation):
        prompt: str = Field(default="", description="what the referee says")

    class GuessEnvironment(Environment):
        SUPPORTS_CONCURRENT_SESSIONS = True

        def __init__(self) -> None:
            super().__init__()
            self.secret, self.tries, self._state = 0, 0, State(step_count=0)

        def reset(self, seed: int | None = None, high: int = HIGH, **_: Any) -> GuessObservation:
            self.secret, self.tries = random.Random(seed).randint(1, high), 0
            self._state = State(step_count=0)
            return GuessObservation(prompt=f"I picked a number from 1 to {high}. Your guess?")

        def step(self, action: GuessAction, **_: Any) -> GuessObservation:  # type: ignore[override]
            if action.guess == CRASH:
                raise RuntimeError("the referee fell over")
            self.tries += 1
            self._state.step_count = self.tries
            if action.guess == self.secret:
                return GuessObservation(prompt="Right!", reward=1.0, done=True)
            hint = "Higher." if action.guess < self.secret else "Lower."
            return GuessObservation(prompt=hint, reward=0.0, done=self.tries >= TRIES)

        @property
        def state(self) -> State:
            return self._state

    return GuessEnvironment, GuessAction, GuessObservation


def echo_env() -> tuple[type, type, type]:
    from openenv.core.env_server.interfaces import Environment
    from openenv.core.env_server.types import Action, Observation, State
    from pydantic import Field

    class EchoAction(Action):
        message: str = Field(..., description="message to echo back")

    class EchoObservation(Observation):
        echoed_message: str = Field(default="", description="the message, echoed")

    class EchoEnvironment(Environment):
        SUPPORTS_CONCURRENT_SESSIONS = True

        def __init__(self) -> None:
            super().__init__()
            self._state = State(step_count=0)

        def reset(self, **_: Any) -> EchoObservation:
            self._state = State(step_count=0)
            return EchoObservation(echoed_message="Echo environment ready! Say something.")

        def step(self, action: EchoAction, **_: Any) -> EchoObservation:  # type: ignore[override]
            self._state.step_count += 1
            reward = min(len(action.message) * 0.1, 1.0)
            return EchoObservation(echoed_message=action.message, reward=reward)

        @property
        def state(self) -> State:
            return self._state

    return EchoEnvironment, EchoAction, EchoObservation


def _require_token(app: Any, token: str) -> Any:
    wanted = f"Bearer {token}".encode()

    async def guarded(scope: dict, receive: Any, send: Any) -> None:
        if (
            scope["type"] in ("http", "websocket")
            and dict(scope["headers"]).get(b"authorization") != wanted
        ):
            if scope["type"] == "websocket":  # closed before accept: the client sees HTTP 403
                await send({"type": "websocket.close", "code": 1008})
                return
            await send({"type": "http.response.start", "status": 401, "headers": []})
            await send({"type": "http.response.body", "body": b"token required"})
            return
        await app(scope, receive, send)

    return guarded


@contextlib.contextmanager
def serve(
    kind: str = "guess", max_sessions: int = 8, token: str = "", deadline_s: float = 60.0
) -> Iterator[str]:
    """The base URL of a fresh server of environment ``kind`` on loopback, up until the block
    ends."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    base = f"http://127.0.0.1:{listener.getsockname()[1]}"
    cmd = [sys.executable, __file__, "--fd", str(listener.fileno()), "--env", kind]
    cmd += ["--sessions", str(max_sessions)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GUESS_TOKEN": token}
    server = subprocess.Popen(cmd, pass_fds=[listener.fileno()], env=env)
    listener.close()  # the server holds its own copy
    try:
        _wait_healthy(base, server, deadline_s, token)
        yield base
    finally:
        server.terminate()
        try:
            server.wait(timeout=10)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


def _wait_healthy(base: str, server: subprocess.Popen, deadline_s: float, token: str) -> None:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"the OpenEnv server exited ({server.returncode}) before serving")
        try:
            request = urllib.request.Request(f"{base}/health", headers=headers)
            with urllib.request.urlopen(request, timeout=2):
                return
        except OSError:
            time.sleep(0.1)  # the server is importing OpenEnv (seconds): poll its health
    raise RuntimeError(f"the OpenEnv server at {base} was not healthy within {deadline_s:g} s")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--fd", type=int, required=True)
    parser.add_argument("--env", choices=("guess", "echo"), default="guess")
    parser.add_argument("--sessions", type=int, default=8)
    args = parser.parse_args()
    import uvicorn

    app = build_app(args.env, args.sessions, os.environ.get("GUESS_TOKEN", ""))
    uvicorn.run(app, fd=args.fd, log_level="warning")


if __name__ == "__main__":
    main()
