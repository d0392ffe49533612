"""A process group of its own between the trainer's sender and the rollout workers.

It is built from a private TCP store and never touches ``torch.distributed``'s default group,
so the trainer's own group (and vLLM's, inside a rollout) are unaffected, and the group lives
as long as the transport: built once at ``connect``, reused by every sync.

Every wait is abortable. A collective blocked on a dead peer is not ended by aborting the
local group (gloo's stays blocked until its own timeout), and a survivor may be waiting for
data that will now never be sent. So a participant that sees the group break (a collective
failed or passed its deadline) sets an abort key in the store, and every wait looks at that key
between slices of at most ``ABORT_POLL_S``: the others learn in well under a second.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import socket
import threading
import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from drivetrain.api.weight_sync import WeightSyncError

STORE_PREFIX = "drivetrain-weight-sync"
#: a receiver's heartbeat interval (seconds), see :meth:`Group.beat`
BEAT_S = 1.0
ABORT_KEY = "abort"
ABORT_POLL_S = 0.25  # how often a waiting participant looks for a peer's abort
BUSY_WAIT_S = 0.001  # between completion checks where a wait cannot be sliced (NCCL's own)


def _listening_socket(host: str, port: int) -> socket.socket:
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(socket.SOMAXCONN)
    except BaseException:
        sock.close()
        raise
    return sock


def master_store(host: str, port: int, timeout_s: float) -> dist.TCPStore:
    """The rendezvous store, created by the sender at ``prepare`` (port 0: a free one),
    listening on ``host`` only: ``TCPStore`` would bind every interface, so it is handed a
    socket bound here."""
    try:
        sock = _listening_socket(host, port)
        port = sock.getsockname()[1]
        fd = sock.detach()  # the store owns (and closes) the socket from here
        try:
            return dist.TCPStore(
                host,
                port,
                is_master=True,
                wait_for_workers=False,
                timeout=timedelta(seconds=timeout_s),
                master_listen_fd=fd,
            )
        except BaseException:
            os.close(fd)
            raise
    except Exception as exc:
        raise WeightSyncError(f"cannot listen for weight sync on {host}:{port}: {exc}") from exc


def client_store(host: str, port: int, timeout_s: float) -> dist.TCPStore:
    try:
        return dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s))
    except Exception as exc:
        raise WeightSyncError(
            f"cannot reach the weight-sync sender at {host}:{port} within {timeout_s:.0f} s: {exc}"
        ) from exc


def _process_group(
    backend: str, store: dist.Store, rank: int, world_size: int, timeout_s: float
) -> Any:
    """A process-group object of ``backend`` over ``store`` (not registered globally)."""
    timeout = timedelta(seconds=timeout_s)
    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, world_size, timeout)
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, world_size, options)
    if backend == "hccl":
        import torch_npu  # noqa: F401  (registers the NPU device and HCCL)
        from torch_npu._C._distributed_c10d import ProcessGroupHCCL

        options = ProcessGroupHCCL.Options()
        options._timeout = timeout
        return ProcessGroupHCCL(store, rank, world_size, options)
    raise WeightSyncError(f"unsupported collective backend {backend!r} (gloo, nccl, hccl)")


class Group:
    """The transport's process group over ``store``, with abortable, deadline-bound waits.

    ``timeout_s`` is the group's own operation timeout; make it at least the longest deadline
    passed to :meth:`wait`, or the backend gives up first (NCCL's watchdog by killing the
    process). Operations return tickets, not work objects: the group holds every pending
    work, so :meth:`shut_down` can really release them (a work keeps gloo's connections open,
    and one referenced from an exception's traceback would keep a blocked peer waiting).
    """

    def __init__(
        self, backend: str, store: dist.Store, rank: int, world_size: int, timeout_s: float
    ) -> None:
        self.store = dist.PrefixStore(STORE_PREFIX, store)
        self.rank = rank
        self._stop_beating = threading.Event()
        self.pg: Any = _process_group(backend, self.store, rank, world_size, timeout_s)
        # gloo's wait(timeout) leaves the work pending when it expires, so it can be sliced;
        # NCCL's and HCCL's abort the communicator instead, so there completion is polled
        self._sliced = backend == "gloo"
        self._works: dict[int, Any] = {}
        self._tickets = itertools.count()

    def _issue(self, work: Any) -> int:
        ticket = next(self._tickets)
        self._works[ticket] = work
        return ticket

    def broadcast(self, tensor: torch.Tensor, root: int = 0) -> int:
        """Start a broadcast from ``root``; :meth:`wait` on the ticket."""
        options = dist.BroadcastOptions()
        options.rootRank = root
        options.rootTensor = 0
        return self._issue(self.pg.broadcast([tensor], options))

    def all_reduce_max(self, tensor: torch.Tensor, timeout_s: float) -> None:
        options = dist.AllreduceOptions()
        options.reduceOp = dist.ReduceOp.MAX
        self.wait(self._issue(self.pg.allreduce([tensor], options)), timeout_s)

    def wait(self, ticket: int, timeout_s: float) -> None:
        """Block until the operation is done; :class:`WeightSyncError` when it failed, when a
        peer aborted, or after ``timeout_s`` (a failure or timeout here aborts for the others).
        """
        deadline = time.monotonic() + timeout_s
        failure = None
        try:
            while not self._wait_slice(ticket, min(ABORT_POLL_S, deadline - time.monotonic())):
                reason = self.abort_reason()
                if reason is not None:
                    raise WeightSyncError(f"a peer aborted the weight sync: {reason}")
                if time.monotonic() >= deadline:
                    failure = f"a collective made no progress for {timeout_s:.0f} s"
                    break
        except WeightSyncError:
            raise
        except Exception as exc:  # the collective itself failed: a peer is gone
            failure = f"{type(exc).__name__}: {exc}"
        finally:
            self._works.pop(ticket, None)
        if failure is not None:  # raised outside the handler: no traceback holds the work
            self.abort(failure)
            raise WeightSyncError(failure)

    def _wait_slice(self, ticket: int, seconds: float) -> bool:
        """Whether the work finished (successfully) within ``seconds``; raises its error.
        The work is looked up, never bound to a local, so no frame keeps it alive."""
        if self._sliced:
            try:
                self._works[ticket].wait(timedelta(seconds=max(seconds, 0.0)))
                return True
            except RuntimeError:
                if not self._works[ticket].is_completed():
                    return False  # this slice expired; the work is still pending
                self._works[ticket].wait()  # it ended meanwhile: its own outcome
                return True
        end = time.monotonic() + seconds
        while not self._works[ticket].is_completed():
            if time.monotonic() >= end:
                return False
            time.sleep(BUSY_WAIT_S)
        self._works[ticket].wait()  # orders the current stream after it; raises its error
        return True

    def abort(self, reason: str) -> None:
        """Tell every participant the group is broken (best effort: the store may be gone)."""
        with contextlib.suppress(Exception):
            self.store.set(ABORT_KEY, reason)

    def beat(self) -> None:
        """Say this rank is alive every ``BEAT_S`` from a daemon thread until
        :meth:`shut_down`: a stopped process (SIGSTOP, a hung machine) stops beating, one
        that waits in a collective does not, so :meth:`silent` can name the stuck one."""
        stop = self._stop_beating

        def run() -> None:
            while not stop.wait(BEAT_S):
                try:
                    self.store.add(f"beat/{self.rank}", 1)
                except Exception:  # the store (the sender's) is gone: nobody to tell
                    return

        threading.Thread(target=run, name="weight-sync-beat", daemon=True).start()

    def silent(self, ranks: Sequence[int], over_s: float = 2.5 * BEAT_S) -> list[int]:
        """Of ``ranks`` (which :meth:`beat`), those that did not beat for ``over_s``: the
        stopped or dead ones. Waits ``over_s``; best effort (the store may be gone)."""
        try:
            before = {rank: self.store.add(f"beat/{rank}", 0) for rank in ranks}
            time.sleep(over_s)
            return [rank for rank in ranks if self.store.add(f"beat/{rank}", 0) == before[rank]]
        except Exception:
            return []

    def abort_reason(self) -> str | None:
        try:
            if not self.store.check([ABORT_KEY]):
                return None
            return self.store.get(ABORT_KEY).decode(errors="replace")
        except Exception as exc:  # the store lives in the sender's process
            return f"the sender's rendezvous store is unreachable ({type(exc).__name__})"

    def shut_down(self, *, abort: bool) -> None:
        """Leave the group; ``abort`` (the group broke) breaks pending collectives (NCCL, HCCL)
        instead of waiting for them. The group and its works are dropped too: destroying them
        is what closes gloo's connections, so a peer still blocked on this one fails at once.
        (Destroying a gloo group whose own operation is pending blocks until that operation
        ends: at once when its peer closes, else at the group's timeout, which is the wait's
        deadline; releasing it in a background thread instead crashed at interpreter exit.)"""
        self._stop_beating.set()
        pg, self.pg = self.pg, None
        self._works.clear()
        with contextlib.suppress(Exception):  # already broken: nothing else to release
            getattr(pg, "abort" if abort else "shutdown")()
        # returning drops the last reference to the group: it is destroyed here
