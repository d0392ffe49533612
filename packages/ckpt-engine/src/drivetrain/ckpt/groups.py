"""A process group of its own between the trainer's sender and the rollout workers.

It is built from a private TCP store and never touches ``torch.distributed``'s default group,
so the trainer's own group (and vLLM's, inside a rollout) are unaffected, and the group lives
as long as the transport: built once at ``connect``, reused by every sync.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from drivetrain.api.weight_sync import WeightSyncError

STORE_PREFIX = "drivetrain-weight-sync"


def master_store(host: str, port: int, timeout_s: float) -> dist.TCPStore:
    """The rendezvous store, created by the sender at ``prepare`` (port 0: a free one)."""
    try:
        return dist.TCPStore(
            host,
            port,
            is_master=True,
            wait_for_workers=False,
            timeout=timedelta(seconds=timeout_s),
        )
    except Exception as exc:
        raise WeightSyncError(f"cannot listen for weight sync on {host}:{port}: {exc}") from exc


def client_store(host: str, port: int, timeout_s: float) -> dist.TCPStore:
    try:
        return dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s))
    except Exception as exc:
        raise WeightSyncError(
            f"cannot reach the weight-sync sender at {host}:{port} within {timeout_s:.0f} s: {exc}"
        ) from exc


def new_group(backend: str, store: dist.Store, rank: int, world_size: int, timeout_s: float) -> Any:
    """A process-group object of ``backend`` over ``store`` (not registered globally)."""
    prefixed = dist.PrefixStore(STORE_PREFIX, store)
    timeout = timedelta(seconds=timeout_s)
    if backend == "gloo":
        return dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(prefixed, rank, world_size, options)
    if backend == "hccl":
        import torch_npu  # noqa: F401  (registers the NPU device and HCCL)
        from torch_npu._C._distributed_c10d import ProcessGroupHCCL

        options = ProcessGroupHCCL.Options()
        options._timeout = timeout
        return ProcessGroupHCCL(prefixed, rank, world_size, options)
    raise WeightSyncError(f"unsupported collective backend {backend!r} (gloo, nccl, hccl)")


def broadcast(group: Any, tensor: torch.Tensor, root: int = 0) -> Any:
    """Asynchronous broadcast from ``root``; ``.wait()`` on the result."""
    options = dist.BroadcastOptions()
    options.rootRank = root
    options.rootTensor = 0
    return group.broadcast([tensor], options)


def wait(work: Any, timeout_s: float) -> None:
    """Block the calling thread until ``work`` is done or ``timeout_s`` passed (raising). NCCL's
    plain ``wait()`` only orders the current stream after the collective; with a timeout it
    blocks the CPU and aborts the communicator when it expires, as gloo does."""
    work.wait(timedelta(seconds=timeout_s))


def all_reduce_max(group: Any, tensor: torch.Tensor, timeout_s: float) -> None:
    options = dist.AllreduceOptions()
    options.reduceOp = dist.ReduceOp.MAX
    wait(group.allreduce([tensor], options), timeout_s)


def shut_down(group: Any, *, abort: bool) -> None:
    """Leave the group; ``abort`` breaks pending collectives so peers fail fast."""
    method = getattr(group, "abort" if abort else "shutdown", None)
    if method is not None:
        try:
            method()
        except Exception:  # already broken: nothing else to release
            return
