"""One owner of rollout traffic: a thread that submits requests to the rollouts, polls them
and completes each request's future (``submit -> Future[Completion]``), with abort, and on
close an abort-and-drain that fails nothing silently. A rollout has one poller at a time:
whoever needs generation hands requests here instead of polling it (the trainer's episodes
and its OpenAI endpoint, and :func:`generate_with_requests`, every request-level rollout's
batch ``generate``)."""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any

from drivetrain.api import Completion, Rollout
from drivetrain.api.requests import Request
from drivetrain.runtime.collector import Collector

log = logging.getLogger(__name__)

#: longest wait in one poll while requests run (seconds)
POLL_S = 0.02
#: how long aborted requests may take to end when the service closes (seconds)
SETTLE_S = 30.0


class ServiceClosed(RuntimeError):
    """The service closed (or failed) while a request was waiting or generating."""


class RolloutService:
    """The one thread that drives ``rollouts``: submits, polls, completes futures."""

    def __init__(self, rollouts: Sequence[Rollout], *, name: str = "rollouts") -> None:
        self.rollouts = list(rollouts)
        self.commands: queue.SimpleQueue[tuple[Any, ...]] = queue.SimpleQueue()
        self.collectors = [Collector() for _ in self.rollouts]
        self.waiting: list[dict[str, Future[Completion]]] = [{} for _ in self.rollouts]
        self.failure: BaseException | None = None
        #: a submit either reaches the queue before the stop drains it, or sees the failure
        self._closing = threading.Lock()
        self.thread = threading.Thread(target=self._run, name=f"{name}-service", daemon=True)
        self.thread.start()

    def submit(self, replica: int, request: Request) -> Future[Completion]:
        return self.submit_many(replica, [request])[0]

    def submit_many(self, replica: int, requests: Sequence[Request]) -> list[Future[Completion]]:
        """``requests`` on replica ``replica``, submitted in one call (they start together);
        each future gets its request's completion, or the error that ended it."""
        futures: list[Future[Completion]] = [Future() for _ in requests]
        with self._closing:
            if self.failure is not None:
                closed = ServiceClosed(f"the rollout service stopped: {self.failure}")
                for future in futures:
                    future.set_exception(closed)
            else:
                self.commands.put(("submit", replica, list(requests), futures))
        return futures

    def abort(self, request_id: str) -> None:
        self.commands.put(("abort", request_id))

    def close(self, timeout_s: float = SETTLE_S + 5) -> None:
        """Stop: requests still running are aborted and drained, their waiters failed."""
        self.commands.put(("stop",))
        self.thread.join(timeout_s)

    def __enter__(self) -> RolloutService:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- the thread ---------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                busy = any(self.waiting)
                try:  # idle: wait for a command; busy: take what is queued, then poll (a
                    # rollout its poller drives advances one token step per poll: no wait here)
                    command = self.commands.get_nowait() if busy else self.commands.get(timeout=1.0)
                except queue.Empty:
                    command = None
                while command is not None:
                    if command[0] == "stop":
                        self._stop()
                        return
                    self._command(command)
                    try:
                        command = self.commands.get_nowait()
                    except queue.Empty:
                        command = None
                for replica, waiting in enumerate(self.waiting):
                    if waiting:
                        self._poll(replica)
        except BaseException as exc:  # a bug here: fail every waiter instead of hanging them
            with self._closing:
                self.failure = exc
            log.exception("the rollout service failed")
            self._fail_all(ServiceClosed(f"the rollout service failed: {exc}"))

    def _command(self, command: tuple[Any, ...]) -> None:
        if command[0] == "submit":
            _, replica, requests, futures = command
            try:
                self.rollouts[replica].submit(requests)
            except Exception as exc:  # a refused request (too long...): its waiters' error
                for future in futures:
                    future.set_exception(exc)
                return
            for request, future in zip(requests, futures, strict=True):
                self.collectors[replica].track(request)
                self.waiting[replica][request.request_id] = future
        elif command[0] == "abort":
            for replica, waiting in enumerate(self.waiting):
                if command[1] in waiting:
                    self.rollouts[replica].abort([command[1]])

    def _poll(self, replica: int) -> None:
        waiting = self.waiting[replica]
        try:
            chunks = self.rollouts[replica].poll(POLL_S if self.commands.empty() else 0.0)
            finished = self.collectors[replica].add(chunks)
        except Exception as exc:  # the rollout failed: its requests' waiters get the error
            log.exception("rollout %d failed while polling", replica)
            with contextlib.suppress(Exception):
                self.rollouts[replica].abort(list(waiting))
            for future in waiting.values():
                future.set_exception(exc)
            waiting.clear()
            self.collectors[replica] = Collector()
            return
        for request_id in finished:
            future = waiting.pop(request_id)
            future.set_result(self.collectors[replica].pop(request_id))

    def _stop(self) -> None:
        closed = ServiceClosed("the rollout service closed")
        with self._closing:  # no submit reaches the queue after this
            self.failure = closed
        while True:  # submits queued behind the stop: failed, never left waiting
            try:
                command = self.commands.get_nowait()
            except queue.Empty:
                break
            if command[0] == "submit":
                for future in command[3]:
                    future.set_exception(closed)
        deadline = time.monotonic() + SETTLE_S
        for replica, waiting in enumerate(self.waiting):
            if not waiting:
                continue
            with contextlib.suppress(Exception):
                self.rollouts[replica].abort(list(waiting))
                while waiting and time.monotonic() < deadline:
                    self._poll(replica)
        self._fail_all(closed)

    def _fail_all(self, exc: BaseException) -> None:
        for waiting in self.waiting:
            for future in waiting.values():
                if not future.done():
                    future.set_exception(exc)
            waiting.clear()


def generate_with_requests(rollout: Rollout, requests: Sequence[Request]) -> list[Completion]:
    """Submit ``requests`` (in one call), wait for every one, return their completions in
    submission order: batch generation over the request interface, through a service of its
    own (the rollout's one poller meanwhile). If anything fails, the requests are aborted and
    drained before the error propagates, so the rollout is left with nothing of this call."""
    with RolloutService([rollout], name="generate") as service:
        return [future.result() for future in service.submit_many(0, requests)]
