"""Megatron-Core ``GPTModel`` built from a Hugging Face config (Llama / Qwen2 / Qwen3 dense,
Qwen2-MoE / Qwen3-MoE / Mixtral mixture-of-experts).

The mapping is explicit per family: a config field we do not translate is refused rather than
silently dropped, so a model that would not match its HF logits never trains.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from drivetrain.engine.megatron.context import context_parallel_kwargs
from drivetrain.engine.megatron.moe import moe_kwargs

#: HF ``model_type`` -> what differs from the Llama baseline (``moe``: sparse MLP blocks;
#: ``shared_expert``: Qwen2-MoE's sigmoid-gated shared expert beside the routed ones).
FAMILIES: dict[str, dict[str, bool]] = {
    "llama": {"qkv_bias": False, "qk_norm": False, "moe": False, "shared_expert": False},
    "qwen2": {"qkv_bias": True, "qk_norm": False, "moe": False, "shared_expert": False},
    "qwen3": {"qkv_bias": False, "qk_norm": True, "moe": False, "shared_expert": False},
    "qwen2_moe": {"qkv_bias": True, "qk_norm": False, "moe": True, "shared_expert": True},
    "qwen3_moe": {"qkv_bias": False, "qk_norm": True, "moe": True, "shared_expert": False},
    "mixtral": {"qkv_bias": False, "qk_norm": False, "moe": True, "shared_expert": False},
}
#: rope types that only change ``inv_freq`` (no attention scaling, no length-dependence)
_ROPE_TYPES = ("default", "linear", "llama3")
_VOCAB_MULTIPLE = 128


def family(hf_config: Any) -> dict[str, bool]:
    model_type = getattr(hf_config, "model_type", None)
    if model_type not in FAMILIES:
        raise ValueError(
            f"model_type={model_type!r} has no Megatron converter; supported: "
            f"{', '.join(sorted(FAMILIES))}"
        )
    return FAMILIES[model_type]


def padded_vocab_size(vocab_size: int, tensor_parallel: int) -> int:
    """Vocab rows rounded up to a multiple of 128*TP: equal vocab shards with aligned sizes.

    The padding rows are ours: zero on load, dropped on export."""
    multiple = _VOCAB_MULTIPLE * tensor_parallel
    return -(-vocab_size // multiple) * multiple


def head_dim(hf_config: Any) -> int:
    return getattr(hf_config, "head_dim", None) or (
        hf_config.hidden_size // hf_config.num_attention_heads
    )


def _rope_parameters(hf_config: Any) -> dict[str, Any]:
    rope = dict(getattr(hf_config, "rope_parameters", None) or {})
    legacy = getattr(hf_config, "rope_scaling", None) or {}  # transformers < 5
    rope = {**legacy, **rope}
    rope.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    rope["rope_type"] = rope.get("rope_type", rope.get("type", "default"))
    if rope["rope_type"] not in _ROPE_TYPES:
        raise ValueError(
            f"rope_type={rope['rope_type']!r} is not supported by the Megatron engine; "
            f"supported: {', '.join(_ROPE_TYPES)}"
        )
    return rope


def _check_supported(hf_config: Any, flags: dict[str, bool]) -> None:
    if getattr(hf_config, "hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act={hf_config.hidden_act!r}: only SwiGLU (silu) is supported")
    if getattr(hf_config, "mlp_bias", False) or (
        not flags["qkv_bias"] and getattr(hf_config, "attention_bias", False)
    ):
        raise ValueError("attention_bias / mlp_bias are not supported by the Megatron converter")
    if getattr(hf_config, "use_sliding_window", False):
        raise ValueError("sliding-window attention is not supported by the Megatron engine")


def transformer_config(
    hf_config: Any,
    *,
    dtype: torch.dtype,
    tensor_parallel: int,
    pipeline_parallel: int,
    virtual_pipeline: int | None,
    context_parallel: int,
    sequence_parallel: bool,
    recompute: bool,
    device: str,
    expert_parallel: int = 1,
    expert_tensor_parallel: int | None = None,
) -> Any:
    """The ``TransformerConfig`` equivalent of ``hf_config`` under the given parallel layout.

    On CPU every fusion flag is off (the fused kernels are CUDA-only or compile slowly) and
    weights are initialised on the host (``use_cpu_initialization``)."""
    from megatron.core.transformer import TransformerConfig

    flags = family(hf_config)
    _check_supported(hf_config, flags)
    _rope_parameters(hf_config)  # refuse unsupported rope early
    on_cpu = device.split(":")[0] == "cpu"
    kwargs: dict[str, Any] = {}
    if context_parallel > 1:
        kwargs.update(context_parallel_kwargs(on_cpu))
    if flags["moe"]:
        kwargs.update(
            moe_kwargs(
                hf_config,
                flags,
                tensor_parallel=tensor_parallel,
                sequence_parallel=sequence_parallel,
            )
        )
    elif expert_parallel > 1:
        raise ValueError(
            f"expert_parallel={expert_parallel} needs a mixture-of-experts model, "
            f"{hf_config.model_type!r} is dense"
        )
    if recompute:  # whole layers, one at a time: the lowest-memory setting
        kwargs.update(
            recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1
        )
    return TransformerConfig(
        num_layers=hf_config.num_hidden_layers,
        hidden_size=hf_config.hidden_size,
        num_attention_heads=hf_config.num_attention_heads,
        num_query_groups=getattr(hf_config, "num_key_value_heads", None)
        or hf_config.num_attention_heads,
        kv_channels=head_dim(hf_config),
        ffn_hidden_size=hf_config.intermediate_size,
        normalization="RMSNorm",
        layernorm_epsilon=hf_config.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=flags["qkv_bias"],
        qk_layernorm=flags["qk_norm"],
        hidden_dropout=0.0,
        attention_dropout=float(getattr(hf_config, "attention_dropout", 0.0) or 0.0),
        attention_softmax_in_fp32=True,
        apply_query_key_layer_scaling=False,
        init_method_std=getattr(hf_config, "initializer_range", 0.02),
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        tensor_model_parallel_size=tensor_parallel,
        pipeline_model_parallel_size=pipeline_parallel,
        virtual_pipeline_model_parallel_size=virtual_pipeline,
        context_parallel_size=context_parallel,
        expert_model_parallel_size=expert_parallel,
        expert_tensor_parallel_size=expert_tensor_parallel,
        sequence_parallel=sequence_parallel and tensor_parallel > 1,
        use_cpu_initialization=on_cpu,
        gradient_accumulation_fusion=False,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        cross_entropy_loss_fusion=False,
        **kwargs,
    )


class RMSNorm(nn.RMSNorm):
    """``torch.nn.RMSNorm`` behind megatron's norm constructor, usable with sequence parallel.

    megatron's torch fallback (``WrappedTorchNorm``, used without TransformerEngine/Apex)
    refuses sequence parallel. Under SP each TP rank normalises its own slice of the sequence,
    so the weight is marked ``sequence_parallel`` and ``finalize_model_grads`` sums its
    gradient over the TP group (q/k norms are summed by name there already)."""

    def __init__(self, config: Any, hidden_size: int, eps: float = 1e-5, **_: Any) -> None:
        super().__init__(hidden_size, eps=eps, dtype=config.params_dtype)
        self.weight.sequence_parallel = config.sequence_parallel  # type: ignore[attr-defined]


def _layer_spec(qk_norm: bool, num_experts: int | None = None) -> Any:
    """megatron's local (non-TransformerEngine) layer; MoE layers get ``SequentialMLP`` experts
    (one plain MLP per local expert, no grouped GEMM: that kernel is CUDA-only)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec = get_gpt_layer_local_spec(
        num_experts=num_experts,
        moe_grouped_gemm=False,
        qk_layernorm=qk_norm,
        normalization="RMSNorm",
    )
    spec.submodules.input_layernorm = RMSNorm
    spec.submodules.pre_mlp_layernorm = RMSNorm
    if qk_norm:
        spec.submodules.self_attention.submodules.q_layernorm = RMSNorm
        spec.submodules.self_attention.submodules.k_layernorm = RMSNorm
    return spec


