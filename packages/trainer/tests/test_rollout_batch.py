import pytest

from drivetrain.api import Completion, FinishReason, Layout
from drivetrain.api.columns import (
    INPUT_IDS,
    LOSS_MASK,
    RESPONSE_MASK,
    ROLLOUT_LOG_PROBS,
    TOKEN_WEIGHT_VERSION,
)
from drivetrain.trainer.rollout_batch import FINISH_REASON, PROMPT_INDEX, completions_to_batch


def completion(index, prompt, tokens, version=3):
    logps = tuple(-0.5 * (i + 1) for i in range(len(tokens)))
    return Completion(index, prompt, tokens, logps, FinishReason.STOP, version)


COMPLETIONS = [completion(0, (5, 6), (7,)), completion(1, (8,), (9, 10, 11))]


def test_padded_batch_aligns_log_probs_with_generated_tokens():
    batch = completions_to_batch(COMPLETIONS, pad_token_id=0)
    assert batch.layout is Layout.PADDED and batch.seq_lens == (3, 4)
    assert batch[INPUT_IDS] == [[5, 6, 7, 0], [8, 9, 10, 11]]
    assert batch[RESPONSE_MASK] == [[0, 0, 1, 0], [0, 1, 1, 1]]
    assert batch[LOSS_MASK] == batch[RESPONSE_MASK]
    assert batch[ROLLOUT_LOG_PROBS] == [[0.0, 0.0, -0.5, 0.0], [0.0, -0.5, -1.0, -1.5]]
    assert batch[PROMPT_INDEX] == [0, 1] and batch[FINISH_REASON] == ["stop", "stop"]
    assert batch.meta.weight_version == 3


def test_packed_batch_concatenates_and_equals_packing_the_padded_one():
    packed = completions_to_batch(COMPLETIONS, pad_token_id=0, packed=True)
    assert packed.layout is Layout.PACKED
    assert packed[INPUT_IDS] == [5, 6, 7, 8, 9, 10, 11]
    assert (
        packed[INPUT_IDS]
        == completions_to_batch(COMPLETIONS, pad_token_id=0).to_packed()[INPUT_IDS]
    )


def test_mixed_versions_leave_meta_version_unset_and_bad_completions_fail():
    mixed = [COMPLETIONS[0], completion(1, (8,), (9,), version=4)]
    assert completions_to_batch(mixed, pad_token_id=0).meta.weight_version is None
    bad = Completion(0, (1,), (2, 3), (-1.0,), FinishReason.LENGTH, 0)
    with pytest.raises(ValueError, match="2 tokens but 1 log-probs"):
        completions_to_batch([bad], pad_token_id=0)
    with pytest.raises(ValueError, match="no completions"):
        completions_to_batch([], pad_token_id=0)


def test_token_weight_versions_come_from_the_completion_or_its_version():
    """A partial rollout's tokens keep their own versions; a completion without them (from
    an older peer) has its weight version on every generated token; prompts and pads are -1."""
    spanning = Completion(1, (8,), (9, 10, 11), (-1.0,) * 3, FinishReason.STOP, 3, None, {},
                          (3, 4, 4))  # fmt: skip
    batch = completions_to_batch([COMPLETIONS[0], spanning], pad_token_id=0)
    assert batch[TOKEN_WEIGHT_VERSION] == [[-1, -1, 3, -1], [-1, 3, 4, 4]]
    assert TOKEN_WEIGHT_VERSION in batch.token_keys
    short = Completion(1, (8,), (9, 10), (-1.0,) * 2, FinishReason.STOP, 3, None, {}, (3,))
    with pytest.raises(ValueError, match="2 tokens but 1 token versions"):
        completions_to_batch([short], pad_token_id=0)


def test_trajectory_observation_tokens_are_not_trained_on() -> None:
    from drivetrain.api.columns import LOSS_MASK, ROLLOUT_LOG_PROBS, TOKEN_WEIGHT_VERSION
    from drivetrain.trainer.trajectory import Trajectory

    episode = Trajectory(
        prompt_index=0,
        prompt_ids=(5, 6),
        token_ids=(7, 8, 1, 2, 9),  # turn 1 (7, 8), observation (1, 2), turn 2 (9)
        log_probs=(-0.5, -0.25, 0.0, 0.0, -1.0),
        finish_reason=FinishReason.STOP,
        weight_version=3,
        sampled=(1, 1, 0, 0, 1),
        turn_ends=(1, 4),
    )
    batch = completions_to_batch([episode, COMPLETIONS[0]], pad_token_id=0)
    assert batch[INPUT_IDS][0] == [5, 6, 7, 8, 1, 2, 9]
    assert batch[LOSS_MASK][0] == [0, 0, 1, 1, 0, 0, 1]
    assert batch[ROLLOUT_LOG_PROBS][0] == [0.0, 0.0, -0.5, -0.25, 0.0, 0.0, -1.0]
    assert batch[TOKEN_WEIGHT_VERSION][0] == [-1, -1, 3, 3, -1, -1, 3]
    with pytest.raises(ValueError, match="sampled flags"):
        Trajectory(0, (5,), (7, 8), (-0.1, -0.2), FinishReason.STOP, 0, sampled=(1,))
    with pytest.raises(ValueError, match="turn ends"):
        Trajectory(
            0, (5,), (7, 8), (-0.1, -0.2), FinishReason.STOP, 0, sampled=(1, 0), turn_ends=(1,)
        )
