"""Preference losses over pairs, as a picklable loss object every engine rank receives.

Each sample's log-probability is the sum over its answer tokens (``loss_mask``) of the
engine's ``log_probs``, as TRL's ``DPOTrainer`` sums them; IPO and SimPO divide by the answer's
length. With ``z`` the pair's logit:

- ``sigmoid`` (DPO): ``z = beta * ((pi_c - ref_c) - (pi_r - ref_r))``, loss ``-log sigmoid(z)``;
- ``ipo``: ``h = (pi_c - ref_c) / n_c - (pi_r - ref_r) / n_r``, loss ``(h - 1 / (2 beta))^2``;
- ``simpo``: ``z = beta * (pi_c / n_c - pi_r / n_r) - gamma``, loss ``-log sigmoid(z)``.

The loss is the mean over the mini-batch's pairs: each micro-batch returns its pairs' sum
divided by the global pair count (``global_sequences / 2``), so the engine's sum over
micro-batches and ranks is that mean whatever the split, provided both samples of a pair
arrive together (``sample_group``; a pair split across micro-batches is an error).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from drivetrain.api import Batch, LossContext, OutputSpec
from drivetrain.api.columns import LOG_PROBS, LOSS_MASK, SAMPLE_GROUP
from drivetrain.api.errors import BatchError
from drivetrain.trainer.dpo.config import NEEDS_REFERENCE
from drivetrain.trainer.dpo.data import CHOSEN, REF_LOGPS
from drivetrain.trainer.sequences import sequence_sums


def pair_order(micro: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """Indices of each pair's chosen and rejected sample in ``micro``, pairs in group order."""
    groups = torch.as_tensor(micro[SAMPLE_GROUP]).cpu()
    chosen = torch.as_tensor(micro[CHOSEN]).cpu().bool()
    order = torch.argsort(groups * 2 + (~chosen).long(), stable=True)
    c, r = order[0::2], order[1::2]
    if (
        len(order) % 2
        or not bool((groups[c] == groups[r]).all())
        or not bool(chosen[c].all())
        or bool(chosen[r].any())
    ):
        raise BatchError(
            "a micro-batch holds an incomplete preference pair: the engine split a "
            "sample_group (engines must partition with Batch.fixed_size_parts / "
            "token_budget_parts / dp_shards)"
        )
    return c, r


@dataclass(frozen=True)
class PreferenceLoss:
    loss: str = "sigmoid"
    beta: float = 0.1
    simpo_gamma: float = 0.5

    @property
    def outputs(self) -> OutputSpec:
        return OutputSpec(log_probs=True)

    def pair_terms(self, outputs: Mapping[str, Any], micro: Batch) -> dict[str, torch.Tensor]:
        """Per pair: ``loss`` and the logged quantities (TRL's names)."""
        log_probs = outputs[LOG_PROBS]
        mask = micro[LOSS_MASK].to(device=log_probs.device, dtype=log_probs.dtype)
        logps = sequence_sums(log_probs * mask, micro.seq_lens)
        lengths = sequence_sums(mask, micro.seq_lens).clamp(min=1.0)
        c, r = (i.to(log_probs.device) for i in pair_order(micro))
        if self.loss in NEEDS_REFERENCE:
            ref = torch.as_tensor(micro[REF_LOGPS]).to(log_probs.device, log_probs.dtype)
            ratio = logps - ref  # log pi / ref per sample
            if self.loss == "ipo":  # per token, as TRL's IPO (its rewards too)
                ratio = ratio / lengths
        else:
            ratio = logps / lengths  # SimPO's implicit reward: the average log-prob
        if self.loss == "sigmoid":
            logit = self.beta * (ratio[c] - ratio[r])
            loss = -F.logsigmoid(logit)
        elif self.loss == "ipo":
            loss = (ratio[c] - ratio[r] - 1 / (2 * self.beta)) ** 2
        else:  # simpo
            logit = self.beta * (ratio[c] - ratio[r]) - self.simpo_gamma
            loss = -F.logsigmoid(logit)
        rewards = (self.beta * ratio).detach()
        return {
            "loss": loss,
            "rewards/chosen": rewards[c],
            "rewards/rejected": rewards[r],
            "rewards/margins": rewards[c] - rewards[r],
            "rewards/accuracies": (rewards[c] > rewards[r]).to(log_probs.dtype),
            "logps/chosen": logps[c].detach(),
            "logps/rejected": logps[r].detach(),
            # the policy alone prefers the chosen answer (what held-out accuracy reports)
            "preference_accuracy": (logps[c] > logps[r]).to(log_probs.dtype),
        }

    def __call__(
        self, outputs: Mapping[str, Any], micro: Batch, ctx: LossContext
    ) -> tuple[torch.Tensor, Mapping[str, Any]]:
        terms = self.pair_terms(outputs, micro)
        pairs = max(ctx.global_sequences // 2, 1)
        loss = terms.pop("loss").sum() / pairs
        return loss, {name: value.sum() / pairs for name, value in terms.items()}
