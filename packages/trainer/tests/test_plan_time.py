"""The step time on paper: its FLOP count agrees with the benchmarks' (every nn.Linear weight
of the real model), decoding costs a read of the weights a token, training at the measured MFU
gives back the measured step."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config

from drivetrain.trainer.plan_target import accelerator
from drivetrain.trainer.plan_time import MEASURED_TRAIN_MFU, ModelShape, StepWork, step_time

BENCHMARKS = Path(__file__).resolve().parents[3] / "benchmarks"
LLAMA_1B = LlamaConfig(
    hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=16,
    num_key_value_heads=8, vocab_size=32000, tie_word_embeddings=True,
)  # fmt: skip


@pytest.mark.parametrize("config", [LLAMA_1B, Qwen3Config(num_hidden_layers=2, head_dim=96)])
def test_the_matmul_weights_are_the_models_linear_weights(config):
    sys.path.insert(0, str(BENCHMARKS))
    from flops import matmul_params

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    assert ModelShape.of(config).matmul_params == matmul_params(model)


def test_training_the_h200_batch_at_the_measured_mfu_takes_the_measured_step():
    """16 x 4096 tokens of the 1.07B Llama, trained only: 1.273 s a step measured (fsdp2
    dense on an H200, benchmarks/README.md), which is where its MFU of 0.377 came from."""
    work = StepWork(sequences=16, prompt=4096, new=0, scored=0)
    time = step_time(
        ModelShape.of(LLAMA_1B), work, accelerator("h200-141gb"), train_gpus=1, rollout_gpus=0
    )
    assert time.generate_s == 0 and time.score_s == 0
    assert time.train_at_mfu_s == pytest.approx(1.273, rel=0.01)
    assert time.train_s == pytest.approx(1.273 * MEASURED_TRAIN_MFU, rel=0.01)


def test_decoding_one_sequence_reads_every_weight_a_token():
    """An 8B model alone on an H100: each new token reads 16 GB of bf16 weights at 3.35 TB/s."""
    qwen3_8b = Qwen3Config(
        hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, vocab_size=151936,
    )  # fmt: skip
    shape = ModelShape.of(qwen3_8b)
    work = StepWork(sequences=1, prompt=1, new=1000, trained=0, scored=0)
    time = step_time(shape, work, accelerator("h100-80gb"), train_gpus=1, rollout_gpus=1)
    per_token = time.generate_s / 1000
    assert per_token == pytest.approx(shape.matmul_params * 2 / 3.35e12, rel=0.01)
    assert 4e-3 < per_token < 6e-3
    # a replica of two GPUs (tensor parallel) reads its half of the weights on each
    halved = step_time(shape, work, accelerator("h100-80gb"), train_gpus=1, rollout_gpus=2,
                       rollout_tp=2)  # fmt: skip
    assert halved.generate_s == pytest.approx(time.generate_s / 2, rel=0.01)
