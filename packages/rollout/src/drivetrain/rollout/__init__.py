"""drivetrain's rollout (generation) backends: ``hf``, ``vllm`` and ``sglang``.

Each runs in this process, or in its own Python environment as a server process
(``python=<that environment's interpreter>`` in its config); see :mod:`drivetrain.rollout.env`.
This module stays light: backends are imported only when selected.
"""

from drivetrain.rollout.config import (
    BackendConfig,
    HFRolloutConfig,
    SGLangRolloutConfig,
    VLLMRolloutConfig,
)

__version__ = "0.1.0"

__all__ = ["BackendConfig", "HFRolloutConfig", "SGLangRolloutConfig", "VLLMRolloutConfig"]
