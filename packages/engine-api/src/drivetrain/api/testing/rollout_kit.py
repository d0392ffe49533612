"""The rollout conformance kit: checks any request-level rollout against the contract.

A rollout author writes a :class:`RolloutHarness` (how to build the rollout, a second set of
weights, and a reference forward that scores tokens) and runs :func:`run_rollout_conformance`,
or inherits :class:`RolloutConformance` under pytest. Standard library only.
"""

from __future__ import annotations

import abc
import math
import random
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace

from drivetrain.api.engine import NamedTensor
from drivetrain.api.requests import Chunk, Request
from drivetrain.api.rollout import Completion, FinishReason, Prompt, Rollout, SamplingParams
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


def _greedy(tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_new_tokens=tokens, ignore_eos=True)


def _requests(h: RolloutHarness, params: SamplingParams, prefix: str) -> list[Request]:
    return [Request(f"{prefix}{i}", p, params, i) for i, p in enumerate(h.prompts())]


def _deadline(h: RolloutHarness) -> Callable[[str], None]:
    """A check that raises once the harness's deadline passed, naming what was awaited."""
    end = time.monotonic() + h.deadline_s

    def check(what: str) -> None:
        if time.monotonic() > end:
            raise AssertionError(f"{what} did not happen within {h.deadline_s:.0f} s")

    return check


def _drain(rollout: Rollout, collector: Collector, h: RolloutHarness,
           on_chunks: Callable[[list[Chunk]], None] | None = None) -> None:  # fmt: skip
    overdue = _deadline(h)
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


def _run(h: RolloutHarness, rollout: Rollout, requests: list[Request]) -> list[Completion]:
    collector = Collector()
    for r in requests:
        collector.track(r)
    rollout.submit(requests)
    _drain(rollout, collector, h)
    return collector.completions()


def _assert_log_probs(
    h: RolloutHarness, c: Completion, temperature: float, changed: bool, what: str
) -> None:
    if not c.token_ids:
        return
    reference = h.reference_log_probs(c.prompt_ids, c.token_ids, temperature, changed)
    worst = max(abs(a - b) for a, b in zip(c.log_probs, reference, strict=True))
    if not worst <= h.log_prob_tolerance:
        raise AssertionError(
            f"{what}: sampled log-probs differ from the reference forward by {worst:.3g} "
            f"(tolerance {h.log_prob_tolerance:.3g})"
        )


def _with_rollout(h: RolloutHarness, check: Callable[[Rollout], None]) -> None:
    rollout = h.make_rollout()
    try:
        check(rollout)
    finally:
        rollout.shutdown()


# ---- the checks ----------------------------------------------------------------------------
def check_greedy_determinism(h: RolloutHarness) -> None:
    """Greedy tokens do not depend on what else runs: all requests at once, one at a time and
    joining a running batch at staggered points give the same tokens; log-probs match the
    reference forward; versions are 0 and each request ends once."""

    def check(rollout: Rollout) -> None:
        together = _run(h, rollout, _requests(h, _greedy(16), "all-"))
        alone = [_run(h, rollout, [r])[0] for r in _requests(h, _greedy(16), "one-")]
        staggered = _staggered(h, rollout, _requests(h, _greedy(16), "join-"))
        for i, (a, b, c) in enumerate(zip(together, alone, staggered, strict=True)):
            if not a.token_ids == b.token_ids == c.token_ids:
                raise AssertionError(
                    f"prompt {i}: greedy tokens depend on the batch: together {a.token_ids}, "
                    f"alone {b.token_ids}, joining later {c.token_ids}"
                )
            if a.weight_version != 0 or set(a.token_versions) - {0}:
                raise AssertionError(f"prompt {i}: version {a.weight_version} before any update")
            _assert_log_probs(h, a, 0, False, f"greedy prompt {i}")

    _with_rollout(h, check)


def _staggered(h: RolloutHarness, rollout: Rollout, requests: list[Request]) -> list[Completion]:
    collector = Collector()
    for r in requests:
        collector.track(r)
    for r in requests:  # one joins after every poll, while the earlier ones run
        rollout.submit([r])
        collector.add(rollout.poll(0.0))
    _drain(rollout, collector, h)
    return collector.completions()


