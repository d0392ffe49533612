"""Train/eval mode bookkeeping that every engine needs, written once.

Subclass :class:`ModalEngine` instead of :class:`Engine` to get ``train_mode()``,
``eval_mode()`` (nestable; leaving one restores the outer mode) and ``_require(mode, what)``
for the :class:`EngineStateError` the contract asks for. Implement ``_place(mode)``: put
parameters and optimizer state where ``mode`` needs them, or, for ``None`` (idle), where the
offload config says. ``_resident()`` brings the state onto the device for a call made outside
the modes (weight export, checkpoints) and back where the offload config keeps it afterwards.
"""

from __future__ import annotations

import abc
import contextlib
from collections.abc import Iterator
from contextlib import AbstractContextManager

from drivetrain.api.engine import Engine
from drivetrain.api.errors import EngineStateError

TRAIN, EVAL = "train", "eval"


class ModalEngine(Engine):
    _mode: str | None = None

    @abc.abstractmethod
    def _place(self, mode: str | None) -> None:
        """Prepare for ``mode`` ("train", "eval") or go idle (``None``)."""

    def _initialized(self) -> bool:
        """Whether ``initialize()`` has run; modes refuse to start before."""
        return True

    @contextlib.contextmanager
    def _mode_context(self, mode: str) -> Iterator[None]:
        if not self._initialized():
            raise EngineStateError("call initialize() first")
        previous, self._mode = self._mode, mode
        self._place(mode)
        try:
            yield
        finally:
            self._mode = previous
            self._place(previous)

    def train_mode(self) -> AbstractContextManager[None]:
        return self._mode_context(TRAIN)

    def eval_mode(self) -> AbstractContextManager[None]:
        return self._mode_context(EVAL)

    @contextlib.contextmanager
    def _resident(self, *, optimizer: bool = True) -> Iterator[None]:
        """Parameters (and the optimizer state, if ``optimizer``) on the device for the
        ``with`` body; nothing moves inside a mode, which placed them already."""
        if self._mode is not None:
            yield
            return
        self.to("device", model=True, optimizer=optimizer)
        try:
            yield
        finally:
            self._place(None)

    def _require(self, mode: str, what: str) -> None:
        if self._mode != mode:
            raise EngineStateError(f"{what} needs {mode}_mode() (current mode: {self._mode})")
