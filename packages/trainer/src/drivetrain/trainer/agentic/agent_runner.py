"""Episodes played by an agent program of the user's, through the OpenAI-compatible endpoint.

:class:`AgentRunner` is :class:`~drivetrain.trainer.agentic.episodes.EpisodeRunner`'s twin for
agent code written against the OpenAI API: ``play`` opens one session per episode on a
:class:`~drivetrain.trainer.agentic.endpoint.ChatServer` (started once, reused), runs the agent
command once, and turns what the server recorded into :class:`PlayedEpisode` s.

The agent protocol: the command runs in its own process group, in the current directory, with

- ``DRIVETRAIN_EPISODES``: a JSON file listing the episodes to play, each
  ``{"session", "base_url", "reward_url", "task", "sample"}``: ``task`` is the task itself
  (e.g. ``{"question": ..., "answer": ...}``), ``sample`` which of its ``n`` samples this is.
  **Each episode uses its own** ``base_url`` (``http://127.0.0.1:<port>/sessions/<sid>/v1``):
  the server tells episodes apart by it.
- ``OPENAI_API_KEY``: the key every request needs (``Authorization: Bearer``).
- ``OPENAI_BASE_URL``: the first episode's ``base_url``, so that a one-episode agent runs
  unchanged; an agent playing several must use each episode's.

The agent plays every episode (concurrently, for throughput: requests of all episodes batch
together on the rollouts), optionally POSTs ``{"reward": r}`` to an episode's ``reward_url``,
and exits 0. An episode whose agent reported no reward gets ``score(task, text)``, ``text``
being its last assistant turn as the model wrote it (tool-call markup included).
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from drivetrain.api import SamplingParams
from drivetrain.api.environment import Task
from drivetrain.api.errors import DrivetrainError
from drivetrain.runtime.replicas import replica_slots
from drivetrain.runtime.rollout_service import RolloutService
from drivetrain.trainer.agentic.chat_tokens import ChatTokens
from drivetrain.trainer.agentic.endpoint import ChatServer
from drivetrain.trainer.agentic.episodes import EpisodeLimits, PlayedEpisode
from drivetrain.trainer.agentic.sessions import Session
from drivetrain.trainer.agentic.tool_parsers import ToolParser
from drivetrain.trainer.forced_exit import on_forced_exit

#: how much of the agent's stderr an error quotes (characters)
STDERR_TAIL = 2000


class AgentError(DrivetrainError, RuntimeError):
    """The agent program failed, timed out, or left an episode unplayed (one line: the
    command prints it as such, with the agent's stderr tail joined by ' | ')."""


class AgentRunner:
    """Plays episodes by running ``command`` (an argv list) against a chat endpoint over
    ``rollouts`` (see the module docstring).

    ``chat`` is a tokenizer with a chat template, or a function of a conversation's tools
    giving its :class:`ChatTokens`; ``parser`` reads tool calls; ``score(task, text)`` rewards
    an episode whose agent reported none; ``limits`` bound every episode's turns and tokens
    (each segment's, when the agent edited its history); ``timeout_s`` bounds one ``play``.
    ``env`` adds environment variables for the agent; ``host``, ``port`` and ``api_key`` are
    the server's (``127.0.0.1``, a free port, a fresh key)."""

    def __init__(
        self,
        rollouts: RolloutService,
        chat: Any,
        parser: ToolParser,
        command: Sequence[str],
        score: Callable[[Task, str], float],
        limits: EpisodeLimits,
        *,
        timeout_s: float = 3600.0,
        request_timeout_s: float = 600.0,
        env: Mapping[str, str] | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        api_key: str | None = None,
    ) -> None:
        if not command:
            raise ValueError("the agent command is empty")
        self.rollouts, self.parser = rollouts, parser
        if hasattr(chat, "apply_chat_template"):
            # the endpoint's own copy: its handler threads tokenise at once, and no other
            # user of the trainer's tokenizer can change its settings under them
            tokenizer = copy.deepcopy(chat)
            self.chat_for: Callable[[Sequence[Mapping[str, Any]]], ChatTokens] = lambda tools: (
                ChatTokens(tokenizer, tools)
            )
        else:
            self.chat_for = chat
        self.command, self.score, self.limits = list(command), score, limits
        self.timeout_s, self.request_timeout_s = timeout_s, request_timeout_s
        self.env = dict(env or {})
        self._server_options = {"host": host, "port": port, "api_key": api_key}
        self.server: ChatServer | None = None

    def start(self) -> ChatServer:
        """The endpoint, started on first use and kept for later plays."""
        if self.server is None:
            self.server = ChatServer(
                self.rollouts,
                self.chat_for,
                self.parser,
                request_timeout_s=self.request_timeout_s,
                **self._server_options,
            )
        return self.server

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
            self.server = None

    def __enter__(self) -> AgentRunner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def play(self, tasks: Sequence[Task], n: int, params: SamplingParams) -> list[PlayedEpisode]:
        """``n`` episodes of every task, played by one run of the agent command.

        Returns each episode's segments in episode order (episode ``k`` is sample ``k % n`` of
        task ``k // n``): one per episode, ``result[i * n + j]`` as from
        :meth:`EpisodeRunner.play`, unless an agent edited its history; then an episode gives
        several samples, all carrying its task index and reward (group by ``task``)."""
        if not tasks:
            return []
        server = self.start()
        slots = replica_slots(len(tasks) * n, server.replicas)
        sessions = [
            server.open_session(
                k, k // n, k % n, tasks[k // n], self.limits, params, replica=slot.replica
            )
            for k, slot in enumerate(slots)
        ]
        try:
            with tempfile.TemporaryDirectory(prefix="drivetrain-agent-") as tmp:
                self._run_agent(server, sessions, Path(tmp))
        finally:
            server.end_sessions([s.sid for s in sessions])
        unplayed = [s for s in sessions if not s.segments]
        if unplayed:
            named = ", ".join(f"{s.sid} (task {s.task}, sample {s.sample})" for s in unplayed[:5])
            more = f" and {len(unplayed) - 5} more" if len(unplayed) > 5 else ""
            raise AgentError(
                f"the agent played no turn of session {named}{more}: every episode in "
                "DRIVETRAIN_EPISODES needs at least one chat completion at its own base_url"
            )
        return [played for session in sessions for played in self._played(session)]

    def _run_agent(self, server: ChatServer, sessions: Sequence[Session], tmp: Path) -> None:
        episodes = [
            {
                "session": s.sid,
                "base_url": server.session_url(s.sid),
                "reward_url": f"{server.base_url}/sessions/{s.sid}/reward",
                "task": dict(s.task_data),
                "sample": s.sample,
            }
            for s in sessions
        ]
        path = tmp / "episodes.json"
        path.write_text(json.dumps(episodes, indent=1, ensure_ascii=False))
        env = {
            **os.environ,
            **self.env,
            "OPENAI_API_KEY": server.api_key,
            "OPENAI_BASE_URL": episodes[0]["base_url"],
            "DRIVETRAIN_EPISODES": str(path),
        }
        stderr_path = tmp / "agent.stderr"
        with open(stderr_path, "wb") as stderr:
            try:
                process = subprocess.Popen(
                    self.command,
                    env=env,
                    stdin=subprocess.DEVNULL,
                    stderr=stderr,
                    start_new_session=True,
                )
            except OSError as exc:
                raise AgentError(f"agent {self.command[0]!r} failed to start: {exc}") from exc
            started = time.monotonic()
            try:  # its own session outlives a forced exit (the stop grace's): kill it then too
                with on_forced_exit(lambda: _kill_group_now(process)):
                    code = process.wait(timeout=self.timeout_s)
            except subprocess.TimeoutExpired:
                code = None
            finally:  # the agent's helpers too, whatever happened
                _kill_group(process)
        if code is None:
            raise AgentError(
                f"agent {self.command[0]!r} timed out after {self.timeout_s:.0f} s (killed)"
                + _tail(stderr_path)
            )
        if code != 0:
            raise AgentError(
                f"agent {self.command[0]!r} exited with status {code} after "
                f"{time.monotonic() - started:.1f} s" + _tail(stderr_path)
            )

    def _played(self, session: Session) -> list[PlayedEpisode]:
        reported = session.reward is not None
        if session.reward is not None:
            reward = session.reward
        else:
            try:
                reward = float(self.score(session.task_data, session.segments[-1].last_text))
            except Exception as exc:
                raise AgentError(
                    f"score() raised on session {session.sid} (task {session.task}): "
                    f"{type(exc).__name__}: {exc}"
                ) from exc
        played = []
        for index, segment in enumerate(session.segments):
            turns = len(segment.turn_ends)
            info = {
                "agent/segments": float(len(session.segments)),
                "agent/segment": float(index),
                "agent/reported_reward": float(reported),
                "agent/tool_calls": float(segment.tool_calls),
                "agent/tool_call_errors": float(segment.call_errors),
            }
            played.append(
                PlayedEpisode(
                    task=session.task,
                    trajectory=segment.trajectory(session.number),
                    turn_rewards=(0.0,) * (turns - 1) + (reward,),
                    truncation=segment.truncation,
                    info=info,
                )
            )
        return played


def _kill_group(process: subprocess.Popen[bytes]) -> None:
    """Kill the agent's process group (it, and whatever it left running)."""
    _kill_group_now(process)
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout=10)


def _kill_group_now(process: subprocess.Popen[bytes]) -> None:
    """SIGKILL to the agent's process group, without waiting for it."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)


def _tail(path: Path) -> str:
    text = path.read_bytes()[-STDERR_TAIL:].decode(errors="replace").strip()
    return f"; stderr ends: {' | '.join(text.splitlines())}" if text else "; no stderr"
