"""Train/eval mode bookkeeping that every engine needs, written once.

Subclass :class:`ModalEngine` instead of :class:`Engine` to get ``train_mode()``,
``eval_mode()`` (nestable; leaving one restores the outer mode) and ``_require(mode, what)``
for the :class:`EngineStateError` the contract asks for. Implement ``_place(mode)``: put
parameters and optimizer state where ``mode`` needs them, or, for ``None`` (idle), where the
offload config says.
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

    def _require(self, mode: str, what: str) -> None:
        if self._mode != mode:
            raise EngineStateError(f"{what} needs {mode}_mode() (current mode: {self._mode})")
