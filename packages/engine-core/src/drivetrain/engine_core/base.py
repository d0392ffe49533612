"""What every torch training engine does the same way, written once: where its state lives
between phases (``_place`` and ``to``), which outputs a model can give (the output-spec and
value-head checks). Its ``device`` is ``config.device`` resolved by
:func:`drivetrain.runtime.devices.resolve_device`, as every package resolves one.

An engine subclasses :class:`TorchEngine` and supplies the mechanics that differ: how its
modules switch train/eval (``_modules``) and how parameters and optimizer state move between
host and device (``_move``: FSDP's sharded tensors, megatron's gradient buffers).
"""

from __future__ import annotations

import abc
from collections.abc import Iterable
from typing import ClassVar

import torch
from torch import nn

from drivetrain.api import EngineStateError, OutputSpec
from drivetrain.runtime.modes import TRAIN, ModalEngine


class TorchEngine(ModalEngine):
    """A :class:`ModalEngine` whose state is torch modules and a torch optimizer."""

    device: torch.device

    # ---- placement ----------------------------------------------------------------------
    @abc.abstractmethod
    def _modules(self) -> Iterable[nn.Module]:
        """The modules whose train/eval flag follows the engine's mode."""

    @abc.abstractmethod
    def _move(self, *, to_host: bool, model: bool, optimizer: bool) -> None:
        """Move parameters (``model``) and/or optimizer state to host memory or back to
        ``self.device``; at least one of the two is asked for."""

    def _place(self, mode: str | None) -> None:
        if mode is None:  # idle: offload as configured
            off = self.config.offload
            self.to("cpu", model=off.params, optimizer=off.optimizer)
            return
        self.to("device", model=True, optimizer=mode == TRAIN)
        for module in self._modules():
            module.train(mode == TRAIN)

    def to(self, device: str, *, model: bool = True, optimizer: bool = True) -> None:
        if device not in ("cpu", "device"):
            raise ValueError(f"device must be 'cpu' or 'device', got {device!r}")
        if model or optimizer:
            self._move(to_host=device == "cpu", model=model, optimizer=optimizer)

    # ---- outputs ------------------------------------------------------------------------
    def _training_outputs(self, outputs: OutputSpec | None) -> OutputSpec:
        """What ``forward_backward`` computes when the caller does not say: values for a
        value-head model, log-probs for a causal LM."""
        if outputs is not None:
            return outputs
        if self.config.model.value_head:
            return OutputSpec(log_probs=False, values=True)
        return OutputSpec()

    #: whether the engine replays a batch's ``routed_experts`` and reports the experts it used
    replays_routing: ClassVar[bool] = False

    def _check_outputs(self, spec: OutputSpec) -> None:
        """A value-head model gives values only; a causal LM gives log-probs and entropy; the
        routers' choice needs an engine that replays routing."""
        value_head = self.config.model.value_head
        if spec.values != value_head or (spec.values and (spec.log_probs or spec.entropy)):
            kind = "value-head" if value_head else "causal LM"
            raise EngineStateError(f"a {kind} engine cannot compute {spec.names}")
        if spec.routed_experts and not self.replays_routing:
            raise EngineStateError(f"{type(self).__name__} does not report routed experts")
