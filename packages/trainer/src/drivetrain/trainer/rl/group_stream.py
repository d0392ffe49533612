"""Generation ahead of training (``algorithm.mode`` ``one_step_off`` and ``async``): the prompt
stream's groups generated on the rollouts while the trainer trains.

The stream is the sync loop's prompts in the sync loop's order: position ``q`` is prompt
``q % P`` of step ``q // P`` (``P`` prompts per step, each a group of ``n`` requests), seeded
exactly as the sync loop's ``generate`` call for that step seeds it and sent to the replica
that call would have used, so a stream that never runs ahead generates what the sync loop
generates.

Admission bounds staleness: position ``q`` is submitted once the rollouts hold weights version
``v`` with ``(q - dropped) // P <= v + max_staleness`` (it is meant for that training step, or
a later one after drops), and never past the run's last step. The trainer :meth:`take` s a
step's groups: ``ordered`` the next ``P`` positions (one-step-off), else the first ``P``
complete ones (async: a long generation does not hold the batch back), in stream order either
way. A group is complete when all ``n`` samples have finished; its staleness is the trainer's
version minus its oldest token's version (``staleness_from=last_token``, the default: minus
the version it completed under), whole groups are kept or dropped (never split, so
GRPO's baseline always has ``n`` samples, even across versions).

Generation goes through a :class:`~drivetrain.runtime.rollout_service.RolloutService` (the
rollouts' one poller): a request the rollout aborts (a weight update with ``abort_inflight``,
or :meth:`suspended`) continues there as a partial rollout, each token keeping its version.
With ``scripted_rounds`` the trainer itself polls, a fixed number of rounds at fixed points
(:meth:`advance`): the same interleaving every run, so two runs are bit-identical.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, replace
from functools import partial

from drivetrain.api import Completion, SamplingParams
from drivetrain.api.errors import ConfigError
from drivetrain.api.requests import Request, sample_seed
from drivetrain.runtime.replicas import replica_slots
from drivetrain.runtime.rollout_service import RolloutService, ServiceClosed


@dataclass(frozen=True)
class AheadConfig:
    """``algorithm.ahead``: how generation runs ahead of training (modes one_step_off, async)."""

    max_staleness: int = 1  # async: groups at most this many versions behind (staleness_from)
    stale_samples: str = "drop"  # async: older samples are dropped, or kept (and corrected)
    #: async: a group's staleness counts from its first token (the oldest), or its last (the
    #: version it completed under): a group with a long answer, resumed under newer weights,
    #: then stays fresh (its older tokens corrected by importance sampling) instead of being
    #: the one dropped
    staleness_from: str = "last_token"
    sync_every: int = 1  # async: push weights every N steps (N - 1 <= max_staleness)
    #: async: requests running at a weight update are aborted and resumed under the new
    #: weights with their tokens kept (resume), or run to their end under the old (finish)
    partial_rollouts: str = "resume"
    #: 0: each rollout replica has a polling thread; N > 0: the trainer drives generation, N
    #: token steps between training steps (a fixed interleaving: runs are bit-identical)
    scripted_rounds: int = 0
    #: with polling threads, each rollout that can generates on its own (its server process
    #: steps between the calls it serves) and is polled every 20 ms for what it made
    #: meanwhile (Rollout.background_generation); false: one poll per token step, from the
    #: trainer's process (benchmarks/async_grpo.py's async_polled mode)
    background_generation: bool = True

    def __post_init__(self) -> None:
        choices = {
            "stale_samples": ("drop", "keep"),
            "staleness_from": ("first_token", "last_token"),
            "partial_rollouts": ("resume", "finish"),
        }
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ConfigError(
                    f"algorithm.ahead.{name}={getattr(self, name)!r} is not one of {allowed}"
                )
        if self.max_staleness < 0 or self.sync_every < 1 or self.scripted_rounds < 0:
            raise ConfigError(
                "algorithm.ahead.max_staleness and scripted_rounds must be >= 0, sync_every >= 1"
            )


class GenerationError(RuntimeError):
    """Generation ahead of training failed (a rollout raised or its process died)."""


@dataclass(frozen=True)
class Group:
    """The ``n`` finished samples of stream position ``position``."""

    position: int
    prompt: int  # index into the training prompts
    completions: tuple[Completion, ...]

    @property
    def oldest_version(self) -> int:
        return min(min(c.token_versions, default=c.weight_version) for c in self.completions)

    @property
    def newest_version(self) -> int:
        """The version of its last token: the one the group completed under."""
        return max(max(c.token_versions, default=c.weight_version) for c in self.completions)


@dataclass(frozen=True)
class Taken:
    """One training step's groups, in stream order, and what happened on the way."""

    groups: tuple[Group, ...]
    dropped: int  # groups dropped as too stale since the previous take
    ready_left: int  # complete groups left for later steps
    in_flight: int  # groups still generating
    #: response lengths (tokens) of the samples those dropped groups held: what dropping
    #: costs, and whether it falls on the long answers (the ones that go stale)
    dropped_lengths: tuple[int, ...] = ()


