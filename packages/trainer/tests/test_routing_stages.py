"""Where a step's routing goes (``algorithm.routing_replay``), against a recording stand-in for
the actor's workers: ``rollout`` sends the rollout's routing to the old log-probs' forward and
the updates; ``old_policy`` sends none to that forward, asks it which experts it used and hands
exactly those (int16) to the updates; the reference never gets routing."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from drivetrain.api import Batch
from drivetrain.api.columns import ENTROPY, LOG_PROBS, ROUTED_EXPERTS
from drivetrain.trainer.rl.batch_ops import engine_view
from drivetrain.trainer.rl.routing import ROLLOUT_ROUTED_EXPERTS, replay_column
from drivetrain.trainer.rl.stages import OldLogProbs, StepBatch
from drivetrain.trainer.rl.update_losses import ActorLoss

LENS = [5, 3]


class RecordingGroup:
    """The actor's workers: records each ``infer`` call's columns and spec; answers with
    log-probs, entropy and (asked for) the experts 'used': the rollout's plus one."""

    parallel = SimpleNamespace(dp_size=1)

    def __init__(self) -> None:
        self.calls: list[tuple[set[str], object]] = []

    def gather_sharded(self, method, batch: Batch, role, spec, adapter_off):
        self.calls.append((set(batch.columns), spec))
        width = batch["input_ids"].shape[1]
        out = {LOG_PROBS: torch.zeros(len(batch), width), ENTROPY: torch.zeros(len(batch), width)}
        if spec.routed_experts:  # float, as an empty shard's output would make it
            out[ROUTED_EXPERTS] = (routing() + 1).float()
        return [out]


def routing() -> torch.Tensor:
    column = torch.full((2, 5, 2, 2), -1, dtype=torch.int16)
    column[0, :4] = torch.tensor([[0, 1], [2, 3]], dtype=torch.int16)
    column[1, :2] = torch.tensor([[1, 2], [0, 3]], dtype=torch.int16)
    return column


def step_batch(mode: str) -> StepBatch:
    batch = Batch.from_columns(
        {
            "input_ids": torch.ones(2, 5, dtype=torch.long),
            "loss_mask": torch.ones(2, 5),
            "rollout_log_probs": torch.zeros(2, 5),
            ROLLOUT_ROUTED_EXPERTS: routing(),
        },
        seq_lens=LENS,
        token_keys=[ROLLOUT_ROUTED_EXPERTS],
    )
    return StepBatch(replay_column(batch, mode), torch.zeros(2), [], None, {})


@pytest.mark.parametrize("mode", ["rollout", "old_policy"])
def test_the_routing_each_forward_gets(mode):
    group = RecordingGroup()
    step = step_batch(mode)
    OldLogProbs(group, 1.0, mode).run(step)
    ((columns, spec),) = group.calls
    if mode == "rollout":  # the old log-probs' forward replays the rollout's experts
        assert ROUTED_EXPERTS in columns and not spec.routed_experts
        assert torch.equal(step.batch[ROUTED_EXPERTS], routing())
    else:  # it routes itself; the updates replay what it used
        assert ROUTED_EXPERTS not in columns and spec.routed_experts
        handed = step.batch[ROUTED_EXPERTS]
        assert handed.dtype == torch.int16 and torch.equal(handed, routing() + 1)
    assert ROLLOUT_ROUTED_EXPERTS not in columns
    # the update sends the replayed routing (and the rollout's, for the metrics) ...
    loss = ActorLoss(replay_routing=True, routing_metrics=True)
    wanted = [*loss.reads, *loss.replays]
    sent = engine_view(step.batch, *(c for c in wanted if c in step.batch))
    assert torch.equal(sent[ROUTED_EXPERTS], step.batch[ROUTED_EXPERTS])
    assert ROLLOUT_ROUTED_EXPERTS in sent and loss.outputs.routed_experts
    # ... and no other role gets any: the reference's and critic's view
    assert ROUTED_EXPERTS not in engine_view(step.batch)


def test_off_replays_nothing():
    step = step_batch("off")
    assert ROUTED_EXPERTS not in step.batch
    assert ActorLoss(routing_metrics=True).replays == ()
