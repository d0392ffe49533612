"""Tiny local models and the conformance harness for the FSDP engines (no hub access)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from drivetrain.api import (
    LoraConfig,
    MicroBatchConfig,
    ModelConfig,
    OffloadConfig,
    OptimConfig,
)
from drivetrain.engine.fsdp.config import FSDPConfig
from drivetrain.engine.fsdp.engine import FSDP1Engine, FSDP2Engine
from drivetrain.engine.fsdp.plugin import FSDP2
from drivetrain.testing.model_dirs import hf_variant
from drivetrain.testing.torch_engines.kit_harness import TorchHarness

ENGINES = {"fsdp2": FSDP2Engine, "fsdp": FSDP1Engine}
VOCAB = 64


def build_tiny_model(
    path: str, *, family: str = "qwen2", seed: int = 0, tie: bool = True, hidden: int = 32
) -> str:
    """A 2-layer random model saved as a Hugging Face directory (fp32): ``qwen2``, ``llama``,
    or a mixture of experts (``qwen3_moe``, ``mixtral``: 4 experts, top-2)."""
    from transformers import (
        AutoModelForCausalLM,
        LlamaConfig,
        MixtralConfig,
        Qwen2Config,
        Qwen3MoeConfig,
    )

    config_class = {"qwen2": Qwen2Config, "qwen3_moe": Qwen3MoeConfig, "mixtral": MixtralConfig}
    moe = {"num_experts_per_tok": 2}
    if family == "qwen3_moe":
        moe.update(num_experts=4, moe_intermediate_size=hidden, norm_topk_prob=True)
    if family == "mixtral":
        moe.update(num_local_experts=4)
    config = config_class.get(family, LlamaConfig)(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=tie,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        **(moe if family in ("qwen3_moe", "mixtral") else {}),
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(path)
    return path


@dataclass
class FSDPHarness(TorchHarness):
    model_dir: str
    engine: str = "fsdp2"
    overrides: dict[str, Any] = field(default_factory=dict)
    vocab_size: int = VOCAB
    atol: float = 1e-5
    rtol: float = 1e-5
    packed: bool = True
    device: str = "cpu"
    capabilities: frozenset[str] = FSDP2.capabilities  # fsdp declares the same
    model_dtypes: tuple[str, ...] = ("float32", "bfloat16")

    def config(
        self,
        micro_batch: MicroBatchConfig,
        *,
        optim: OptimConfig | None = None,
        offload: OffloadConfig | None = None,
        dropout: float = 0.0,
        dtype: str | None = None,
    ) -> FSDPConfig:
        rest = dict(self.overrides)
        model = dict(rest.pop("model", {}))
        if dtype:
            model["dtype"] = dtype
        if "lora" in model:
            model["lora"] = LoraConfig(**model["lora"])
        path = hf_variant(self.model_dir, attention_dropout=dropout) if dropout else self.model_dir
        optim_keys = {"lr": 1e-2, "weight_decay": 0.0, "clip_grad": None, **rest.pop("optim", {})}
        offload_keys = rest.pop("offload", {})
        return FSDPConfig(
            model=ModelConfig(path=path, **model),
            optim=optim or OptimConfig(**optim_keys),
            offload=offload or OffloadConfig(**offload_keys),
            micro_batch=micro_batch,
            device=self.device,
            **rest,
        )

    def make_engine(
        self,
        micro_batch: MicroBatchConfig,
        *,
        optim: OptimConfig | None = None,
        offload: OffloadConfig | None = None,
        dropout: float = 0.0,
        dtype: str | None = None,
    ) -> Any:
        config = self.config(
            micro_batch, optim=optim, offload=offload, dropout=dropout, dtype=dtype
        )
        engine = ENGINES[self.engine](config)
        engine.initialize()
        return engine

    def reference_weights(self) -> Mapping[str, Any]:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=torch.float32)
        return {name: p.detach() for name, p in model.named_parameters()}


def single_thread() -> None:
    """One torch thread per process: two processes share two cores (FACTS)."""
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))


def build_tiny_tokenizer(path: str) -> str:
    """A word-level tokenizer over the tiny vocabulary, saved next to a model (no hub)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"w{i}": i for i in range(3, VOCAB)})
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="<pad>", bos_token="<s>", eos_token="</s>"
    )
    tokenizer.save_pretrained(path)
    return path
