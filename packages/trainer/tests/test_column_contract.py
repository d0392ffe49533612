"""Every job's batches obey the api's column contract (``drivetrain.api.columns.DTYPES``):
SFT's, DPO's and the RL roles' views (actor, critic, reward model) have the same dtypes, on
the CPU."""

import pytest
import torch

from drivetrain.api import Batch, Completion, FinishReason
from drivetrain.api.columns import (
    ADVANTAGES,
    DTYPES,
    INPUT_IDS,
    LOSS_MASK,
    OLD_LOG_PROBS,
    RETURNS,
    ROLLOUT_LOG_PROBS,
    SAMPLE_GROUP,
    SHARED_PREFIX_LEN,
    TOKEN_WEIGHT_VERSION,
)
from drivetrain.api.errors import BatchError
from drivetrain.trainer.column_contract import check_columns
from drivetrain.trainer.data.batching import make_batch
from drivetrain.trainer.data.tokenize import Example
from drivetrain.trainer.dpo.data import Pair, pair_batch
from drivetrain.trainer.rl.batch_ops import completions_batch, engine_view

EXAMPLES = [Example((5, 6, 7, 8), (0, 0, 1, 1)), Example((5, 9, 3), (0, 1, 1))]


def dtypes(batch: Batch) -> dict[str, str]:
    return {name: str(batch[name].dtype).removeprefix("torch.") for name in batch.columns}


def obeys_contract(batch: Batch, *names: str) -> None:
    """``names`` are there, each with the contract's dtype."""
    assert set(names) <= set(batch.columns), batch.columns
    got = dtypes(batch)
    assert {n: got[n] for n in names} == {n: DTYPES[n] for n in names}


@pytest.mark.parametrize("packed", [False, True])
def test_sft_batches(packed):
    batch = make_batch(EXAMPLES, pad_token_id=0, packed=packed)
    obeys_contract(batch, INPUT_IDS, LOSS_MASK)
    assert dtypes(batch)[LOSS_MASK] == "float32"


def test_dpo_batches():
    batch = pair_batch([Pair(*EXAMPLES)], pad_token_id=0, packed=True)
    obeys_contract(batch, INPUT_IDS, LOSS_MASK, SAMPLE_GROUP)


def rl_batch() -> Batch:
    completions = [
        Completion(0, (5, 6), (7, 8, 2), (-0.5, -1.0, -0.1), FinishReason.STOP, 3),
        Completion(0, (5, 6), (9,), (-2.0,), FinishReason.LENGTH, 3),
    ]
    return completions_batch(completions, pad_token_id=0)


def test_rl_role_views():
    """What the actor trains on, what the critic trains on, what every role's infer gets."""
    batch = rl_batch()
    shape = batch[LOSS_MASK].shape
    per_token = torch.zeros(shape, dtype=torch.float32)
    batch = batch.with_columns(old_log_probs=per_token, advantages=per_token, returns=per_token)
    base = (INPUT_IDS, LOSS_MASK, SHARED_PREFIX_LEN)
    obeys_contract(engine_view(batch), *base)
    actor = engine_view(batch, OLD_LOG_PROBS, ADVANTAGES, ROLLOUT_LOG_PROBS, TOKEN_WEIGHT_VERSION)
    obeys_contract(actor, *base, OLD_LOG_PROBS, ADVANTAGES, ROLLOUT_LOG_PROBS, TOKEN_WEIGHT_VERSION)
    obeys_contract(engine_view(batch, RETURNS), *base, RETURNS)
    # GRPO's loss mask was int64 while SFT's was float32
    assert (
        dtypes(engine_view(batch))[LOSS_MASK]
        == dtypes(make_batch(EXAMPLES, pad_token_id=0, packed=False))[LOSS_MASK]
    )


def test_a_column_off_the_contract_is_refused_where_it_is_built():
    batch = rl_batch()
    wrong = batch.with_columns(loss_mask=batch[LOSS_MASK].long())
    with pytest.raises(BatchError, match=r"column 'loss_mask' is int64 on cpu, but .* float32"):
        engine_view(wrong)
    listed = Batch.from_columns({INPUT_IDS: [[1, 2]]}, seq_lens=[2])
    with pytest.raises(BatchError, match="'input_ids' is list on cpu"):
        check_columns(listed)
    extra = batch.with_columns(chosen=torch.ones(len(batch), dtype=torch.float64))
    check_columns(extra)  # columns the api does not name are the job's own business


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_a_column_on_an_accelerator_is_refused():
    batch = rl_batch()
    with pytest.raises(BatchError, match="on cuda:0"):
        check_columns(batch.with_columns(loss_mask=batch[LOSS_MASK].cuda()))
