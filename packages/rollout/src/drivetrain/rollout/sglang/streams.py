"""Requests served by an asyncio streaming API whose event loop runs only while its caller
drives it: the step function of a :class:`~drivetrain.api.request_queue.RequestQueue`.

SGLang's ``Engine`` keeps its tokenizer manager on an event loop (``Engine.loop``) that nothing
runs in the background: its own blocking calls (weight updates, memory) run it with
``run_until_complete``, and so does :meth:`LoopStreams.step`. SGLang's scheduler, in its own
process, keeps generating meanwhile; its outputs wait in a socket until the loop runs again.
Each request is one task consuming its stream (``open_stream``); :meth:`step` starts the
joining requests, cancels the aborted ones (cancelling SGLang's stream aborts the request in
the scheduler) and runs the loop until an output arrives or ``wait_s`` passes. The loop is
only ever run by whoever holds the queue's lock, so one thread at a time runs it. A cancelled
request ends in the backend a little later; :meth:`LoopStreams.settle` waits for that (``holds``
says whether the backend still has it) before anything that needs the backend idle.

Nothing here imports sglang: it is tested with plain asyncio streams on CPU.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any

from drivetrain.api.request_queue import TokenEvent
from drivetrain.api.requests import Request

#: opens a request's stream of outputs (each the request's output so far)
OpenStream = Callable[[Request], Awaitable[AsyncIterator[Mapping[str, Any]]]]
#: ``(request_id, output, tokens already reported) -> the new tokens`` (and finish reason)
ReadOutput = Callable[[str, Mapping[str, Any], int], TokenEvent]
#: whether the backend still holds a request (a cancelled one until it ended there)
Holds = Callable[[str], bool]


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
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._cancelled: set[str] = set()  # not yet ended in the backend
        self._events: list[TokenEvent] = []
        self._failure: BaseException | None = None
        self._arrived = asyncio.Event()

    @property
    def running(self) -> set[str]:
        return set(self._tasks)

    def step(self, joining: list[Request], aborted: list[str]) -> list[TokenEvent]:
        """Start ``joining``, cancel ``aborted`` (what they produced since the last step is
        dropped: their last chunk is the queue's), then run the loop until some request has
        new tokens or ``wait_s`` passed. Returns every running request's new tokens; raises
        what a stream raised."""
        for request_id in aborted:
            self._cancel(request_id)
        for request in joining:
            self._tasks[request.request_id] = self._loop.create_task(self._consume(request))
        self._loop.run_until_complete(self._wait())
        failure, self._failure = self._failure, None
        if failure is not None:
            raise failure
        events, self._events = self._events, []
        return events

    def reset(self) -> None:
        """After a failed step: every request's task cancelled and finished."""
        tasks = list(self._tasks.values())
        for request_id in list(self._tasks):
            self._cancel(request_id)
        if tasks:
            self._loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
        self._events.clear()
        self._failure = None

    def settle(self, timeout_s: float) -> None:
        """Run the loop until the backend let go of every cancelled request; ``RuntimeError``
        after ``timeout_s``."""
        self._loop.run_until_complete(self._settle(timeout_s))

    async def _settle(self, timeout_s: float) -> None:
        deadline = self._loop.time() + timeout_s
        while True:
            self._cancelled = {i for i in self._cancelled if self._holds(i)}
            if not self._cancelled:
                return
            if self._loop.time() >= deadline:
                raise RuntimeError(
                    f"the backend still holds {len(self._cancelled)} aborted requests after "
                    f"{timeout_s:g} s (e.g. {sorted(self._cancelled)[:3]})"
                )
            await asyncio.sleep(0.005)  # the backend's own tasks on this loop end them

    def _cancel(self, request_id: str) -> None:
        task = self._tasks.pop(request_id, None)
        if task is not None:
            task.cancel()
            self._cancelled.add(request_id)
        self._events = [e for e in self._events if e.request_id != request_id]

    async def _wait(self) -> None:
        if not self._tasks and not self._events:
            await asyncio.sleep(0)  # let cancelled tasks unwind
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._arrived.wait(), self._wait_s)
        self._arrived.clear()
        self._cancelled = {i for i in self._cancelled if self._holds(i)}

    async def _consume(self, request: Request) -> None:
        request_id = request.request_id
        task = asyncio.current_task()
        reported = 0
        try:
            stream = await self._open(request)
            async for output in stream:
                event = self._read(request_id, output, reported)
                reported += len(event.token_ids)
                if event.token_ids or event.finish_reason is not None:
                    self._events.append(event)
                    self._arrived.set()
                if event.finish_reason is not None:
                    return
            raise RuntimeError(f"the stream of request {request_id!r} ended unfinished")
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # reported by the step that runs the loop
            if self._failure is None:
                self._failure = exc
            self._arrived.set()
        finally:
            if self._tasks.get(request_id) is task:  # an id is reused once its request ended
                del self._tasks[request_id]
