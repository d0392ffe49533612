"""Chunks back into completions, and the requests of a batch ``generate`` call
(:mod:`drivetrain.api.requests`): what every request-level rollout and its callers share.
The batch call itself is :func:`drivetrain.runtime.request_poller.generate_with_requests`."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from drivetrain.api.requests import Chunk, Request, sample_seed
from drivetrain.api.rollout import Completion, FinishReason, SamplingParams
from drivetrain.api.routing import RoutedExperts, join_routing


@dataclass
class _Progress:
    request: Request
    token_ids: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    last_version: int = 0  # of the latest chunk, tokens or not
    finish_reason: FinishReason | None = None
    aliases: list[str] = field(default_factory=list)  # its segments' ids, the first one first
    routed_experts: RoutedExperts | None = None


class Collector:
    """Assembles the chunks of submitted requests into completions.

    :meth:`resume` continues an aborted request as a new one whose prompt is the original
    prompt plus what was generated (a partial rollout); the completion then holds both segments
    and :attr:`Completion.token_versions` the version of each token.
    """

    def __init__(self) -> None:
        #: by each sequence's first id, in the order they were tracked (the completion order)
        self._progress: dict[str, _Progress] = {}
        self._alias: dict[str, str] = {}  # a continuation's id -> the sequence's first id

    def track(self, request: Request) -> None:
        if request.request_id in self._alias or request.request_id in self._progress:
            raise ValueError(f"request id {request.request_id!r} is already tracked")
        self._progress[request.request_id] = _Progress(request, aliases=[request.request_id])
        self._alias[request.request_id] = request.request_id

    def add(self, chunks: Sequence[Chunk]) -> list[str]:
        """Record chunks; returns the ids of the sequences they finished."""
        finished = []
        for chunk in chunks:
            key = self._alias.get(chunk.request_id)
            if key is None:
                raise ValueError(f"a chunk of unknown request {chunk.request_id!r}")
            progress = self._progress[key]
            if progress.finish_reason is not None:
                raise ValueError(f"a chunk of {chunk.request_id!r} after it finished")
            progress.token_ids += chunk.token_ids
            progress.log_probs += chunk.log_probs
            progress.versions += [chunk.weight_version] * len(chunk.token_ids)
            progress.last_version = chunk.weight_version
            progress.routed_experts = join_routing(progress.routed_experts, chunk.routed_experts)
            if chunk.finish_reason is not None:
                progress.finish_reason = chunk.finish_reason
                finished.append(key)
        return finished

    def resume(self, request_id: str, new_id: str) -> Request:
        """The request continuing aborted ``request_id``: prompt plus its tokens so far, the
        remaining token budget (a seeded request continues with a seed of its own, not its
        first one again). Tracked under ``new_id``; its chunks extend the same completion. A
        stop string that would span the abort point is not seen: the continuation's stop
        strings match its own tokens."""
        key = self._alias[request_id]
        progress = self._progress[key]
        if progress.finish_reason is not FinishReason.ABORT:
            raise ValueError(f"request {request_id!r} was not aborted; nothing to resume")
        if new_id in self._alias:
            raise ValueError(f"request id {new_id!r} is already tracked")
        first = progress.request
        left = first.params.max_new_tokens - len(progress.token_ids)
        if left < 1:
            raise ValueError(f"request {request_id!r} has no token budget left to resume")
        progress.finish_reason = None
        self._alias[new_id] = key
        progress.aliases.append(new_id)
        seed = first.params.seed
        return Request(
            new_id,
            first.prompt_ids + tuple(progress.token_ids),
            replace(
                first.params,
                max_new_tokens=left,
                seed=None if seed is None else sample_seed(seed, len(progress.token_ids)),
            ),
            first.prompt_index,
        )

    def abandon(self, request_id: str) -> None:
        """``request_id`` (a continuation) will never run: its sequence ends as aborted, with
        what it generated before."""
        self._progress[self._alias[request_id]].finish_reason = FinishReason.ABORT

    @property
    def done(self) -> bool:
        return all(p.finish_reason is not None for p in self._progress.values())

    def finished(self, request_id: str) -> bool:
        """Whether the request (or the one it resumed) has had its last chunk."""
        return self._progress[self._alias[request_id]].finish_reason is not None

    def completion(self, request_id: str) -> Completion:
        progress = self._progress[self._alias[request_id]]
        if progress.finish_reason is None:
            raise ValueError(f"request {request_id!r} has not finished")
        versions = tuple(progress.versions)
        request = progress.request
        return Completion(
            prompt_index=request.prompt_index,
            prompt_ids=request.prompt_ids,
            token_ids=tuple(progress.token_ids),
            log_probs=tuple(progress.log_probs),
            finish_reason=progress.finish_reason,
            # a request aborted before its first token reports the version of its last chunk
            weight_version=versions[0] if versions else progress.last_version,
            token_versions=versions,
            routed_experts=progress.routed_experts,
        )

    def pop(self, request_id: str) -> Completion:
        """The finished sequence's completion, forgotten here (ids of all its segments become
        free): for a caller that streams requests through one collector for a long time."""
        completion = self.completion(request_id)
        self.forget(request_id)
        return completion

    def forget(self, request_id: str) -> None:
        """Drop ``request_id``'s sequence, finished or not (ids of all its segments become
        free)."""
        for alias in self._progress.pop(self._alias[request_id]).aliases:
            del self._alias[alias]

    def completions(self) -> list[Completion]:
        """Every tracked sequence's completion, in the order they were first tracked."""
        return [self.completion(request_id) for request_id in self._progress]


def call_requests(
    prompt_ids: Sequence[Sequence[int]],
    budgets: Sequence[int],
    params: SamplingParams,
    *,
    seed: int | None,
    prefix: str | None = None,
) -> list[Request]:
    """The requests of one batch ``generate`` call: ``params.n`` per prompt, prompt order,
    each with at most its prompt's token budget; a seeded call seeds every sample
    (:func:`sample_seed`) so the call is reproducible. Ids are ``{prefix}-{number}``, the
    prefix unique per call unless given."""
    prefix = prefix or f"generate-{uuid.uuid4().hex[:12]}"
    requests = []
    for index, (ids, budget) in enumerate(zip(prompt_ids, budgets, strict=True)):
        for _ in range(params.n):
            number = len(requests)
            requests.append(
                Request(
                    f"{prefix}-{number}",
                    tuple(ids),
                    replace(
                        params,
                        n=1,
                        max_new_tokens=budget,
                        seed=None if seed is None else sample_seed(seed, number),
                    ),
                    prompt_index=index,
                )
            )
    return requests
