"""The ``sglang`` rollout serving requests through SGLang's native async API: the rollout
conformance kit, 64 streaming requests with half of them aborted, and the colocated order of a
weight update (sleep, wake the weights, update, wake the KV cache). Needs a CUDA GPU and
sglang; skipped elsewhere (``packages/rollout/tests/test_sglang_streams.py`` runs the same
request machinery on CPU against an asyncio streaming server)."""

import importlib.util

import pytest
import torch

from drivetrain.api import SamplingParams
from drivetrain.api.requests import Request
from drivetrain.rollout.config import SGLangRolloutConfig
from drivetrain.runtime.request_poller import generate_with_requests
from drivetrain.testing.rollout_kit import RolloutConformance
from rollout_support import (
    KeptRollout,
    TransformersRolloutHarness,
    build_model,
    check_64_streams_half_aborted,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.timeout(900),
    pytest.mark.skipif(
        not torch.cuda.is_available() or importlib.util.find_spec("sglang") is None,
        reason="needs a CUDA GPU and sglang",
    ),
]

#: fp32 on both sides; SGLang's kernels sum in another order than transformers on the CPU
TOLERANCE = 2e-3


def start_sglang(model_dir):
    from drivetrain.rollout.sglang.rollout import SGLangRollout

    config = SGLangRolloutConfig(
        model_path=str(model_dir),
        dtype="float32",
        max_model_len=256,
        mem_fraction_static=0.2,
        attention_backend="torch_native",  # fp32 attention, as transformers computes it
        disable_cuda_graph=True,
    )
    return SGLangRollout(config)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_model(tmp_path_factory.mktemp("sglang-rollout") / "model")


@pytest.fixture(scope="module")
def sglang(model_dir):
    rollout = start_sglang(model_dir)
    yield rollout
    rollout.shutdown()


class TestSGLangRolloutConformance(RolloutConformance):
    """The rollout kit on one SGLang engine (its weights reset between checks)."""

    @pytest.fixture(autouse=True)
    def _rollout(self, sglang, model_dir):
        self.model_dir, self.sglang = model_dir, sglang

    def harness(self):
        kept = KeptRollout(self.sglang, self.model_dir)
        return TransformersRolloutHarness(self.model_dir, lambda: kept, tolerance=TOLERANCE)


def test_64_streaming_requests_half_aborted(sglang, model_dir):
    """Aborted requests return their partial tokens and log-probs with finish reason abort;
    the others equal an undisturbed greedy run."""
    harness = TransformersRolloutHarness(model_dir, lambda: sglang, tolerance=TOLERANCE)
    check_64_streams_half_aborted(lambda: sglang, lambda r: None, harness)


def test_colocated_order_sleep_wake_weights_update_wake_kv_cache(sglang, model_dir):
    """What the sync manager does around a colocated update: the weights arrive while the KV
    cache is still released, and the requests after it use them."""
    harness = TransformersRolloutHarness(model_dir, lambda: sglang, tolerance=TOLERANCE)
    kept = KeptRollout(sglang, model_dir)
    prompt = harness.prompts()[0]
    greedy = SamplingParams(temperature=0, max_new_tokens=16, ignore_eos=True)
    try:
        assert sglang.sleep(1) is True
        sglang.wake_up(("weights",))
        sglang.update_weights(harness.changed_weights(), version=3)
        sglang.wake_up(("kv_cache",))
        (after,) = generate_with_requests(sglang, [Request("after", prompt, greedy)])
        assert set(after.token_versions) == {3}
        reference = harness.reference_log_probs(prompt, after.token_ids, 0, True)
        assert max(abs(a - b) for a, b in zip(after.log_probs, reference, strict=True)) < TOLERANCE
    finally:
        kept.shutdown()  # the initial weights back, as version 0
