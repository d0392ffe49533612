"""An ``infer`` result assembled from micro-batch outputs, in the caller's order."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from drivetrain.api import Batch
from drivetrain.api.batch import restore_order


class InferOutputs:
    """Collects each micro-batch's computed columns (moved to the host: ``infer`` outputs
    live on the CPU, whatever the compute device) and puts them back in batch order."""

    def __init__(self, batch: Batch) -> None:
        self.batch = batch
        self._pieces: list[Batch] = []
        self._indices: list[Sequence[int]] = []

    def add(
        self, indices: Sequence[int], micro: Batch, computed: Mapping[str, torch.Tensor]
    ) -> None:
        """The outputs of ``micro`` (samples ``indices`` of the batch), in ``micro``'s layout."""
        host = {name: value.detach().cpu() for name, value in computed.items()}
        self._pieces.append(
            Batch(host, micro.seq_lens, frozenset(host), micro.layout, self.batch.meta)
        )
        self._indices.append(indices)

    def result(self, names: Sequence[str]) -> Batch:
        """The whole shard's outputs ``names`` (empty tensors for an empty shard)."""
        if not self._pieces:
            empty = {name: torch.zeros(0) for name in names}
            return Batch(empty, (), frozenset(empty), self.batch.layout, self.batch.meta)
        return restore_order(self._pieces, self._indices)
