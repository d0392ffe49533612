"""Mixture-of-experts families (Qwen2-MoE, Qwen3-MoE, Mixtral): config translation and the
HF <-> Megatron-Core conversion of their sparse MLP blocks.

Routing, as HF computes it and how megatron's ``TopKRouter`` is set up to match:

- Qwen2/Qwen3-MoE: ``softmax(router logits)`` over all experts, top-k, renormalised over the
  k picks only when ``norm_topk_prob``. Renormalised top-k of a softmax equals the softmax of
  the top-k logits, which is megatron's default (``moe_router_pre_softmax=False``); without
  renormalisation megatron's pre-softmax router (softmax over all experts, then top-k) is HF's.
- Mixtral: always renormalised (megatron's default).
- No load-balancing or z loss (HF adds its auxiliary loss to ``loss`` only when asked for
  router logits; the engine's loss is the caller's), no capacity factor: no token is dropped.
- The router runs in fp32 (HF's softmax does) whatever the parameter dtype.

Layouts. HF checkpoints on disk hold one tensor per expert (``experts.{e}.gate_proj`` /
``up_proj`` / ``down_proj``, Mixtral ``w1`` / ``w3`` / ``w2`` under ``block_sparse_moe``);
transformers >= 5 models hold them fused (``experts.gate_up_proj`` ``[E, 2I, H]``, gate rows
first, and ``experts.down_proj`` ``[E, H, I]``), which is what the export yields (the names of
``model.state_dict()``, like every other tensor of the stream). Both layouts load. megatron's
``SequentialMLP`` holds ``E / EP`` local experts per expert-parallel rank (rank ``r``: global
experts ``r*E/EP ..``), each a plain MLP split over the *expert* tensor-parallel group
(``[gate shard | up shard]`` rows in ``linear_fc1``, like a dense MLP). The shared expert is a
dense MLP over the ordinary tensor-parallel group with an unsplit sigmoid gate.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

#: per family: where the block lives on disk, the per-expert weight names (gate, up, down), and
#: whether the router's ``gate`` comes before the experts in the HF module order
_DISK = {
    "qwen2_moe": ("mlp", ("gate_proj", "up_proj", "down_proj"), True),
    "qwen3_moe": ("mlp", ("gate_proj", "up_proj", "down_proj"), False),
    "mixtral": ("block_sparse_moe", ("w1", "w3", "w2"), True),
}


def num_experts(hf_config: Any) -> int:
    return int(getattr(hf_config, "num_experts", None) or hf_config.num_local_experts)


def expert_ffn(hf_config: Any) -> int:
    return int(getattr(hf_config, "moe_intermediate_size", None) or hf_config.intermediate_size)


def _check_all_sparse(hf_config: Any) -> None:
    step = getattr(hf_config, "decoder_sparse_step", 1) or 1
    if step != 1 or getattr(hf_config, "mlp_only_layers", None):
        raise ValueError(
            "MoE models with dense layers in between (decoder_sparse_step != 1 or "
            "mlp_only_layers) are not supported by the Megatron converter yet"
        )


def _define_missing_te_gemm() -> None:
    """megatron-core 0.16's router GEMM (``RouterGatingLinearFunction``) tests
    ``te_general_gemm is not None``, but that name is only defined when TransformerEngine
    imports: without TE every MoE forward raises ``NameError``, on GPU as on CPU. Define it as
    ``None`` (the plain-torch branch it was meant to select) when TE is absent."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None  # type: ignore[attr-defined]


def moe_kwargs(
    hf_config: Any,
    flags: dict[str, bool],
    *,
    tensor_parallel: int = 1,
    sequence_parallel: bool = False,
) -> dict[str, Any]:
    """``TransformerConfig`` fields of an HF MoE config (see the module docstring)."""
    _check_all_sparse(hf_config)
    if tensor_parallel > 1 and not sequence_parallel:
        # megatron's MoELayer raises in every training forward otherwise; say it up front
        raise ValueError(
            "a mixture-of-experts model with tensor_parallel > 1 needs "
            "sequence_parallel=True (megatron-core refuses MoE + TP without SP)"
        )
    _define_missing_te_gemm()
    if getattr(hf_config, "router_jitter_noise", 0.0):
        raise ValueError("router_jitter_noise > 0 is not supported by the Megatron engine")
    renormalise = hf_config.model_type == "mixtral" or bool(
        getattr(hf_config, "norm_topk_prob", False)
    )
    kwargs: dict[str, Any] = {
        "num_moe_experts": num_experts(hf_config),
        "moe_ffn_hidden_size": expert_ffn(hf_config),
        "moe_router_topk": hf_config.num_experts_per_tok,
        "moe_router_pre_softmax": not renormalise,
        "moe_router_score_function": "softmax",
        "moe_router_dtype": "fp32",
        "moe_router_load_balancing_type": "none",
        "moe_aux_loss_coeff": 0.0,
        "moe_z_loss_coeff": None,
        "moe_expert_capacity_factor": None,  # no capacity: no token dropped, as in HF
        "moe_token_dispatcher_type": "allgather",
        "moe_grouped_gemm": False,
        "moe_permute_fusion": False,
        "moe_router_fusion": False,
    }
    if flags["shared_expert"]:
        kwargs["moe_shared_expert_intermediate_size"] = hf_config.shared_expert_intermediate_size
        kwargs["moe_shared_expert_gate"] = True
    return kwargs


