"""The routers of a transformers mixture-of-experts model: record the experts they choose, or
make them choose given ones (routing replay). The hf rollout records; the fsdp engine replays
and records the experts its forward used (for the router metrics and ``old_policy`` replay).

transformers 5 routers (``Qwen2MoeTopKRouter``, ``Qwen3MoeTopKRouter``, ``MixtralTopKRouter``)
take the block's hidden states flattened to ``[rows, hidden]`` and return ``(logits, scores,
indices)``: the softmax over all experts of each row, its ``top_k`` largest (``indices``,
``[rows, top_k]``) and their probabilities, renormalised over the picks when the model says so
(Mixtral always), in the logits' dtype. The experts then mix the picked experts' outputs with
``scores``. Replaying ``indices`` means keeping the row's softmax and taking it at the given
experts instead of the largest: the router still learns through ``scores``, as in peers'
replay (verl's R2/R3, megatron-core's ``RouterReplay``). Other routers (sigmoid or grouped
routing, a correction bias) compute their scores otherwise and are refused by name.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

#: routers whose scores are a softmax over all experts taken at the top-k (see the docstring)
SOFTMAX_TOP_K = ("Qwen2MoeTopKRouter", "Qwen3MoeTopKRouter", "MixtralTopKRouter")


def moe_routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's routers, first layer first; ``[]`` for a dense model. A router of another
    kind is refused in one line."""
    found = [m for m in model.modules() if type(m).__name__.endswith("TopKRouter")]
    for router in found:
        if type(router).__name__ not in SOFTMAX_TOP_K:
            raise ValueError(
                f"routing replay knows the softmax top-k routers of Qwen2-MoE, Qwen3-MoE and "
                f"Mixtral ({', '.join(SOFTMAX_TOP_K)}), not {type(router).__name__}"
            )
    return found


class RoutingRecorder:
    """The experts each router chose in the forwards run while it is active: :meth:`take`
    returns them as ``[rows, layers, top_k]`` int16 (rows as each router saw them)."""

    def __init__(self) -> None:
        self.chosen: list[list[torch.Tensor]] = []

    def record(self, layer: int, indices: torch.Tensor) -> None:
        while len(self.chosen) <= layer:
            self.chosen.append([])
        self.chosen[layer].append(indices.detach().to(torch.int16))

    def clear(self) -> None:
        """Forget what was recorded (a forward that failed part-way)."""
        self.chosen = []

    def take(self) -> torch.Tensor:
        """What the routers chose since the last take (every layer saw the same rows)."""
        layers = [torch.cat(calls) for calls in self.chosen]
        self.chosen = []
        if not layers:
            return torch.zeros(0, 0, 0, dtype=torch.int16)
        return torch.stack(layers, 1)


def _renormalises(router: torch.nn.Module) -> bool:
    return bool(getattr(router, "norm_topk_prob", True))  # Mixtral always renormalises


def replay_indices(
    router: torch.nn.Module,
    logits: torch.Tensor,
    scores: torch.Tensor,
    own: torch.Tensor,
    target: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(scores, indices)`` of a router made to pick ``target`` (``[rows, top_k]``, a row of
    -1 keeps the router's ``own`` choice), scored as the router scores its own picks."""
    use = (target[:, 0] >= 0)[:, None]
    indices = torch.where(use, target.to(own.device, torch.long), own)
    picked = torch.softmax(logits.float(), -1).gather(1, indices)
    if _renormalises(router):
        picked = picked / picked.sum(-1, keepdim=True)
    return picked.to(scores.dtype), indices


@contextmanager
def routing_hooks(
    model: torch.nn.Module,
    *,
    record: RoutingRecorder | None = None,
    replay: torch.Tensor | None = None,
) -> Iterator[None]:
    """While active, every router of ``model``, given ``replay`` (``[rows, layers, top_k]``, the
    rows each router sees in the next forward, -1 to keep its own), picks those experts
    instead of its own, and records the experts it used into ``record``."""
    routers = moe_routers(model)
    if replay is not None and replay.shape[1:] != (
        len(routers),
        routers[0].top_k if routers else 0,
    ):
        raise ValueError(
            f"replayed routing is [rows, {replay.shape[1]}, {replay.shape[2]}] but the model "
            f"routes over {len(routers)} layers x top-{routers[0].top_k if routers else 0}"
        )
    handles = []

    def hook(layer: int) -> Callable[[torch.nn.Module, object, tuple], tuple | None]:
        def after(router: torch.nn.Module, args: object, out: tuple) -> tuple | None:
            logits, scores, own = out
            if replay is None:
                if record is not None:
                    record.record(layer, own)
                return None
            target = replay[:, layer]
            if target.shape[0] != own.shape[0]:
                raise ValueError(
                    f"replayed routing holds {target.shape[0]} rows but router {layer} sees "
                    f"{own.shape[0]}"
                )
            scores, indices = replay_indices(router, logits, scores, own, target)
            if record is not None:
                record.record(layer, indices)
            return logits, scores, indices

        return after

    try:
        for layer, router in enumerate(routers):
            handles.append(router.register_forward_hook(hook(layer)))
        yield
    finally:
        for handle in handles:
            handle.remove()
