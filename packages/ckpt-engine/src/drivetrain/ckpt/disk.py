"""``disk``: safetensors shards in a directory every receiver can read (no shared fabric).

Layout under ``<path>/<session>/`` (a session per ``prepare``, so a stale directory from an
earlier run is never mistaken for new weights)::

    v00000007/                      published by an atomic rename once complete
        shard-00000.safetensors     at most bucket_bytes each (one larger tensor alone)
        manifest.json               order, counts, digest
    acks/v00000007.rank1.json       each receiver's verdict after reading everything
    alive/sender, alive/rank1       heartbeats (``heartbeat.py``): a dead peer is noticed in
                                    ``liveness_s``, not at the deadline
    v00000008.aborted               the sender failed; waiting receivers raise

The sender returns once every receiver acknowledged, then keeps only the newest
``keep_versions`` versions. Deadlines (``WeightSyncConfig.deadline_s``) cover whole versions:
the sender waits for acknowledgements for the version's bytes, a receiver waits for a new
version for the bytes the sender has written since it began to wait.

Disk is also the route for LoRA adapters to rollouts that can only load adapters from a path:
the stream may hold adapter tensors only.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
import uuid
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from drivetrain.api.engine import NamedTensor
from drivetrain.api.weight_sync import (
    Destination,
    SyncStats,
    Topology,
    TransportRole,
    WeightSyncError,
    WeightTransport,
)
from drivetrain.ckpt.buckets import StreamDigest, byte_view
from drivetrain.ckpt.config import DiskConfig
from drivetrain.ckpt.devices import bucket_device
from drivetrain.ckpt.heartbeat import Heartbeat, Watch
from drivetrain.ckpt.shard_files import aligned, read_shard, write_shard
from drivetrain.runtime.atomic_dir import remove_stale_staging, staging_path

POLL_S = 0.005  # between looks at the directory; every wait also has a deadline
ALIVE = "alive"


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
        self._heartbeat: Heartbeat | None = None

    def _beat(self, root: Path, who: str) -> None:
        if self._heartbeat is not None:
            self._heartbeat.stop()
        self._heartbeat = Heartbeat(root / ALIVE / who)

    def _watch(self, who: str, label: str) -> Watch:
        assert self.root is not None
        return Watch(self.root / ALIVE / who, label, self.config.liveness_s)

    def prepare(self) -> Mapping[str, Any]:
        if self.config.path:
            base = Path(self.config.path)
            base.mkdir(parents=True, exist_ok=True)
        else:
            base = self._temporary = Path(tempfile.mkdtemp(prefix="drivetrain-weight-sync-"))
        session = base / f"session-{uuid.uuid4().hex[:12]}"
        (session / "acks").mkdir(parents=True)
        (session / ALIVE).mkdir()
        self._beat(session, "sender")  # beating before any receiver learns the path
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
        self.device = bucket_device(self.config.device)
        # a handshake, as the other transports have: the sender learns at connect time that
        # every receiver sees the directory, instead of at the first sync's timeout
        if role is TransportRole.RECEIVER:
            self._beat(root, f"rank{rank}")
            _write_json(root / "acks" / f"joined.rank{rank}.json", {"pid": os.getpid()})
        else:
            self._wait_for([root / "acks" / f"joined.rank{r}.json" for r in self.receivers], "join")

    # ---- sender ---------------------------------------------------------------------------
    def send(self, weights: Iterable[NamedTensor], *, version: int) -> SyncStats:
        if self.role is not TransportRole.SENDER or self.root is None:
            raise WeightSyncError("not connected as the sender")
        return self._send(weights, version)

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
            # atomic for readers (they see the whole version or none); no fsync: weights in
            # flight need not survive a power loss, and ext4 would flush every shard for it
            os.replace(staging, target)
        except BaseException as exc:
            shutil.rmtree(staging, ignore_errors=True)
            _write_json(self.root / f"v{version:08d}.aborted", {"reason": f"{exc}"})
            if isinstance(exc, Exception) and not isinstance(exc, WeightSyncError):
                raise WeightSyncError(f"writing version {version} failed: {exc}") from exc
            raise
        self._wait_for_acks(version, manifest["bytes"])
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
        """Copy tensors into a bucket-sized buffer and write it as one shard whenever the next
        tensor does not fit; a tensor larger than the buffer is written alone, straight from
        its own memory."""
        digest = StreamDigest() if self.config.verify else None
        buffer = torch.empty(self.bucket_bytes, dtype=torch.uint8)
        order: list[list[Any]] = []
        pending: list[tuple[str, torch.Tensor, int]] = []
        used = total = 0
        shards = 0

        def flush(entries: list[tuple[str, torch.Tensor, int]], data: torch.Tensor) -> None:
            nonlocal shards
            file = f"shard-{shards:05d}.safetensors"
            write_shard(staging / file, entries, data)
            order.extend([name, file] for name, _, _ in entries)
            shards += 1
            if self._heartbeat is not None:  # lets waiting receivers extend their deadline
                self._heartbeat.progress += sum(t.numel() * t.element_size() for _, t, _ in entries)

        for name, tensor in weights:
            data = byte_view(tensor.detach().to("cpu"))
            if digest is not None:
                digest.update_tensor(name, tensor)
            total += data.numel()
            if data.numel() > self.bucket_bytes:
                if pending:  # keep the stream's order across shards
                    flush(pending, buffer)
                    pending, used = [], 0
                flush([(name, tensor, 0)], data)
                continue
            offset = aligned(used) if used else 0
            if offset + data.numel() > self.bucket_bytes:
                flush(pending, buffer)
                pending, offset = [], 0
            buffer[offset : offset + data.numel()].copy_(data)
            pending.append((name, tensor, offset))
            used = offset + data.numel()
        if pending:
            flush(pending, buffer)
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

    def _wait_for(
        self, paths: list[Path], what: str, *, nbytes: int = 0, watch: bool = False
    ) -> None:
        """Wait until every path exists (each receiver writes its own), or raise naming the
        receivers that did not within ``deadline_s(nbytes)``. With ``watch`` (once they have
        joined) their heartbeats are watched too, so a dead one fails the wait in seconds."""
        limit = self.config.deadline_s(nbytes)
        deadline = time.monotonic() + limit
        pending = dict(zip(paths, self.receivers, strict=True))
        watches = {r: self._watch(f"rank{r}", f"receiver {r}") for r in self.receivers if watch}
        while True:
            pending = {path: rank for path, rank in pending.items() if not path.is_file()}
            if not pending:
                return
            try:
                for rank in pending.values():
                    if rank in watches:
                        watches[rank].progress()
            except WeightSyncError as exc:
                raise WeightSyncError(f"receivers did not {what}: {exc}") from None
            if time.monotonic() > deadline:
                raise WeightSyncError(
                    f"receivers {sorted(pending.values())} did not {what} within "
                    f"{limit:.0f} s (hung, or not reading {self.root})"
                )
            time.sleep(POLL_S)

    def _wait_for_acks(self, version: int, nbytes: int) -> None:
        assert self.root is not None
        paths = [self.root / "acks" / f"v{version:08d}.rank{r}.json" for r in self.receivers]
        self._wait_for(paths, f"confirm version {version}", nbytes=nbytes, watch=True)
        verdicts = {
            rank: json.loads(path.read_text())
            for path, rank in zip(paths, self.receivers, strict=True)
        }
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
    def receive(self, into: Destination | None = None) -> Iterator[NamedTensor]:
        del into  # whole tensors only: nothing to rebuild
        if self.role is not TransportRole.RECEIVER or self.root is None:
            raise WeightSyncError("not connected as a receiver")
        return self._receive()

    def _next_version(self) -> int:
        """The oldest version after the last one received, published or aborted (in order:
        an aborted sync raises for its own receive, the next receive gets the next one)."""
        assert self.root is not None
        sender = self._watch("sender", "the sender")
        written_before = sender.progress()
        start = time.monotonic()
        while True:
            aborted = {
                int(marker.name[1:9]): marker
                for marker in self.root.glob("v*.aborted")
                if int(marker.name[1:9]) > self.seen
            }
            candidates = sorted({v for v in _published(self.root) if v > self.seen} | set(aborted))
            if candidates:
                version = candidates[0]
                if version not in aborted:
                    return version
                self.seen = version
                reason = json.loads(aborted[version].read_text())["reason"]
                raise WeightSyncError(f"the sender aborted version {version}: {reason}")
            written = sender.progress() - written_before  # raises once the sender stopped
            waited = time.monotonic() - start
            if waited > self.config.deadline_s(written):
                raise WeightSyncError(
                    f"no new weights in {self.root} for {waited:.0f} s (the sender wrote "
                    f"{written} bytes meanwhile)"
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
        files: dict[str, list[str]] = {}
        for name, file in manifest["order"]:
            files.setdefault(file, []).append(name)
        try:
            for file, names in files.items():  # shards in order, each read once
                for name, tensor in read_shard(directory / file, names, self.device):
                    total += tensor.numel() * tensor.element_size()
                    if digest is not None:
                        digest.update_tensor(name, tensor)
                    yield name, tensor
        except (OSError, KeyError, RuntimeError, ValueError) as exc:
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
        if self._heartbeat is not None:
            self._heartbeat.stop()
            self._heartbeat = None
        if self._temporary is not None:
            shutil.rmtree(self._temporary, ignore_errors=True)
            self._temporary = None
        self.root = None
        self.role = None
