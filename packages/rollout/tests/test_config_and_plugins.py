import pytest

from drivetrain.api import ConfigError, Prompt, SamplingParams
from drivetrain.api.registry import rollouts
from drivetrain.rollout.config import HFRolloutConfig, VLLMRolloutConfig
from drivetrain.rollout.errors import BackendNotInstalledError
from drivetrain.rollout.factories import load_backend_class


def test_registry_lists_the_three_backends_with_capabilities():
    assert {"hf", "vllm", "sglang"} <= set(rollouts.names())
    assert "separate_process" in rollouts.spec("vllm").capabilities
    assert "sleep" in rollouts.spec("vllm").capabilities
    assert "device:cpu" not in rollouts.spec("sglang").capabilities
    assert rollouts.load_config_class("vllm", object) is VLLMRolloutConfig


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"device": "tpu"}, "rollout.device"),
        ({"env": ("NOEQUALS",)}, "NAME=value"),
        ({"max_batch_size": 0}, "max_batch_size"),
    ],
)
def test_bad_config_values_are_named(overrides, message):
    with pytest.raises(ConfigError, match=message):
        HFRolloutConfig(**overrides)


def test_vllm_config_checks_its_ranges():
    with pytest.raises(ConfigError, match="gpu_memory_utilization"):
        VLLMRolloutConfig(gpu_memory_utilization=1.5)


@pytest.mark.parametrize("backend", ["vllm", "sglang"])
def test_missing_backend_library_gives_install_hint(backend):
    pytest.importorskip("torch")
    try:
        __import__(backend)
    except ImportError:
        pass
    else:
        pytest.skip(f"{backend} is installed in this environment")
    with pytest.raises(BackendNotInstalledError, match=r"pip install 'drivetrain-rollout\["):
        load_backend_class(backend)
    # the frontend class itself imports (the registry lists the backend as usable)
    assert rollouts.load(backend).backend == backend


def test_missing_model_directory_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="not a Hugging Face model directory"):
        rollouts.load("hf")(HFRolloutConfig(model_path=str(tmp_path / "nowhere")))
    with pytest.raises(FileNotFoundError, match="model_path is empty"):
        rollouts.load("hf")(HFRolloutConfig())


def test_missing_interpreter_names_the_env_command(tmp_path):
    config = VLLMRolloutConfig(model_path=str(tmp_path), python=str(tmp_path / "bin" / "python"))
    with pytest.raises(FileNotFoundError, match=r"python -m drivetrain.rollout.env vllm"):
        rollouts.load("vllm")(config)


def test_sampling_params_are_validated_before_any_backend():
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)
    with pytest.raises(ValueError, match="stop strings"):
        SamplingParams(stop=("",))
    with pytest.raises(ValueError, match="exactly one"):
        Prompt()


def test_cpu_tensor_parallel_workers_split_the_cores(monkeypatch):
    from drivetrain.rollout.vllm import rollout as vllm_rollout

    monkeypatch.setattr(vllm_rollout.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3, 4})
    assert vllm_rollout.cpu_binding(2) == "0,1|2,3"
    with pytest.raises(ValueError, match="need at least 8 cores"):
        vllm_rollout.cpu_binding(8)
