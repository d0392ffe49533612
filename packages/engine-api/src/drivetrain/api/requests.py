"""Request-level generation: the unit a rollout serves.

A caller :meth:`~drivetrain.api.rollout.Rollout.submit` s requests (prompt token ids, sampling
params, an id of its choosing), :meth:`~drivetrain.api.rollout.Rollout.poll` s for the tokens
generated since its last poll, as :class:`Chunk` s, and may
:meth:`~drivetrain.api.rollout.Rollout.abort` requests at any time. Requests join and leave the
running batch whenever they are submitted or finish (continuous batching). Every chunk carries
the weight version its tokens were sampled under; a request's last chunk carries its finish
reason (``abort`` for an aborted one, with the tokens generated up to then).

:class:`drivetrain.runtime.collector.Collector` turns chunks back into completions, and
:func:`drivetrain.runtime.request_poller.generate_with_requests` is the batch ``generate`` every
request-level rollout offers. Standard library only: requests and chunks cross process
boundaries as plain data.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from drivetrain.api.rollout import FinishReason, SamplingParams
from drivetrain.api.routing import RoutedExperts

if TYPE_CHECKING:
    pass

#: Seeds derived from one call-level seed stay below this (some backends keep them as int32).
SEED_MODULUS = 2**31 - 1


@dataclass(frozen=True)
class Request:
    """One sequence to generate. ``params.n`` must be 1: ``n`` samples of a prompt are ``n``
    requests (each with its own id, and its own seed when seeded). ``prompt_index`` is the
    caller's bookkeeping, copied into the completion."""

    request_id: str
    prompt_ids: tuple[int, ...]
    params: SamplingParams
    prompt_index: int = 0

    def __post_init__(self) -> None:
        if not self.request_id:
            raise ValueError("a request needs a non-empty request_id")
        if not self.prompt_ids:
            raise ValueError(f"request {self.request_id!r} has no prompt tokens")
        if self.params.n != 1:
            raise ValueError(
                f"request {self.request_id!r} has n={self.params.n}: submit one request per sample"
            )


@dataclass(frozen=True)
class Chunk:
    """Tokens of one request generated since the previous poll, with their log-probs (as in
    :class:`~drivetrain.api.rollout.Completion`) and the weight version they were sampled
    under. ``finish_reason`` is set on a request's last chunk only; an aborted request's last
    chunk may hold no tokens. ``routed_experts``: the routing of the positions these tokens'
    steps computed (a rollout asked to return it; :mod:`drivetrain.api.routing`)."""

    request_id: str
    token_ids: tuple[int, ...]
    log_probs: tuple[float, ...]
    weight_version: int
    finish_reason: FinishReason | None = None
    routed_experts: RoutedExperts | None = None

    def __post_init__(self) -> None:
        if len(self.token_ids) != len(self.log_probs):
            raise ValueError(
                f"chunk of {self.request_id!r}: {len(self.token_ids)} tokens but "
                f"{len(self.log_probs)} log-probs"
            )

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


def sample_seed(seed: int, index: int) -> int:
    """The seed of sample ``index`` of a call seeded with ``seed``: distinct per sample (``n``
    samples of a prompt sharing one seed would be equal), the same on every backend."""
    step = 0x9E3779B1  # coprime with the prime modulus: distinct seeds for distinct indices
    return (seed + index * step) % SEED_MODULUS
