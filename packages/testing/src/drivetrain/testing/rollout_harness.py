"""What the rollout kit needs to know about a rollout (:class:`RolloutHarness`), and the
request plumbing its checks share: running requests to their end under a deadline, aborting
mid-stream, and scoring a completion against the harness's reference forward."""

from __future__ import annotations

import abc
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from drivetrain.api.engine import NamedTensor
from drivetrain.api.requests import Chunk, Request
from drivetrain.api.rollout import Completion, Rollout, SamplingParams
from drivetrain.runtime.collector import Collector


class RolloutHarness(abc.ABC):
    """What the kit needs to know about a rollout backend."""

    #: max |log-prob - reference| accepted (fp32 models: ~1e-4)
    log_prob_tolerance: float = 1e-4
    #: how long one check may wait for its requests
    deadline_s: float = 300.0

    @abc.abstractmethod
    def make_rollout(self) -> Rollout:
        """A fresh rollout with the initial weights (version 0); the kit shuts it down."""

    @abc.abstractmethod
    def prompts(self) -> list[tuple[int, ...]]:
        """At least 8 distinct token-id prompts leaving room for 24 new tokens."""

    @abc.abstractmethod
    def changed_weights(self) -> list[NamedTensor]:
        """Weights that change greedy outputs (the same names and shapes as the model's)."""

    @abc.abstractmethod
    def reference_log_probs(
        self, prompt_ids: Sequence[int], token_ids: Sequence[int], temperature: float, changed: bool
    ) -> list[float]:
        """log p(token_ids[i] | prompt, token_ids[:i]) under softmax(logits / temperature)
        (temperature 0 means 1) of the initial or the changed weights, by a plain forward."""

    @abc.abstractmethod
    def decode(self, token_ids: Sequence[int]) -> str:
        """The text of generated tokens, as the rollout's tokenizer decodes them for stop
        strings (special tokens skipped)."""

    @abc.abstractmethod
    def eos_token_id(self) -> int | None:
        """The token that ends a request unless ``ignore_eos`` (``None``: the model has none)."""

    def weight_spec(self, value: Any) -> tuple[tuple[int, ...], str]:
        """The shape and dtype name (``"float32"``...) of a weight of :meth:`changed_weights`,
        as a transport asks ``weight_destination`` for it. The default reads a torch-like
        tensor's ``shape`` and ``dtype``."""
        return tuple(value.shape), str(value.dtype).removeprefix("torch.")

    def write_into(self, destination: Any, value: Any) -> None:
        """Copy ``value`` into a tensor ``weight_destination`` handed out, as a transport
        does. The default calls ``destination.copy_(value)`` (torch-like tensors)."""
        destination.copy_(value)

    def exact_rollout(self) -> Rollout | None:
        """Opt in to the check ``exact_numerics``: a fresh rollout configured with
        ``numerics=exact`` and the initial weights (the kit shuts it down). ``None``, the
        default: the check is skipped."""
        return None

    def exact_log_probs(
        self, prompt_ids: Sequence[int], token_ids: Sequence[int], temperature: float, changed: bool
    ) -> list[float]:
        """The training engine's log-probs of ``token_ids`` under ``numerics=exact`` (as
        :meth:`reference_log_probs` otherwise), each the float the engine computed."""
        raise NotImplementedError("a harness with exact_rollout() implements exact_log_probs")

    def routing_rollout(self) -> Rollout | None:
        """Opt in to the check ``routed_experts``: a fresh rollout of a mixture-of-experts model
        configured with ``return_routed_experts`` and the initial weights (the kit shuts it
        down). ``None``, the default: the check is skipped."""
        return None

    def forward_routing(self, ids: Sequence[int], changed: bool) -> list[list[list[int]]]:
        """The experts a plain forward of ``ids`` chooses: ``[position][layer][pick]``, with the
        initial weights or, ``changed``, those of :meth:`changed_weights`."""
        raise NotImplementedError("a harness with routing_rollout() implements forward_routing")

    def chat_prompt_ids(self, messages: Sequence[Mapping[str, str]]) -> tuple[int, ...] | None:
        """The token ids the rollout's chat template gives ``messages`` with the generation
        prompt added, or ``None`` (the default) when the rollout takes token ids only: then the
        kit checks that message prompts are refused."""
        return None