def check_sampled_log_probs(h: RolloutHarness) -> None:
    """Sampled tokens' log-probs equal the reference forward at the sampling temperature, and
    a seeded request repeats its tokens whatever runs beside it."""

    def check(rollout: Rollout) -> None:
        params = SamplingParams(temperature=0.8, max_new_tokens=16, ignore_eos=True)
        seeded = [
            Request(r.request_id, r.prompt_ids, SamplingParams(
                temperature=0.8, max_new_tokens=16, ignore_eos=True, seed=100 + i), i)
            for i, r in enumerate(_requests(h, params, "s-"))
        ]  # fmt: skip
        first = _run(h, rollout, seeded)
        for c in first:
            _assert_log_probs(h, c, 0.8, False, f"sampled prompt {c.prompt_index}")
        again = _run(h, rollout, [Request("again", seeded[3].prompt_ids, seeded[3].params, 3)])
        if again[0].token_ids != first[3].token_ids:
            raise AssertionError("a seeded request sampled other tokens when run alone")

    _with_rollout(h, check)


def check_abort(h: RolloutHarness) -> None:
    """Half of the streaming requests are aborted at random points: each returns the tokens
    it had generated (a prefix of its undisturbed greedy run) with log-probs and finish reason
    ``abort``; the others equal the undisturbed run. Aborting a request that has not started,
    or an unknown id, is allowed."""

    def check(rollout: Rollout) -> None:
        undisturbed = _run(h, rollout, _requests(h, _greedy(24), "u-"))
        requests = _requests(h, _greedy(24), "a-")
        rng = random.Random(0)
        abort_at = {r.request_id: rng.randint(1, 20) for r in requests[1::2]}
        collector = Collector()
        for r in requests:
            collector.track(r)
        rollout.submit(requests)
        if rollout.abort(["no-such-request"]) != 0:
            raise AssertionError("aborting an unknown request id reported an abort")
        _drain(rollout, collector, h, abort_after(rollout, abort_at))
        for r, ours, theirs in zip(requests, collector.completions(), undisturbed, strict=True):
            n = len(ours.token_ids)
            if r.request_id in abort_at:
                if ours.finish_reason is not FinishReason.ABORT:
                    raise AssertionError(f"{r.request_id} was aborted but ended with "
                                         f"{ours.finish_reason}")  # fmt: skip
                if ours.token_ids != theirs.token_ids[:n] or n < abort_at[r.request_id]:
                    raise AssertionError(f"{r.request_id}: aborted output {ours.token_ids} is not "
                                         f"the {abort_at[r.request_id]}+ token prefix of "
                                         f"{theirs.token_ids}")  # fmt: skip
                _assert_log_probs(h, ours, 0, False, f"aborted {r.request_id}")
            elif ours.token_ids != theirs.token_ids:
                raise AssertionError(f"{r.request_id} was not aborted but its tokens changed")
        waiting = Request("never-started", h.prompts()[0], _greedy(4))
        rollout.pause_generation()
        rollout.submit([waiting])
        held = [c for _ in range(3) for c in rollout.poll(0.05)]
        if held:
            raise AssertionError(f"a paused rollout generated {held[0]}")
        if rollout.abort([waiting.request_id]) != 1:
            raise AssertionError("aborting a waiting request did not report it")
        rollout.resume_generation()
        end = Collector()
        end.track(waiting)
        _drain(rollout, end, h)
        if end.completion(waiting.request_id).finish_reason is not FinishReason.ABORT:
            raise AssertionError("an aborted waiting request did not end with 'abort'")

    _with_rollout(h, check)