class ValueHead(nn.Module):
    """A critic's scalar head in place of ``GPTModel.output_layer``: ``nn.Linear(hidden, 1)``,
    replicated on every TP rank (one output cannot be split over the vocab-parallel dim).

    Exported as HF ``score`` (``AutoModelForTokenClassification`` with ``num_labels=1``)."""

    def __init__(self, hidden_size: int, dtype: torch.dtype, sequence_parallel: bool) -> None:
        super().__init__()
        self.score = nn.Linear(hidden_size, 1, bias=True, dtype=dtype)
        self.sequence_parallel = sequence_parallel

    def forward(
        self, hidden: torch.Tensor, weight: torch.Tensor | None = None, **_: Any
    ) -> tuple[torch.Tensor, None]:
        if self.sequence_parallel:
            from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

            # every TP rank computes the full-sequence value and the same loss: the backward
            # only needs this rank's slice, not a reduce-scatter (which would count it TP times)
            hidden = gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=False)
        return self.score(hidden), None


def _override_inv_freq(model: Any, hf_config: Any) -> None:
    """Use HF's own rope init for the inverse frequencies (exact for scaled rope types)."""
    rope = _rope_parameters(hf_config)
    if rope["rope_type"] == "default" or not hasattr(model, "rotary_pos_emb"):
        return
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    inv_freq, attention_scaling = ROPE_INIT_FUNCTIONS[rope["rope_type"]](hf_config, "cpu")
    if attention_scaling != 1.0:
        raise ValueError(f"rope_type={rope['rope_type']!r} with attention scaling is unsupported")
    current = model.rotary_pos_emb.inv_freq
    model.rotary_pos_emb.inv_freq = inv_freq.to(device=current.device, dtype=current.dtype)


