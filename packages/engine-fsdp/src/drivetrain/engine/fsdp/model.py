"""Loading Hugging Face models and the module the engine shards and runs.

:class:`TokenOutputModel` wraps a causal LM (or a value-head model) so that one forward call
turns a packed token row into exactly the per-token outputs the engine needs (log-probs and
entropy through chunked heads, or values), inside the sharded root module, so FSDP gathers and
frees the head's parameters like every other.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForTokenClassification

from drivetrain.api import ConfigError, ModelConfig
from drivetrain.engine.fsdp.attention import EXACT
from drivetrain.engine.fsdp.attention import NAME as VARLEN
from drivetrain.engine.fsdp.config import FSDPConfig
from drivetrain.engine.fsdp.token_outputs import next_token_outputs
from drivetrain.engine_core.exact_modules import exact_linear, make_exact

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load_hf_model(config: ModelConfig, attention: str, *, empty: bool = False) -> nn.Module:
    """The HF model in fp32 (the master copy; mixed precision casts for compute).

    ``empty``: parameters on the meta device (no memory, no disk read), buffers real; the
    engine fills them from rank 0 after sharding, so large models are read once per job."""
    if not config.path:
        raise ConfigError("model.path is empty: point it at a local Hugging Face model directory")
    attn = VARLEN if attention == "varlen" else attention
    kwargs: dict[str, Any] = {"dtype": torch.float32, "attn_implementation": attn}
    remote = {"trust_remote_code": config.trust_remote_code}
    extra = {"num_labels": 1} if config.value_head else {}
    auto = AutoModelForTokenClassification if config.value_head else AutoModelForCausalLM
    try:
        hf_config = AutoConfig.from_pretrained(config.path, **extra, **remote)
        if empty:
            from accelerate import init_empty_weights

            with init_empty_weights():  # parameters on meta, buffers (rotary tables) real
                model = auto.from_config(hf_config, **kwargs, **remote)
            model.tie_weights()  # from_config on meta leaves tied heads as separate parameters
        else:
            model = auto.from_pretrained(config.path, config=hf_config, **kwargs, **remote)
    except OSError as exc:
        raise ConfigError(f"model.path={config.path!r} is not a loadable model: {exc}") from exc
    model.config.use_cache = False  # a KV cache in training breaks packed attention (FACTS)
    if config.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if config.lora.enabled:
        model = _add_lora(model, config)
    return model


def exact_numerics(hf: nn.Module, config: FSDPConfig, device: torch.device, *, fsdp1: bool) -> str:
    """Make ``hf`` batch-invariant for ``numerics=exact`` (the hf rollout runs the same
    modules); the packed kernel that goes with it. One-line errors for what exact mode does
    not cover."""
    if fsdp1:
        raise ConfigError("numerics=exact is built and tested on the fsdp2 engine, not fsdp")
    if config.ulysses_size > 1:  # its all-to-alls may repeat KV heads: other product shapes
        raise ConfigError("numerics=exact does not take ulysses_size > 1")
    if device.type != "cpu":
        raise ConfigError(
            f"numerics=exact is proven on the CPU only; this engine runs on {device.type}"
        )
    if config.attention != "varlen":
        raise ConfigError(
            f"numerics=exact attends with attention='varlen', not {config.attention!r}"
        )
    try:
        make_exact(hf)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    return EXACT


def _add_lora(model: nn.Module, config: ModelConfig) -> nn.Module:
    from peft import LoraConfig, get_peft_model

    targets: Any = list(config.lora.target_modules)
    if targets == ["all-linear"]:
        targets = "all-linear"
    lora = LoraConfig(
        r=config.lora.rank,
        lora_alpha=config.lora.alpha,
        lora_dropout=config.lora.dropout,
        target_modules=targets,
        # the value head of a critic trains fully next to its adapters
        modules_to_save=["score"] if config.value_head else None,
    )
    return get_peft_model(model, lora)


def unwrap_peft(model: nn.Module) -> nn.Module:
    get_base = getattr(model, "get_base_model", None)
    return get_base() if get_base is not None else model


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks (the units FSDP shards one by one)."""
    base = unwrap_peft(model)
    body = getattr(base, base.base_model_prefix)
    layers = getattr(body, "layers", None) or getattr(body, "h", None)
    if layers is None:
        raise ConfigError(f"cannot find the decoder layers of {type(base).__name__}")
    return list(layers)


def compile_layers(model: nn.Module) -> int:
    """Each decoder layer's ``forward`` compiled in place (``torch.compile``, dynamic shapes);
    how many. The module's ``__call__`` stays eager, so FSDP's pre- and post-forward hooks and
    activation checkpointing wrap the compiled code instead of being traced into it."""
    layers = decoder_layers(model)
    for layer in layers:
        layer.forward = torch.compile(layer.forward, dynamic=True)  # type: ignore[method-assign]
    return len(layers)


class TokenOutputModel(nn.Module):
    """``forward`` -> dict of flat per-position tensors for the real tokens of the input.

    For causal LMs, ``log_probs[t]``/``entropy[t]`` describe the token *after* position ``t``
    (``targets[t]``); the engine shifts them to align with the inputs. For value-head models,
    ``values[t]`` is the value at position ``t``. ``extra_src``/``extra_targets`` append
    outputs for more (position, next token) pairs after the row's own.
    """

    def __init__(
        self, hf: nn.Module, *, value_head: bool, logits_chunk: int, exact: bool = False
    ) -> None:
        super().__init__()
        self.hf = hf
        self.value_head = value_head
        self.logits_chunk = logits_chunk
        self.head_linear = exact_linear if exact else F.linear  # numerics=exact: the rollout's

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        targets: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        temperature: float = 1.0,
        want_entropy: bool = False,
        extra_src: torch.Tensor | None = None,
        extra_targets: torch.Tensor | None = None,
    ) -> dict[str, torch.Tensor]:
        base = unwrap_peft(self.hf)
        body = getattr(base, base.base_model_prefix)
        hidden = body(
            input_ids=input_ids,
            position_ids=position_ids,
            attention_mask=attention_mask,
            use_cache=False,
        ).last_hidden_state
        hidden = hidden[attention_mask.bool()] if attention_mask is not None else hidden[0]
        if extra_src is not None and len(extra_src):  # a shared prompt's last position, once
            hidden = torch.cat([hidden, hidden[extra_src]])  # per sample that continues it
            targets = torch.cat([targets, extra_targets])
        if self.value_head:
            return {"values": base.score(hidden).squeeze(-1).float()}
        head = base.get_output_embeddings()
        log_probs, entropy = next_token_outputs(
            hidden,
            head.weight,
            getattr(head, "bias", None),
            targets,
            temperature=temperature,
            want_entropy=want_entropy,
            chunk=self.logits_chunk,
            linear=self.head_linear,
        )
        return {"log_probs": log_probs, "entropy": entropy}
