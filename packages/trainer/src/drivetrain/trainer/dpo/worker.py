"""One rank of the preference job: the actor (and a frozen reference engine when the
reference is one), and the reference log-probs computed where the shard already is."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from drivetrain.api import Batch, OutputSpec
from drivetrain.api.columns import LOG_PROBS, LOSS_MASK
from drivetrain.trainer.dpo.data import REF_LOGPS
from drivetrain.trainer.dpo.loss import PreferenceLoss
from drivetrain.trainer.reference import Reference
from drivetrain.trainer.sequences import sequence_sums
from drivetrain.trainer.workers.engine_worker import StepStats
from drivetrain.trainer.workers.role_worker import ACTOR, RoleWorker


class PreferenceWorker(RoleWorker):
    def with_reference(self, shard: Batch, reference: Reference) -> Batch:
        """``shard`` with each sample's reference log-prob when a role computes it (the frozen
        reference, or the actor with its adapter off). Off output ranks (pipeline stages that
        compute no loss) the column is zeros."""
        if not reference.computed:
            return shard  # precomputed (already a column) or none
        out = self.infer(
            shard, reference.role, OutputSpec(log_probs=True), adapter_off=reference.adapter_off
        )
        if out is None:
            return shard.with_columns(**{REF_LOGPS: torch.zeros(len(shard), dtype=torch.float64)})
        mask = shard[LOSS_MASK].cpu().to(torch.float64)
        logps = sequence_sums(out[LOG_PROBS].to(torch.float64) * mask, shard.seq_lens)
        return shard.with_columns(**{REF_LOGPS: logps})

    def train_pairs(self, shard: Batch, loss: PreferenceLoss, reference: Reference) -> StepStats:
        return self.train(self.with_reference(shard, reference), ACTOR, loss)

    def eval_pairs(
        self, shard: Batch, loss: PreferenceLoss, reference: Reference
    ) -> dict[str, float]:
        """Each logged quantity summed over the pairs of the whole batch (all ranks), and
        ``pairs``: the count."""
        shard = self.with_reference(shard, reference)
        out = self.infer(shard, ACTOR, loss.outputs)
        local: dict[str, float] = {}
        if out is not None and len(shard):
            terms = loss.pair_terms(out, shard)
            local = {name: float(value.double().sum()) for name, value in terms.items()}
            local["pairs"] = float(len(shard) // 2)
        info = self.roles[ACTOR].engine.parallel
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return local
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, (info.dp_rank, local))
        total: dict[str, float] = {}
        # one result per data-parallel shard (tensor/pipeline peers hold the same pairs)
        for values in {dp: values for dp, values in gathered if values}.values():
            for name, value in values.items():
                total[name] = total.get(name, 0.0) + value
        return total
