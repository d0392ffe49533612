"""``disk``: safetensors shards in a directory every receiver can read (no shared fabric).

Layout under ``<path>/<session>/`` (a session per ``prepare``, so a stale directory from an
earlier run is never mistaken for new weights)::

    v00000007/                      published by an atomic rename once complete
        shard-00000.safetensors     at most bucket_bytes each (one larger tensor alone)
        manifest.json               order, counts, digest
    acks/v00000007.rank1.json       each receiver's verdict after reading everything
    v00000008.aborted               the sender failed; waiting receivers raise

The sender returns once every receiver acknowledged, then keeps only the newest
``keep_versions`` versions. Disk is also the route for LoRA adapters to rollouts that can only
load adapters from a path: the stream may hold adapter tensors only.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from drivetrain.api.atomic_dir import publish, remove_stale_staging, staging_path
from drivetrain.api.engine import NamedTensor
from drivetrain.api.weight_sync import (
    SyncStats,
    Topology,
    TransportRole,
    WeightSyncError,
    WeightTransport,
)
from drivetrain.ckpt.buckets import StreamDigest, byte_view
from drivetrain.ckpt.config import DiskConfig
from drivetrain.ckpt.devices import resolve_device
from drivetrain.ckpt.pipeline import iterate_in_thread

POLL_S = 0.02  # between looks at the directory; every wait also has a deadline


def _version_dir(root: Path, version: int) -> Path:
    return root / f"v{version:08d}"


def _published(root: Path) -> list[int]:
    found = []
    for path in root.glob("v*"):
        stem = path.name[1:]
        if path.is_dir() and stem.isdigit() and (path / "manifest.json").is_file():
            found.append(int(stem))
    return sorted(found)


def _write_json(path: Path, data: Mapping[str, Any]) -> None:
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:6]}.tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


def _shards(weights: Iterable[NamedTensor], limit: int) -> Iterator[dict[str, torch.Tensor]]:
    shard: dict[str, torch.Tensor] = {}
    size = 0
    seen_storage: set[int] = set()
    for name, tensor in weights:
        nbytes = tensor.numel() * tensor.element_size()
        if shard and size + nbytes > limit:
            yield shard
            shard, size, seen_storage = {}, 0, set()
        tensor = tensor.detach().contiguous().cpu()
        pointer = tensor.untyped_storage().data_ptr()
        if pointer in seen_storage and tensor.numel():  # tied weights: safetensors refuses
            tensor = tensor.clone()
        seen_storage.add(tensor.untyped_storage().data_ptr())
        shard[name] = tensor
        size += nbytes
    if shard:
        yield shard


class DiskTransport(WeightTransport):
    config: DiskConfig

    def __init__(self, config: DiskConfig) -> None:
        super().__init__(config)
        self.root: Path | None = None
        self.role: TransportRole | None = None
        self.rank = -1
        self.receivers: tuple[int, ...] = ()
        self.seen = -1
        self._temporary: Path | None = None

    def prepare(self) -> Mapping[str, Any]:
        if self.config.path:
            base = Path(self.config.path)
            base.mkdir(parents=True, exist_ok=True)
        else:
            base = self._temporary = Path(tempfile.mkdtemp(prefix="drivetrain-weight-sync-"))
        session = base / f"session-{uuid.uuid4().hex[:12]}"
        (session / "acks").mkdir(parents=True)
        return {"path": str(session), "bucket_bytes": self.config.bucket_bytes}

    def connect(
        self, role: TransportRole, rank: int, topology: Topology, endpoint: Mapping[str, Any]
    ) -> None:
        root = Path(endpoint["path"])
        if not root.is_dir():
            raise WeightSyncError(
                f"weight-sync directory {root} is not visible here: weight_sync.path must be "
                "a directory shared by the trainer and every rollout"
            )
        mine = topology.senders if role is TransportRole.SENDER else topology.receivers
        if rank not in mine:
            raise WeightSyncError(f"rank {rank} is not a {role.value} in {topology}")
        self.root, self.role, self.rank = root, role, rank
        self.receivers = topology.receivers
        self.bucket_bytes = int(endpoint["bucket_bytes"])
        self.device = resolve_device(self.config.device)

    # ---- sender ---------------------------------------------------------------------------
    async def send(self, weights: Iterable[NamedTensor], *, version: int) -> SyncStats:
        if self.role is not TransportRole.SENDER or self.root is None:
            raise WeightSyncError("not connected as the sender")
        return await asyncio.to_thread(self._send, weights, version)

    def _send(self, weights: Iterable[NamedTensor], version: int) -> SyncStats:
        assert self.root is not None
        start = time.perf_counter()
        target = _version_dir(self.root, version)
        if target.exists():
            raise WeightSyncError(f"version {version} was already published in {self.root}")
        staging = staging_path(target)
        staging.mkdir()
        try:
            manifest = self._write(weights, staging, version)
            publish(staging, target)
        except BaseException as exc:
            shutil.rmtree(staging, ignore_errors=True)
            _write_json(self.root / f"v{version:08d}.aborted", {"reason": f"{exc}"})
            if isinstance(exc, Exception) and not isinstance(exc, WeightSyncError):
                raise WeightSyncError(f"writing version {version} failed: {exc}") from exc
            raise
        self._wait_for_acks(version)
        self._prune()
        return SyncStats(
            version,
            manifest["num_tensors"],
            manifest["num_buckets"],
            manifest["bytes"],
            time.perf_counter() - start,
            manifest["digest"],
        )

    def _write(self, weights: Iterable[NamedTensor], staging: Path, version: int) -> dict:
        digest = StreamDigest() if self.config.verify else None
        order: list[list[Any]] = []
        total = 0
        shards = 0
        for index, shard in enumerate(_shards(weights, self.bucket_bytes)):
            file = f"shard-{index:05d}.safetensors"
            save_file(shard, str(staging / file))
            for name, tensor in shard.items():
                order.append([name, file])
                total += tensor.numel() * tensor.element_size()
                if digest is not None:
                    digest.update_tensor(name, tensor)
            shards += 1
        manifest = {
            "version": version,
            "order": order,
            "num_tensors": len(order),
            "num_buckets": shards,
            "bytes": total,
            "digest": digest.hexdigest() if digest is not None else None,
        }
        _write_json(staging / "manifest.json", manifest)
        return manifest

    def _wait_for_acks(self, version: int) -> None:
        assert self.root is not None
        deadline = time.monotonic() + self.config.timeout_s
        pending = set(self.receivers)
        verdicts: dict[int, dict] = {}
        while pending:
            for rank in sorted(pending):
                path = self.root / "acks" / f"v{version:08d}.rank{rank}.json"
                if path.is_file():
                    verdicts[rank] = json.loads(path.read_text())
                    pending.discard(rank)
            if pending and time.monotonic() > deadline:
                raise WeightSyncError(
                    f"receivers {sorted(pending)} did not confirm version {version} within "
                    f"{self.config.timeout_s:.0f} s (dead, or not reading {self.root})"
                )
            if pending:
                time.sleep(POLL_S)
        rejected = {r: v["detail"] for r, v in verdicts.items() if not v["ok"]}
        if rejected:
            raise WeightSyncError(f"receivers rejected version {version}: {rejected}")

    def _prune(self) -> None:
        assert self.root is not None
        versions = _published(self.root)
        for old in versions[: -self.config.keep_versions]:
            shutil.rmtree(_version_dir(self.root, old), ignore_errors=True)
            for ack in (self.root / "acks").glob(f"v{old:08d}.rank*.json"):
                ack.unlink(missing_ok=True)
        remove_stale_staging(self.root)

    # ---- receiver -------------------------------------------------------------------------
    def receive(self) -> AsyncIterator[NamedTensor]:
        if self.role is not TransportRole.RECEIVER or self.root is None:
            raise WeightSyncError("not connected as a receiver")
        return iterate_in_thread(self._receive())

    def _next_version(self) -> int:
        assert self.root is not None
        deadline = time.monotonic() + self.config.timeout_s
        while True:
            newer = [v for v in _published(self.root) if v > self.seen]
            if newer:
                return newer[-1]
            for marker in self.root.glob("v*.aborted"):
                version = int(marker.name[1:9])
                if version > self.seen:
                    self.seen = version
                    reason = json.loads(marker.read_text())["reason"]
                    raise WeightSyncError(f"the sender aborted version {version}: {reason}")
            if time.monotonic() > deadline:
                raise WeightSyncError(
                    f"no new weights in {self.root} for {self.config.timeout_s:.0f} s"
                )
            time.sleep(POLL_S)

    def _receive(self) -> Iterator[NamedTensor]:
        assert self.root is not None
        start = time.perf_counter()
        version = self._next_version()
        directory = _version_dir(self.root, version)
        manifest = json.loads((directory / "manifest.json").read_text())
        digest = StreamDigest() if self.config.verify else None
        total = 0
        device = str(self.device)
        handles: dict[str, Any] = {}
        try:
            for name, file in manifest["order"]:
                if file not in handles:
                    handles.clear()  # shards are read in order: one open at a time
                    handles[file] = safe_open(str(directory / file), framework="pt", device=device)
                tensor = handles[file].get_tensor(name)
                total += byte_view(tensor).numel()
                if digest is not None:
                    digest.update_tensor(name, tensor)
                yield name, tensor
        except (OSError, KeyError, RuntimeError) as exc:
            self._ack(version, False, f"{type(exc).__name__}: {exc}")
            raise WeightSyncError(f"reading version {version} from {directory}: {exc}") from exc
        ours = digest.hexdigest() if digest is not None else None
        if digest is not None and ours != manifest["digest"]:
            self._ack(version, False, f"digest {ours} != {manifest['digest']}")
            raise WeightSyncError(f"version {version} in {directory} fails verification")
        self._ack(version, True, "")
        self.seen = version
        self.last_stats = SyncStats(
            version,
            len(manifest["order"]),
            manifest["num_buckets"],
            total,
            time.perf_counter() - start,
            ours,
        )

    def _ack(self, version: int, ok: bool, detail: str) -> None:
        assert self.root is not None
        path = self.root / "acks" / f"v{version:08d}.rank{self.rank}.json"
        _write_json(path, {"ok": ok, "detail": detail})

    def finalize(self) -> None:
        if self._temporary is not None:
            shutil.rmtree(self._temporary, ignore_errors=True)
            self._temporary = None
        self.root = None
        self.role = None
