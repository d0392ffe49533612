"""Requests served by an asyncio streaming API whose event loop runs only while its caller
drives it: the step function of a :class:`~drivetrain.runtime.request_queue.RequestQueue`.

SGLang's ``Engine`` keeps its tokenizer manager on an event loop (``Engine.loop``) that nothing
runs in the background: its own blocking calls (weight updates, memory) run it with
``run_until_complete``, and so does :meth:`LoopStreams.step`. SGLang's scheduler, in its own
process, keeps generating meanwhile; its outputs wait in a socket until the loop runs again.
Each request is one task consuming its stream (``open_stream``) under a backend id of its own,
a fresh fixed-length hex string: SGLang aborts every request whose id *starts with* the aborted
one's (``a1`` would take ``a10`` with it) and refuses an id still in use (a resumed request
may reuse an aborted one's id at once). :meth:`step` starts the joining requests, cancels the
aborted ones (cancelling SGLang's stream aborts the request in the scheduler) and runs the loop
until an output arrives or ``wait_s`` passes. A stream is closed when its task ends, so SGLang
releases what it holds for it (its model-update reader lock). The loop is
only ever run by whoever holds the queue's lock, so one thread at a time runs it. A cancelled
request ends in the backend a little later; :meth:`LoopStreams.settle` waits for that (``holds``
says whether the backend still has it) before anything that needs the backend idle.

Nothing here imports sglang: it is tested with plain asyncio streams on CPU.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from drivetrain.api.requests import Request
from drivetrain.runtime.request_queue import TokenEvent

#: opens the stream of outputs (each the request's output so far) of a request under its
#: backend id
OpenStream = Callable[[Request, str], Awaitable[AsyncIterator[Mapping[str, Any]]]]
#: ``(request_id, output, tokens already reported) -> the new tokens`` (and finish reason)
ReadOutput = Callable[[str, Mapping[str, Any], int], TokenEvent]
#: whether the backend still holds the request of a backend id (a cancelled one until it
#: ended there)
Holds = Callable[[str], bool]


@dataclass
class _Running:
    task: asyncio.Task[None]
    backend_id: str


class LoopStreams:
    """The running requests of a streaming asyncio API (see the module docstring)."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        open_stream: OpenStream,
        read_output: ReadOutput,
        holds: Holds,
        *,
        wait_s: float = 0.05,
    ) -> None:
        self._loop = loop
        self._open = open_stream
        self._read = read_output
        self._holds = holds
        self._wait_s = wait_s
        self._running: dict[str, _Running] = {}
        self._ending: dict[str, str] = {}  # backend id -> request id, until the backend let go
        self._events: list[TokenEvent] = []
        self._failure: BaseException | None = None
        self._arrived = asyncio.Event()

    @property
    def running(self) -> set[str]:
        return set(self._running)

    def step(self, joining: list[Request], aborted: list[str]) -> list[TokenEvent]:
        """Start ``joining``, cancel ``aborted`` (what they produced since the last step is
        dropped: their last chunk is the queue's), then run the loop until some request has
        new tokens or ``wait_s`` passed. Returns every running request's new tokens; raises
        what a stream raised."""
        for request_id in aborted:
            self._cancel(request_id)
        for request in joining:
            backend_id = uuid.uuid4().hex
            task = self._loop.create_task(self._consume(request, backend_id))
            self._running[request.request_id] = _Running(task, backend_id)
        self._loop.run_until_complete(self._wait())
        failure, self._failure = self._failure, None
        if failure is not None:
            raise failure
        events, self._events = self._events, []
        return events

    def reset(self) -> None:
        """After a failed step: every request's task cancelled and finished."""
        tasks = [running.task for running in self._running.values()]
        for request_id in list(self._running):
            self._cancel(request_id)
        if tasks:
            self._loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
        self._events.clear()
        self._failure = None

    def settle(self, timeout_s: float) -> None:
        """Run the loop until the backend let go of every cancelled or failed request;
        ``RuntimeError`` after ``timeout_s``."""
        self._loop.run_until_complete(self._settle(timeout_s))

    async def _settle(self, timeout_s: float) -> None:
        deadline = self._loop.time() + timeout_s
        while True:
            self._forget_ended()
            if not self._ending:
                return
            if self._loop.time() >= deadline:
                names = sorted(self._ending.values())[:3]
                raise RuntimeError(
                    f"the backend still holds {len(self._ending)} aborted requests after "
                    f"{timeout_s:g} s (e.g. {names})"
                )
            await asyncio.sleep(0.005)  # the backend's own tasks on this loop end them

    def _forget_ended(self) -> None:
        self._ending = {b: r for b, r in self._ending.items() if self._holds(b)}

    def _cancel(self, request_id: str) -> None:
        running = self._running.pop(request_id, None)
        if running is not None:
            running.task.cancel()
            self._ending[running.backend_id] = request_id
        self._events = [e for e in self._events if e.request_id != request_id]

    async def _wait(self) -> None:
        if not self._running and not self._events:
            await asyncio.sleep(0)  # let cancelled tasks unwind
        else:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._arrived.wait(), self._wait_s)
            self._arrived.clear()
        self._forget_ended()

    async def _consume(self, request: Request, backend_id: str) -> None:
        request_id = request.request_id
        stream: AsyncIterator[Mapping[str, Any]] | None = None
        reported = 0
        try:
            stream = await self._open(request, backend_id)
            async for output in stream:
                event = self._read(request_id, output, reported)
                reported += len(event.token_ids)
                if event.token_ids or event.finish_reason is not None:
                    self._events.append(event)
                    self._arrived.set()
                if event.finish_reason is not None:
                    return
            raise RuntimeError(f"the stream of request {request_id!r} ended unfinished")
        # reported by the step that runs the loop (a cancelled task's CancelledError is no
        # Exception: it ends the task)
        except Exception as exc:
            if self._failure is None:
                self._failure = exc
            self._ending[backend_id] = request_id  # closing it aborts it in the backend
            self._arrived.set()
        finally:
            if stream is not None and hasattr(stream, "aclose"):
                with contextlib.suppress(Exception):  # a stream left open holds resources
                    await stream.aclose()
            running = self._running.get(request_id)
            if running is not None and running.backend_id == backend_id:
                del self._running[request_id]
