"""The rollout conformance kit: checks any request-level rollout against the contract.

A rollout author writes a :class:`RolloutHarness` (how to build the rollout, a second set of
weights, and a reference forward that scores tokens) and runs :func:`run_rollout_conformance`,
or inherits :class:`RolloutConformance` under pytest. Standard library only.
"""

from __future__ import annotations

import math
import random
import threading
from collections.abc import Callable
from dataclasses import replace

from drivetrain.api.requests import Chunk, Request
from drivetrain.api.rollout import Completion, FinishReason, Prompt, Rollout, SamplingParams
from drivetrain.runtime.collector import Collector
from drivetrain.testing import rollout_kit_limits as limits
from drivetrain.testing import rollout_kit_updates as updates
from drivetrain.testing.kit_runner import KitCheckResult, KitConformance, run_checks
from drivetrain.testing.rollout_harness import (
    RolloutHarness,
    abort_after,
    assert_log_probs,
    deadline,
    drain,
    greedy,
    requests_for,
    run,
    staggered,
    with_rollout,
)
from drivetrain.testing.rollout_kit_background import check_background_generation
from drivetrain.testing.rollout_kit_exact import check_exact_numerics
from drivetrain.testing.rollout_kit_routing import check_routed_experts

__all__ = [
    "ROLLOUT_CHECKS",
    "RolloutCheckResult",
    "RolloutConformance",
    "RolloutHarness",
    "abort_after",
    "run_rollout_conformance",
]


# ---- the checks ----------------------------------------------------------------------------
def check_greedy_determinism(h: RolloutHarness) -> None:
    """Greedy tokens do not depend on what else runs: all requests at once, one at a time and
    joining a running batch at staggered points give the same tokens; log-probs match the
    reference forward; versions are 0 and each request ends once."""

    def check(rollout: Rollout) -> None:
        together = run(h, rollout, requests_for(h, greedy(16), "all-"))
        alone = [run(h, rollout, [r])[0] for r in requests_for(h, greedy(16), "one-")]
        joining = staggered(h, rollout, requests_for(h, greedy(16), "join-"))
        for i, (a, b, c) in enumerate(zip(together, alone, joining, strict=True)):
            if not a.token_ids == b.token_ids == c.token_ids:
                raise AssertionError(
                    f"prompt {i}: greedy tokens depend on the batch: together {a.token_ids}, "
                    f"alone {b.token_ids}, joining later {c.token_ids}"
                )
            if a.weight_version != 0 or set(a.token_versions) - {0}:
                raise AssertionError(f"prompt {i}: version {a.weight_version} before any update")
            assert_log_probs(h, a, 0, False, f"greedy prompt {i}")

    with_rollout(h, check)


def check_sampled_log_probs(h: RolloutHarness) -> None:
    """Sampled tokens' log-probs equal the reference forward at the sampling temperature, and
    a seeded request repeats its tokens whatever runs beside it."""

    def check(rollout: Rollout) -> None:
        params = SamplingParams(temperature=0.8, max_new_tokens=16, ignore_eos=True)
        seeded = [
            Request(
                r.request_id,
                r.prompt_ids,
                SamplingParams(temperature=0.8, max_new_tokens=16, ignore_eos=True, seed=100 + i),
                i,
            )
            for i, r in enumerate(requests_for(h, params, "s-"))
        ]
        first = run(h, rollout, seeded)
        for c in first:
            assert_log_probs(h, c, 0.8, False, f"sampled prompt {c.prompt_index}")
        again = run(h, rollout, [Request("again", seeded[3].prompt_ids, seeded[3].params, 3)])
        if again[0].token_ids != first[3].token_ids:
            raise AssertionError("a seeded request sampled other tokens when run alone")

    with_rollout(h, check)


def check_abort(h: RolloutHarness) -> None:
    """Half of the streaming requests are aborted at random points: each returns the tokens
    it had generated (a prefix of its undisturbed greedy run) with log-probs and finish reason
    ``abort``; the others equal the undisturbed run. Aborting a request that has not started,
    or an unknown id, is allowed."""

    def check(rollout: Rollout) -> None:
        undisturbed = run(h, rollout, requests_for(h, greedy(24), "u-"))
        requests = requests_for(h, greedy(24), "a-")
        rng = random.Random(0)
        abort_at = {r.request_id: rng.randint(1, 20) for r in requests[1::2]}
        collector = Collector()
        for r in requests:
            collector.track(r)
        rollout.submit(requests)
        if rollout.abort(["no-such-request"]) != 0:
            raise AssertionError("aborting an unknown request id reported an abort")
        streamed = dict.fromkeys(abort_at, 0)  # tokens that came before a request's end
        aborter = abort_after(rollout, abort_at)

        def consume(chunks: list[Chunk]) -> None:
            for chunk in chunks:
                if chunk.request_id in streamed and not chunk.finished:
                    streamed[chunk.request_id] += len(chunk.token_ids)
            aborter(chunks)

        drain(rollout, collector, h, consume)
        for r, ours, theirs in zip(requests, collector.completions(), undisturbed, strict=True):
            if r.request_id in abort_at:
                _check_aborted(
                    h, r.request_id, ours, theirs, abort_at[r.request_id], streamed[r.request_id]
                )
            elif ours.token_ids != theirs.token_ids:
                raise AssertionError(f"{r.request_id} was not aborted but its tokens changed")
        _check_waiting_abort(h, rollout)

    with_rollout(h, check)


def _check_waiting_abort(h: RolloutHarness, rollout: Rollout) -> None:
    """A request submitted while paused does not run; aborting it ends it with ``abort``."""
    waiting = Request("never-started", h.prompts()[0], greedy(4))
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
    drain(rollout, end, h)
    if end.completion(waiting.request_id).finish_reason is not FinishReason.ABORT:
        raise AssertionError("an aborted waiting request did not end with 'abort'")


