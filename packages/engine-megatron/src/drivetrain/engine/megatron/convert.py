"""Hugging Face <-> Megatron-Core weights for the Llama / Qwen2 / Qwen3 families (and the
attention / norm / embedding part of the MoE families; their sparse MLPs are in ``moe.py``),
streaming.

Layouts (local layer spec, ``TP`` ranks, ``g`` KV groups, ``q = heads / g`` query heads each):

- ``linear_qkv``: rows grouped per KV head, ``[q heads of group i | k_i | v_i]`` for each group
  in turn; a TP rank owns ``g / TP`` whole groups, i.e. a contiguous row range of each of
  ``q_proj``, ``k_proj`` and ``v_proj`` (the same for the Qwen2 biases).
- ``linear_fc1``: per TP rank ``[gate shard | up shard]`` (SwiGLU chunks its output in two).
- ``linear_proj`` / ``linear_fc2``: row-parallel, split along the input (second) dim.
- ``word_embeddings`` / ``output_layer``: vocab rows padded to ``padded_vocab_size`` and split
  contiguously; padding rows are zero on load and dropped on export.
- layer ``i`` of HF is the chunk layer whose ``layer_number`` is ``i + 1`` (PP / virtual PP).

Loading reads only this rank's slices (``safetensors`` ``get_slice``). Export yields full HF
tensors on every rank in the same order, gathering TP shards (all-gather over the TP group)
and broadcasting from the owning pipeline stage; one megatron parameter is materialised at a
time.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from itertools import chain
from typing import Any

import torch
import torch.distributed as dist
from safetensors import safe_open

from drivetrain.engine.megatron.model import family, head_dim, padded_vocab_size
from drivetrain.engine.megatron.moe import (
    ExpertSlot,
    iter_moe_export,
    moe_export_items,
    moe_layer_weights,
)


@dataclass(frozen=True)
class _Shape:
    """What the converters need to know about the model and this rank's TP slot."""

    heads: int
    groups: int
    head_dim: int
    hidden: int
    ffn: int
    vocab: int
    padded_vocab: int
    tp: int
    tp_rank: int
    qkv_bias: bool
    qk_norm: bool
    moe: ExpertSlot | None  # None: dense MLPs

    @property
    def q_per_group(self) -> int:
        return self.heads // self.groups


def _shape(hf_config: Any, tcfg: Any) -> _Shape:
    from megatron.core import parallel_state

    flags = family(hf_config)
    tp = tcfg.tensor_model_parallel_size
    return _Shape(
        heads=tcfg.num_attention_heads,
        groups=tcfg.num_query_groups,
        head_dim=head_dim(hf_config),
        hidden=tcfg.hidden_size,
        ffn=tcfg.ffn_hidden_size,
        vocab=hf_config.vocab_size,
        padded_vocab=padded_vocab_size(hf_config.vocab_size, tp),
        tp=tp,
        tp_rank=parallel_state.get_tensor_model_parallel_rank(),
        qkv_bias=flags["qkv_bias"],
        qk_norm=flags["qk_norm"],
        moe=ExpertSlot(hf_config, tcfg) if flags["moe"] else None,
    )


def _unwrap(model: Any) -> Any:
    """The ``GPTModel`` inside megatron's DDP / ``Float16Module`` wrappers."""
    while hasattr(model, "module"):
        model = model.module
    return model


def _tied(hf_config: Any) -> bool:
    return bool(getattr(hf_config, "tie_word_embeddings", False))


# --------------------------------------------------------------------------- loading


class _Reader:
    """Slices of HF safetensors tensors by name, opening each file once."""

    def __init__(self, hf_dir: str) -> None:
        index = os.path.join(hf_dir, "model.safetensors.index.json")
        if os.path.exists(index):
            with open(index) as f:
                files = sorted(set(json.load(f)["weight_map"].values()))
        else:
            files = ["model.safetensors"]
        self._handles = [safe_open(os.path.join(hf_dir, name), "pt") for name in files]
        self._where = {key: h for h in self._handles for key in h.keys()}  # noqa: SIM118

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def full(self, name: str) -> torch.Tensor:
        if name not in self._where:
            raise KeyError(f"{name} is missing from the HF checkpoint")
        return self._where[name].get_tensor(name)

    def rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        return self._where[name].get_slice(name)[start:stop]

    def cols(self, name: str, start: int, stop: int) -> torch.Tensor:
        return self._where[name].get_slice(name)[:, start:stop]

    def slice(self, name: str) -> Any:
        """A lazily read tensor: index it to read only that part."""
        return self._where[name].get_slice(name)


