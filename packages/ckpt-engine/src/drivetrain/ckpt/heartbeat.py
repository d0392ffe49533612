"""Liveness through a shared directory, for the disk transport (no connection to watch).

Each process rewrites its own small file every ``BEAT_S`` with a counter and a progress number
(bytes written so far). A watcher calls a peer dead once the counter has not changed for
``liveness_s`` as measured on the watcher's own clock, so the machines' clocks never need to
agree. The file is rewritten in place (not replaced by a rename) because a network filesystem
may cache a directory entry for many seconds, while close-to-open consistency makes a reopened
file's content fresh.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from pathlib import Path

from drivetrain.api.weight_sync import WeightSyncError

BEAT_S = 0.5


class Heartbeat:
    """A daemon thread beating into ``path`` until :meth:`stop`; set ``progress`` freely."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.progress = 0
        self._stop = threading.Event()
        self._write(0)  # the file exists before anyone is told where to look
        self._thread = threading.Thread(target=self._run, name="weight-sync-heartbeat", daemon=True)
        self._thread.start()

    def _write(self, beat: int) -> None:
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            os.pwrite(fd, f"{beat:020d} {self.progress:020d}\n".encode(), 0)  # fixed width
        finally:
            os.close(fd)

    def _run(self) -> None:
        beat = 0
        while not self._stop.wait(BEAT_S):
            beat += 1
            with contextlib.suppress(OSError):  # a vanished directory: watchers see silence
                self._write(beat)

    def stop(self) -> None:
        self._stop.set()


class Watch:
    """One process's view of a peer's heartbeat, from the moment the watch is made."""

    def __init__(self, path: Path, who: str, liveness_s: float) -> None:
        self.path = path
        self.who = who
        self.liveness_s = liveness_s
        self._beat: int | None = None
        self._progress = 0
        self._changed = self._read_at = time.monotonic()
        self._look()

    def _look(self) -> None:
        try:
            beat, progress = (int(field) for field in self.path.read_text().split())
        except (OSError, ValueError):
            return  # missing, or read while being rewritten: no news
        if beat != self._beat:
            self._beat, self._progress, self._changed = beat, progress, time.monotonic()

    def progress(self) -> int:
        """The peer's latest progress; :class:`WeightSyncError` once its heartbeat stopped."""
        now = time.monotonic()
        if now - self._read_at >= BEAT_S / 2:  # callers poll faster than peers beat
            self._read_at = now
            self._look()
        if now - self._changed > self.liveness_s:
            raise WeightSyncError(
                f"{self.who} stopped: no heartbeat in {self.path} for {self.liveness_s:.0f} s "
                "(the process died or hangs)"
            )
        return self._progress
