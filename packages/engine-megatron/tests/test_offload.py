"""Offload between phases: the storage swap of ``offload.py`` on CPU (a real megatron DDP +
optimizer, one process), and the engine's own offload on a GPU (marked ``gpu``).

Either way: training after every offload/reload round trip is bit-identical to training
without one, with and without the distributed optimizer, and the state really left the device.
"""

import pytest
import torch

from megatron_harness import build_tiny_model
from megatron_launch import launch

KEYS = [f"dopt={d},offload={o}" for d in (True, False) for o in (False, True)]


def _check_identical(results):
    for dopt in (True, False):
        plain, moved = results[f"dopt={dopt},offload=False"], results[f"dopt={dopt},offload=True"]
        assert moved["steps"] == plain["steps"]  # exact: same process, same kernels
        for name, tensor in plain["exported"].items():
            assert torch.equal(moved["exported"][name], tensor), name


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(str(tmp_path_factory.mktemp("tiny") / "llama"), family="llama",
                            layers=2)  # fmt: skip


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_storage_swap_round_trip_on_cpu(model_dir, tmp_path):
    (results,) = launch("worker_offload.py", tmp_path, model_dir, "cpu", nproc=1, timeout=200)
    _check_identical(results)
    for key in KEYS:
        for record in results[key]["memory"]:
            assert record["before"]["model"] > 0 and record["before"]["optimizer"] > 0
            assert record["offloaded"] == {"model": 0, "optimizer": 0}


@pytest.mark.gpu
@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_engine_offload_on_gpu(model_dir, tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    (results,) = launch("worker_offload.py", tmp_path, model_dir, "cuda", nproc=1, timeout=500)
    _check_identical(results)
    for dopt in (True, False):
        for record in results[f"dopt={dopt},offload=True"]["memory"]:
            print(dopt, record)
            assert record["offloaded"] == {"model": 0, "optimizer": 0}
            freed = record["allocated_in_train"] - record["allocated_idle"]
            assert freed >= sum(record["resident"].values())
