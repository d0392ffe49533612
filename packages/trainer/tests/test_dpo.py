"""The preference losses against hand-computed values, pairs kept whole, the pair data and the
config's checks."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from drivetrain.api import Batch, LossContext
from drivetrain.api.errors import BatchError, ConfigError
from drivetrain.trainer.config_loader import load_config
from drivetrain.trainer.dpo.config import DPOConfig, PreferenceDataConfig
from drivetrain.trainer.dpo.data import CHOSEN, REF_LOGPS, load_pairs, pair_batch
from drivetrain.trainer.dpo.loss import PreferenceLoss
from drivetrain.trainer.errors import DataError

# two pairs; per sample, the answer's token log-probs (the mask covers tokens 1..)
# pair 0: chosen [-.5, -.5] (sum -1, 2 tokens), rejected [-1, -2, -3] (sum -6, 3 tokens)
# pair 1: chosen [-2] (sum -2, 1 token),       rejected [-1] (sum -1, 1 token)
LOGPS = [[0.0, -0.5, -0.5], [0.0, -1.0, -2.0, -3.0], [0.0, -2.0], [0.0, -1.0]]
REF = [-2.0, -4.0, -1.5, -1.5]


def _micro(packed: bool) -> tuple[dict, Batch]:
    lens = [len(x) for x in LOGPS]
    width = max(lens)
    pad = [x + [0.0] * (width - len(x)) for x in LOGPS]
    mask = [[0.0] + [1.0] * (n - 1) + [0.0] * (width - n) for n in lens]
    batch = Batch.from_columns(
        {
            "input_ids": torch.ones(4, width, dtype=torch.long),
            "loss_mask": torch.tensor(mask),
            "sample_group": torch.tensor([0, 0, 1, 1]),
            CHOSEN: torch.tensor([1, 0, 1, 0]),
            REF_LOGPS: torch.tensor(REF, dtype=torch.float64),
        },
        seq_lens=lens,
    )
    log_probs = torch.tensor(pad)
    if packed:
        batch = batch.to_packed()
        log_probs = torch.cat([torch.tensor(x) for x in LOGPS])
    return {"log_probs": log_probs}, batch


CTX = LossContext(global_tokens=7, global_sequences=4, dp_size=1, micro_batch_index=0,
                  num_micro_batches=1)  # fmt: skip


def _softplus(x: float) -> float:  # -log sigmoid(-x) = log(1 + e^x)
    return math.log1p(math.exp(x))


@pytest.mark.parametrize("packed", [False, True])
def test_sigmoid_dpo_by_hand(packed: bool) -> None:
    outputs, micro = _micro(packed)
    loss, metrics = PreferenceLoss("sigmoid", beta=0.1)(outputs, micro, CTX)
    # log-ratios: pair 0: c -1 - -2 = 1, r -6 - -4 = -2; pair 1: c -2 - -1.5 = -0.5, r 0.5
    z = [0.1 * (1 - -2), 0.1 * (-0.5 - 0.5)]
    assert float(loss) == pytest.approx(sum(_softplus(-v) for v in z) / 2)
    assert float(metrics["rewards/margins"]) == pytest.approx((0.3 - 0.1) / 2)
    assert float(metrics["rewards/accuracies"]) == pytest.approx(0.5)
    assert float(metrics["logps/chosen"]) == pytest.approx((-1 - 2) / 2)
    assert float(metrics["preference_accuracy"]) == pytest.approx(0.5)  # -1 > -6, -2 < -1


def test_ipo_uses_length_averaged_log_ratios() -> None:
    outputs, micro = _micro(True)
    loss, _ = PreferenceLoss("ipo", beta=0.5)(outputs, micro, CTX)
    h = [1 / 2 - (-2) / 3, -0.5 / 1 - 0.5 / 1]
    assert float(loss) == pytest.approx(sum((v - 1.0) ** 2 for v in h) / 2)


def test_simpo_is_reference_free_and_length_averaged() -> None:
    outputs, micro = _micro(False)
    loss, _ = PreferenceLoss("simpo", beta=2.0, simpo_gamma=0.5)(
        outputs, micro.drop(REF_LOGPS), CTX
    )
    z = [2.0 * (-1 / 2 - -6 / 3) - 0.5, 2.0 * (-2 - -1) - 0.5]
    assert float(loss) == pytest.approx(sum(_softplus(-v) for v in z) / 2)


def test_micro_batch_shares_sum_to_the_mean_and_gradients_flow() -> None:
    outputs, micro = _micro(True)
    outputs["log_probs"].requires_grad_()
    whole, _ = PreferenceLoss()(outputs, micro, CTX)
    first = micro.select([0, 1])
    second = micro.select([2, 3])
    offsets = [0, 7]
    parts = sum(
        float(PreferenceLoss()({"log_probs": outputs["log_probs"][o : o + n]}, m, CTX)[0].detach())
        for m, o, n in zip((first, second), offsets, (7, 4), strict=True)
    )
    assert parts == pytest.approx(float(whole.detach()))
    whole.backward()
    assert outputs["log_probs"].grad.abs().sum() > 0


def test_a_split_pair_is_an_error() -> None:
    outputs, micro = _micro(False)
    half = micro.select([0, 2, 3])
    with pytest.raises(BatchError, match="split a sample_group"):
        PreferenceLoss()({"log_probs": outputs["log_probs"][[0, 2, 3]]}, half, CTX)


def _tokenizer(tmp_path: Path):
    from transformers import AutoTokenizer

    from drivetrain.trainer.builtin.tiny_model import build_tiny_chat_model

    return AutoTokenizer.from_pretrained(str(build_tiny_chat_model(tmp_path / "model")))


def test_pairs_load_and_batch_with_precomputed_reference(tmp_path: Path) -> None:
    rows = [
        {"prompt": "1+1?", "chosen": "2", "rejected": "3", "ref_chosen_logps": -1.0,
         "ref_rejected_logps": -2.0},
        {"prompt": [{"role": "user", "content": "2+2?"}],
         "chosen": [{"role": "assistant", "content": "4"}], "rejected": "44",
         "ref_chosen_logps": -0.5, "ref_rejected_logps": -3.0},
    ]  # fmt: skip
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tokenizer = _tokenizer(tmp_path)
    pairs = load_pairs(str(path), tokenizer, PreferenceDataConfig(), None, precomputed=True)
    batch = pair_batch(pairs, pad_token_id=0, packed=True)
    assert len(batch) == 4 and batch["sample_group"].tolist() == [0, 0, 1, 1]
    assert batch[CHOSEN].tolist() == [1, 0, 1, 0]
    assert batch[REF_LOGPS].tolist() == [-1.0, -2.0, -0.5, -3.0]
    # the rejected "44" has one answer token more than the chosen "4"
    chosen, rejected = pairs[1].chosen, pairs[1].rejected
    assert sum(rejected.loss_mask) == sum(chosen.loss_mask) + 1
    with pytest.raises(DataError, match="needs ref_chosen_logps and ref_rejected_logps"):
        bare = tmp_path / "bare.jsonl"
        bare.write_text(json.dumps({"prompt": "a", "chosen": "b", "rejected": "c"}) + "\n")
        load_pairs(str(bare), tokenizer, PreferenceDataConfig(), None, precomputed=True)
    with pytest.raises(DataError, match="missing 'rejected'"):
        bare.write_text(json.dumps({"prompt": "a", "chosen": "b"}) + "\n")
        load_pairs(str(bare), tokenizer, PreferenceDataConfig(), None)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["algorithm.loss=kto"], "is not one of sigmoid, ipo, simpo"),
        (["algorithm.loss=simpo", "reference.mode=engine"], "reference-free"),
        (["reference.mode=none"], "compares with a reference"),
        (["reference.mode=adapter"], "needs a LoRA actor"),
        (["reference.model_path=/x", "reference.mode=precomputed"], "is for reference.mode=engine"),
        (["algorithm.beta=0"], "must be > 0"),
    ],
)
def test_config_errors(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(DPOConfig, overrides=overrides)


def test_reference_auto() -> None:
    assert load_config(DPOConfig).reference_mode == "engine"
    assert load_config(DPOConfig, overrides=["algorithm.loss=simpo"]).reference_mode == "none"
    lora = load_config(DPOConfig, overrides=["engine.model.lora.rank=4"])
    assert lora.reference_mode == "adapter"
