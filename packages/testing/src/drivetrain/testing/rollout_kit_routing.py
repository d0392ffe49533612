"""The rollout kit's opt-in check "recorded routing is the model's".

A rollout that declares the ``routed_experts`` capability promises that, configured with
``return_routed_experts`` on a mixture-of-experts model, every completion carries the experts
each MoE layer chose at every position it computed (prompt and generated tokens but the last:
``drivetrain.api.routing``), the same experts a plain forward of those tokens chooses. Its
harness opts in with
:meth:`~drivetrain.testing.rollout_harness.RolloutHarness.routing_rollout` and
:meth:`~drivetrain.testing.rollout_harness.RolloutHarness.forward_routing`; a harness that does
not is reported as not opted in (skipped), never as passing. The harness's model should route
tokens apart (weights away from a near tie), since the rollout's batch may move a tie's bits.
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


def check_routed_experts(h: RolloutHarness) -> None:
    """With ``return_routed_experts``: sampled and greedy requests, together and joining a
    running batch, samples of one prompt joining together, before and after a weight update:
    every position's experts (per layer, as a set) are those of a plain forward."""
    rollout = h.routing_rollout()
    if rollout is None:
        raise NotOptedIn("the harness builds no return_routed_experts rollout (routing_rollout)")
    try:
        for changed in (False, True):
            if changed:
                rollout.update_weights(h.changed_weights(), version=1)
            params = SamplingParams(temperature=1.0, max_new_tokens=10, ignore_eos=True, seed=3)
            tag = int(changed)
            for c in run(h, rollout, requests_for(h, params, f"all-{tag}-")):
                _assert_routing(h, c, changed)
            for c in staggered(h, rollout, requests_for(h, greedy(10), f"join-{tag}-")):
                _assert_routing(h, c, changed)
        prompt = h.prompts()[1]
        shared = [
            Request(f"n{i}", prompt, SamplingParams(max_new_tokens=8, seed=i), 1) for i in range(3)
        ]
        for c in run(h, rollout, shared):
            _assert_routing(h, c, True)
    finally:
        rollout.shutdown()


def _assert_routing(h: RolloutHarness, c: Completion, changed: bool) -> None:
    ids = [*c.prompt_ids, *c.token_ids]
    routed = c.routed_experts
    what = f"prompt {c.prompt_index} ({len(c.prompt_ids)} + {len(c.token_ids)} tokens)"
    if routed is None:
        raise AssertionError(f"{what}: no routed experts with return_routed_experts")
    if (routed.start, routed.positions) != (0, len(ids) - 1):
        raise AssertionError(
            f"{what}: routed experts cover positions {routed.start}..{routed.end - 1}, not "
            f"0..{len(ids) - 2} (every position but the last token's)"
        )
    expected = h.forward_routing(ids[:-1], changed)  # [position][layer][pick]
    got = routed.indices()
    width = routed.layers * routed.top_k
    for position, layers in enumerate(expected):
        if len(layers) != routed.layers or any(len(p) != routed.top_k for p in layers):
            raise AssertionError(
                f"{what}: {routed.layers} layers x top-{routed.top_k} recorded, the model "
                f"routes {len(layers)} layers x top-{len(layers[0]) if layers else 0}"
            )
        row = got[position * width : (position + 1) * width]
        for layer, picks in enumerate(layers):
            mine = sorted(row[layer * routed.top_k : (layer + 1) * routed.top_k])
            if mine != sorted(picks):
                raise AssertionError(
                    f"{what}, position {position}, layer {layer}: the rollout recorded experts "
                    f"{mine}, a forward of the same tokens chooses {sorted(picks)} "
                    f"({'changed' if changed else 'initial'} weights)"
                )