def build_model(
    hf_config: Any, tcfg: Any, *, value_head: bool = False, packed_kernel: str = "grouped_sdpa"
) -> list[Any]:
    """This rank's model chunks: one ``GPTModel`` per virtual pipeline stage (one without VP).

    Each chunk holds the layers megatron assigns to (pipeline rank, virtual stage); only the
    first chunk of the first stage embeds and only the last of the last stage has the head.
    Attention runs per document (:class:`~drivetrain.engine.megatron.attention.
    DocumentAttention` over ``packed_kernel``), or TransformerEngine's under context parallel."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.transformer_block import (
        TransformerBlockSubmodules,
        get_num_layers_to_build,
    )

    flags = family(hf_config)
    rope = _rope_parameters(hf_config)
    layer = _layer_spec(flags["qk_norm"], tcfg.num_moe_experts)
    if tcfg.context_parallel_size > 1:
        # megatron's local DotProductAttention refuses CP; TransformerEngine's runs the ring
        # attention over the CP group on packed (thd) rows. It has no parameters, so the
        # converters' names stay those of the local spec (transformer_config checked TE is here)
        from megatron.core.extensions.transformer_engine import TEDotProductAttention

        layer.submodules.self_attention.submodules.core_attention = TEDotProductAttention
    else:  # megatron's local attention would build a [T, T] score matrix per packed row
        from megatron.core.transformer.spec_utils import ModuleSpec

        from drivetrain.engine.megatron.attention import DocumentAttention

        layer.submodules.self_attention.submodules.core_attention = ModuleSpec(
            module=DocumentAttention, params={"kernel": packed_kernel}
        )
    tied = bool(getattr(hf_config, "tie_word_embeddings", False)) and not value_head
    vocab = padded_vocab_size(hf_config.vocab_size, tcfg.tensor_model_parallel_size)
    vp = tcfg.virtual_pipeline_model_parallel_size
    chunks = []
    for stage in range(vp or 1):
        vp_stage = stage if vp else None
        post = parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage)
        model = GPTModel(
            config=tcfg,
            transformer_layer_spec=TransformerBlockSubmodules(
                layer_specs=[layer] * get_num_layers_to_build(tcfg, vp_stage=vp_stage),
                layer_norm=RMSNorm,
            ),
            vocab_size=vocab,
            max_sequence_length=hf_config.max_position_embeddings,
            pre_process=parallel_state.is_pipeline_first_stage(
                ignore_virtual=False, vp_stage=vp_stage
            ),
            post_process=post,
            parallel_output=True,
            share_embeddings_and_output_weights=tied,
            position_embedding_type="rope",
            rotary_base=rope["rope_theta"],
            vp_stage=vp_stage,
        )
        _override_inv_freq(model, hf_config)
        model.value_head = value_head  # known on every stage: the exporter's names depend on it
        if post and value_head:
            model.output_layer = ValueHead(
                tcfg.hidden_size, tcfg.params_dtype, tcfg.sequence_parallel
            )
        chunks.append(model)
    return chunks
