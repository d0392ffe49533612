"""Multi-turn episodes played on the rollouts, many at once, token-exact.

Every episode is a chain of requests: turn ``t``'s prompt is the first prompt plus every
token sampled or observed so far, so the rollout continues exactly the token ids the trainer
will train on. Requests of all episodes share the rollouts (continuous batching): an episode
whose turn finished is parsed, stepped by its environment in a worker thread (tools may be
slow) and resubmitted, while the others keep generating. Episode ``k`` stays on one replica
(``runtime.replicas.replica_slots``: its growing prompt shares a prefix there) and is seeded
per turn from the step's seed, whatever its replica, so a run is reproducible.

The trainer ends an episode early at ``max_turns`` turns, when the next turn would have no
room (the episode's token budget or the context), and gives the environment a last word
(:meth:`~drivetrain.api.environment.Episode.truncated`); the reason is in the metrics.

Nothing an environment does can hang the run: its calls run on daemon threads
(:class:`~drivetrain.runtime.daemon_pool.DaemonPool`), each step, the trainer's handling of
its result included, has ``step_timeout_s``, and what a model or an environment can make a step
cost is bounded (:mod:`~drivetrain.trainer.agentic.bounds`). Every failure of an environment
is an :class:`EpisodeError`, a one-line error naming the environment, the episode and the
setting; a hung call is abandoned and does not keep the process alive.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass, field, replace
from typing import Any

from drivetrain.api import Completion, FinishReason, SamplingParams
from drivetrain.api.environment import Environment, Episode, StepResult, Task
from drivetrain.api.errors import DrivetrainError
from drivetrain.api.requests import Request, sample_seed
from drivetrain.runtime.daemon_pool import DaemonPool
from drivetrain.runtime.replicas import replica_slots
from drivetrain.runtime.rollout_service import RolloutService
from drivetrain.trainer.agentic.bounds import (
    CUT_INFO_ENTRIES,
    CUT_OBSERVATION_CHARS,
    CUT_TOOL_CALLS,
    EpisodeBounds,
    cut_observations,
    limit_calls,
    step_info,
)
from drivetrain.trainer.agentic.chat_tokens import ChatTokens
from drivetrain.trainer.agentic.growing import GrowingTrajectory
from drivetrain.trainer.agentic.tool_parsers import ToolParser, parse_turn
from drivetrain.trainer.errors import said
from drivetrain.trainer.trajectory import Trajectory

#: how often a play waiting on queued environment calls looks at when they started (seconds)
QUEUED_CHECK_S = 0.5
#: characters a token holds at most, for the purpose of refusing a first prompt untokenised
MAX_CHARS_PER_TOKEN = 64


class EpisodeError(DrivetrainError):
    """An environment raised, hung or returned what cannot be used (a bug of the environment:
    a model's bad turn is an observation)."""


@dataclass(frozen=True)
class EpisodeLimits:
    """``max_turns`` assistant turns; ``turn_tokens`` sampled per turn (the sampling's
    ``max_new_tokens``); ``episode_tokens`` after the first prompt, sampled and observed (0:
    only the context bounds it); ``context`` tokens in all."""

    max_turns: int
    turn_tokens: int
    episode_tokens: int
    context: int

    def __post_init__(self) -> None:
        if self.max_turns < 1 or self.turn_tokens < 1 or self.context < 2:
            raise ValueError(f"invalid episode limits {self}")

    def budget(self, prompt: int, used: int, asked: int = 0) -> tuple[int, str]:
        """Tokens the next turn may sample after a ``prompt``-token first prompt and ``used``
        tokens since (``asked``: a smaller budget the caller wants), and what bounds it when
        not the turn budget: ``context`` or ``episode_tokens``."""
        budget, why = min(self.turn_tokens, asked or self.turn_tokens), ""
        if self.context - prompt - used < budget:
            budget, why = self.context - prompt - used, "context"
        if self.episode_tokens and self.episode_tokens - used < budget:
            budget, why = self.episode_tokens - used, "episode_tokens"
        return budget, why


@dataclass(frozen=True)
class PlayedEpisode:
    """One finished episode: its tokens, rewards and what happened."""

    task: int  # index into the tasks played
    trajectory: Trajectory
    turn_rewards: tuple[float, ...]  # per turn; a truncation's reward is added to the last
    truncation: str  # "" when the environment ended it
    info: Mapping[str, float]  # the steps' info, summed

    @property
    def reward(self) -> float:
        return sum(self.turn_rewards)

    @property
    def turns(self) -> int:
        return len(self.trajectory.turn_ends)


@dataclass(kw_only=True)
class _Live(GrowingTrajectory):
    number: int  # k: task k // n, sample k % n
    task: int
    replica: int
    episode: Episode | None = None
    rewards: list[float] = field(default_factory=list)
    info: dict[str, float] = field(default_factory=dict)
    bound: str = ""  # what bounds the running turn's budget, when not the turn budget
    truncation: str = ""
    done: bool = False


class EpisodeRunner:
    """Plays episodes of ``environment`` through ``rollouts``, the placement's rollout service
    (see the module docstring)."""

    def __init__(
        self,
        rollouts: RolloutService,
        environment: Environment,
        parser: ToolParser,
        chat: ChatTokens,
        limits: EpisodeLimits,
        *,
        env_threads: int = 8,
        step_timeout_s: float = 600.0,
        bounds: EpisodeBounds | None = None,
    ) -> None:
        self.rollouts = rollouts
        self.environment, self.parser, self.chat, self.limits = environment, parser, chat, limits
        self.env_threads, self.step_timeout_s = env_threads, step_timeout_s
        self.bounds = bounds or EpisodeBounds()
        self.name = type(environment).__name__
        self.plays = 0  # request ids carry the play's number: never reused across plays

    def play(self, tasks: Sequence[Task], n: int, params: SamplingParams) -> list[PlayedEpisode]:
        """``n`` episodes of every task; ``result[i * n + j]`` is episode ``j`` of task ``i``.
        ``params.seed`` seeds every turn of every episode (one seed per episode and turn)."""
        if not tasks:
            return []
        play = _Play(self, tasks, n, params, f"p{self.plays}")
        self.plays += 1
        pool = DaemonPool(self.env_threads, name="episode")
        # the play's requests go through the rollout service, polled in its threads; releasing
        # it aborts and drains whatever a failed play left running, so the next starts clean
        service = self.rollouts
        service.poll_in_threads()
        play.pool, play.service = pool, service
        try:
            play.run()
        finally:
            pool.abandon()  # queued environment calls dropped; a hung one left behind
            service.release()
        return [play.result(live) for live in play.live]

    def close(self) -> None:
        """Nothing to release (the rollouts are the placement's); as the agent runner's."""
        return None


class _Play:
    """One :meth:`EpisodeRunner.play` call's state."""

    def __init__(
        self,
        runner: EpisodeRunner,
        tasks: Sequence[Task],
        n: int,
        params: SamplingParams,
        name: str,
    ) -> None:
        self.runner, self.tasks, self.params, self.name = runner, tasks, params, name
        slots = replica_slots(len(tasks) * n, len(runner.rollouts.rollouts))
        self.live = [
            _Live(number=k, task=k // n, replica=slot.replica) for k, slot in enumerate(slots)
        ]
        self.generating: dict[Future[Completion], _Live] = {}  # each episode's running turn
        self.stepping: dict[Future[Any], tuple[_Live, Callable[[_Live, Any], None]]] = {}
        #: when each environment call began on a worker (empty while it waits for one: time
        #: in the pool's queue is not the environment's)
        self.started: dict[Future[Any], list[float]] = {}
        self.pool: DaemonPool | None = None
        self.service: RolloutService | None = None

    # ---- the loop ------------------------------------------------------------------------
    def run(self) -> None:
        """Until every episode is done: apply each turn or environment call that finished
        (in this thread, which alone touches the tokenizer and the episodes' state)."""
        for live in self.live:
            self._in_thread(live, self._reset, self._started)
        while not all(live.done for live in self.live):
            done = self._wait()
            for future in [f for f in done if f in self.generating]:
                self._turn_done(self.generating.pop(future), future.result())
            self._collect_steps([f for f in done if f in self.stepping])

    def _in_thread(
        self, live: _Live, work: Callable[[_Live], Any], then: Callable[[_Live, Any], None]
    ) -> None:
        assert self.pool is not None
        began: list[float] = []

        def timed(lv: _Live) -> Any:
            began.append(time.monotonic())
            return work(lv)

        future = self.pool.submit(timed, live)
        self.stepping[future] = (live, then)
        self.started[future] = began

    def _wait(self) -> set[Future[Any]]:
        """The turns and environment calls that finished, waiting for one; an environment
        call running longer than the runner's ``step_timeout_s`` fails the play."""
        limit = self.runner.step_timeout_s
        oldest = min((b[0] for b in self.started.values() if b), default=None)
        left = None if oldest is None else max(0.0, oldest + limit - time.monotonic())
        if any(not b for b in self.started.values()):  # queued calls start meanwhile: look again
            left = QUEUED_CHECK_S if left is None else min(left, QUEUED_CHECK_S)
        pending = [*self.generating, *self.stepping]
        if not pending:  # every unfinished episode generates or is being stepped
            raise EpisodeError(f"play {self.name}: episodes unfinished with nothing running")
        # a turn's generation ends or fails through the service (a rollout's error, its
        # process gone); the environment's calls are bounded by step_timeout_s
        done, _ = wait(pending, timeout=left, return_when=FIRST_COMPLETED)
        if not done and oldest is not None and time.monotonic() - oldest > limit:
            future = next(f for f, b in self.started.items() if b and b[0] == oldest)
            live, _ = self.stepping[future]
            raise EpisodeError(
                f"environment {self.runner.name} did not answer episode {live.number} (task "
                f"{live.task}) within {limit:g} s (episode.step_timeout_s); its call is "
                "abandoned"
            )
        return done

    def _collect_steps(self, done: list[Future[Any]]) -> None:
        """Apply the environment calls that finished: an exception there, a result that cannot
        be used, or a step whose handling here (tokenising its observations) takes it past
        ``step_timeout_s`` fails the play."""
        limit = self.runner.step_timeout_s
        for future in done:
            began = (self.started.pop(future) or [time.monotonic()])[0]
            live, then = self.stepping.pop(future)
            where = f"environment {self.runner.name} in episode {live.number} (task {live.task})"
            try:
                value = future.result()
            except BaseException as exc:  # a plugin's SystemExit is its bug, not our exit
                raise EpisodeError(f"{where} raised {said(exc)}") from exc
            try:
                then(live, value)
            except EpisodeError:
                raise
            except Exception as exc:
                raise EpisodeError(f"{where} returned what cannot be used: {said(exc)}") from exc
            took = time.monotonic() - began
            if took > limit:
                raise EpisodeError(
                    f"{where}: the step took {took:.1f} s with the trainer's handling of its "
                    f"result, over {limit:g} s (episode.step_timeout_s)"
                )

    # ---- an episode's course --------------------------------------------------------------
    def _reset(self, live: _Live) -> Sequence[Any]:
        live.episode = self.runner.environment.episode(self.tasks[live.task])
        return live.episode.reset()

    def _started(self, live: _Live, messages: Sequence[Any]) -> None:
        # rendered here, not in the worker: a fast tokenizer is not safe to share between
        # threads (every ChatTokens call stays in this loop's thread)
        context = self.runner.limits.context
        chars = sum(len(str(m.get("content", ""))) for m in messages if isinstance(m, Mapping))
        if chars > context * MAX_CHARS_PER_TOKEN:  # it cannot fit: not worth tokenising
            raise EpisodeError(
                f"task {live.task}'s first prompt has {chars} characters, more than the "
                f"context of {context} tokens can hold"
            )
        prompt = self.runner.chat.prompt(messages)
        live.prompt = prompt
        if len(prompt) >= self.runner.limits.context:
            raise EpisodeError(
                f"task {live.task}'s first prompt has {len(prompt)} tokens, no room left in "
                f"the context of {self.runner.limits.context}"
            )
        self._next_turn(live)

    def _budget(self, live: _Live) -> tuple[int, str]:
        return self.runner.limits.budget(len(live.prompt), len(live.tokens))

    def _next_turn(self, live: _Live) -> None:
        turn = len(live.turn_ends)
        budget, live.bound = self._budget(live)
        seed = self.params.seed
        if seed is not None:
            seed = sample_seed(seed, live.number * self.runner.limits.max_turns + turn)
        request = Request(
            f"{self.name}-e{live.number}-t{turn}",
            tuple(live.prompt + live.tokens),
            replace(self.params, n=1, max_new_tokens=budget, seed=seed),
            prompt_index=live.number,
        )
        assert self.service is not None
        self.generating[self.service.submit(live.replica, request)] = live

    def _turn_done(self, live: _Live, completion: Completion) -> None:
        live.add_turn(completion)
        if not completion.token_ids:  # nothing sampled (aborted at once): nothing to step
            self._truncate(live, "context")
            return
        if completion.finish_reason is FinishReason.LENGTH and live.bound:
            self._truncate(live, live.bound)  # cut by the episode's room, not the turn's budget
            return
        text = self.runner.chat.decode(completion.token_ids)
        turn = parse_turn(
            self.runner.parser,
            len(live.turn_ends) - 1,
            text,
            finished=completion.finish_reason is FinishReason.STOP,
        )
        turn, dropped = limit_calls(turn, self.runner.bounds.max_tool_calls)
        if dropped:
            live.info[CUT_TOOL_CALLS] = live.info.get(CUT_TOOL_CALLS, 0.0) + dropped
        sampled = list(completion.token_ids)
        self._in_thread(
            live, lambda lv: lv.episode.step(turn), lambda lv, r: self._stepped(lv, r, sampled)
        )

    def _stepped(self, live: _Live, result: StepResult, sampled: list[int]) -> None:
        if not isinstance(result, StepResult):
            raise TypeError(f"step returned {type(result).__name__}, not a StepResult")
        bounds = self.runner.bounds
        info, dropped_keys = step_info(result.info, bounds.info_keys)
        live.rewards.append(float(result.reward))
        if dropped_keys:
            info[CUT_INFO_ENTRIES] = info.get(CUT_INFO_ENTRIES, 0.0) + dropped_keys
        for key, value in info.items():
            live.info[key] = live.info.get(key, 0.0) + value
        if result.done:
            live.done = True
            return
        if len(live.turn_ends) >= self.runner.limits.max_turns:
            self._truncate(live, "max_turns")
            return
        messages, cut = cut_observations(result.observations, bounds.observation_chars)
        if cut:
            live.info[CUT_OBSERVATION_CHARS] = live.info.get(CUT_OBSERVATION_CHARS, 0.0) + cut
        observed = self.runner.chat.observation(messages, sampled)
        live_tokens = len(live.tokens) + len(observed)
        limits = self.runner.limits
        if limits.episode_tokens and live_tokens >= limits.episode_tokens:
            self._truncate(live, "episode_tokens")
            return
        if len(live.prompt) + live_tokens >= limits.context:
            self._truncate(live, "context")
            return
        live.add_observation(observed)
        self._next_turn(live)

    def _truncate(self, live: _Live, reason: str) -> None:
        live.truncation = reason
        live.rewards += [0.0] * (len(live.turn_ends) - len(live.rewards))  # turns not stepped
        if live.episode is None or not live.turn_ends:
            live.done = True
            return
        self._in_thread(live, lambda lv: lv.episode.truncated(reason), self._last_word)

    def _last_word(self, live: _Live, reward: float) -> None:
        live.rewards[-1] += float(reward)
        live.done = True

    # ---- results and failure ----------------------------------------------------------------
    def result(self, live: _Live) -> PlayedEpisode:
        trajectory = live.trajectory(live.number)
        return PlayedEpisode(live.task, trajectory, tuple(live.rewards), live.truncation, live.info)
