"""drivetrain's engine for vLLM's weight-transfer API (``vllm.distributed.weight_transfer``,
backend ``"drivetrain"``): the vllm rollout updates weights through vLLM's own update lifecycle
(``start_weight_update`` / ``update_weights`` / ``finish_weight_update``, the weight version
stamped on vLLM's outputs) with the bytes drivetrain's transport already delivered to the rollout
process. In vLLM's process they arrive as tensors; in worker processes, which tensors do not
reach through vLLM's RPC, as a safetensors directory written for the update.

Imported only inside vLLM (its workers resolve this module by name), so vLLM's imports are
plain here. :func:`register` runs in every worker process, from the worker extension.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from drivetrain.rollout.vllm.tied_head import refresh_tied_lm_head

BACKEND = "drivetrain"


@dataclass
class DrivetrainInitInfo(WeightTransferInitInfo):
    """Nothing to rendezvous: the weights reached the rollout process over drivetrain's own
    transport before they are handed to vLLM."""


@dataclass
class DrivetrainUpdateInfo(WeightTransferUpdateInfo):
    """One update's weights in checkpoint (Hugging Face) names: ``tensors`` when vLLM's worker
    shares the rollout's process, else ``directory`` holding them as safetensors."""

    tensors: Iterable[tuple[str, torch.Tensor]] | None = None
    directory: str | None = None

    def __post_init__(self) -> None:
        if (self.tensors is None) == (self.directory is None):
            raise ValueError("a drivetrain weight update carries either tensors or a directory")


class DrivetrainWeightTransferEngine(
    WeightTransferEngine[DrivetrainInitInfo, DrivetrainUpdateInfo]
):
    """Loads each update with the model's own ``load_weights`` inside vLLM's layer-wise reload
    (the checkpoint-format path of vLLM's IPC and NCCL engines), then re-derives a tied output
    layer that no checkpoint name addresses."""

    init_info_cls = DrivetrainInitInfo
    update_info_cls = DrivetrainUpdateInfo
    supports_draft_weight_update = False

    def init_transfer_engine(self, init_info: DrivetrainInitInfo) -> None:
        return None

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # the base class synchronizes an accelerator after each chunk; there is none on CPU
        self.receive_weights(self.parse_update_info(update_info))
        if torch.accelerator.is_available():
            torch.accelerator.synchronize()

    def receive_weights(self, update_info: DrivetrainUpdateInfo) -> None:
        from vllm.model_executor.model_loader.mtp_validation import (
            disable_mtp_completeness_check,
        )

        weights = update_info.tensors
        if weights is None:
            weights = _read_directory(Path(str(update_info.directory)))
        with disable_mtp_completeness_check():  # an update may cover part of the model
            self.model.load_weights(weights)

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)
        refresh_tied_lm_head(self.model)

    def shutdown(self) -> None:
        return None


def _read_directory(directory: Path) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors.torch import safe_open

    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no safetensors in the weight update directory {directory}")
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                yield name, f.get_tensor(name)


def register() -> None:
    """Make ``"drivetrain"`` a weight-transfer backend in this process (idempotent)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    # a ValueError: registered already (this process imported the worker extension before)
    with contextlib.suppress(ValueError):
        WeightTransferEngineFactory.register_engine(
            BACKEND, __name__, DrivetrainWeightTransferEngine.__name__
        )
