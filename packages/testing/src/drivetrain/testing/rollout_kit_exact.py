"""The rollout kit's opt-in check "bitwise with the trainer in exact mode".

A rollout that declares the ``exact_numerics`` capability promises that, configured with
``numerics=exact``, every token's log-prob is the training engine's (under the same setting)
to the last bit, whatever ran beside the request. Its harness opts in with
:meth:`~drivetrain.testing.rollout_harness.RolloutHarness.exact_rollout` and
:meth:`~drivetrain.testing.rollout_harness.RolloutHarness.exact_log_probs`; a harness that
does not is reported as not opted in (skipped), never as passing.
"""

from __future__ import annotations

from drivetrain.api.requests import Request
from drivetrain.api.rollout import Completion, SamplingParams
from drivetrain.testing.kit_runner import NotOptedIn
from drivetrain.testing.rollout_harness import (
    RolloutHarness,
    greedy,
    requests_for,
    run,
    staggered,
)


def check_exact_numerics(h: RolloutHarness) -> None:
    """With ``numerics=exact``: sampled (temperature 1 and 0.7) and greedy tokens, requests
    together and joining a running batch, before and after a weight update: each log-prob is
    the engine's, bit for bit."""
    rollout = h.exact_rollout()
    if rollout is None:
        raise NotOptedIn("the harness builds no numerics=exact rollout (exact_rollout)")
    try:
        for changed in (False, True):
            if changed:
                rollout.update_weights(h.changed_weights(), version=1)
            for temperature in (1.0, 0.7, 0.0):
                params = SamplingParams(
                    temperature=temperature, max_new_tokens=12, ignore_eos=True, seed=5
                )
                tag = f"{temperature}-{int(changed)}-"
                together = run(h, rollout, requests_for(h, params, f"all-{tag}"))
                joining = staggered(h, rollout, requests_for(h, params, f"join-{tag}"))
                for c in together + joining:
                    _assert_bitwise(h, c, temperature, changed)
        # samples of one prompt joining together (a rollout may share their prefill)
        prompt = h.prompts()[2]
        shared = [
            Request(f"n{i}", prompt, SamplingParams(max_new_tokens=8, seed=i), 2) for i in range(4)
        ]
        for c in run(h, rollout, shared):
            _assert_bitwise(h, c, 1.0, True)
        for c in run(h, rollout, requests_for(h, greedy(8), "g-")):
            _assert_bitwise(h, c, 0.0, True)
    finally:
        rollout.shutdown()


def _assert_bitwise(h: RolloutHarness, c: Completion, temperature: float, changed: bool) -> None:
    engine = h.exact_log_probs(c.prompt_ids, c.token_ids, temperature, changed)
    for i, (mine, theirs) in enumerate(zip(c.log_probs, engine, strict=True)):
        if mine != theirs:
            raise AssertionError(
                f"prompt {c.prompt_index}, token {i} (id {c.token_ids[i]}, temperature "
                f"{temperature}, {'changed' if changed else 'initial'} weights): rollout "
                f"{mine!r}, engine {theirs!r} under numerics=exact"
            )
