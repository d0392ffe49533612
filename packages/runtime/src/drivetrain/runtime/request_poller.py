"""The request-level traffic of one or more rollouts, polled by its caller: requests
submitted (``submit -> Future[Completion]``), each rollout polled, each request's future
completed, with abort, a hold (:meth:`RequestPoller.paused`) and, on close, an abort-and-drain
that fails nothing silently. :class:`~drivetrain.runtime.rollout_service.RolloutService`
builds on it with polling threads; a batch ``generate`` over requests
(:func:`generate_with_requests`) uses it alone, inside the rollout's own process.

Partial rollouts: a request submitted with ``resume_aborted`` that the rollout aborts (a
weight update's abort, or :meth:`RequestPoller.paused`) continues as a new request with its
tokens so far (:meth:`~drivetrain.runtime.collector.Collector.resume`), which waits in the
replica's queue until polling resumes; its future completes when the whole sequence ends,
each token with the weight version it was sampled under.

Progress deadline: with ``stall_timeout_s``, a replica on which requests of this poller run
but that gives no token for that long is failed as stalled (its waiters get
:class:`~drivetrain.api.errors.RolloutStalled`, one line naming it); the others go on. Inside
:meth:`RequestPoller.excused` (a weight sync pausing the rollouts, colocated rollouts asleep
while the trainer updates) no silence counts.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass

from drivetrain.api import Completion, FinishReason, Rollout
from drivetrain.api.errors import DrivetrainError, RolloutStalled
from drivetrain.api.requests import Chunk, Request
from drivetrain.runtime.collector import Collector
from drivetrain.runtime.rollout_commands import Abort, Command, Continue, Submit, fail, settle

log = logging.getLogger(__name__)

#: a caller-driven poll's longest wait (seconds): :func:`generate_with_requests`, drains
POLL_S = 0.02
#: how long aborted requests may take to end, and a polling thread to stop (seconds): both
#: happen at the rollout's next token step
SETTLE_S = 30.0


class ServiceClosed(RuntimeError):
    """The service closed (or failed) while a request was waiting or generating."""


@dataclass
class _Sequence:
    """A submitted request and its continuations: one future."""

    future: Future[Completion]
    request_id: str | None  # the rollout's id of the segment running now; None: none runs
    resume: bool  # an abort continues it (resume_aborted), unless asked for by abort()


class RequestPoller:
    """The request-level traffic of ``rollouts``, polled by its caller (:meth:`pump`): the
    core of :class:`~drivetrain.runtime.rollout_service.RolloutService`, which adds polling
    threads, and all a batch ``generate`` over requests needs (:func:`generate_with_requests`)."""

    def __init__(
        self, rollouts: Sequence[Rollout], *, name: str, stall_timeout_s: float | None = None
    ) -> None:
        self.rollouts = list(rollouts)
        self.name = name
        self.stall_timeout_s = stall_timeout_s
        #: per replica: since when its running requests gave no token (None: nothing runs)
        self._quiet_since: list[float | None] = [None for _ in self.rollouts]
        self._excused = 0  # excused() blocks open: the rollouts' silence is their owner's doing
        #: per replica: it generates on its own (a poller thread asked it to)
        self.background = [False for _ in self.rollouts]
        replicas = range(len(self.rollouts))
        #: guards the commands, the hold and the stop; a replica's sequences and collector
        #: are touched only by its poller (or, while every poller is held, the holder)
        self._cond = threading.Condition()
        self._commands: list[list[Command]] = [[] for _ in replicas]
        self._sequences: list[dict[str, _Sequence]] = [{} for _ in replicas]
        self._collectors = [Collector() for _ in replicas]
        #: ids of requests failed with their rollout's poll: their late chunks are dropped
        self._failed_ids: list[set[str]] = [set() for _ in replicas]
        self._segments = 0  # numbers continuations' ids
        self._holds = 0  # paused() blocks open: nothing of this service runs meanwhile
        self._active = 0  # pollers between taking their commands and their poll's end
        self._stopping = False
        self._failure: BaseException | None = None  # every replica refuses submits
        #: replicas whose poller crashed: they alone refuse submits
        self._dead: dict[int, BaseException] = {}

    # ---- the callers' side ----------------------------------------------------------------
    def submit(
        self, replica: int, request: Request, *, resume_aborted: bool = False
    ) -> Future[Completion]:
        return self.submit_many(replica, [request], resume_aborted=resume_aborted)[0]

    def submit_many(
        self, replica: int, requests: Sequence[Request], *, resume_aborted: bool = False
    ) -> list[Future[Completion]]:
        """``requests`` on replica ``replica``, submitted in one call (they start together);
        each future gets its request's completion, or the error that ended it."""
        futures: list[Future[Completion]] = [Future() for _ in requests]
        with self._cond:
            refused = self._failure or self._dead.get(replica)
            if refused is None:
                command = Submit(tuple(requests), tuple(futures), resume_aborted)
                self._commands[replica].append(command)
                self._cond.notify_all()
        if refused is not None:  # outside the lock: a future's callbacks may submit again
            closed = ServiceClosed(f"the rollout service {self.name} stopped: {refused}")
            for future in futures:
                future.set_exception(closed)
        return futures

    def abort(self, request_id: str) -> None:
        """End ``request_id`` (its future gets what it generated so far, never continued)."""
        with self._cond:
            for commands in self._commands:
                commands.append(Abort(request_id))
            self._cond.notify_all()

    def pump(self, rounds: int = 1, poll_s: float = 0.0) -> int:
        """The owner's polling (``threads=False``): ``rounds`` times, each replica submits what
        was queued for it, then polls once if something of it runs; the chunks that came
        (none while paused: another caller may be generating)."""
        got = 0
        for _ in range(rounds):
            for replica in range(len(self.rollouts)):
                with self._cond:
                    if self._holds or self._stopping:
                        return got
                    commands, self._commands[replica] = self._commands[replica], []
                got += self._turn(replica, commands, poll_s)
        return got

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Nothing of this service runs on the rollouts inside (another caller may generate):
        pollers stop, running requests are aborted and their last chunks collected; those
        submitted with ``resume_aborted`` continue afterwards, with what was queued meanwhile."""
        with self._cond:
            self._holds += 1
            self._cond.notify_all()
            if not self._cond.wait_for(lambda: not self._active, SETTLE_S):
                self._holds -= 1
                raise ServiceClosed(f"a poll of {self.name} did not return within {SETTLE_S:.0f} s")
        try:
            self._drain()
            yield
        finally:
            self._quiet_since = [None for _ in self.rollouts]  # a pause is no stall
            with self._cond:
                self._holds -= 1
                self._cond.notify_all()

    @contextlib.contextmanager
    def excused(self) -> Iterator[None]:
        """The rollouts' owner pauses or puts them to sleep inside (a weight sync, a training
        update): their silence meanwhile is no stall; the deadline starts afresh after."""
        with self._cond:
            self._excused += 1
        try:
            yield
        finally:
            with self._cond:
                self._excused -= 1
                self._quiet_since = [None for _ in self.rollouts]

    def close(self, timeout_s: float = SETTLE_S) -> None:
        """Stop: requests still running are aborted and drained, and their futures get what
        they generated, as do sequences whose continuation had not started; submits still
        queued fail with :class:`ServiceClosed`. Whatever fails on the way is logged: every
        future ends."""
        closed = ServiceClosed(f"the rollout service {self.name} closed")
        with self._cond:
            self._stopping = True
            self._failure = self._failure or closed
            self._cond.notify_all()
        stuck = self._stop_pollers(timeout_s)
        with self._cond:
            queued, self._commands = self._commands, [[] for _ in self.rollouts]
        try:
            if stuck:  # its poll never returned: nobody else may poll that rollout meanwhile
                log.error("%s did not stop within %.0f s; not draining", stuck, timeout_s)
            else:
                self._drain(strict=False)
        finally:
            for replica, commands in enumerate(queued):
                self._settle_queued(replica, commands, closed)
            self._stop_background()
            for sequences in self._sequences:
                fail([s.future for s in list(sequences.values())], closed)
                sequences.clear()

    def _stop_pollers(self, timeout_s: float) -> list[str]:
        """Polling threads that did not stop within ``timeout_s`` (none here: the caller
        polls)."""
        return []

    def _stop_background(self) -> None:
        """The rollouts step when polled again (another caller may poll them next)."""
        for replica, rollout in enumerate(self.rollouts):
            if self.background[replica]:
                try:
                    rollout.background_generation(False)
                except Exception:  # a rollout that is gone generates nothing
                    log.warning("%s: rollout %d did not stop generating", self.name, replica)
                self.background[replica] = False

    def __enter__(self) -> RequestPoller:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _turn(self, replica: int, commands: list[Command], poll_s: float) -> int:
        """Carry out ``commands`` on ``replica``, then poll it if something of ours runs. Runs
        of submits and continuations go as one call: a server process stepping between the
        calls it serves steps once per call (an update's continuations: hundreds)."""
        starts: list[Submit | Continue] = []
        for command in commands:
            if not isinstance(command, Abort):
                starts.append(command)
                continue
            self._start(replica, starts)
            starts = []
            sequence = self._sequences[replica].get(command.request_id)
            if sequence is not None:
                sequence.resume = False
                if sequence.request_id is not None:
                    self._abort(replica, [sequence.request_id])
        self._start(replica, starts)
        return self._poll(replica, poll_s) if self._running(replica) else 0

    def _start(self, replica: int, starts: list[Submit | Continue]) -> None:
        if len(starts) > 1 and self._start_together(replica, starts):
            return
        for command in starts:
            if isinstance(command, Submit):
                self._submit(replica, command)
            else:
                self._continue(replica, command)

    def _start_together(self, replica: int, starts: list[Submit | Continue]) -> bool:
        """Submits and continuations in one ``submit`` call. False, with nothing started or
        tracked, where any is refused (a rollout refuses a submit whole): one call each then,
        so that only the refused ones fail."""
        collector, sequences = self._collectors[replica], self._sequences[replica]
        starts = [c for c in starts if isinstance(c, Submit) or c.key in sequences]  # in order
        requests = [
            r for c in starts for r in (c.requests if isinstance(c, Submit) else [c.request])
        ]
        tracked: list[Request] = []
        try:
            for request in (r for c in starts if isinstance(c, Submit) for r in c.requests):
                collector.track(request)
                tracked.append(request)
            self.rollouts[replica].submit(requests)
        except Exception:
            for request in tracked:
                collector.forget(request.request_id)
            return False
        for command in starts:
            if isinstance(command, Continue):
                self._continued(replica, command)
                continue
            for request, future in zip(command.requests, command.futures, strict=True):
                sequences[request.request_id] = _Sequence(
                    future, request.request_id, command.resume_aborted
                )
        return True

    def _running(self, replica: int) -> bool:
        """Something of this service runs on ``replica`` (read by its poller, or the holder)."""
        return any(s.request_id for s in self._sequences[replica].values())

    def _submit(self, replica: int, command: Submit) -> None:
        requests, futures = command.requests, command.futures
        collector = self._collectors[replica]
        tracked: list[Request] = []
        try:
            for request in requests:
                collector.track(request)  # a reused id is refused before the rollout sees it
                tracked.append(request)
            self.rollouts[replica].submit(requests)
        except Exception as exc:  # a refused request (too long...): its waiters' error
            for request in tracked:
                collector.forget(request.request_id)
            fail(futures, exc)
            return
        for request, future in zip(requests, futures, strict=True):
            self._sequences[replica][request.request_id] = _Sequence(
                future, request.request_id, command.resume_aborted
            )

    def _continue(self, replica: int, command: Continue) -> None:
        sequence = self._sequences[replica].get(command.key)
        if sequence is None:  # failed meanwhile (its rollout's poll raised)
            return
        try:
            self.rollouts[replica].submit([command.request])
        except Exception as exc:  # the rollout refused it: the sequence ends with the error
            del self._sequences[replica][command.key]
            self._collectors[replica].forget(command.key)
            fail([sequence.future], exc)
            return
        self._continued(replica, command)

    def _continued(self, replica: int, command: Continue) -> None:
        sequence = self._sequences[replica][command.key]
        sequence.request_id = command.request.request_id
        if not sequence.resume:  # abort() came while it waited: it ends at once
            self._abort(replica, [command.request.request_id])

    def _abort(self, replica: int, request_ids: list[str]) -> None:
        try:
            self.rollouts[replica].abort(request_ids)
        except Exception as exc:  # the rollout is gone: as when its poll fails
            self._replica_failed(replica, exc)

    def _poll(self, replica: int, poll_s: float) -> int:
        sequences, collector = self._sequences[replica], self._collectors[replica]
        try:
            chunks = self._known(replica, self.rollouts[replica].poll(poll_s))
            finished = collector.add(chunks)
        except Exception as exc:  # the rollout failed: its requests' waiters get the error
            self._replica_failed(replica, exc)
            return 0
        if self._stalled(replica, bool(chunks)):
            return 0
        for key in finished:
            sequence = sequences[key]
            sequence.request_id = None
            continuation = self._continuation(replica, key) if sequence.resume else None
            if continuation is not None:  # submitted once polling goes on (after a pause)
                with self._cond:
                    self._commands[replica].append(Continue(key, continuation))
                continue
            del sequences[key]
            settle(sequence.future, collector.pop(key))
        if not self._running(replica):
            self._quiet_since[replica] = None
        return len(chunks)

    def _stalled(self, replica: int, got: bool) -> bool:
        """Past the progress deadline with no token: the replica fails as stalled."""
        now, since = time.monotonic(), self._quiet_since[replica]
        if got or since is None or self._excused:
            self._quiet_since[replica] = now
            return False
        limit = self.stall_timeout_s
        if limit is None or now - since <= limit:
            return False
        running = sum(1 for s in self._sequences[replica].values() if s.request_id)
        self._replica_failed(
            replica,
            RolloutStalled(
                f"rollout replica {replica} of {self.name} "
                f"({type(self.rollouts[replica]).__name__}) produced no token for "
                f"{now - since:.0f} s while {running} requests ran on it "
                f"(rollout.stall_timeout_s={limit:g}): it is alive but stopped or hung"
            ),
        )
        return True

    def _replica_failed(self, replica: int, exc: Exception) -> None:
        """``replica`` raised: its running requests are aborted (their last chunks collected
        once, so the next poller of that rollout does not get them) and their waiters fail."""
        if isinstance(exc, DrivetrainError):  # its message says it all: no traceback
            log.error("rollout %d of %s failed: %s", replica, self.name, exc)
        else:
            log.exception("rollout %d of %s failed", replica, self.name)
        self._quiet_since[replica] = None
        sequences = self._sequences[replica]
        running = [s.request_id for s in sequences.values() if s.request_id]
        self._failed_ids[replica].update(running)
        with contextlib.suppress(Exception):
            self.rollouts[replica].abort(running)
            self._known(replica, self.rollouts[replica].poll(0.0))
        fail([s.future for s in sequences.values()], exc)
        sequences.clear()
        self._collectors[replica] = Collector()

    def _known(self, replica: int, chunks: list[Chunk]) -> list[Chunk]:
        """``chunks`` less those of requests failed earlier (forgotten once the rollout
        reports their end)."""
        failed = self._failed_ids[replica]
        if not failed:
            return chunks
        kept = []
        for chunk in chunks:
            if chunk.request_id not in failed:
                kept.append(chunk)
            elif chunk.finish_reason is not None:
                failed.discard(chunk.request_id)
        return kept

    def _continuation(self, replica: int, key: str) -> Request | None:
        """The request continuing ``key`` if the rollout aborted it (None: it is finished)."""
        collector = self._collectors[replica]
        if self._stopping or collector.completion(key).finish_reason is not FinishReason.ABORT:
            return None
        self._segments += 1
        try:
            return collector.resume(key, f"{key}+{self._segments}")
        except ValueError:  # no token budget left: it is finished
            return None

    def _settle_queued(self, replica: int, commands: list[Command], exc: BaseException) -> None:
        """Commands that will never run: submits fail with ``exc``; a sequence whose
        continuation never started gets what it generated."""
        for command in commands:
            if isinstance(command, Submit):
                fail(command.futures, exc)
            elif isinstance(command, Continue):
                sequence = self._sequences[replica].pop(command.key, None)
                if sequence is not None:
                    collector = self._collectors[replica]
                    collector.abandon(command.request.request_id)
                    settle(sequence.future, collector.pop(command.key))

    def _drain(self, *, strict: bool = True) -> None:
        """Abort every running request and collect its last chunks (the pollers are held or
        gone: this thread is every replica's poller meanwhile). ``strict``: a replica whose
        requests do not end raises; else it is logged and the next one drained."""
        deadline = time.monotonic() + SETTLE_S
        for replica in range(len(self.rollouts)):
            running = [s.request_id for s in self._sequences[replica].values() if s.request_id]
            if not running:
                continue
            self._abort(replica, running)
            while self._running(replica):
                if time.monotonic() > deadline:
                    error = ServiceClosed(
                        f"aborted requests on replica {replica} of {self.name} did not end "
                        f"within {SETTLE_S:.0f} s"
                    )
                    if strict:
                        raise error
                    log.error("%s", error)
                    break
                self._poll(replica, POLL_S)


def generate_with_requests(rollout: Rollout, requests: Sequence[Request]) -> list[Completion]:
    """Submit ``requests`` (in one call), wait for every one, return their completions in
    submission order: batch generation over the request interface, polled by this thread. If
    anything fails, the requests are aborted and drained before the error propagates, so the
    rollout is left with nothing of this call."""
    with RequestPoller([rollout], name="generate") as poller:
        futures = poller.submit_many(0, requests)
        while not all(future.done() for future in futures):
            poller.pump(poll_s=POLL_S)
        return [future.result() for future in futures]