def _check_aborted(
    h: RolloutHarness,
    request_id: str,
    ours: Completion,
    theirs: Completion,
    abort_at: int,
    streamed: int,
) -> None:
    """One request the abort check aborted after ``abort_at`` streamed tokens."""
    n = len(ours.token_ids)
    if not streamed and ours.finish_reason is not FinishReason.ABORT:
        raise AssertionError(
            f"{request_id} streamed no tokens before it ended (all {n} came in its last chunk), "
            "so it could not be aborted part-way: poll must return the tokens sampled since the "
            "last poll, and an abort keeps them"
        )
    if ours.finish_reason is not FinishReason.ABORT:
        raise AssertionError(f"{request_id} was aborted but ended with {ours.finish_reason}")
    if ours.token_ids != theirs.token_ids[:n]:
        raise AssertionError(
            f"{request_id}: aborted output {ours.token_ids} is not the "
            f"{abort_at}+ token prefix of {theirs.token_ids}"
        )
    assert_log_probs(h, ours, 0, False, f"aborted {request_id}")


def check_weight_versions(h: RolloutHarness) -> None:
    """A weight update between requests changes the next request's output and its version; a
    request spanning an update (aborted, then resumed with its prefix) reports each token's
    version and each segment's tokens follow its weights."""

    def check(rollout: Rollout) -> None:
        prompt = h.prompts()[0]
        before = run(h, rollout, [Request("before", prompt, greedy(16))])[0]
        span = Collector()
        first = Request("span", prompt, greedy(20))
        span.track(first)
        rollout.submit([first])
        got, overdue = 0, deadline(h)
        while got < 6:
            overdue("6 tokens of request 'span'")
            chunks = rollout.poll(0.05)
            span.add(chunks)
            got += sum(len(c.token_ids) for c in chunks)
        rollout.abort(["span"])
        drain(rollout, span, h)
        rollout.update_weights(h.changed_weights(), version=7)
        if rollout.weight_version != 7:
            raise AssertionError(f"weight_version is {rollout.weight_version} after update 7")
        after = run(h, rollout, [Request("after", prompt, greedy(16))])[0]
        if after.token_ids == before.token_ids:
            raise AssertionError("new weights did not change the next greedy request")
        if after.weight_version != 7 or set(after.token_versions) != {7}:
            raise AssertionError(f"a request after update 7 reports {after.token_versions}")
        assert_log_probs(h, after, 0, True, "greedy after the update")
        resumed = span.resume("span", "span-resumed")
        rollout.submit([resumed])
        drain(rollout, span, h)
        c = span.completion("span")
        old = c.token_versions.count(0)
        if old < 6 or c.token_versions != (0,) * old + (7,) * (len(c.token_ids) - old):
            raise AssertionError(f"resumed request versions {c.token_versions}")
        if len(c.token_ids) != 20:
            raise AssertionError(f"resumed request has {len(c.token_ids)} tokens, wanted 20")
        head = Completion(
            c.prompt_index, c.prompt_ids, c.token_ids[:old], c.log_probs[:old], c.finish_reason, 0
        )
        tail = Completion(
            c.prompt_index,
            c.prompt_ids + c.token_ids[:old],
            c.token_ids[old:],
            c.log_probs[old:],
            c.finish_reason,
            7,
        )
        assert_log_probs(h, head, 0, False, "the segment before the update")
        assert_log_probs(h, tail, 0, True, "the segment after the update")

    with_rollout(h, check)


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
                        request = Request(
                            f"live-{number}", prompts[number % len(prompts)], greedy(12), number
                        )
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
        overdue = deadline(h)
        try:
            while len(chunks_seen) < 8 and thread.is_alive():
                overdue("8 chunks")
                thread.join(0.01)
            rollout.update_weights(h.changed_weights(), version=1)
            if rollout.weight_version != 1:  # else the wait below would last the deadline
                raise AssertionError(f"weight_version is {rollout.weight_version} after update 1")
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

    with_rollout(h, check)


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
            assert_log_probs(h, segment, 0, False, f"{what}: tokens under version 0")
        elif versions:
            fresh += 1
            assert_log_probs(h, c, 0, True, f"{what}: a request run under version 1")
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

    with_rollout(h, check)


ROLLOUT_CHECKS: dict[str, Callable[[RolloutHarness], None]] = {
    "greedy_determinism": check_greedy_determinism,
    "sampled_log_probs": check_sampled_log_probs,
    "abort": check_abort,
    "weight_versions": check_weight_versions,
    "failed_update": updates.check_failed_update,
    "destination_update": updates.check_destination_update,
    "updates_between_steps": check_updates_between_steps,
    "generate_helper": check_generate_helper,
    "stop_conditions": limits.check_stop_conditions,
    "sampling_filters": limits.check_sampling_filters,
    "refusals": limits.check_refusals,
    "pause_abort": limits.check_pause_abort,
    "background_generation": check_background_generation,
    "sleep": limits.check_sleep,
    "exact_numerics": check_exact_numerics,  # opt-in (RolloutHarness.exact_rollout)
    "routed_experts": check_routed_experts,  # opt-in (RolloutHarness.routing_rollout)
}


RolloutCheckResult = KitCheckResult


def run_rollout_conformance(h: RolloutHarness) -> list[KitCheckResult]:
    """Every check, each on a fresh rollout; failures are collected, not raised."""
    return run_checks(ROLLOUT_CHECKS, h)


class RolloutConformance(KitConformance):
    """Inherit under pytest and implement :meth:`harness`; each check becomes a test."""

    CHECKS = ROLLOUT_CHECKS
