"""The rollout kit's checks of weight streams that break part-way: sent as tensors
(``failed_update``) or written by the transport straight into the tensors the rollout hands
out through ``weight_destination`` (``destination_update``). Either way the rollout must never
serve a mix of two versions without saying so."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from drivetrain.api.engine import NamedTensor
from drivetrain.api.requests import Request
from drivetrain.api.rollout import Completion, Rollout
from drivetrain.testing.rollout_harness import (
    RolloutHarness,
    assert_log_probs,
    greedy,
    run,
    with_rollout,
)


def _broken(stream: Iterator[NamedTensor]) -> Iterator[NamedTensor]:
    yield from stream
    raise ConnectionError("the weight stream broke")


def _assert_failed(
    h: RolloutHarness,
    rollout: Rollout,
    update: Iterator[NamedTensor],
    before: Completion,
    torn: str,
) -> None:
    """``update`` (version 5) raises; afterwards the rollout serves version 0's tokens or
    refuses requests (``RuntimeError``); ``torn`` says what it did wrong otherwise."""
    try:
        rollout.update_weights(update, version=5)
    except Exception:  # backends may wrap the stream's error
        pass
    else:
        raise AssertionError("update_weights returned although its stream raised")
    if rollout.weight_version != 0:
        raise AssertionError(f"version {rollout.weight_version} after a failed update")
    try:
        again = run(h, rollout, [Request("after-failure", before.prompt_ids, greedy(16))])[0]
    except RuntimeError:
        return  # refused until whole weights arrive
    if again.token_ids != before.token_ids or set(again.token_versions) != {0}:
        raise AssertionError(f"{torn} (versions {sorted(set(again.token_versions))})")


def _assert_whole_update(
    h: RolloutHarness, rollout: Rollout, update: Iterator[NamedTensor], before: Completion
) -> None:
    """A whole ``update`` (version 6) after the failed one serves its weights and version."""
    rollout.update_weights(update, version=6)
    after = run(h, rollout, [Request("after", before.prompt_ids, greedy(16))])[0]
    if set(after.token_versions) != {6}:
        raise AssertionError(
            f"a request after update 6 (following a failed update 5) reports "
            f"versions {sorted(set(after.token_versions))}"
        )
    if after.token_ids == before.token_ids:
        raise AssertionError(
            "a whole update after a failed one did not change the greedy "
            "tokens: its weights were not applied"
        )
    assert_log_probs(h, after, 0, True, "greedy after the repeated update")


def check_failed_update(h: RolloutHarness) -> None:
    """A weight stream that breaks part-way (rollouts apply weights as they arrive) never
    leaves the rollout silently generating from a mix of two versions: it kept the old weights
    (same greedy tokens, version unchanged) or it refuses requests (``RuntimeError``) until a
    whole update lands, after which it serves that update's weights and version."""

    def check(rollout: Rollout) -> None:
        before = run(h, rollout, [Request("before", h.prompts()[0], greedy(16))])[0]
        changed = h.changed_weights()
        half = iter(changed[: max(1, len(changed) // 2)])
        torn = (
            "after a failed update the rollout generated from other weights than version 0 "
            "without refusing"
        )
        _assert_failed(h, rollout, _broken(half), before, torn)
        _assert_whole_update(h, rollout, iter(changed), before)

    with_rollout(h, check)


def check_destination_update(h: RolloutHarness) -> None:
    """As ``failed_update``, with the weights written as a transport writes them: into the
    tensor ``weight_destination`` hands out for each (``RolloutHarness.write_into``), which
    is then yielded. Half of the weights written, the stream breaks: the rollout must refuse
    requests or serve version 0, then take a whole update the same way. (Passes trivially for
    a rollout that hands out no destination.)"""

    def check(rollout: Rollout) -> None:
        before = run(h, rollout, [Request("before", h.prompts()[0], greedy(16))])[0]
        changed = h.changed_weights()
        written: list[str] = []
        half = _through_destinations(h, rollout, changed[: max(1, len(changed) // 2)], written)
        torn = (
            "after a stream that wrote weights through weight_destination broke, the rollout "
            "generated from a mix of two versions without refusing: mark the update changed "
            "(update.changed = True) before handing out a destination"
        )
        _assert_failed(h, rollout, _broken(half), before, torn)
        if not written:
            return  # no destination handed out: failed_update covers it
        _assert_whole_update(h, rollout, _through_destinations(h, rollout, changed, []), before)

    with_rollout(h, check)


def _through_destinations(
    h: RolloutHarness, rollout: Rollout, weights: Sequence[NamedTensor], written: list[str]
) -> Iterator[NamedTensor]:
    """The stream a transport gives ``update_weights``: each weight written into its
    destination where the rollout hands one out (named in ``written``), else yielded as is."""
    for name, value in weights:
        shape, dtype = h.weight_spec(value)
        target = rollout.weight_destination(name, shape, dtype)
        if target is None:
            yield name, value
            continue
        h.write_into(target, value)
        written.append(name)
        yield name, target
