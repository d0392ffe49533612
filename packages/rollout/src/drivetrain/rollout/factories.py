"""What the registry hands out: rollout factories. ``HFRolloutFactory(config)``
(``rollouts.load("hf")``) makes the backend's own rollout in this process
(``drivetrain.rollout.hf.rollout.HFRollout``), or, when ``config.python`` is set, the
remote-rollout proxy to a server process running it in that environment. Nothing stays between
the caller and either.

Importing this module imports no backend library, so ``drivetrain rollouts`` lists ``vllm`` and
``sglang`` even in an environment that only reaches them through a server process.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any, ClassVar

from drivetrain.api.config import coerce_config
from drivetrain.api.rollout import Rollout
from drivetrain.rollout import plugin
from drivetrain.rollout.config import (
    BackendConfig,
    HFRolloutConfig,
    SGLangRolloutConfig,
    VLLMRolloutConfig,
)
from drivetrain.rollout.errors import BackendNotInstalledError

#: backend name -> (rollout class "module:attribute", the library it needs, install hint)
IMPLEMENTATIONS = {
    "hf": ("drivetrain.rollout.hf.rollout:HFRollout", "transformers", plugin.HF.install_hint),
    "vllm": ("drivetrain.rollout.vllm.rollout:VLLMRollout", "vllm", plugin.VLLM.install_hint),
    "sglang": (
        "drivetrain.rollout.sglang.rollout:SGLangRollout",
        "sglang",
        plugin.SGLANG.install_hint,
    ),
}


def load_backend_class(backend: str) -> type[Rollout]:
    """The in-process rollout class of ``backend``, or an install hint if its library is
    missing here. Names other than drivetrain's own backends resolve through the registry, so
    any installed rollout plugin can run in a server process too."""
    if backend not in IMPLEMENTATIONS:
        from drivetrain.api.registry import rollouts

        return rollouts.load(backend)
    target, library, hint = IMPLEMENTATIONS[backend]
    if importlib.util.find_spec(library) is None:
        raise BackendNotInstalledError(
            f"rollout {backend!r} needs {library}, which is not installed in this environment. "
            f"Install: {hint}; then run here, or set rollout.python to that environment's "
            "interpreter to run the backend there."
        )
    module_name, _, attribute = target.partition(":")
    return getattr(importlib.import_module(module_name), attribute)


class RolloutFactory(Rollout):
    """A factory in the shape of a :class:`Rollout` subclass (what the registry requires):
    ``cls(config)`` is the backend's rollout or its remote proxy, never an instance of
    ``cls``."""

    backend: ClassVar[str]
    config_class: ClassVar[type[BackendConfig]]

    def __new__(cls, config: Any) -> Any:
        config = coerce_config(config, cls.config_class)
        if config.python:
            from drivetrain.rollout.process.client import start_server_rollout

            return start_server_rollout(cls.backend, config)
        return load_backend_class(cls.backend)(config)


class HFRolloutFactory(RolloutFactory):
    backend = "hf"
    config_class = HFRolloutConfig


class VLLMRolloutFactory(RolloutFactory):
    backend = "vllm"
    config_class = VLLMRolloutConfig


class SGLangRolloutFactory(RolloutFactory):
    backend = "sglang"
    config_class = SGLangRolloutConfig
