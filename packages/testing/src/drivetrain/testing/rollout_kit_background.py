"""The rollout kit's check of generation on the rollout's own thread
(:meth:`~drivetrain.api.rollout.Rollout.background_generation`), for the rollouts that offer
it: the request contract holds as when polled."""

from __future__ import annotations

from drivetrain.api.requests import Request
from drivetrain.api.rollout import Completion, FinishReason, Rollout
from drivetrain.runtime.collector import Collector
from drivetrain.testing.rollout_harness import (
    RolloutHarness,
    assert_log_probs,
    deadline,
    drain,
    greedy,
    requests_for,
    run,
    with_rollout,
)

SPAN = 20  # tokens of the request a weight update lands in


def check_background_generation(h: RolloutHarness) -> None:
    """With ``background_generation(True)`` (a rollout that returns ``False`` is polled as
    before: nothing to check): requests give the tokens and log-probs they give when polled;
    a whole weight update sent while one runs, with no pause, lands between token steps (its
    tokens carry version 0 then 7, the first as the old weights score them; a request after
    it scores as the new weights do); a pause
    with abort keeps the prefix; ``background_generation(False)`` steps when polled again."""

    def check(rollout: Rollout) -> None:
        polled = run(h, rollout, requests_for(h, greedy(16), "p-"))
        if not rollout.background_generation(True):
            return
        try:
            ran = run(h, rollout, requests_for(h, greedy(16), "b-"))
            for want, got in zip(polled, ran, strict=True):
                if got.token_ids != want.token_ids or got.log_probs != want.log_probs:
                    raise AssertionError(
                        f"generating in the background gave {got.token_ids}, polled "
                        f"{want.token_ids} (or other log-probs)"
                    )
            _check_update_mid_request(h, rollout)
            _check_pause(h, rollout)
        finally:
            rollout.background_generation(False)
        again = run(h, rollout, [Request("again", h.prompts()[0], greedy(4))])[0]
        if set(again.token_versions) != {7}:
            raise AssertionError(f"a polled request after update 7 reports {again.token_versions}")
        assert_log_probs(h, again, 0, True, "a polled request after background generation")

    with_rollout(h, check)


def _check_update_mid_request(h: RolloutHarness, rollout: Rollout) -> None:
    span = Collector()
    request = Request("span", h.prompts()[0], greedy(SPAN))
    span.track(request)
    rollout.submit([request])
    got, overdue = 0, deadline(h)
    while got < 2 and not span.finished("span"):
        overdue("2 tokens of request 'span'")
        chunks = rollout.poll(0.05)
        span.add(chunks)
        got += sum(len(c.token_ids) for c in chunks)
    rollout.update_weights(h.changed_weights(), version=7)
    drain(rollout, span, h)
    c = span.completion("span")
    old = c.token_versions.count(0)
    if len(c.token_ids) != SPAN or c.token_versions != (0,) * old + (7,) * (SPAN - old):
        raise AssertionError(
            f"an update sent mid-request left versions {c.token_versions} over "
            f"{len(c.token_ids)} tokens: it must land between steps, whole"
        )
    # (the tokens after it were sampled over a prefix cached under the old weights: no
    # reference exists for them, which is why partial rollouts abort and resume)
    head = Completion(
        c.prompt_index, c.prompt_ids, c.token_ids[:old], c.log_probs[:old], c.finish_reason, 0
    )
    assert_log_probs(h, head, 0, False, "background: the tokens before the update")
    after = run(h, rollout, [Request("after", h.prompts()[0], greedy(8))])[0]
    if set(after.token_versions) != {7}:
        raise AssertionError(f"a request after update 7 reports {after.token_versions}")
    assert_log_probs(h, after, 0, True, "background: a request after the update")


def _check_pause(h: RolloutHarness, rollout: Rollout) -> None:
    collector = Collector()
    requests = requests_for(h, greedy(SPAN), "q-")
    for r in requests:
        collector.track(r)
    rollout.submit(requests)
    aborted = rollout.pause_generation(abort=True)  # the ones not started wait for resume
    rollout.resume_generation()
    drain(rollout, collector, h)
    for c in collector.completions():
        if len(c.token_ids) < SPAN and c.finish_reason is not FinishReason.ABORT:
            raise AssertionError(f"a request cut by the pause ended with {c.finish_reason}")
    cut = sum(c.finish_reason is FinishReason.ABORT for c in collector.completions())
    if cut != aborted:
        raise AssertionError(f"pause_generation(abort=True) returned {aborted}, {cut} were cut")
