"""Routing replay in an RL step (``algorithm.routing_replay``) and the router metrics.

A rollout asked for routing (``rollout.return_routed_experts``, which replay sets) gives the
batch the trainer's column :data:`ROLLOUT_ROUTED_EXPERTS`; the api column ``routed_experts``,
which engines replay, is set only where a mode replays:

- ``rollout``: the actor's forwards (old log-probs, every update) use the experts the rollout
  chose for each token, so rollout and trainer compute the same mixture.
- ``old_policy``: the old log-probs' forward routes itself and every update replays that: the
  updates of a step share one routing (on-policy, with one update, there is nothing to replay).
- ``off``: nothing is replayed; with ``rollout.return_routed_experts`` the metrics still show
  how the trainer's routing differs from the rollout's.

Metrics of every update against the rollout's routing: ``routing/mismatch_share`` (tokens
whose experts the update's forward used differ from the rollout's in any layer: 0 where it
replays the rollout's, its routers' own disagreement where nothing is replayed), each
layer's (``routing/mismatch_share_layer_NN``) and their mean (``routing/layer_mismatch_share``);
and how evenly the routing the step used loads the experts (``routing/expert_load_max_over_mean``:
the busiest expert's picks over the mean, 1 when balanced, averaged over layers, and the worst
layer's ``..._max``).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import torch

from drivetrain.api import Batch, Completion
from drivetrain.api.columns import INPUT_IDS, LOSS_MASK, ROUTED_EXPERTS
from drivetrain.api.routing import NOT_RECORDED

#: ``algorithm.routing_replay`` values
MODES = ("off", "rollout", "old_policy")
#: the trainer's token column of the rollout's routing (``[.., layers, top_k]`` int16): what
#: the metrics compare with; engines replay the api column ``routed_experts`` only
ROLLOUT_ROUTED_EXPERTS = "rollout_routed_experts"


def routing_column(completions: Sequence[Completion], width: int) -> torch.Tensor:
    """``[samples, width, layers, top_k]`` int16: each completion's recorded positions, -1
    elsewhere (its last token, padding). Every completion must carry routing of one shape."""
    shapes = {
        (c.routed_experts.layers, c.routed_experts.top_k)
        for c in completions
        if c.routed_experts is not None
    }
    missing = sum(c.routed_experts is None for c in completions)
    if missing or len(shapes) != 1:
        raise ValueError(
            f"routing replay: {missing} of {len(completions)} completions carry no routed "
            f"experts, shapes {sorted(shapes)} (the rollout must return them for every request)"
        )
    layers, top_k = shapes.pop()
    column = torch.full((len(completions), width, layers, top_k), NOT_RECORDED, dtype=torch.int16)
    for i, c in enumerate(completions):
        routed = c.routed_experts
        assert routed is not None
        if routed.end > len(c.prompt_ids) + len(c.token_ids):
            raise ValueError(
                f"routing replay: completion of prompt {c.prompt_index} has routing of "
                f"{routed.end} positions for {len(c.prompt_ids) + len(c.token_ids)} tokens"
            )
        if routed.positions:  # (frombuffer refuses no bytes)
            values = torch.frombuffer(bytearray(routed.data), dtype=torch.int16)
            column[i, routed.start : routed.end] = values.reshape(-1, layers, top_k)
    return column


def with_routing(batch: Batch, completions: Sequence[Completion]) -> Batch:
    """``batch`` (built from ``completions``, padded) with their routing as
    :data:`ROLLOUT_ROUTED_EXPERTS`."""
    column = routing_column(completions, batch[INPUT_IDS].shape[1])
    return batch.with_columns(
        token_keys=[ROLLOUT_ROUTED_EXPERTS], **{ROLLOUT_ROUTED_EXPERTS: column}
    )


def replay_column(batch: Batch, mode: str) -> Batch:
    """``batch`` with the column engines replay, where ``mode`` replays the rollout's."""
    if mode != "rollout" or ROLLOUT_ROUTED_EXPERTS not in batch:
        return batch
    return batch.with_columns(**{ROUTED_EXPERTS: batch[ROLLOUT_ROUTED_EXPERTS]})


def mismatch(used: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``[..., layers]``: 1.0 where the experts a forward used differ (as a set) from the
    rollout's, on ``mask`` tokens the rollout recorded (0 elsewhere)."""
    differs = (used.sort(-1).values != rollout.sort(-1).values).any(-1)
    counted = mask.bool() & (rollout[..., 0] >= 0).all(-1)
    return (differs & counted[..., None]).to(torch.float32)


def mismatch_metrics(
    used: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor, tokens: float
) -> dict[str, torch.Tensor]:
    """The ``routing/*mismatch*`` metrics as shares of ``tokens`` (the loss's global token
    count: summed over micro-batches and ranks they are the batch's; a sequence's last token,
    which no rollout routes, counts as agreeing), one per layer too."""
    per_layer = mismatch(used, rollout, mask)
    flat = per_layer.reshape(-1, per_layer.shape[-1])
    layer_share = flat.sum(0) / tokens
    metrics = {
        "routing/mismatch_share": flat.amax(-1).sum() / tokens,
        "routing/layer_mismatch_share": layer_share.mean(),
    }
    for layer, share in enumerate(layer_share):
        metrics[f"routing/mismatch_share_layer_{layer:02d}"] = share
    return metrics


def expert_count(model_path: str) -> int:
    """The experts per layer an HF model directory's ``config.json`` declares (0: unknown)."""
    config = Path(model_path) / "config.json"
    if not config.is_file():
        return 0
    values = json.loads(config.read_text())
    return int(values.get("num_experts") or values.get("num_local_experts") or 0)


def load_metrics(batch: Batch, experts: int) -> dict[str, float]:
    """How evenly the routing the step used (replayed, else the rollout's) loads the
    ``experts`` of each layer (at least the highest index it routes to), over the tokens the
    loss counts: the busiest expert's picks against the mean (1: balanced), averaged over
    layers, and the worst layer's."""
    used = ROUTED_EXPERTS if ROUTED_EXPERTS in batch else ROLLOUT_ROUTED_EXPERTS
    if used not in batch:
        return {}
    routed, mask = batch[used], batch[LOSS_MASK].bool()
    picks = routed[mask & (routed[..., 0] >= 0).all(-1)].long()  # [tokens, layers, top_k]
    if not len(picks):
        return {}
    experts = max(experts, int(picks.max()) + 1)
    per_layer = picks.transpose(0, 1).reshape(picks.shape[1], -1)
    counts = torch.stack([torch.bincount(row, minlength=experts) for row in per_layer])
    ratio = counts.max(-1).values / counts.float().mean(-1)
    return {
        "routing/expert_load_max_over_mean": float(ratio.mean()),
        "routing/expert_load_max_over_mean_max": float(ratio.max()),
    }
