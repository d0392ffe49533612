"""A GGUF checkpoint as a plain Hugging Face model directory (what engines and rollouts load).

transformers reads GGUF files (with the ``gguf`` package) and dequantises them, but refuses to
``save_pretrained`` a model loaded that way; so the weights are copied into a model built from
the same config, and that one is saved with the tokenizer, in ``dtype``.
"""

from __future__ import annotations

from pathlib import Path

from drivetrain.api.errors import ConfigError
from drivetrain.runtime.atomic_dir import publish, staging_path


def import_gguf(gguf_file: Path, out_dir: Path, *, dtype: str = "bfloat16") -> Path:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not gguf_file.is_file():
        raise ConfigError(f"{gguf_file} is not a file")
    if not hasattr(torch, dtype):
        raise ConfigError(f"unknown dtype {dtype!r}")
    where, name = str(gguf_file.parent), gguf_file.name
    try:
        tokenizer = AutoTokenizer.from_pretrained(where, gguf_file=name)
        loaded = AutoModelForCausalLM.from_pretrained(where, gguf_file=name, dtype=torch.float32)
    except ImportError as exc:
        raise ConfigError(f"reading GGUF needs the gguf package ({exc})") from None
    plain = AutoModelForCausalLM.from_config(loaded.config, dtype=torch.float32)
    missing, unexpected = plain.load_state_dict(loaded.state_dict(), strict=False)
    # a tied output layer has no tensor of its own in the file
    missing = [
        k for k in missing if not (k == "lm_head.weight" and plain.config.tie_word_embeddings)
    ]
    if missing or unexpected:
        raise ConfigError(
            f"GGUF tensors do not fit the model: missing {missing}, extra {unexpected}"
        )
    plain = plain.to(getattr(torch, dtype))
    plain.config.dtype = getattr(torch, dtype)
    # the weights are plain now; a config that still names GGUF quantisation (transformers
    # keeps it from the load) makes vLLM refuse the model
    if hasattr(plain.config, "quantization_config"):
        del plain.config.quantization_config
    staging = staging_path(out_dir)
    plain.save_pretrained(str(staging))
    tokenizer.save_pretrained(str(staging))
    publish(staging, out_dir)
    return out_dir
