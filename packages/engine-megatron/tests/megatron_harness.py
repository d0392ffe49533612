"""Tiny local models and the conformance harness for the megatron engine (no hub access)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from drivetrain.api import MicroBatchConfig, ModelConfig, OffloadConfig, OptimConfig
from drivetrain.engine.megatron.config import MegatronConfig
from drivetrain.engine.megatron.engine import MegatronEngine
from drivetrain.engine.megatron.plugin import MEGATRON
from drivetrain.testing.model_dirs import hf_variant
from drivetrain.testing.torch_engines.kit_harness import TorchHarness

VOCAB = 64


def build_tiny_model(
    path: str, *, family: str = "qwen2", seed: int = 0, tie: bool = True, layers: int = 4
) -> str:
    """A small random model saved as a Hugging Face directory (fp32); head_dim 16."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    config_class = Qwen2Config if family == "qwen2" else LlamaConfig
    config = config_class(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=tie,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(path)
    return path


def default_optim(lr: float = 1e-2, eps: float = 1e-8) -> OptimConfig:
    return OptimConfig(lr=lr, eps=eps, weight_decay=0.0, clip_grad=None)


@dataclass
class MegatronHarness(TorchHarness):
    """The conformance kit's harness. Use it with a Llama model: Qwen2's k_proj bias cancels in
    the softmax, so its gradient is pure rounding noise that Adam's normalisation turns into
    visible, order-dependent updates in any engine (the kit compares weights after a step)."""

    model_dir: str
    overrides: dict[str, Any] = field(default_factory=dict)
    vocab_size: int = VOCAB
    atol: float = 1e-5
    rtol: float = 1e-5
    packed: bool = True
    capabilities: frozenset[str] = MEGATRON.capabilities
    model_dtypes: tuple[str, ...] = ("float32", "bfloat16")

    def config(
        self,
        micro_batch: MicroBatchConfig,
        *,
        optim: OptimConfig | None = None,
        offload: OffloadConfig | None = None,
        dropout: float = 0.0,
        dtype: str = "float32",
    ) -> MegatronConfig:
        """The kit's ``optim``/``offload``/``dropout`` (attention dropout in the model's
        config.json)/``dtype`` replace the defaults below; ``overrides`` apply last."""
        path = hf_variant(self.model_dir, attention_dropout=dropout) if dropout else self.model_dir
        return MegatronConfig(
            model=ModelConfig(path=path, dtype=dtype),
            # Adam's first step moves every weight by lr * g / (|g| + eps), so a weight whose
            # gradient is ~0 moves by up to lr/eps times the gradient's fp32 rounding noise.
            # That noise depends on the reduction order (micro-batches, tensor-parallel
            # all-reduces): measured here, 1 vs 4 micro-batches differ by <= 5e-8 in the
            # gradients (max 0.24), which eps 1e-8 would amplify to 5e-2 in a weight. eps 1e-4
            # bounds it below the kit's 1e-5; losses and gradient norms are unaffected.
            optim=optim or default_optim(eps=1e-4),
            offload=offload or OffloadConfig(),
            micro_batch=micro_batch,
            **{"device": "cpu", **self.overrides},
        )

    def make_engine(self, micro_batch: MicroBatchConfig, **kit: Any) -> MegatronEngine:
        """``kit``: the optim/offload/dropout/dtype keywords of :meth:`config`."""
        engine = MegatronEngine(self.config(micro_batch, **kit))
        engine.initialize()
        return engine

    def reference_weights(self) -> Mapping[str, Any]:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=torch.float32)
        return {name: p.detach() for name, p in model.named_parameters()}
