"""One owner of the traffic to a placement's rollouts. The placement builds one
:class:`RolloutService` next to its weight-sync manager (``rl/placement.py``; a test fails if
product code builds another), and every caller generates through it: the sync loop's steps and
validation (:meth:`RolloutService.generate`), the groups generated ahead of training, the
trainer's episodes and its OpenAI endpoint (requests: :meth:`submit_many`). Which replica
generates what is :func:`~drivetrain.runtime.replicas.replica_slots`, for every caller.

Who polls: its user, through :meth:`pump` at points of its choosing (a fixed interleaving, so
two runs are bit-identical), or one thread per replica, from :meth:`poll_in_threads` until
:meth:`release` (the user is done: what it left running is aborted and drained, and the next
user starts clean). With ``background=True`` the threads ask each rollout to generate on its own
(:meth:`~drivetrain.api.rollout.Rollout.background_generation`) and poll one that does every
``BACKGROUND_POLL_S``, collecting several token steps a call. A thread never waits inside a
poll (a remote rollout's waiting poll holds the channel a weight update needs): it polls
without waiting, then waits a backoff that a new command cuts short; a replica with nothing
running is not polled. A turn's submits and continuations go as one ``submit`` call. The
request mechanics (continuations after an abort, drains) are :mod:`request_poller`'s.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

from drivetrain.api import Completion, Prompt, Rollout, SamplingParams
from drivetrain.runtime.replicas import replica_slots
from drivetrain.runtime.request_poller import SETTLE_S, RequestPoller, ServiceClosed
from drivetrain.runtime.rollout_commands import Command, fail

#: a polling thread's backoff after a poll that found nothing: from the first to the last
IDLE_POLL_S, BACKOFF_S = 0.001, 0.05
#: a polling thread's interval for a rollout that generates in the background (seconds): what
#: a finished request may wait to be noticed, against one call per token step
BACKGROUND_POLL_S = 0.02

__all__ = ["SETTLE_S", "RolloutService", "ServiceClosed"]

log = logging.getLogger(__name__)


class RolloutService(RequestPoller):
    """The poller of ``rollouts`` (see the module docstring); ``threads``: poll in threads
    from the start (:meth:`poll_in_threads`)."""

    def __init__(
        self,
        rollouts: Sequence[Rollout],
        *,
        name: str = "rollouts",
        threads: bool = True,
        background: bool = False,
        stall_timeout_s: float | None = None,
    ) -> None:
        if not rollouts:
            raise ValueError("a rollout service needs at least one rollout")
        super().__init__(rollouts, name=name, stall_timeout_s=stall_timeout_s)
        self._threads: list[threading.Thread] = []
        self._shut = False  # shutdown(): no user takes it again
        self._generating = ThreadPoolExecutor(len(self.rollouts), thread_name_prefix=name)
        if threads:
            self.poll_in_threads(background=background)

    # ---- who polls ------------------------------------------------------------------------
    def poll_in_threads(self, *, background: bool = False) -> None:
        """One polling thread per replica from now until :meth:`release` (nothing if they
        run); ``background``: each rollout generates on its own where it can."""
        if self.alive:
            return
        self.background = [
            background and rollout.background_generation(True) for rollout in self.rollouts
        ]
        self._threads = [
            threading.Thread(target=self._run, args=(r,), name=f"{self.name}-{r}", daemon=True)
            for r in range(len(self.rollouts))
        ]
        for thread in self._threads:
            thread.start()

    @property
    def alive(self) -> bool:
        """A polling thread runs (false while its user polls)."""
        return any(thread.is_alive() for thread in self._threads)

    def release(self, timeout_s: float = SETTLE_S) -> None:
        """Its user is done: as :meth:`close` (what runs is aborted and drained, every future
        ends, the threads stop), after which the service takes requests again, polled by its
        next user."""
        self.close(timeout_s)
        if self.alive or self._shut:  # a poll that never returned (nothing may poll beside
            return  # it), or the placement is done: it stays closed
        with self._cond:
            self._stopping = False
            self._failure = None
            self._dead.clear()  # the next user's pollers start afresh
        self._threads = []

    def shutdown(self) -> None:
        """The placement is done with its rollouts: close, then shut each rollout down."""
        self._shut = True
        self.close()
        for rollout in self.rollouts:
            with contextlib.suppress(Exception):
                rollout.shutdown()
        self._generating.shutdown(wait=False)

    def _stop_pollers(self, timeout_s: float) -> list[str]:
        deadline = time.monotonic() + timeout_s  # for them all: stuck pollers do not add up
        for thread in self._threads:  # a poller ends its turn, then sees the stop
            thread.join(max(0.0, deadline - time.monotonic()))
        return [thread.name for thread in self._threads if thread.is_alive()]

    # ---- batch generation -----------------------------------------------------------------
    def generate(self, prompts: Sequence[Prompt], params: SamplingParams) -> list[Completion]:
        """Each replica's share of ``prompts`` (:func:`replica_slots`) through its own batch
        ``generate``, all at once; the completions in prompt order. Nothing of this service
        may run on the rollouts meanwhile (hold it with :meth:`paused` if something does)."""
        chunks: dict[int, list[Prompt]] = {}
        for slot, prompt in zip(
            replica_slots(len(prompts), len(self.rollouts)), prompts, strict=True
        ):
            chunks.setdefault(slot.first, []).append(prompt)
        jobs = [
            (first, self._generating.submit(self.rollouts[replica].generate, chunk, params))
            for replica, (first, chunk) in enumerate(chunks.items())
        ]
        out: list[Completion] = []
        for offset, job in jobs:
            out.extend(
                dataclasses.replace(c, prompt_index=c.prompt_index + offset) for c in job.result()
            )
        return out

    # ---- a replica's poller -------------------------------------------------------------
    def _run(self, replica: int) -> None:
        backoff = 0.0
        while True:
            with self._cond:
                commands = self._next_commands(replica, backoff)
                if commands is None:
                    return
                self._active += 1
            try:
                got = self._turn(replica, commands, 0.0)
            except BaseException as exc:  # a bug here: nothing of it may hang or keep running
                self._crashed(replica, commands, exc)
                return
            finally:
                with self._cond:
                    self._active -= 1
                    self._cond.notify_all()
            if self.background[replica]:  # it steps on its own: collect at an interval
                backoff = BACKGROUND_POLL_S
            else:
                backoff = 0.0 if got else min(max(2 * backoff, IDLE_POLL_S), BACKOFF_S)

    def _crashed(self, replica: int, commands: list[Command], exc: BaseException) -> None:
        """This replica's poller failed (a bug): its requests are aborted and every waiter
        of it fails; later submits to it are refused (the other replicas go on)."""
        log.exception("the poller of replica %d of %s failed", replica, self.name)
        error = ServiceClosed(f"replica {replica} of the rollout service {self.name} failed: {exc}")
        with self._cond:
            self._dead[replica] = error
            commands = commands + self._commands[replica]
            self._commands[replica] = []
        sequences = self._sequences[replica]
        with contextlib.suppress(Exception):
            self.rollouts[replica].abort([s.request_id for s in sequences.values() if s.request_id])
        fail([s.future for s in sequences.values()], error)
        sequences.clear()
        self._settle_queued(replica, commands, error)  # submits taken or queued: failed too

    def _next_commands(self, replica: int, backoff: float) -> list[Command] | None:
        """Under the lock: wait until this replica has commands, or something runs and the
        backoff is over (never while held); its commands, or None to stop."""
        deadline = time.monotonic() + backoff
        while not self._stopping:
            if self._holds:  # the holder polls meanwhile: its sequences are not ours to read
                self._cond.wait(1.0)
                continue
            if self._commands[replica]:
                break
            running = self._running(replica)
            if running and time.monotonic() >= deadline:
                break
            self._cond.wait(max(0.0, deadline - time.monotonic()) if running else 1.0)
        else:
            return None
        commands, self._commands[replica] = self._commands[replica], []
        return commands