def _tp_range(total: int, s: _Shape) -> tuple[int, int]:
    size = total // s.tp
    return s.tp_rank * size, (s.tp_rank + 1) * size


def _qkv_shard(read: _Reader, prefix: str, kind: str, s: _Shape) -> torch.Tensor:
    groups = s.groups // s.tp
    q_rows, kv_rows = s.q_per_group * s.head_dim, s.head_dim
    q0, k0 = s.tp_rank * groups * q_rows, s.tp_rank * groups * kv_rows
    q = read.rows(f"{prefix}.q_proj.{kind}", q0, q0 + groups * q_rows)
    k = read.rows(f"{prefix}.k_proj.{kind}", k0, k0 + groups * kv_rows)
    v = read.rows(f"{prefix}.v_proj.{kind}", k0, k0 + groups * kv_rows)
    tail = q.shape[1:]
    parts = (
        q.view(groups, q_rows, *tail),
        k.view(groups, kv_rows, *tail),
        v.view(groups, kv_rows, *tail),
    )
    return torch.cat(parts, dim=1).reshape(-1, *tail)


def _vocab_shard(read: _Reader, name: str, s: _Shape) -> torch.Tensor:
    start, stop = _tp_range(s.padded_vocab, s)
    shard = torch.zeros(stop - start, s.hidden, dtype=torch.float32)
    real_stop = min(stop, s.vocab)
    if real_stop > start:
        shard[: real_stop - start] = read.rows(name, start, real_stop).float()
    return shard


def _layer_weights(
    read: _Reader, prefix: str, s: _Shape, hf_config: Any
) -> dict[str, torch.Tensor]:
    """Megatron layer parameter name -> this rank's shard, for HF layer ``prefix``."""
    attn, mlp = f"{prefix}.self_attn", f"{prefix}.mlp"
    f0, f1 = _tp_range(s.ffn, s)
    o0, o1 = _tp_range(s.heads * s.head_dim, s)
    out = {
        "input_layernorm.weight": read.full(f"{prefix}.input_layernorm.weight"),
        "pre_mlp_layernorm.weight": read.full(f"{prefix}.post_attention_layernorm.weight"),
        "self_attention.linear_qkv.weight": _qkv_shard(read, attn, "weight", s),
        "self_attention.linear_proj.weight": read.cols(f"{attn}.o_proj.weight", o0, o1),
    }
    if s.moe is not None:
        out.update(moe_layer_weights(read, prefix, hf_config, s.moe, s.tp, s.tp_rank))
    else:
        out["mlp.linear_fc1.weight"] = torch.cat(
            [
                read.rows(f"{mlp}.gate_proj.weight", f0, f1),
                read.rows(f"{mlp}.up_proj.weight", f0, f1),
            ]
        )
        out["mlp.linear_fc2.weight"] = read.cols(f"{mlp}.down_proj.weight", f0, f1)
    if s.qkv_bias:
        out["self_attention.linear_qkv.bias"] = _qkv_shard(read, attn, "bias", s)
    if s.qk_norm:
        out["self_attention.q_layernorm.weight"] = read.full(f"{attn}.q_norm.weight")
        out["self_attention.k_layernorm.weight"] = read.full(f"{attn}.k_norm.weight")
    return out


