"""Serving engines' routed experts as drivetrain's RoutedExperts (``rollout.routed``): the MoE
layers picked out of every hidden layer, vLLM's uint8/uint16 arrays and SGLang's base64 int32,
and SGLang's stream attaching them to the finishing event only. The engines themselves need a
GPU for this (vLLM's CPU backend has no capture; SGLang is CUDA only)."""

import base64

import numpy as np
import pytest

from drivetrain.api.requests import Request
from drivetrain.api.rollout import SamplingParams
from drivetrain.rollout.routed import moe_layers, routed_from_array, routed_from_base64
from drivetrain.rollout.sglang.requests import RoutingShape, request_kwargs, stream_event


def test_moe_layers_follow_the_config():
    assert moe_layers({"num_hidden_layers": 4}) == [0, 1, 2, 3]  # Mixtral: every layer
    assert moe_layers({"num_hidden_layers": 4, "decoder_sparse_step": 2}) == [1, 3]
    assert moe_layers({"num_hidden_layers": 4, "mlp_only_layers": [0, 2]}) == [1, 3]


@pytest.mark.parametrize("dtype", [np.uint8, np.uint16, np.int32])
def test_an_engines_array_keeps_the_router_layers_as_int16(dtype):
    routing = np.arange(5 * 3 * 2, dtype=dtype).reshape(5, 3, 2)  # 3 hidden layers, top-2
    routed = routed_from_array(routing, [0, 2], 2)
    assert (routed.start, routed.positions, routed.layers, routed.top_k) == (0, 5, 2, 2)
    assert list(routed.indices()) == routing[:, [0, 2], :].flatten().tolist()
    with pytest.raises(RuntimeError, match=r"expected \[positions, hidden layers, 4\]"):
        routed_from_array(routing, [0, 2], 4)


def test_sglang_returns_routing_with_the_finishing_event_only():
    routing = np.arange(4 * 2 * 2, dtype="<i4").reshape(4, 2, 2) % 8
    encoded = base64.b64encode(routing.tobytes()).decode()
    shape = RoutingShape(hidden_layers=2, layers=[0, 1], top_k=2)
    running = {
        "output_ids": [5, 6],
        "meta_info": {
            "output_token_logprobs": [(-0.1, 5, None), (-0.2, 6, None)],
            "completion_tokens": 2,
        },
    }
    done = {"output_ids": [5, 6, 7], "meta_info": {
        "output_token_logprobs": [(-0.1, 5, None), (-0.2, 6, None), (-0.3, 7, None)],
        "completion_tokens": 3, "finish_reason": {"type": "length"},
        "routed_experts": encoded}}  # fmt: skip
    assert stream_event("r", running, 0, shape).routed_experts is None
    event = stream_event("r", done, 2, shape)
    assert event.token_ids == [7] and event.routed_experts is not None
    assert list(event.routed_experts.indices()) == routing.flatten().tolist()
    assert stream_event("r", done, 2).routed_experts is None  # not asked: none
    request = Request("r", (1, 2), SamplingParams(max_new_tokens=3))
    assert request_kwargs(request, "s", routed_experts=True)["return_routed_experts"] is True
    assert "return_routed_experts" not in request_kwargs(request, "s")
    with pytest.raises(RuntimeError, match="not a multiple of 2 layers x top-2"):
        routed_from_base64(base64.b64encode(b"\0" * 12).decode(), 2, [0, 1], 2)