@dataclass
class _Pending:
    prompt: int
    samples: list[Completion | None]


class GroupStream:
    """Groups of the prompt stream generated on ``rollouts`` ahead of training (see the module
    docstring). ``prompts(step)`` are the training prompt indices of a step, ``prompt_ids(i)``
    a prompt's tokens, ``params(step)`` the step's sampling (``n`` samples, call seed)."""

    def __init__(
        self,
        rollouts: RolloutService,
        *,
        prompts: Callable[[int], Sequence[int]],
        prompt_ids: Callable[[int], Sequence[int]],
        params: Callable[[int], SamplingParams],
        per_step: int,
        steps: int,
        max_staleness: int,
        ordered: bool,
        drop_stale: bool,
        stale_from_last_token: bool = False,
        start_step: int = 0,
        version: int = 0,
        scripted_rounds: int = 0,
        background: bool = False,
    ) -> None:
        self.service = rollouts  # the placement's: polled here (scripted) or in its threads
        self.rollouts = rollouts.rollouts
        self.prompts, self.prompt_ids, self.params = prompts, prompt_ids, params
        self.per_step, self.steps = per_step, steps
        self.max_staleness, self.ordered, self.drop_stale = max_staleness, ordered, drop_stale
        self.stale_from_last_token = stale_from_last_token
        self.scripted_rounds = scripted_rounds
        self.background = background
        self.version = version
        self._next = start_step * per_step  # the next position to admit
        self._consumed = start_step * per_step  # positions consumed or dropped
        self._dropped = 0  # since the run (re)started: shifts admission
        self._dropped_since_take = 0
        self._dropped_lengths: list[int] = []
        self._pending: dict[int, _Pending] = {}
        #: per place in a step: its replica and the replica's first place (the sync loop's
        #: split of a step's prompts over the replicas)
        self._replica_of = replica_slots(per_step, len(self.rollouts))
        self._ready: dict[int, Group] = {}
        self._failure: BaseException | None = None
        self._cond = threading.Condition()
        self._stopping = False
        #: scripted: the trainer polls, from the start; else polling threads, from start()
        self._started = bool(scripted_rounds)

    # ---- driving ---------------------------------------------------------------------------
    def start(self) -> None:
        """Start generating: one polling thread per replica (none when scripted), each
        rollout generating on its own where it can (polls collect several token steps)."""
        if not self.scripted_rounds:
            self.service.poll_in_threads(background=self.background)
        with self._cond:
            self._started = True
            self._admit()

    def advance(self, rounds: int = 1) -> None:
        """Scripted schedule: ``rounds`` polling rounds in this thread (each replica: submit
        what admission allows, then one poll, which runs one token step where requests run)."""
        for _ in range(rounds):
            with self._cond:
                self._admit()
            self.service.pump()

    # ---- admission and bookkeeping (under the lock) ---------------------------------------
    def _admit(self) -> None:
        """Submit the positions the staleness bound admits now (it moves with the weights'
        version and with drops)."""
        while not self._stopping and self._started:
            step = (self._next - self._dropped) // self.per_step  # the step it is meant for
            if step >= self.steps or step > self.version + self.max_staleness:
                break
            self._submit(self._next)
            self._next += 1

    def _submit(self, position: int) -> None:
        step, within = divmod(position, self.per_step)
        prompt = self.prompts(step)[within]
        params = self.params(step)
        # the replica and sample numbers the sync loop's generate call gives this prompt
        index, first = self._replica_of[within].replica, self._replica_of[within].first
        self._pending[position] = _Pending(prompt, [None] * params.n)
        prompt_ids = tuple(self.prompt_ids(prompt))
        requests = []
        for sample in range(params.n):
            number = (within - first) * params.n + sample
            seed = None if params.seed is None else sample_seed(params.seed, number)
            requests.append(
                Request(
                    f"q{position}-{sample}",
                    prompt_ids,
                    replace(params, n=1, seed=seed),
                    prompt_index=position,
                )
            )
        futures = self.service.submit_many(index, requests, resume_aborted=True)
        for sample, future in enumerate(futures):
            future.add_done_callback(partial(self._finished, position, sample))

    def _finished(self, position: int, sample: int, future: Future[Completion]) -> None:
        """A sample ended (in the poller's thread): its group is ready once all have."""
        with self._cond:
            exc = future.exception()
            if exc is not None:
                if not (self._stopping and isinstance(exc, ServiceClosed)):
                    self._failure = self._failure or exc  # raised at the next take or sync
            else:
                pending = self._pending[position]
                pending.samples[sample] = future.result()
                if all(s is not None for s in pending.samples):
                    del self._pending[position]
                    done = tuple(s for s in pending.samples if s is not None)
                    self._ready[position] = Group(position, pending.prompt, done)
            self._cond.notify_all()

    # ---- the trainer's side ----------------------------------------------------------------
    def take(self, trainer_version: int) -> Taken:
        """The next step's ``P`` groups (waits for them); groups older than ``max_staleness``
        versions are dropped first when ``drop_stale``."""
        with self._cond:
            while True:
                self._raise_failure()
                chosen = self._choose(trainer_version)
                if chosen is not None:
                    break
                if self.scripted_rounds:
                    self._cond.release()
                    try:
                        self.advance(1)
                    finally:
                        self._cond.acquire()
                    continue
                # how long generating takes is bounded by the rollout's own call timeouts
                # (a poll that timed out fails its requests); no poller left is a bug
                if not self.service.alive:
                    raise GenerationError("no generation thread is running (was start() called?)")
                self._cond.wait(1.0)
            for group in chosen:
                del self._ready[group.position]
            self._consumed += len(chosen)
            dropped, self._dropped_since_take = self._dropped_since_take, 0
            lengths, self._dropped_lengths = tuple(self._dropped_lengths), []
            return Taken(tuple(chosen), dropped, len(self._ready), len(self._pending), lengths)

    def _choose(self, trainer_version: int) -> list[Group] | None:
        if self.ordered:
            wanted = range(self._consumed, self._consumed + self.per_step)
            if all(q in self._ready for q in wanted):
                return [self._ready[q] for q in wanted]
            return None
        if self.drop_stale:
            for q, group in sorted(self._ready.items()):
                since = group.newest_version if self.stale_from_last_token else group.oldest_version
                if trainer_version - since > self.max_staleness:
                    del self._ready[q]
                    self._dropped += 1
                    self._dropped_since_take += 1
                    self._dropped_lengths += [len(c.token_ids) for c in group.completions]
                    self._consumed += 1
                    self._admit()  # a dropped group's place goes to a new one
        if len(self._ready) < self.per_step:
            return None
        return [self._ready[q] for q in sorted(self._ready)[: self.per_step]]

    def weights_at(self, version: int) -> None:
        """The rollouts now generate with ``version`` (after a sync): admission moves on."""
        with self._cond:
            self._raise_failure()
            self.version = version
            if not self.scripted_rounds:  # scripted: admitted at the schedule's next round
                self._admit()

    def _raise_failure(self) -> None:
        if self._failure is not None:
            exc = self._failure
            raise GenerationError(
                f"generation ahead of training failed: {type(exc).__name__}: {exc}"
            ) from exc

    @contextlib.contextmanager
    def suspended(self) -> Iterator[None]:
        """Nothing of this stream runs on the rollouts inside (e.g. validation generates):
        polling stops, running requests are aborted and their tokens kept; they resume as
        continuations afterwards."""
        with self.service.paused():
            yield

    def close(self) -> None:
        """Stop generating: this stream's requests are aborted and collected, polling ends,
        and the rollout service is free for its next user."""
        with self._cond:
            self._stopping = True
        self.service.release()
