"""Methods vLLM mixes into each of its workers (``worker_extension_cls``), called by name
through ``collective_rpc``: no callable crosses vLLM's process boundary, so this works with
worker processes and without ``VLLM_ALLOW_INSECURE_SERIALIZATION``. Imported only by vLLM, in
every worker process before its model loads: importing it registers drivetrain's
weight-transfer engine there (:mod:`drivetrain.rollout.vllm.transfer_engine`)."""

from __future__ import annotations

import importlib.util
from typing import Any

from drivetrain.rollout.vllm.tied_head import refresh_tied_lm_head


class DrivetrainWorkerExtension:
    def drivetrain_refresh_tied_lm_head(self) -> bool:
        """After ``reload_weights`` (vLLM without the weight-transfer API): see
        :func:`~drivetrain.rollout.vllm.tied_head.refresh_tied_lm_head`."""
        model: Any = self.get_model()  # type: ignore[attr-defined]
        return refresh_tied_lm_head(model)


def has_weight_transfer_api() -> bool:
    """Whether the installed vLLM has ``vllm.distributed.weight_transfer`` (0.32 has it)."""
    return importlib.util.find_spec("vllm.distributed.weight_transfer") is not None


if has_weight_transfer_api():
    from drivetrain.rollout.vllm.transfer_engine import register

    register()
