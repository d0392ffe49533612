"""How long a step takes, on paper: a roofline from the model's shape and the device's sheet.

Training and frozen forwards are compute-bound: their model FLOPs (``6 N`` a token to train,
``2 N`` to score, ``N`` the matmul weights, the LM head included; plus causal attention,
``6 A n (n + 1)`` a layer for a document of ``n`` tokens to train, a third of it to score;
``+ 2 N`` a token with activation checkpointing, which runs the forward twice) at the
device's dense bf16 peak. Decoding is bandwidth-bound: each new token of a batch reads every
weight and the batch's KV cache once, at the device's HBM bandwidth; the prompts' prefill is
compute-bound. The roofline is what no implementation beats; ``at_mfu`` is the same work at a
measured fraction of the peak (the fsdp2 engine's 0.377 on an H200, ``benchmarks/README.md``),
for training only: no decode speed of ours was measured on a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from drivetrain.trainer.plan_target import Accelerator

#: fsdp2 dense bf16 on an H200 (benchmarks/README.md, 2026-11-27): the one measured MFU
MEASURED_TRAIN_MFU = 0.377


@dataclass(frozen=True)
class ModelShape:
    """What the roofline needs of a decoder: from a Hugging Face ``config.json``."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    experts_per_token: int = 1  # mixture of experts: the experts a token's MLP runs

    @staticmethod
    def of(config: Any) -> ModelShape:
        """From a transformers ``PretrainedConfig`` (or anything with its attribute names)."""
        heads = config.num_attention_heads
        return ModelShape(
            hidden=config.hidden_size,
            layers=config.num_hidden_layers,
            heads=heads,
            kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
            intermediate=getattr(config, "moe_intermediate_size", None) or config.intermediate_size,
            vocab=config.vocab_size,
            experts_per_token=getattr(config, "num_experts_per_tok", None) or 1,
        )

    @property
    def matmul_params(self) -> int:
        """The weights a token multiplies by: attention, the gated MLP (its active experts),
        the LM head."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        attention = self.hidden * (q + 2 * kv) + q * self.hidden
        mlp = 3 * self.hidden * self.intermediate * self.experts_per_token
        return self.layers * (attention + mlp) + self.vocab * self.hidden

    def kv_bytes_per_token(self, dtype_bytes: int = 2) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * dtype_bytes

    def forward_flops(self, length: int) -> float:
        """One sequence of ``length`` tokens forward: ``2 N`` a token and causal attention."""
        attention = 2 * self.heads * self.head_dim * length * (length + 1) * self.layers
        return 2 * self.matmul_params * length + attention


@dataclass(frozen=True)
class StepWork:
    """One RL step: ``sequences`` of ``prompt`` + ``new`` tokens; the roles that train
    (``trained``: how many: actor, critic) and score (``scored``: old log-probs, reference,
    teacher, reward model) them; each trained role runs ``epochs`` passes."""

    sequences: int
    prompt: int
    new: int
    trained: int = 1
    scored: int = 1
    epochs: int = 1
    checkpointing: bool = False


@dataclass(frozen=True)
class StepTime:
    """Seconds a step takes at the roofline, by phase; ``expected_s`` with training and scoring
    at the measured MFU (the generation stays at its roofline)."""

    generate_s: float
    score_s: float
    train_s: float
    tokens: int

    @property
    def train_at_mfu_s(self) -> float:
        return self.train_s / MEASURED_TRAIN_MFU

    @property
    def roofline_s(self) -> float:
        return self.generate_s + self.score_s + self.train_s

    @property
    def expected_s(self) -> float:
        return self.generate_s + (self.score_s + self.train_s) / MEASURED_TRAIN_MFU

    def row(self, gpus: int) -> dict[str, float]:
        return {
            "roofline_s": _sig(self.roofline_s),
            "generate_s": _sig(self.generate_s),
            "score_s": _sig(self.score_s),
            "train_s": _sig(self.train_s),
            "at_measured_mfu_s": _sig(self.expected_s),
            "tokens_per_s_per_gpu": round(self.tokens / self.expected_s / gpus, 1),
        }


def _sig(seconds: float) -> float:
    """Four significant digits (a tiny model's step is microseconds on paper)."""
    return float(f"{seconds:.4g}")


def step_time(
    shape: ModelShape,
    work: StepWork,
    device: Accelerator,
    *,
    train_gpus: int,
    rollout_gpus: int,
    rollout_tp: int = 1,
) -> StepTime:
    """The roofline of ``work`` with training (and scoring) on ``train_gpus`` devices and
    generation on ``rollout_gpus`` (replicas of ``rollout_tp`` devices each)."""
    peak = device.bf16_tflops * 1e12
    length = work.prompt + work.new
    forward = shape.forward_flops(length) * work.sequences
    train_factor = 3 + (1 if work.checkpointing else 0)  # forward + 2x backward (+ recompute)
    train = forward * train_factor * work.trained * work.epochs / (peak * train_gpus)
    score = forward * work.scored / (peak * train_gpus)
    generate = _generate_s(shape, work, device, rollout_gpus, rollout_tp)
    return StepTime(
        generate_s=generate,
        score_s=score,
        train_s=train,
        tokens=work.sequences * length,
    )


def _generate_s(
    shape: ModelShape, work: StepWork, device: Accelerator, gpus: int, tp: int
) -> float:
    """Prefill at peak compute, then ``work.new`` decode steps of every replica's share of the
    sequences, each reading the weights and the KV cache (half full on average) at HBM speed.
    Nothing to generate (SFT): none."""
    if not work.new or not gpus:
        return 0.0
    replicas = max(1, gpus // tp)
    per_replica = -(-work.sequences // replicas)
    peak = device.bf16_tflops * 1e12 * tp
    bandwidth = device.hbm_tb_per_s * 1e12 * tp
    prefill = shape.forward_flops(work.prompt) * per_replica / peak
    weights = shape.matmul_params * 2  # bf16
    kv = per_replica * (work.prompt + work.new / 2) * shape.kv_bytes_per_token()
    memory_bound = (weights + kv) / bandwidth
    compute_bound = 2 * shape.matmul_params * per_replica / peak
    return prefill + work.new * max(memory_bound, compute_bound)
