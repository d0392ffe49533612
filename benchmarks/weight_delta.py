"""Delta updates (``weight_sync.delta``): the bytes a sync moves as a fraction of the full model's,
through the sender's ledger (``drivetrain.runtime.weight_ledger``) exactly as the trainer runs
it, for three runs of ``weight_sync.py``'s model (``--delta-size``):

- ``unchanged``: a second sync of weights that did not change (~0);
- ``half_frozen``: a full fine-tune with the embeddings and the lower half of the layers
  frozen: the trained half, the final norm and the output layer move (<= 0.55);
- ``lora``: the fsdp2 engine with a rank-8 LoRA adapter on the attention projections, one
  optimizer step between syncs (the third sync measured): the bytes moved over the adapter's
  own bytes when the rollouts take adapters (``export_weights(adapter_only=True)``, <= 2.0),
  and, for rollouts that cannot (``lora_merged``: the merged weights), the same ratio.

Each fraction is also timed: seconds of the sender's ledger and stream (fingerprints included)
beside the full stream's, so the cost of fingerprinting is on the same line.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterable
from pathlib import Path

import torch

from drivetrain.runtime.weight_ledger import WeightLedger


def moved(ledger: WeightLedger, weights: Iterable, version: int) -> tuple[int, float]:
    """Bytes the ledger lets through for one sync (the transport would move these), and the
    seconds the fingerprinted stream took."""
    start = time.perf_counter()
    base = version - 1 if version > 1 else None
    total = sum(
        t.numel() * t.element_size() for _, t in ledger.stream(weights, version=version, base=base)
    )
    return total, time.perf_counter() - start


def train_upper_half(model: torch.nn.Module) -> None:
    """A training step of a model whose embeddings and lower half of layers are frozen."""
    lower = tuple(f"model.layers.{i}." for i in range(model.config.num_hidden_layers // 2))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if not name.startswith(("model.embed_tokens", *lower)):
                param.add_(1e-3)


def model_rows(model: torch.nn.Module) -> dict[str, float]:
    state = lambda: model.state_dict().items()  # noqa: E731
    total = sum(t.numel() * t.element_size() for _, t in state())
    ledger = WeightLedger()
    full, full_s = moved(ledger, state(), 1)
    unchanged, unchanged_s = moved(ledger, state(), 2)
    train_upper_half(model)
    half, half_s = moved(ledger, state(), 3)
    assert full == total
    print(f"full sync {total / 1e6:.1f} MB in {full_s:.3f} s (fingerprints included); "
          f"unchanged {unchanged} B in {unchanged_s:.3f} s; half frozen {half / 1e6:.1f} MB "
          f"in {half_s:.3f} s")  # fmt: skip
    return {
        "delta_bytes_fraction.unchanged": round(unchanged / total, 4),
        "delta_bytes_fraction.half_frozen": round(half / total, 4),
        "ledger_seconds.full": round(full_s, 3),
    }


def lora_rows(model_dir: Path) -> dict[str, float]:
    from drivetrain.api import Batch, LoraConfig, ModelConfig, OptimConfig
    from drivetrain.engine.fsdp.config import FSDPConfig
    from drivetrain.engine.fsdp.engine import FSDP2Engine
    from drivetrain.testing import token_mean_nll

    lora = LoraConfig(rank=8, alpha=16, target_modules=("q_proj", "k_proj", "v_proj", "o_proj"))
    config = FSDPConfig(
        model=ModelConfig(path=str(model_dir), lora=lora),
        optim=OptimConfig(lr=1e-3, weight_decay=0.0),
        device="cpu",
    )
    engine = FSDP2Engine(config)
    engine.initialize()
    rng = random.Random(0)
    ids = torch.tensor([[rng.randrange(3, 32000) for _ in range(64)] for _ in range(2)])
    batch = Batch.from_columns(
        {"input_ids": ids, "loss_mask": torch.ones(2, 64)}, seq_lens=[64, 64]
    )
    adapter_bytes = sum(
        t.numel() * t.element_size() for _, t in engine.export_weights(adapter_only=True)
    )
    rows = {}
    for label, adapter_only in (("lora", True), ("lora_merged", False)):
        ledger = WeightLedger()
        for version in (1, 2, 3):  # measured: the sync after the second step (after the
            if version > 1:  # first only lora_B has moved: lora_A's gradient is B = 0)
                with engine.train_mode():
                    engine.optimizer_zero_grad()
                    engine.forward_backward(batch, token_mean_nll)
                    engine.optimizer_step()
            sent, _ = moved(ledger, engine.export_weights(adapter_only=adapter_only), version)
        rows[f"delta_vs_adapter_bytes.{label}"] = round(sent / adapter_bytes, 3)
    print(f"LoRA adapter {adapter_bytes / 1e6:.2f} MB: {rows}")
    engine.close()
    return rows
