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
version minus its oldest token's version, whole groups are kept or dropped (never split, so
GRPO's baseline always has ``n`` samples, even across versions).

Partial rollouts: a request the rollout aborted (a weight update with ``abort_inflight``, or
:meth:`suspended`) is resumed at once as a continuation (its prompt plus its tokens so far,
:meth:`~drivetrain.runtime.collector.Collector.resume`), which waits in the rollout's queue until
generation resumes under the new weights; each token keeps its own version.

Who polls: one thread per replica (the replica's one poller), or, with ``scripted_rounds``,
the trainer itself, which advances generation by a fixed number of polling rounds at fixed
points (:meth:`advance`): the same interleaving every run, so two runs are bit-identical.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from functools import partial

from drivetrain.api import Completion, FinishReason, Rollout, SamplingParams
from drivetrain.api.errors import ConfigError
from drivetrain.api.partition import chunk_sizes
from drivetrain.api.requests import Chunk, Request, sample_seed
from drivetrain.runtime.collector import Collector

#: how long a replica's thread waits, at most, before polling again after a poll that found
#: nothing; and how long the drain waits in one poll (seconds)
POLL_S = 0.05
#: the first of those waits (it doubles up to POLL_S while polls find nothing)
IDLE_POLL_S = 0.001
#: how long aborted requests may take to end, and a polling thread to stop (seconds): both
#: happen at the rollout's next token step
SETTLE_S = 120.0


@dataclass(frozen=True)
class AheadConfig:
    """``algorithm.ahead``: how generation runs ahead of training (modes one_step_off, async)."""

    max_staleness: int = 1  # async: samples at most this many versions behind the trainer
    stale_samples: str = "drop"  # async: older samples are dropped, or kept (and corrected)
    sync_every: int = 1  # async: push weights every N steps (N - 1 <= max_staleness)
    #: async: requests running at a weight update are aborted and resumed under the new
    #: weights with their tokens kept (resume), or run to their end under the old (finish)
    partial_rollouts: str = "resume"
    #: 0: each rollout replica has a polling thread; N > 0: the trainer drives generation, N
    #: token steps between training steps (a fixed interleaving: runs are bit-identical)
    scripted_rounds: int = 0

    def __post_init__(self) -> None:
        choices = {"stale_samples": ("drop", "keep"), "partial_rollouts": ("resume", "finish")}
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


@dataclass(frozen=True)
class Taken:
    """One training step's groups, in stream order, and what happened on the way."""

    groups: tuple[Group, ...]
    dropped: int  # groups dropped as too stale since the previous take
    ready_left: int  # complete groups left for later steps
    in_flight: int  # groups still generating


@dataclass
class _Replica:
    rollout: Rollout
    collector: Collector = field(default_factory=Collector)
    owner: dict[str, tuple[int, int]] = field(default_factory=dict)  # request -> (position, j)
    outbox: list[Request] = field(default_factory=list)  # admitted, not yet submitted
    live: set[str] = field(default_factory=set)  # sequences with a submitted, unfinished request
    resumes: int = 0


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
        rollouts: Sequence[Rollout],
        *,
        prompts: Callable[[int], Sequence[int]],
        prompt_ids: Callable[[int], Sequence[int]],
        params: Callable[[int], SamplingParams],
        per_step: int,
        steps: int,
        max_staleness: int,
        ordered: bool,
        drop_stale: bool,
        start_step: int = 0,
        version: int = 0,
        scripted_rounds: int = 0,
    ) -> None:
        self.replicas = [_Replica(r) for r in rollouts]
        self.prompts, self.prompt_ids, self.params = prompts, prompt_ids, params
        self.per_step, self.steps = per_step, steps
        self.max_staleness, self.ordered, self.drop_stale = max_staleness, ordered, drop_stale
        self.scripted_rounds = scripted_rounds
        self.version = version
        self._next = start_step * per_step  # the next position to admit
        self._consumed = start_step * per_step  # positions consumed or dropped
        self._dropped = 0  # since the run (re)started: shifts admission
        self._dropped_since_take = 0
        self._pending: dict[int, _Pending] = {}
        self._ready: dict[int, Group] = {}
        self._failure: BaseException | None = None
        self._cond = threading.Condition()
        self._hold = False  # suspended: threads stop polling
        self._polling = 0
        self._stopping = False
        #: bumped by whatever may give an idle or backing-off thread work (new weights,
        #: admissions, a take, the end of a suspension, a stop): they wait for it to move
        self._changes = 0
        self._threads: list[threading.Thread] = []

    # ---- driving ---------------------------------------------------------------------------
    def start(self) -> None:
        """Start generating: one polling thread per replica (none when scripted)."""
        if self.scripted_rounds:
            return
        for index, replica in enumerate(self.replicas):
            thread = threading.Thread(
                target=self._run, args=(replica,), name=f"generate-ahead-{index}", daemon=True
            )
            thread.start()
            self._threads.append(thread)

    def advance(self, rounds: int = 1) -> None:
        """Scripted schedule: ``rounds`` polling rounds in this thread (each replica: submit
        what admission allows, then one poll, which runs one token step where requests run)."""
        for _ in range(rounds):
            for replica in self.replicas:
                self._round(replica)

    def _run(self, replica: _Replica) -> None:
        # Waits happen here, never inside a poll: a remote rollout's poll that waits holds
        # its channel, which the weight sync needs meanwhile. A replica with nothing to
        # generate waits for the stream to change; one whose poll found nothing (paused for a
        # weight update, or generating on its own) polls again after a backoff that a change
        # of the stream since that poll began cuts short (other replicas' chunks do not).
        backoff, seen = 0.0, 0
        try:
            while True:
                with self._cond:
                    if backoff:
                        self._cond.wait_for(partial(self._changed_since, seen), backoff)
                    while not self._stopping and (self._hold or self._idle(replica)):
                        self._cond.wait(1.0)
                    if self._stopping:
                        return
                    self._polling += 1
                    seen = self._changes
                try:
                    got = self._round(replica)
                finally:
                    with self._cond:
                        self._polling -= 1
                        self._cond.notify_all()
                backoff = 0.0 if got else min(max(2 * backoff, IDLE_POLL_S), POLL_S)
        except BaseException as exc:  # the trainer raises it at its next take or sync
            with self._cond:
                self._failure = self._failure or exc
                self._cond.notify_all()

    def _round(self, replica: _Replica) -> int:
        """Submit what admission allows, poll once without waiting; how many chunks came
        back."""
        with self._cond:
            self._admit()
            outbox, replica.outbox = replica.outbox, []
            replica.live.update(r.request_id.split("+", 1)[0] for r in outbox)  # sequence ids
        if outbox:
            replica.rollout.submit(outbox)
        chunks = replica.rollout.poll(0.0)
        with self._cond:
            self._record(replica, chunks)
            self._cond.notify_all()
        return len(chunks)

    # ---- admission and bookkeeping (under the lock) ---------------------------------------
    def _idle(self, replica: _Replica) -> bool:
        """Nothing to submit or collect on ``replica`` after admitting what may go now."""
        self._admit()
        return not replica.live and not replica.outbox

    def _admit(self) -> None:
        admitted = False
        while not self._stopping:
            step = (self._next - self._dropped) // self.per_step  # the step it is meant for
            if step >= self.steps or step > self.version + self.max_staleness:
                break
            self._submit(self._next)
            self._next += 1
            admitted = True
        if admitted:  # possibly into another replica's outbox, whose thread may be idle
            self._changed()

    def _changed_since(self, seen: int) -> bool:
        return self._changes != seen

    def _changed(self) -> None:
        self._changes += 1
        self._cond.notify_all()

    def _submit(self, position: int) -> None:
        step, within = divmod(position, self.per_step)
        prompt = self.prompts(step)[within]
        params = self.params(step)
        # the replica and sample numbers the sync loop's generate call gives this prompt
        sizes = chunk_sizes(self.per_step, min(len(self.replicas), self.per_step))
        index, start = 0, 0
        while within >= start + sizes[index]:
            start += sizes[index]
            index += 1
        replica = self.replicas[index]
        self._pending[position] = _Pending(prompt, [None] * params.n)
        for sample in range(params.n):
            number = (within - start) * params.n + sample
            seed = None if params.seed is None else sample_seed(params.seed, number)
            request = Request(
                f"q{position}-{sample}",
                tuple(self.prompt_ids(prompt)),
                replace(params, n=1, seed=seed),
                prompt_index=position,
            )
            replica.collector.track(request)
            replica.owner[request.request_id] = (position, sample)
            replica.outbox.append(request)

    def _record(self, replica: _Replica, chunks: Sequence[Chunk]) -> None:
        for key in replica.collector.add(chunks):
            replica.live.discard(key)
            position, sample = replica.owner[key]
            completion = replica.collector.completion(key)
            if completion.finish_reason is FinishReason.ABORT and not self._stopping:
                with contextlib.suppress(ValueError):  # no budget left: it is finished
                    replica.resumes += 1
                    request = replica.collector.resume(key, f"{key}+{replica.resumes}")
                    replica.outbox.append(request)
                    continue
            replica.collector.pop(key)
            del replica.owner[key]
            pending = self._pending[position]
            pending.samples[sample] = completion
            if all(s is not None for s in pending.samples):
                del self._pending[position]
                done = tuple(s for s in pending.samples if s is not None)
                self._ready[position] = Group(position, pending.prompt, done)

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
                # (a thread whose call timed out fails); a thread gone without failing is a bug
                if not any(t.is_alive() for t in self._threads):
                    raise GenerationError("no generation thread is running (was start() called?)")
                self._cond.wait(1.0)
            for group in chosen:
                del self._ready[group.position]
            self._consumed += len(chosen)
            self._changed()
            dropped, self._dropped_since_take = self._dropped_since_take, 0
            return Taken(tuple(chosen), dropped, len(self._ready), len(self._pending))

    def _choose(self, trainer_version: int) -> list[Group] | None:
        if self.ordered:
            wanted = range(self._consumed, self._consumed + self.per_step)
            if all(q in self._ready for q in wanted):
                return [self._ready[q] for q in wanted]
            return None
        if self.drop_stale:
            for q, group in sorted(self._ready.items()):
                if trainer_version - group.oldest_version > self.max_staleness:
                    del self._ready[q]
                    self._dropped += 1
                    self._dropped_since_take += 1
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
            self._changed()

    def _raise_failure(self) -> None:
        if self._failure is not None:
            exc = self._failure
            raise GenerationError(
                f"generation ahead of training failed: {type(exc).__name__}: {exc}"
            ) from exc

    @contextlib.contextmanager
    def suspended(self) -> Iterator[None]:
        """Nothing of this stream runs on the rollouts inside (e.g. validation generates):
        threads stop polling, running requests are aborted and their tokens kept; they resume
        as continuations afterwards."""
        with self._cond:
            self._hold = True
            if not self._cond.wait_for(lambda: not self._polling, SETTLE_S):
                self._hold = False
                raise GenerationError(f"a rollout poll did not return within {SETTLE_S:.0f} s")
        try:
            self._drain()
            yield
        finally:
            with self._cond:
                self._hold = False
                self._changed()

    def _drain(self) -> None:
        """Abort this stream's running requests on every replica and collect their last
        chunks (threads are held: this thread is every replica's poller meanwhile)."""
        for replica in self.replicas:
            with self._cond:
                live = sorted(replica.live)
            if not live:
                continue
            replica.rollout.abort(live)
            deadline = time.monotonic() + SETTLE_S
            while True:
                chunks = replica.rollout.poll(POLL_S)
                with self._cond:
                    self._record(replica, chunks)
                    if not replica.live:
                        break
                if time.monotonic() > deadline:
                    raise GenerationError(
                        f"{len(replica.live)} aborted requests did not end within {SETTLE_S:.0f} s"
                    )

    def close(self) -> None:
        """Stop generating: threads end, this stream's requests are aborted and collected."""
        with self._cond:
            self._stopping = True
            self._changed()
        for thread in self._threads:
            thread.join(SETTLE_S)
            if thread.is_alive():
                raise GenerationError(f"{thread.name} did not stop within {SETTLE_S:.0f} s")
        self._threads.clear()
        if self._failure is None:
            self._drain()
