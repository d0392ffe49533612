"""Small random Llama models created from a config next to a local tokenizer (no hub)."""

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
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    config = LlamaConfig(
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