def greedy(tokens: int) -> SamplingParams:
    """Greedy sampling of exactly ``tokens`` tokens (EOS ignored)."""
    return SamplingParams(temperature=0, max_new_tokens=tokens, ignore_eos=True)


def requests_for(h: RolloutHarness, params: SamplingParams, prefix: str) -> list[Request]:
    """One request per harness prompt, ids ``prefix0``, ``prefix1``..."""
    return [Request(f"{prefix}{i}", p, params, i) for i, p in enumerate(h.prompts())]


def deadline(h: RolloutHarness) -> Callable[[str], None]:
    """A check that raises once the harness's deadline passed, naming what was awaited."""
    end = time.monotonic() + h.deadline_s

    def check(what: str) -> None:
        if time.monotonic() > end:
            raise AssertionError(f"{what} did not happen within {h.deadline_s:.0f} s")

    return check


def drain(
    rollout: Rollout,
    collector: Collector,
    h: RolloutHarness,
    on_chunks: Callable[[list[Chunk]], None] | None = None,
) -> None:
    """Poll until every tracked request has ended (or the deadline)."""
    overdue = deadline(h)
    while not collector.done:
        overdue("the requests' end")
        chunks = rollout.poll(0.05)
        collector.add(chunks)
        if on_chunks is not None:
            on_chunks(chunks)


def abort_after(rollout: Rollout, abort_at: dict[str, int]) -> Callable[[list[Chunk]], None]:
    """A chunk consumer that aborts request ``id`` once it has streamed ``abort_at[id]``
    tokens (the abort lands while it runs: its last chunk comes with a later poll)."""
    counts = dict.fromkeys(abort_at, 0)

    def consume(chunks: list[Chunk]) -> None:
        for chunk in chunks:
            if chunk.request_id in counts and not chunk.finished:
                counts[chunk.request_id] += len(chunk.token_ids)
                if counts[chunk.request_id] >= abort_at[chunk.request_id]:
                    rollout.abort([chunk.request_id])
                    del counts[chunk.request_id]

    return consume


def run(h: RolloutHarness, rollout: Rollout, requests: list[Request]) -> list[Completion]:
    """Submit ``requests`` together and return their completions once all have ended."""
    collector = Collector()
    for r in requests:
        collector.track(r)
    rollout.submit(requests)
    drain(rollout, collector, h)
    return collector.completions()


def staggered(h: RolloutHarness, rollout: Rollout, requests: list[Request]) -> list[Completion]:
    """Submit ``requests`` one per poll, each joining while the earlier ones run."""
    collector = Collector()
    for r in requests:
        collector.track(r)
    for r in requests:
        rollout.submit([r])
        collector.add(rollout.poll(0.0))
    drain(rollout, collector, h)
    return collector.completions()


def assert_log_probs(
    h: RolloutHarness, c: Completion, temperature: float, changed: bool, what: str
) -> None:
    """``c``'s log-probs equal the reference forward's at ``temperature`` (no filter)."""
    if not c.token_ids:
        return
    reference = h.reference_log_probs(c.prompt_ids, c.token_ids, temperature, changed)
    worst = max(abs(a - b) for a, b in zip(c.log_probs, reference, strict=True))
    if not worst <= h.log_prob_tolerance:
        raise AssertionError(
            f"{what}: sampled log-probs differ from the reference forward by {worst:.3g} "
            f"(tolerance {h.log_prob_tolerance:.3g})"
        )


def with_rollout(h: RolloutHarness, check: Callable[[Rollout], None]) -> None:
    """Run ``check`` on a fresh rollout, shut down afterwards whatever happens."""
    rollout = h.make_rollout()
    try:
        check(rollout)
    finally:
        rollout.shutdown()