def _chunk_weights(
    chunk: Any, read: _Reader, hf_config: Any, s: _Shape
) -> Iterator[tuple[str, torch.Tensor | None]]:
    """(megatron name, shard) for every parameter of ``chunk``; ``None``: keep as built."""
    if chunk.pre_process:
        yield "embedding.word_embeddings.weight", _vocab_shard(read, "model.embed_tokens.weight", s)
    for index, layer in enumerate(chunk.decoder.layers):
        hf_layer = f"model.layers.{layer.layer_number - 1}"
        for name, tensor in _layer_weights(read, hf_layer, s, hf_config).items():
            yield f"decoder.layers.{index}.{name}", tensor
    if chunk.post_process:
        yield "decoder.final_layernorm.weight", read.full("model.norm.weight")
        head = chunk.output_layer
        if hasattr(head, "score"):  # value head: HF's token-classification "score"
            for kind in ("weight", "bias"):  # absent when starting from a causal LM
                yield (
                    f"output_layer.score.{kind}",
                    (read.full(f"score.{kind}") if f"score.{kind}" in read else None),
                )
        elif head.weight is not None:  # not tied, or tied on a later pipeline stage
            source = "model.embed_tokens.weight" if _tied(hf_config) else "lm_head.weight"
            yield "output_layer.weight", _vocab_shard(read, source, s)


@torch.no_grad()
def load_hf_weights(models: list[Any], hf_dir: str, hf_config: Any, tcfg: Any) -> None:
    """Fill this rank's model chunks (bare or DDP-wrapped) from an HF safetensors directory.

    Every parameter must be covered (a missing one is an error, not random init), except a
    value head's ``score`` when the checkpoint is a causal LM."""
    s = _shape(hf_config, tcfg)
    read = _Reader(hf_dir)
    for chunk in map(_unwrap, models):
        params = dict(chunk.named_parameters())
        for name, tensor in _chunk_weights(chunk, read, hf_config, s):
            param = params.pop(name)
            if tensor is None:
                continue
            if tensor.shape != param.shape:
                raise ValueError(
                    f"{name}: HF gives {tuple(tensor.shape)}, megatron has {tuple(param.shape)}"
                )
            param.copy_(tensor)
        if params:
            raise ValueError(f"no HF weights for megatron parameters {sorted(params)}")


# --------------------------------------------------------------------------- export


def _gather_tp(tensor: torch.Tensor, dim: int, s: _Shape) -> torch.Tensor:
    if s.tp == 1:
        return tensor
    from megatron.core import parallel_state

    parts = [torch.empty_like(tensor) for _ in range(s.tp)]
    dist.all_gather(
        parts, tensor.contiguous(), group=parallel_state.get_tensor_model_parallel_group()
    )
    return torch.cat(parts, dim=dim)


def _split_qkv(full: torch.Tensor, s: _Shape) -> list[torch.Tensor]:
    tail = full.shape[1:]
    grouped = full.view(s.groups, (s.q_per_group + 2) * s.head_dim, *tail)
    sizes = [s.q_per_group * s.head_dim, s.head_dim, s.head_dim]
    return [part.reshape(-1, *tail) for part in grouped.split(sizes, dim=1)]