class ExpertSlot:
    """This rank's place in the expert grid: which experts it holds, which slice of each."""

    def __init__(self, hf_config: Any, tcfg: Any) -> None:
        from megatron.core import parallel_state as ps

        self.experts = num_experts(hf_config)
        self.ffn = expert_ffn(hf_config)
        self.ep = ps.get_expert_model_parallel_world_size()
        self.ep_rank = ps.get_expert_model_parallel_rank()
        self.etp = ps.get_expert_tensor_parallel_world_size()
        self.etp_rank = ps.get_expert_tensor_parallel_rank()
        self.local = self.experts // self.ep
        self.shared_ffn = getattr(tcfg, "moe_shared_expert_intermediate_size", None)

    def global_index(self, local: int) -> int:
        return self.ep_rank * self.local + local


# --------------------------------------------------------------------------- loading


def _expert_rows(
    read: Any,
    prefix: str,
    names: tuple[str, ...],
    expert: int,
    rows: tuple[int, int],
    slot: ExpertSlot,
) -> tuple[torch.Tensor, ...]:
    """(gate rows, up rows, down columns) of one expert's ``rows`` range of the ffn dim."""
    r0, r1 = rows
    fused = f"{prefix}.experts.gate_up_proj"
    if fused in read:  # transformers >= 5 layout saved as is
        gate_up = read.slice(fused)
        down = read.slice(f"{prefix}.experts.down_proj")
        e = slice(expert, expert + 1)
        return (
            gate_up[e, r0:r1][0],
            gate_up[e, slot.ffn + r0 : slot.ffn + r1][0],
            down[e, :, r0:r1][0],
        )
    base = f"{prefix}.experts.{expert}"
    gate, up, down = names
    return (
        read.rows(f"{base}.{gate}.weight", r0, r1),
        read.rows(f"{base}.{up}.weight", r0, r1),
        read.cols(f"{base}.{down}.weight", r0, r1),
    )


def moe_layer_weights(
    read: Any, layer: str, hf_config: Any, slot: ExpertSlot, tp: int, tp_rank: int
) -> dict[str, torch.Tensor]:
    """Megatron ``mlp.*`` parameter name -> this rank's shard, for HF layer prefix ``layer``."""
    where, names, _ = _DISK[hf_config.model_type]
    prefix = f"{layer}.{where}"
    if f"{prefix}.gate.weight" not in read and f"{layer}.mlp.gate.weight" in read:
        prefix = f"{layer}.mlp"  # a Mixtral saved with transformers' in-memory names
    size = slot.ffn // slot.etp
    rows = (slot.etp_rank * size, (slot.etp_rank + 1) * size)
    out = {"mlp.router.weight": read.full(f"{prefix}.gate.weight")}
    for local in range(slot.local):
        gate, up, down = _expert_rows(read, prefix, names, slot.global_index(local), rows, slot)
        out[f"mlp.experts.local_experts.{local}.linear_fc1.weight"] = torch.cat([gate, up])
        out[f"mlp.experts.local_experts.{local}.linear_fc2.weight"] = down
    if slot.shared_ffn:
        size = slot.shared_ffn // tp
        s0, s1 = tp_rank * size, (tp_rank + 1) * size
        shared = f"{prefix}.shared_expert"
        out["mlp.shared_experts.linear_fc1.weight"] = torch.cat(
            [
                read.rows(f"{shared}.gate_proj.weight", s0, s1),
                read.rows(f"{shared}.up_proj.weight", s0, s1),
            ]
        )
        out["mlp.shared_experts.linear_fc2.weight"] = read.cols(
            f"{shared}.down_proj.weight", s0, s1
        )
        out["mlp.shared_experts.gate_weight"] = read.full(f"{prefix}.shared_expert_gate.weight")
    return out


