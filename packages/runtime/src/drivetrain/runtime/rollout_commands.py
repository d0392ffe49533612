"""The commands a :class:`~drivetrain.runtime.rollout_service.RolloutService` queues for a
replica's poller (frozen: a command is never changed once queued), and how a request's future
ends."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass

from drivetrain.api import Completion
from drivetrain.api.requests import Request


@dataclass(frozen=True, eq=False)
class Submit:
    """Start ``requests`` together; each future gets its request's completion."""

    requests: tuple[Request, ...]
    futures: tuple[Future[Completion], ...]
    resume_aborted: bool


@dataclass(frozen=True, eq=False)
class Continue:
    """Continue sequence ``key`` (aborted by an update or a pause) with ``request``."""

    key: str
    request: Request


@dataclass(frozen=True, eq=False)
class Abort:
    """End ``request_id`` (never continued)."""

    request_id: str


#: what a caller or a poll queues for a replica's poller
Command = Submit | Continue | Abort


def fail(futures: Sequence[Future[Completion]], exc: BaseException) -> None:
    for future in futures:
        with contextlib.suppress(InvalidStateError):  # done, or cancelled by its caller
            future.set_exception(exc)


def settle(future: Future[Completion], completion: Completion) -> None:
    with contextlib.suppress(InvalidStateError):  # cancelled by its caller
        future.set_result(completion)
