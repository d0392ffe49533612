"""A serving engine's routed experts as :class:`~drivetrain.api.routing.RoutedExperts`: what the
vllm and sglang rollouts share (``rollout.return_routed_experts``).

Both engines return a finished request's routing at once (vLLM ``CompletionOutput
.routed_experts``, an ``np.ndarray`` ``[positions, hidden layers, top_k]`` of uint8/uint16;
SGLang ``meta_info["routed_experts"]``, base64 of int32 in that shape), over every hidden layer
(a dense layer's rows are never written: zeros) and positions ``0 .. prompt + generated - 2``.
drivetrain's routing has one layer per router, so the MoE layers are picked by the model's
config, as transformers builds them. Neither engine returns routing for an aborted request: a
resumed one reports every position again, from its re-prefill.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from drivetrain.api.errors import ConfigError
from drivetrain.api.routing import RoutedExperts


def moe_layers(hf_config: Mapping[str, Any]) -> list[int]:
    """The indices of the hidden layers with a router, as transformers builds the model:
    Qwen2/Qwen3-MoE skip ``mlp_only_layers`` and keep every ``decoder_sparse_step``-th layer;
    Mixtral routes in every layer."""
    layers = int(hf_config["num_hidden_layers"])
    dense = set(hf_config.get("mlp_only_layers") or ())
    step = int(hf_config.get("decoder_sparse_step") or 1)
    return [i for i in range(layers) if i not in dense and (i + 1) % step == 0]


def routing_shape(hf_config: Mapping[str, Any], model: str) -> tuple[list[int], int]:
    """``(router layers, top_k)`` of a MoE model's config; a dense one is refused in one line."""
    top_k = hf_config.get("num_experts_per_tok")
    if not top_k:
        raise ConfigError(
            f"rollout.return_routed_experts: {model} has no mixture-of-experts router to record"
        )
    return moe_layers(hf_config), int(top_k)


def model_routing_shape(model_dir: str | Path) -> tuple[list[int], int]:
    """:func:`routing_shape` of a model directory's ``config.json``."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    return routing_shape(config, str(model_dir))


def routed_from_array(
    routing: Any, layers: Sequence[int], top_k: int, start: int = 0
) -> RoutedExperts:
    """``[positions, hidden layers, top_k]`` expert indices (any integer dtype, numpy or a CPU
    tensor) as RoutedExperts from position ``start``, keeping the router ``layers``."""
    array = np.asarray(routing)
    if array.ndim != 3 or array.shape[2] != top_k or array.shape[1] <= max(layers, default=0):
        raise RuntimeError(
            f"routed experts of shape {array.shape}: expected [positions, hidden layers, "
            f"{top_k}] covering layers {layers}"
        )
    picked = np.ascontiguousarray(array[:, list(layers), :], dtype="<i2")
    return RoutedExperts(start, len(layers), top_k, picked.tobytes())


def routed_from_base64(
    encoded: str, hidden_layers: int, layers: list[int], top_k: int
) -> RoutedExperts:
    """SGLang's ``meta_info["routed_experts"]`` (base64 of int32 ``[positions, hidden layers,
    top_k]``) as RoutedExperts."""
    flat = np.frombuffer(base64.b64decode(encoded, validate=True), dtype="<i4")
    if flat.size % (hidden_layers * top_k):
        raise RuntimeError(
            f"SGLang's routed experts hold {flat.size} indices, not a multiple of "
            f"{hidden_layers} layers x top-{top_k}"
        )
    return routed_from_array(flat.reshape(-1, hidden_layers, top_k), layers, top_k)
