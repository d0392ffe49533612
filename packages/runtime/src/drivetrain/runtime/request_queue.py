"""The request bookkeeping of a rollout whose generation advances when its caller polls.

A backend whose generation advances when asked (a transformers model, vLLM's ``LLMEngine``,
SGLang's request streams on an event loop, the fake rollout) supplies one function,
``step(joining, aborted) -> events``: start the ``joining`` requests, drop the ``aborted``
ones, advance the running batch (one token step, or SGLang's loop until output arrives), and
report each request's new tokens. :class:`RequestQueue` does the rest of the request contract once:
id checks, the waiting line and its capacity, pause (wait or abort) and resume, abort of waiting
and running requests, chunks merged per request between polls and tagged with the weight
version of their step, and a lock that weight updates take so weights change only between
steps.

By default a step runs when the caller polls. :meth:`RequestQueue.run_in_background` starts a
thread of the rollout's own that steps whenever something runs, so polls only collect the
merged chunks: a rollout in a server process then generates while its caller (the trainer) is
busy, and the caller makes one call per poll instead of one per token step. The step lock is
granted in arrival order (:class:`~drivetrain.runtime.fair_lock.FairRLock`): a weight update,
pause or abort waits for the step in progress, not for a loop that takes the lock again at once.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

from drivetrain.api.requests import Chunk, Request
from drivetrain.api.rollout import FinishReason, Rollout
from drivetrain.api.routing import RoutedExperts, join_routing
from drivetrain.runtime.fair_lock import FairRLock


@dataclass
class TokenEvent:
    """New tokens of one running request from one step (``finish_reason`` when it ended), and
    the routing of the positions the step computed for it (when the rollout records it)."""

    request_id: str
    token_ids: list[int]
    log_probs: list[float]
    finish_reason: FinishReason | None = None
    routed_experts: RoutedExperts | None = None


@dataclass
class _Segment:
    version: int
    tokens: list[int]
    log_probs: list[float]
    routed_experts: RoutedExperts | None


@dataclass
class _Pending:
    """Tokens generated since the last poll, by weight version."""

    segments: list[_Segment] = field(default_factory=list)
    finish_reason: FinishReason | None = None

    def add(self, version: int, event: TokenEvent) -> None:
        last = self.segments[-1] if self.segments else None
        if last is not None and last.version == version:
            last.tokens.extend(event.token_ids)
            last.log_probs.extend(event.log_probs)
            last.routed_experts = join_routing(last.routed_experts, event.routed_experts)
        elif event.token_ids or event.routed_experts is not None:  # (a finishing event may
            # carry a request's routing alone: vLLM and SGLang give it at the end)
            self.segments.append(
                _Segment(
                    version, list(event.token_ids), list(event.log_probs), event.routed_experts
                )
            )


Step = Callable[[list[Request], list[str]], list[TokenEvent]]


class RequestQueue:
    """Requests of one caller-driven rollout (see the module docstring).

    ``step`` is called under :attr:`lock`, as must be anything that changes the weights;
    ``version`` reads the version in use; ``capacity`` is how many requests may run at once.
    A step that raises ends every running request (``abort``, their chunks at the next poll),
    calls ``reset`` (the backend drops its running batch) and re-raises: nothing is left
    half-running.
    """

    def __init__(
        self,
        step: Step,
        version: Callable[[], int],
        *,
        capacity: int,
        reset: Callable[[], None] | None = None,
    ) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self._step = step
        self._reset = reset
        self._version = version
        self.capacity = capacity
        #: held by every token step; take it to change weights between steps
        self.lock = FairRLock()
        self._waiting: deque[Request] = deque()
        self._running: set[str] = set()
        self._to_abort: set[str] = set()
        self._pending: dict[str, _Pending] = {}
        self._paused = False
        #: submits, resumes and aborts wake a waiting poller or the background loop
        self._arrived = threading.Condition(self.lock)
        #: new chunks (or the background loop's failure) wake a poller
        self._output = threading.Condition(self.lock)
        self._background: threading.Thread | None = None
        self._stop_background = False
        #: stepped by its owner between calls (step_if_work): polls only collect
        self._external = False
        self._failure: BaseException | None = None

    # ---- the request contract --------------------------------------------------------------
    def submit(self, requests: Sequence[Request], validate: Callable[[Request], None]) -> None:
        """Queue ``requests`` after ``validate`` accepted every one (it raises ``ValueError``)."""
        ids = [r.request_id for r in requests]
        with self.lock:
            known = self._unfinished() | set(self._pending)  # ended, last chunk not yet polled
            clash = sorted({i for i in ids if i in known or ids.count(i) > 1})
            if clash:
                raise ValueError(f"request ids {clash[:5]} are already in use")
            for request in requests:
                validate(request)
            self._waiting.extend(requests)
            self._arrived.notify_all()

    def poll(self, timeout_s: float = 0.0) -> list[Chunk]:
        deadline = time.monotonic() + timeout_s
        while True:
            with self.lock:
                self._raise_failure()
                if self._external:  # its owner steps between calls, on this very thread
                    return self._take()
                if self._background is not None:  # the loop steps: collect, or wait for it
                    if self._pending or time.monotonic() >= deadline:
                        return self._take()
                    self._output.wait(max(0.0, deadline - time.monotonic()))
                    continue
                if not self._pending and self._has_work():
                    self._advance()
                if self._pending or time.monotonic() >= deadline:
                    return self._take()
                if not self._has_work():  # nothing runs until something is submitted
                    self._arrived.wait(max(0.0, deadline - time.monotonic()))

    # ---- generation on a thread of its own ------------------------------------------------
    def run_in_background(self, enabled: bool) -> None:
        """Step on a thread of this queue's own whenever something runs (``enabled``), or
        stop that thread and step when polled again. A step that raises ends that thread, its
        requests end aborted and the next poll raises the error."""
        if not enabled:
            with self.lock:
                thread, self._background = self._background, None
                self._stop_background = True
                self._arrived.notify_all()
            if thread is not None and thread is not threading.current_thread():
                thread.join()
            return
        with self.lock:
            if self._background is not None:
                return
            self._stop_background = False
            self._background = threading.Thread(
                target=self._run_background, daemon=True, name="rollout-generation"
            )
            self._background.start()

    @property
    def in_background(self) -> bool:
        return self._background is not None or self._external

    def step_between_calls(self, enabled: bool) -> None:
        """The owner steps (:meth:`step_if_work`) between the calls it serves, on the thread
        that serves them, instead of a poll stepping: a server process generates with no
        second thread contending for its GIL, and its polls only collect."""
        self.run_in_background(False)
        with self.lock:
            self._external = enabled

    def step_if_work(self) -> bool:
        """One token step if something runs or may start; whether it ran. A step that raises
        ends the stepping between calls: its requests end aborted, the next poll raises."""
        with self.lock:
            if not self._external or not self._has_work():
                return False
            try:
                self._advance()
            except BaseException as exc:  # the next poll raises it; polls step again after
                self._failure = exc
                self._external = False
                return False
            return True

    def _run_background(self) -> None:
        while True:
            with self.lock:
                while not self._stop_background and not self._has_work():
                    self._arrived.wait()
                if self._stop_background:
                    return
                try:
                    self._advance()
                except BaseException as exc:  # the poller raises it; nothing runs on
                    self._failure = exc
                    self._background = None
                    self._output.notify_all()
                    return
                if self._pending:
                    self._output.notify_all()

    def _raise_failure(self) -> None:
        if self._failure is not None:
            exc, self._failure = self._failure, None
            raise exc

    def abort(self, request_ids: Sequence[str] | None = None) -> int:
        with self.lock:
            wanted = self._unfinished() if request_ids is None else set(request_ids)
            waiting = [r for r in self._waiting if r.request_id in wanted]
            for request in waiting:  # never started: its last chunk is empty
                self._waiting.remove(request)
                self._finish(request.request_id, FinishReason.ABORT)
            running = (wanted & self._running) - self._to_abort
            self._to_abort |= running
            self._arrived.notify_all()  # a poller waiting for work has chunks to collect
            if waiting:
                self._output.notify_all()
            return len(waiting) + len(running)

    def pause(self, *, abort: bool) -> int:
        """Start no waiting request; abort the running ones, or step until they end (their
        chunks wait for the next poll). Returns how many were aborted."""
        with self.lock:
            self._paused = True
            aborted = self.abort(sorted(self._running)) if abort else 0
            self.finish_running()
            return aborted

    def finish_running(self) -> None:
        """Step until no request runs, starting none meanwhile (their chunks wait for the next
        poll): for a backend that changes weights or memory only when idle."""
        with self.lock:
            paused, self._paused = self._paused, True
            try:
                while self._running:
                    self._advance()
            finally:
                self._paused = paused

    def resume(self) -> None:
        with self.lock:
            self._paused = False
            self._arrived.notify_all()

    # ---- internals -----------------------------------------------------------------------
    def _unfinished(self) -> set[str]:
        return {r.request_id for r in self._waiting} | self._running

    def _has_work(self) -> bool:
        return bool(self._running) or (bool(self._waiting) and not self._paused)

    def _advance(self) -> None:
        """One step: aborted requests leave, waiting ones join up to capacity, one token."""
        aborted = sorted(self._to_abort & self._running)
        self._to_abort.clear()
        self._running -= set(aborted)
        joining = []
        while self._waiting and not self._paused and len(self._running) < self.capacity:
            request = self._waiting.popleft()
            joining.append(request)
            self._running.add(request.request_id)
        version = self._version()
        try:
            events = self._step(joining, aborted) if joining or self._running or aborted else []
        except BaseException:
            for request_id in self._running | set(aborted):
                self._finish(request_id, FinishReason.ABORT)
            self._running.clear()
            self._to_abort.clear()
            if self._reset is not None:
                self._reset()
            raise
        for request_id in aborted:
            self._finish(request_id, FinishReason.ABORT)
        for event in events:
            if event.request_id not in self._running:
                raise RuntimeError(
                    f"the backend reported tokens of {event.request_id!r}, which is not running"
                )
            pending = self._pending.setdefault(event.request_id, _Pending())
            pending.add(version, event)
            if event.finish_reason is not None:
                self._running.discard(event.request_id)
                pending.finish_reason = event.finish_reason

    def _finish(self, request_id: str, reason: FinishReason) -> None:
        self._pending.setdefault(request_id, _Pending()).finish_reason = reason

    def _take(self) -> list[Chunk]:
        chunks = []
        for request_id, pending in self._pending.items():
            if not pending.segments and pending.finish_reason is None:
                continue
            segments = pending.segments or [_Segment(self._version(), [], [], None)]
            for i, segment in enumerate(segments):
                last = i == len(segments) - 1
                chunks.append(
                    Chunk(
                        request_id,
                        tuple(segment.tokens),
                        tuple(segment.log_probs),
                        segment.version,
                        pending.finish_reason if last else None,
                        segment.routed_experts,
                    )
                )
        self._pending.clear()
        return chunks


@dataclass
class WeightUpdate:
    """One weight update in progress (see :meth:`QueuedRollout.updating_weights`)."""

    version: int
    #: set by whatever writes a weight: from then on a failure leaves old and new weights mixed
    changed: bool = False


class QueuedRollout(Rollout):
    """A rollout whose requests a :class:`RequestQueue` keeps: set :attr:`requests` in
    ``__init__``; override :meth:`validate_request` (``ValueError`` for a request the backend
    cannot serve) and :meth:`check_ready` (``RuntimeError`` while it cannot generate, e.g.
    asleep; call ``super().check_ready()``). Backends change weights inside
    :meth:`updating_weights`."""

    requests: RequestQueue
    #: why the weights are a mix of two versions (an update failed part-way), else ``None``
    torn: str | None = None
    #: the update in progress, if any
    weight_update: WeightUpdate | None = None

    def validate_request(self, request: Request) -> None:
        return None

    def check_ready(self) -> None:
        if self.torn is not None:
            raise RuntimeError(f"{type(self).__name__} cannot generate: {self.torn}")

    @contextlib.contextmanager
    def updating_weights(self, version: int) -> Iterator[WeightUpdate]:
        """Around applying the weights of ``version`` as they arrive: holds the step lock
        (weights change between token steps only). The body sets ``changed`` before it writes
        the first weight. If it fails after that, the rollout holds a mix of two versions: it
        aborts every request and refuses new ones until an update that changed weights
        succeeds. A failure before any weight changed leaves the rollout as it was."""
        update = WeightUpdate(version)
        with self.requests.lock:
            self.weight_update = update
            try:
                yield update
            except BaseException as exc:
                if update.changed:
                    self.torn = (
                        f"the update to weights version {version} failed part-way "
                        f"({type(exc).__name__}: {exc}); send the weights again"
                    )
                    self.requests.abort()
                raise
            finally:
                self.weight_update = None
            if update.changed:  # an empty stream leaves a torn rollout's mix as it was
                self.torn = None

    def submit(self, requests: Sequence[Request]) -> None:
        # checked under the step lock: a submit that waited for the lock while an update
        # failed part-way must see the rollout torn, not queue requests on mixed weights
        with self.requests.lock:
            self.check_ready()
            self.requests.submit(requests, self.validate_request)

    def poll(self, timeout_s: float = 0.0) -> list[Chunk]:
        return self.requests.poll(timeout_s)

    def abort(self, request_ids: Sequence[str] | None = None) -> int:
        return self.requests.abort(request_ids)

    def pause_generation(self, *, abort: bool = False) -> int:
        return self.requests.pause(abort=abort)

    def background_generation(self, enabled: bool) -> bool:
        self.requests.run_in_background(enabled)
        return enabled

    def resume_generation(self) -> None:
        self.requests.resume()