def check_weight_versions(h: RolloutHarness) -> None:
    """A weight update between requests changes the next request's output and its version; a
    request spanning an update (aborted, then resumed with its prefix) reports each token's
    version and each segment's tokens follow its weights."""

    def check(rollout: Rollout) -> None:
        prompt = h.prompts()[0]
        before = _run(h, rollout, [Request("before", prompt, _greedy(16))])[0]
        span = Collector()
        first = Request("span", prompt, _greedy(20))
        span.track(first)
        rollout.submit([first])
        got, overdue = 0, _deadline(h)
        while got < 6:
            overdue("6 tokens of request 'span'")
            chunks = rollout.poll(0.05)
            span.add(chunks)
            got += sum(len(c.token_ids) for c in chunks)
        rollout.abort(["span"])
        _drain(rollout, span, h)
        rollout.update_weights(h.changed_weights(), version=7)
        if rollout.weight_version != 7:
            raise AssertionError(f"weight_version is {rollout.weight_version} after update 7")
        after = _run(h, rollout, [Request("after", prompt, _greedy(16))])[0]
        if after.token_ids == before.token_ids:
            raise AssertionError("new weights did not change the next greedy request")
        if after.weight_version != 7 or set(after.token_versions) != {7}:
            raise AssertionError(f"a request after update 7 reports {after.token_versions}")
        _assert_log_probs(h, after, 0, True, "greedy after the update")
        resumed = span.resume("span", "span-resumed")
        rollout.submit([resumed])
        _drain(rollout, span, h)
        c = span.completion("span")
        old = c.token_versions.count(0)
        if old < 6 or c.token_versions != (0,) * old + (7,) * (len(c.token_ids) - old):
            raise AssertionError(f"resumed request versions {c.token_versions}")
        if len(c.token_ids) != 20:
            raise AssertionError(f"resumed request has {len(c.token_ids)} tokens, wanted 20")
        head = Completion(c.prompt_index, c.prompt_ids, c.token_ids[:old], c.log_probs[:old],
                          c.finish_reason, 0)  # fmt: skip
        tail = Completion(c.prompt_index, c.prompt_ids + c.token_ids[:old], c.token_ids[old:],
                          c.log_probs[old:], c.finish_reason, 7)  # fmt: skip
        _assert_log_probs(h, head, 0, False, "the segment before the update")
        _assert_log_probs(h, tail, 0, True, "the segment after the update")

    _with_rollout(h, check)


