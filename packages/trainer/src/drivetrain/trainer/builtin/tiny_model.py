"""Small random Llama and mixture-of-experts models created from a config next to a local
tokenizer (no hub)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def build_llama_model(
    path: str | Path,
    *,
    tokenizer_dir: str | Path,
    seed: int = 0,
    tie_word_embeddings: bool = True,
    **shape: Any,
) -> Path:
    """Save a randomly initialised fp32 Llama model (and the tokenizer) to ``path``.

    Llama rather than Qwen2: transformers 5 replaces the tokenizer of a ``qwen2`` model
    directory with its own byte-level BPE class, which would silently re-tokenize a custom
    vocabulary. ``shape`` holds ``LlamaConfig`` sizes (hidden_size, num_hidden_layers, ...)."""
    from transformers import LlamaConfig

    return _build(LlamaConfig, path, tokenizer_dir, seed, tie_word_embeddings, shape)


#: the mixture-of-experts families drivetrain trains, by ``model_type``: config class and the
#: config key of the expert count
MOE_FAMILIES = {
    "qwen3_moe": ("Qwen3MoeConfig", "num_experts"),
    "qwen2_moe": ("Qwen2MoeConfig", "num_experts"),
    "mixtral": ("MixtralConfig", "num_local_experts"),
}


def build_moe_model(
    path: str | Path,
    *,
    tokenizer_dir: str | Path,
    family: str = "qwen3_moe",
    experts: int = 4,
    top_k: int = 2,
    seed: int = 0,
    **shape: Any,
) -> Path:
    """Save a randomly initialised fp32 mixture-of-experts model of ``family`` (a key of
    :data:`MOE_FAMILIES`) with ``experts`` experts, ``top_k`` per token, every layer sparse,
    no load-balancing loss asked for; ``shape`` holds the config's other sizes."""
    import transformers

    if family not in MOE_FAMILIES:
        raise ValueError(f"MoE family {family!r}: one of {', '.join(MOE_FAMILIES)}")
    config_name, count = MOE_FAMILIES[family]
    shape = {count: experts, "num_experts_per_tok": top_k, **shape}
    if family != "mixtral":
        shape.setdefault("norm_topk_prob", True)
        shape.setdefault("moe_intermediate_size", shape.get("intermediate_size", 64))
    if family == "qwen2_moe":
        shape.setdefault("shared_expert_intermediate_size", shape["moe_intermediate_size"])
    config_cls = getattr(transformers, config_name)
    return _build(config_cls, path, tokenizer_dir, seed, False, shape)


def _build(
    config_cls: Any,
    path: str | Path,
    tokenizer_dir: str | Path,
    seed: int,
    tie_word_embeddings: bool,
    shape: dict[str, Any],
) -> Path:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    config = config_cls(
        vocab_size=len(tokenizer),
        tie_word_embeddings=tie_word_embeddings,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        **shape,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(str(path))
    tokenizer.save_pretrained(str(path))
    return Path(path)


def build_tiny_chat_model(
    path: str | Path, *, hidden: int = 32, heads: int = 4, seed: int = 0
) -> Path:
    """A 2-layer model with the character tokenizer and chat template, for tests. vLLM's CPU
    attention needs ``hidden // heads`` >= 32."""
    from drivetrain.trainer.builtin.char_tokenizer import build_char_tokenizer

    build_char_tokenizer(path)
    return build_llama_model(
        path,
        tokenizer_dir=path,
        seed=seed,
        tie_word_embeddings=False,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=2,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 2),
        max_position_embeddings=256,
    )
