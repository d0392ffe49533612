"""One rank of the RL job: its roles' engines (:class:`RoleWorker`), and the sending end of
the weight sync. Rank 0 holds the transport's sender; the other ranks take part in the
export's collectives."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from drivetrain.api import registry
from drivetrain.api.config import WeightSyncConfig
from drivetrain.api.weight_sync import SyncStats, Topology, TransportRole, WeightTransport
from drivetrain.runtime.weight_ledger import WeightLedger
from drivetrain.trainer.rl.sync_manager import engine_sender
from drivetrain.trainer.workers.role_worker import ACTOR, RoleSpec, RoleWorker


class SyncingWorker(RoleWorker):
    def __init__(self, roles: Mapping[str, RoleSpec], plugins: tuple[str, ...] = ()) -> None:
        super().__init__(roles, plugins)
        self._sender: WeightTransport | None = None
        self._ledger: WeightLedger | None = None  # what the rollouts hold (rank 0)
        self._adapter_sync = False  # the rollouts take the actor's LoRA adapter alone

    def export_weights(self) -> Any:
        """The actor's weight stream (what rank 0's transport sends): its LoRA adapter alone
        when the rollouts take adapters, else the (merged) weights."""
        return self.roles[ACTOR].engine.export_weights(adapter_only=self._adapter_sync)

    def sync_prepare(
        self, transport: str, config: WeightSyncConfig, adapter: bool = False
    ) -> Mapping[str, Any] | None:
        """``adapter``: the rollouts take LoRA adapters; a LoRA actor then sends its adapter
        alone (every rank: exporting runs collectives)."""
        self._adapter_sync = adapter and self.roles[ACTOR].engine.adapter_config() is not None
        if self.rank != 0:
            return None
        self.sync_close()
        self._sender = registry.ckpt_engines.load(transport)(config)
        keeps = config.delta or config.provenance
        self._ledger = WeightLedger(delta=config.delta) if keeps else None
        return self._sender.prepare()

    def sync_connect(self, topology: Topology, endpoint: Mapping[str, Any]) -> None:
        if self._sender is not None:
            self._sender.connect(TransportRole.SENDER, 0, topology, endpoint)

    def sync_send(self, version: int, base: int | None = None) -> SyncStats | None:
        return engine_sender(self.export_weights, self._sender, self._ledger)(version, base)

    def sync_close(self) -> None:
        if self._sender is not None:
            sender, self._sender = self._sender, None
            sender.finalize()

    def close(self) -> None:
        self.sync_close()
        super().close()