# --------------------------------------------------------------------------- export


def _gather(tensor: torch.Tensor, dim: int, group: Any, size: int) -> torch.Tensor:
    if size == 1:
        return tensor
    parts = [torch.empty_like(tensor) for _ in range(size)]
    dist.all_gather(parts, tensor.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def _gate_up(fc1: torch.Tensor, tp: int, ffn: int) -> torch.Tensor:
    """Full ``linear_fc1`` rows (per TP rank ``[gate shard | up shard]``) -> ``[gate | up]``."""
    per_rank = fc1.view(tp, 2, ffn // tp, fc1.shape[-1])
    return torch.cat([per_rank[:, 0].reshape(ffn, -1), per_rank[:, 1].reshape(ffn, -1)])


#: one exported tensor: (HF suffix under ``model.layers.{i}.``, full shape, producer on the owner)
MoeItem = tuple[str, tuple[int, ...], Callable[[dict[str, torch.Tensor]], torch.Tensor]]


def moe_export_items(hf_config: Any, slot: ExpertSlot, hidden: int, tp: int) -> list[MoeItem]:
    """The ``mlp.*`` tensors of one HF MoE layer in HF module order. Each producer runs on the
    pipeline stage that owns the layer, on every rank of it (it uses TP/EP collectives), and
    gets that layer's megatron parameters (names relative to the layer)."""
    from megatron.core import parallel_state as ps

    ep_group, etp_group = (
        ps.get_expert_model_parallel_group(),
        ps.get_expert_tensor_parallel_group(),
    )
    tp_group = ps.get_tensor_model_parallel_group()

    def experts(kind: str) -> Callable[[dict[str, torch.Tensor]], torch.Tensor]:
        def produce(params: dict[str, torch.Tensor]) -> torch.Tensor:
            local = []
            for e in range(slot.local):
                weight = params[f"mlp.experts.local_experts.{e}.linear_{kind}.weight"]
                if kind == "fc1":
                    local.append(
                        _gate_up(_gather(weight, 0, etp_group, slot.etp), slot.etp, slot.ffn)
                    )
                else:
                    local.append(_gather(weight, 1, etp_group, slot.etp))
            return _gather(torch.stack(local), 0, ep_group, slot.ep)

        return produce

    def shared_fc1(params: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        full = _gate_up(
            _gather(params["mlp.shared_experts.linear_fc1.weight"], 0, tp_group, tp),
            tp,
            slot.shared_ffn,
        )
        return full.split(slot.shared_ffn)

    E, ffn = slot.experts, slot.ffn
    gate: MoeItem = ("mlp.gate.weight", (E, hidden), lambda p: p["mlp.router.weight"])
    expert_items: list[MoeItem] = [
        ("mlp.experts.gate_up_proj", (E, 2 * ffn, hidden), experts("fc1")),
        ("mlp.experts.down_proj", (E, hidden, ffn), experts("fc2")),
    ]
    _, _, gate_first = _DISK[hf_config.model_type]
    items = [gate, *expert_items] if gate_first else [*expert_items, gate]
    if slot.shared_ffn:
        S = slot.shared_ffn
        items += [
            ("mlp.shared_expert.gate_proj.weight", (S, hidden), lambda p: shared_fc1(p)[0]),
            ("mlp.shared_expert.up_proj.weight", (S, hidden), lambda p: shared_fc1(p)[1]),
            (
                "mlp.shared_expert.down_proj.weight",
                (hidden, S),
                lambda p: _gather(p["mlp.shared_experts.linear_fc2.weight"], 1, tp_group, tp),
            ),
            (
                "mlp.shared_expert_gate.weight",
                (1, hidden),
                lambda p: p["mlp.shared_experts.gate_weight"],
            ),
        ]
    return items


def iter_moe_export(
    items: list[MoeItem], params: dict[str, torch.Tensor] | None, share: Callable[..., Any]
) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF suffix, full tensor) per item; ``params`` is None on stages not owning the layer,
    ``share(tensors, shapes)`` broadcasts the owner's tensors to every stage."""
    for suffix, shape, produce in items:
        full = [produce(params).contiguous()] if params is not None else None
        yield suffix, share(full, [shape])[0]
