"""One device resolution for every package: engines, rollouts and transports agree on
``auto`` and refuse the same inputs, each with its own setting's name and error type."""

import pytest
import torch

from drivetrain.api import ConfigError
from drivetrain.api.weight_sync import WeightSyncError
from drivetrain.runtime.devices import resolve_device

needs_no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is present")


@needs_no_cuda
def test_auto_is_the_cpu_without_an_accelerator():
    assert resolve_device("auto") == torch.device("cpu")
    assert resolve_device("cpu") == torch.device("cpu")


@pytest.mark.parametrize("requested", ["xla", "mps"])
def test_an_unsupported_device_names_the_setting_and_the_supported_ones(requested):
    with pytest.raises(ConfigError) as info:
        resolve_device(requested, setting="rollout.device")
    message = str(info.value)
    assert message.startswith(f"rollout.device={requested!r} is not supported")
    assert "cpu (gloo), cuda (nccl), npu (hccl)" in message


def test_a_string_that_is_no_device_is_refused_as_the_callers_error():
    with pytest.raises(WeightSyncError, match=r"weight_sync.device='gpu0' is not a device"):
        resolve_device("gpu0", setting="weight_sync.device", error=WeightSyncError)


@needs_no_cuda
@pytest.mark.parametrize("requested", ["cuda", "cuda:1"])
def test_cuda_without_cuda_fails_before_anything_is_built(requested):
    with pytest.raises(ConfigError, match=f"device='{requested}' but CUDA is not available"):
        resolve_device(requested)


@needs_no_cuda
def test_kinds_limit_what_auto_picks_and_what_is_accepted():
    """An engine without NPU support leaves npu out; a rollout may run on mps."""
    assert resolve_device("auto", kinds=("cpu", "cuda")) == torch.device("cpu")
    assert resolve_device("mps", kinds=("cpu", "cuda", "mps")) == torch.device("mps")
    with pytest.raises(ConfigError, match=r"supported are auto, cpu \(gloo\), cuda \(nccl\)$"):
        resolve_device("mps", setting="engine.device", kinds=("cpu", "cuda"))