def _split_fc1(full: torch.Tensor, s: _Shape) -> list[torch.Tensor]:
    per_rank = full.view(s.tp, 2, s.ffn // s.tp, s.hidden)
    return [per_rank[:, 0].reshape(s.ffn, s.hidden), per_rank[:, 1].reshape(s.ffn, s.hidden)]


#: (megatron layer suffix, HF layer suffixes, TP dim or None, full megatron -> HF tensors)
_Rule = tuple[
    str, tuple[str, ...], int | None, Callable[[torch.Tensor, _Shape], list[torch.Tensor]]
]


def _keep(full: torch.Tensor, _: _Shape) -> list[torch.Tensor]:
    return [full]


def _layer_rules(s: _Shape) -> tuple[list[_Rule], list[_Rule]]:
    """Per-layer rules in HF ``state_dict`` order: those before the MLP block, those after
    (a dense MLP's rules are in the first list; a MoE block's tensors go in between)."""
    qkv = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
    rules: list[_Rule] = [
        ("self_attention.linear_qkv.weight", tuple(f"{n}.weight" for n in qkv), 0, _split_qkv)
    ]
    if s.qkv_bias:
        rules.append(
            ("self_attention.linear_qkv.bias", tuple(f"{n}.bias" for n in qkv), 0, _split_qkv)
        )
    rules.append(("self_attention.linear_proj.weight", ("self_attn.o_proj.weight",), 1, _keep))
    if s.qk_norm:
        rules += [
            ("self_attention.q_layernorm.weight", ("self_attn.q_norm.weight",), None, _keep),
            ("self_attention.k_layernorm.weight", ("self_attn.k_norm.weight",), None, _keep),
        ]
    if s.moe is None:
        rules += [
            (
                "mlp.linear_fc1.weight",
                ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
                0,
                _split_fc1,
            ),
            ("mlp.linear_fc2.weight", ("mlp.down_proj.weight",), 1, _keep),
        ]
    norms: list[_Rule] = [
        ("input_layernorm.weight", ("input_layernorm.weight",), None, _keep),
        ("pre_mlp_layernorm.weight", ("post_attention_layernorm.weight",), None, _keep),
    ]
    return rules, norms


def _hf_shapes(s: _Shape) -> dict[str, tuple[int, ...]]:
    """Full HF shape per layer suffix: what a non-owning pipeline stage allocates."""
    q, kv = s.heads * s.head_dim, s.groups * s.head_dim
    return {
        "self_attn.q_proj.weight": (q, s.hidden),
        "self_attn.k_proj.weight": (kv, s.hidden),
        "self_attn.v_proj.weight": (kv, s.hidden),
        "self_attn.q_proj.bias": (q,),
        "self_attn.k_proj.bias": (kv,),
        "self_attn.v_proj.bias": (kv,),
        "self_attn.o_proj.weight": (s.hidden, q),
        "self_attn.q_norm.weight": (s.head_dim,),
        "self_attn.k_norm.weight": (s.head_dim,),
        "mlp.gate_proj.weight": (s.ffn, s.hidden),
        "mlp.up_proj.weight": (s.ffn, s.hidden),
        "mlp.down_proj.weight": (s.hidden, s.ffn),
        "input_layernorm.weight": (s.hidden,),
        "post_attention_layernorm.weight": (s.hidden,),
    }


class _Stages:
    """Which (pipeline rank, chunk) holds each HF layer; identical on every rank."""

    def __init__(self, tcfg: Any) -> None:
        from megatron.core import parallel_state
        from megatron.core.transformer.transformer_block import get_num_layers_to_build
        from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

        pp = tcfg.pipeline_model_parallel_size
        vp = tcfg.virtual_pipeline_model_parallel_size
        self.pp, self.pp_rank = pp, parallel_state.get_pipeline_model_parallel_rank()
        self.owner: dict[int, tuple[int, int, int]] = {}  # layer -> (pp rank, chunk, local)
        for rank in range(pp):
            for chunk in range(vp or 1):
                vp_stage = chunk if vp else None
                offset = get_transformer_layer_offset(tcfg, vp_stage=vp_stage, pp_rank=rank)
                count = get_num_layers_to_build(tcfg, vp_stage=vp_stage, pp_rank=rank)
                for local in range(count):
                    self.owner[offset + local] = (rank, chunk, local)
        self.group = parallel_state.get_pipeline_model_parallel_group() if pp > 1 else None

    def share(
        self,
        owner: int,
        tensors: list[torch.Tensor] | None,
        shapes: list[tuple[int, ...]],
        dtype: torch.dtype,
        device: torch.device,
    ) -> list[torch.Tensor]:
        """The owning stage's full tensors, on every stage."""
        if self.pp == 1:
            assert tensors is not None
            return tensors
        if tensors is None:
            tensors = [torch.empty(shape, dtype=dtype, device=device) for shape in shapes]
        source = dist.get_global_rank(self.group, owner)
        for tensor in tensors:
            dist.broadcast(tensor, source, group=self.group)
        return tensors


def _params(chunk: Any) -> Mapping[str, torch.Tensor]:
    return {name: p.detach() for name, p in chunk.named_parameters()}


class _Prefixed:
    """The parameters under ``prefix`` (one layer), read from ``params`` only when asked for:
    a reader that gathers shards (Megatron-FSDP) materialises one tensor at a time."""

    def __init__(self, params: Mapping[str, torch.Tensor], prefix: str) -> None:
        self.params, self.prefix = params, prefix

    def __getitem__(self, suffix: str) -> torch.Tensor:
        return self.params[self.prefix + suffix]


@torch.no_grad()
def export_hf_weights(
    models: list[Any],
    hf_config: Any,
    tcfg: Any,
    *,
    read_params: Callable[[Any], Mapping[str, torch.Tensor]] = _params,
) -> Iterator[tuple[str, torch.Tensor]]:
    """HF-named full tensors (``model.state_dict()`` keys), on every rank, in the same order.

    Every rank must consume the whole stream: each item may involve TP and PP collectives.
    Tied embeddings yield no ``lm_head.weight``; a value head yields ``score.weight``/``.bias``
    instead of ``lm_head.weight``. ``read_params(chunk)``: the chunk's tensor-parallel
    parameters by name; each is looked up once, when needed, in the same order on every rank
    of a pipeline stage (a reader may gather data-parallel shards on lookup)."""
    models = [_unwrap(model) for model in models]
    s = _shape(hf_config, tcfg)
    stages = _Stages(tcfg)
    dtype = tcfg.params_dtype
    device = next(models[0].parameters()).device
    chunks = [read_params(chunk) for chunk in models]
    first, last = chunks[0], chunks[-1]

    def vocab(name: str, owner: int, local: dict[str, torch.Tensor]) -> torch.Tensor:
        mine = stages.pp_rank == owner
        full = [_gather_tp(local[name], 0, s)[: s.vocab]] if mine else None
        return stages.share(owner, full, [(s.vocab, s.hidden)], dtype, device)[0]

    yield "model.embed_tokens.weight", vocab("embedding.word_embeddings.weight", 0, first)
    shapes = _hf_shapes(s)
    before, after = _layer_rules(s)
    moe_items = [] if s.moe is None else moe_export_items(hf_config, s.moe, s.hidden, s.tp)
    for layer in range(tcfg.num_layers):
        rank, chunk, local = stages.owner[layer]
        mine = rank == stages.pp_rank
        prefix = f"decoder.layers.{local}."
        params = _Prefixed(chunks[chunk], prefix) if mine else None

        def rule_items(
            rules: list[_Rule], params: Any = params, rank: int = rank
        ) -> Iterator[tuple[str, torch.Tensor]]:
            for suffix, hf_names, dim, to_hf in rules:
                full = None
                if params is not None:
                    tensor = params[suffix]
                    full = to_hf(tensor if dim is None else _gather_tp(tensor, dim, s), s)
                shared = stages.share(rank, full, [shapes[n] for n in hf_names], dtype, device)
                yield from zip(hf_names, shared, strict=True)

        def share(full: Any, shapes: Any, rank: int = rank) -> list[torch.Tensor]:
            return stages.share(rank, full, shapes, dtype, device)

        stream = chain(
            rule_items(before), iter_moe_export(moe_items, params, share), rule_items(after)
        )
        for suffix, tensor in stream:
            yield f"model.layers.{layer}.{suffix}", tensor
    last_rank = stages.pp - 1
    mine = stages.pp_rank == last_rank
    norm = [last["decoder.final_layernorm.weight"]] if mine else None
    yield "model.norm.weight", stages.share(last_rank, norm, [(s.hidden,)], dtype, device)[0]
    yield from _export_head(models, last, stages, s, hf_config, dtype, device, vocab)


def _export_head(
    models: list[Any],
    last: Mapping[str, torch.Tensor],
    stages: _Stages,
    s: _Shape,
    hf_config: Any,
    dtype: torch.dtype,
    device: torch.device,
    vocab: Callable[..., torch.Tensor],
) -> Iterator[tuple[str, torch.Tensor]]:
    """``lm_head.weight`` (untied), or a value head's ``score``: from the last stage."""
    last_rank = stages.pp - 1
    mine = stages.pp_rank == last_rank
    if getattr(models[-1], "value_head", False):  # set by build_model on every chunk
        names = ("output_layer.score.weight", "output_layer.score.bias")
        score = [last[name] for name in names] if mine else None
        shared = stages.share(last_rank, score, [(1, s.hidden), (1,)], dtype, device)
        yield from zip(("score.weight", "score.bias"), shared, strict=True)
    elif not _tied(hf_config):
        yield "lm_head.weight", vocab("output_layer.weight", last_rank, last)