def check_failed_update(h: RolloutHarness) -> None:
    """A weight stream that breaks part-way (rollouts apply weights as they arrive) never
    leaves the rollout silently generating from a mix of two versions: it kept the old weights
    (same greedy tokens, version unchanged) or it refuses requests (``RuntimeError``) until a
    whole update lands, after which it serves that update's weights and version."""

    def check(rollout: Rollout) -> None:
        prompt = h.prompts()[0]
        before = _run(h, rollout, [Request("before", prompt, _greedy(16))])[0]
        changed = h.changed_weights()

        def breaking() -> Iterator[NamedTensor]:
            yield from changed[: max(1, len(changed) // 2)]
            raise ConnectionError("the weight stream broke")

        try:
            rollout.update_weights(breaking(), version=5)
        except Exception:  # backends may wrap the stream's error
            pass
        else:
            raise AssertionError("update_weights returned although its stream raised")
        if rollout.weight_version != 0:
            raise AssertionError(f"version {rollout.weight_version} after a failed update")
        try:
            again = _run(h, rollout, [Request("after-failure", prompt, _greedy(16))])[0]
        except RuntimeError:
            pass  # refused until whole weights arrive
        else:
            if again.token_ids != before.token_ids or set(again.token_versions) != {0}:
                raise AssertionError(
                    "after a failed update the rollout generated from other weights than "
                    f"version 0 without refusing (versions {set(again.token_versions)})"
                )
        rollout.update_weights(changed, version=6)
        after = _run(h, rollout, [Request("after", prompt, _greedy(16))])[0]
        if after.token_ids == before.token_ids or set(after.token_versions) != {6}:
            raise AssertionError("a whole update after a failed one did not take effect")
        _assert_log_probs(h, after, 0, True, "greedy after the repeated update")

    _with_rollout(h, check)


def check_updates_between_steps(h: RolloutHarness) -> None:
    """Weights sent while requests run (a thread polls and keeps submitting) apply between
    token steps: tokens tagged with the old version score as the old weights sampled them, and
    requests started after the update as the new weights do. (Tokens of a request spanning
    the update were sampled over a prefix cached under the old weights: no reference exists
    for them, which is why partial rollouts abort and resume.)"""

    def check(rollout: Rollout) -> None:
        prompts = h.prompts()
        collector = Collector()
        chunks_seen: list[Chunk] = []
        failure: list[BaseException] = []
        stop_submitting = threading.Event()

        def poller() -> None:
            try:
                number = 0
                while not stop_submitting.is_set() or not collector.done:
                    if not stop_submitting.is_set():
                        request = Request(f"live-{number}", prompts[number % len(prompts)],
                                          _greedy(12), number)  # fmt: skip
                        collector.track(request)
                        rollout.submit([request])
                        number += 1
                    chunks = rollout.poll(0.01)
                    collector.add(chunks)
                    chunks_seen.extend(chunks)
            except BaseException as exc:  # reported by the main thread
                failure.append(exc)

        thread = threading.Thread(target=poller, daemon=True)
        thread.start()
        overdue = _deadline(h)
        try:
            while len(chunks_seen) < 8 and thread.is_alive():
                overdue("8 chunks")
                thread.join(0.01)
            rollout.update_weights(h.changed_weights(), version=1)
            while thread.is_alive() and not any(c.weight_version == 1 for c in chunks_seen):
                overdue("a chunk tagged with version 1")
                thread.join(0.01)
        finally:
            stop_submitting.set()
        thread.join(h.deadline_s)
        if failure:
            raise failure[0]
        if thread.is_alive():
            raise AssertionError("polling did not finish while weights were updated")
        _assert_split_at_the_update(h, collector.completions())

    _with_rollout(h, check)


def _assert_split_at_the_update(h: RolloutHarness, completions: list[Completion]) -> None:
    """Each completion's tokens under version 0 score as the old weights sampled them, and at
    least one request ran wholly under version 1, scoring as the new weights do."""
    fresh = 0
    for c in completions:
        versions = c.token_versions
        if list(versions) != sorted(versions) or not set(versions) <= {0, 1}:
            raise AssertionError(f"token versions {versions} (one update, to version 1)")
        old = versions.count(0)
        what = f"request {c.prompt_index}"
        if old:
            segment = replace(c, token_ids=c.token_ids[:old], log_probs=c.log_probs[:old])
            _assert_log_probs(h, segment, 0, False, f"{what}: tokens under version 0")
        elif versions:
            fresh += 1
            _assert_log_probs(h, c, 0, True, f"{what}: a request run under version 1")
    if not fresh:
        raise AssertionError("no request ran under the new weights")


def check_generate_helper(h: RolloutHarness) -> None:
    """Batch ``generate`` returns ``n`` samples per prompt in prompt order, reproducibly with a
    seed, with a bad prompt refused before anything runs."""

    def check(rollout: Rollout) -> None:
        prompts = [Prompt(token_ids=p) for p in h.prompts()[:3]]
        params = SamplingParams(n=2, temperature=1.0, max_new_tokens=8, seed=5, ignore_eos=True)
        out = rollout.generate(prompts, params)
        if [c.prompt_index for c in out] != [0, 0, 1, 1, 2, 2]:
            raise AssertionError(f"generate order {[c.prompt_index for c in out]}")
        if out != rollout.generate(prompts, params):
            raise AssertionError("a seeded generate call is not reproducible")
        try:
            rollout.generate([Prompt(token_ids=(-1,))], params)
        except ValueError:
            pass
        else:
            raise AssertionError("a prompt with token id -1 was accepted")
        if any(math.isnan(x) for c in out for x in c.log_probs):
            raise AssertionError("NaN log-probs")

    _with_rollout(h, check)


ROLLOUT_CHECKS: dict[str, Callable[[RolloutHarness], None]] = {
    "greedy_determinism": check_greedy_determinism,
    "sampled_log_probs": check_sampled_log_probs,
    "abort": check_abort,
    "weight_versions": check_weight_versions,
    "failed_update": check_failed_update,
    "updates_between_steps": check_updates_between_steps,
    "generate_helper": check_generate_helper,
}


@dataclass(frozen=True)
class RolloutCheckResult:
    name: str
    error: str | None  # None when the check passed


def run_rollout_conformance(h: RolloutHarness) -> list[RolloutCheckResult]:
    """Every check, each on a fresh rollout; failures are collected, not raised."""
    results = []
    for name, check in ROLLOUT_CHECKS.items():
        try:
            check(h)
        except Exception as exc:  # a contract violation may surface as any error
            results.append(RolloutCheckResult(name, f"{type(exc).__name__}: {exc}"))
        else:
            results.append(RolloutCheckResult(name, None))
    return results


class RolloutConformance:
    """Inherit under pytest and implement :meth:`harness`; each check becomes a test."""

    def harness(self) -> RolloutHarness:
        raise NotImplementedError("return a RolloutHarness for the rollout under test")

    def test_greedy_determinism(self) -> None:
        check_greedy_determinism(self.harness())

    def test_sampled_log_probs(self) -> None:
        check_sampled_log_probs(self.harness())

    def test_abort(self) -> None:
        check_abort(self.harness())

    def test_weight_versions(self) -> None:
        check_weight_versions(self.harness())

    def test_failed_update(self) -> None:
        check_failed_update(self.harness())

    def test_updates_between_steps(self) -> None:
        check_updates_between_steps(self.harness())

    def test_generate_helper(self) -> None:
        check_generate_helper(self.harness())
