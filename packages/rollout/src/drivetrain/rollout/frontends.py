"""The classes the registry hands out: each runs its backend in this process, or in a server
process of another Python environment when ``config.python`` is set.

Importing this module imports no backend library, so ``drivetrain rollouts`` lists ``vllm`` and
``sglang`` even in an environment that only reaches them through a server process.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace
from typing import Any, ClassVar

from drivetrain.api.config import WeightSyncConfig
from drivetrain.api.engine import NamedTensor
from drivetrain.api.requests import Chunk, Request
from drivetrain.api.rollout import Completion, Prompt, Rollout, SamplingParams
from drivetrain.api.weight_sync import SyncStats, Topology
from drivetrain.rollout import plugin
from drivetrain.rollout.config import (
    BackendConfig,
    HFRolloutConfig,
    SGLangRolloutConfig,
    VLLMRolloutConfig,
)
from drivetrain.rollout.errors import BackendNotInstalledError

#: backend name -> (engine class "module:attribute", the library it needs, install hint)
IMPLEMENTATIONS = {
    "hf": ("drivetrain.rollout.hf.engine:HFEngine", "transformers", plugin.HF.install_hint),
    "vllm": ("drivetrain.rollout.vllm.engine:VLLMEngine", "vllm", plugin.VLLM.install_hint),
    "sglang": (
        "drivetrain.rollout.sglang.engine:SGLangEngine",
        "sglang",
        plugin.SGLANG.install_hint,
    ),
}


def load_engine_class(backend: str) -> type[Rollout]:
    """The in-process engine class of ``backend``, or an install hint if its library is
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


class BackendRollout(Rollout):
    """Delegates to the backend's engine, here or in a server process."""

    backend: ClassVar[str]
    config_class: ClassVar[type[BackendConfig]]

    def __init__(self, config: BackendConfig) -> None:
        if not isinstance(config, self.config_class):
            fields = {k: getattr(config, k) for k in vars(config)}
            config = self.config_class(**fields)
        super().__init__(config)
        if config.python:
            from drivetrain.rollout.process.client import RolloutProcess

            self.impl: Rollout = RolloutProcess(self.backend, replace(config, python=""), config)
        else:
            self.impl = load_engine_class(self.backend)(config)

    def submit(self, requests: Sequence[Request]) -> None:
        self.impl.submit(requests)

    def poll(self, timeout_s: float = 0.0) -> list[Chunk]:
        return self.impl.poll(timeout_s)

    def abort(self, request_ids: Sequence[str] | None = None) -> int:
        return self.impl.abort(request_ids)

    def generate(self, prompts: Sequence[Prompt], params: SamplingParams) -> list[Completion]:
        return self.impl.generate(prompts, params)

    def pause_generation(self, *, abort: bool = False) -> int:
        return self.impl.pause_generation(abort=abort)

    def resume_generation(self) -> None:
        self.impl.resume_generation()

    def update_weights(self, weights: Iterable[NamedTensor], *, version: int) -> None:
        self.impl.update_weights(weights, version=version)

    def connect_weight_sync(
        self,
        transport: str,
        config: WeightSyncConfig,
        *,
        rank: int,
        topology: Topology,
        endpoint: Mapping[str, Any],
    ) -> None:
        self.impl.connect_weight_sync(
            transport, config, rank=rank, topology=topology, endpoint=endpoint
        )

    def receive_weights(self, version: int) -> SyncStats:
        return self.impl.receive_weights(version)

    def disconnect_weight_sync(self) -> None:
        self.impl.disconnect_weight_sync()

    @property
    def weight_version(self) -> int:
        return self.impl.weight_version

    def sleep(self, level: int = 1) -> bool:
        super().sleep(level)  # validates the level
        return self.impl.sleep(level)

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        super().wake_up(tags)  # validates the tags
        self.impl.wake_up(tags)

    def shutdown(self) -> None:
        self.impl.shutdown()


class HFRollout(BackendRollout):
    backend = "hf"
    config_class = HFRolloutConfig


class VLLMRollout(BackendRollout):
    backend = "vllm"
    config_class = VLLMRolloutConfig


class SGLangRollout(BackendRollout):
    backend = "sglang"
    config_class = SGLangRolloutConfig
