"""Starting (or joining) Ray, and waiting on Ray work so that a dead worker fails the job at
once with its error instead of leaving the controller blocked on a peer that waits forever in
a collective."""

from __future__ import annotations

import os
import socket
import time
from typing import Any

from drivetrain.api.errors import DrivetrainError
from drivetrain.trainer.errors import WorkerError
from drivetrain.trainer.job_config import WorkersConfig

#: Driver environment variables every actor inherits (Ray does not forward the environment).
FORWARDED_ENV_PREFIXES = ("DRIVETRAIN_", "HF_", "TRANSFORMERS_", "TORCH_", "NCCL_", "GLOO_")
FORWARDED_ENV = ("PYTHONPATH", "OMP_NUM_THREADS", "CUDA_DEVICE_ORDER")


def driver_env() -> dict[str, str]:
    return {
        key: value
        for key, value in os.environ.items()
        if key in FORWARDED_ENV or key.startswith(FORWARDED_ENV_PREFIXES)
    }


def ensure_ray(workers: WorkersConfig, *, min_cpus: float = 1.0) -> bool:
    """Start a local Ray (or join ``workers.ray_address``) unless one is running; returns
    whether this call started it (then the caller shuts it down)."""
    # Under `uv run`, Ray would otherwise ship the current directory to every worker and
    # re-create the environment there with uv; our workers run in the driver's (or the
    # cluster's) already-synced environment. Read when ray is first imported.
    os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")
    import ray

    if ray.is_initialized():
        return False
    init: dict[str, Any] = {"log_to_driver": True, "runtime_env": {"env_vars": driver_env()}}
    if workers.ray_address:
        # ray.init retries a cluster that refuses for minutes, whatever start_timeout_s says
        wait_for_cluster(workers.ray_address, workers.start_timeout_s)
        init["address"] = workers.ray_address
    else:
        # "local": never join a cluster found through RAY_ADDRESS or a stale session. Logical
        # CPUs: at least what the job's actors ask for (they are mostly waiting on each other).
        init.update(
            address="local",
            num_cpus=max(os.cpu_count() or 1, int(-(-min_cpus // 1))),
            include_dashboard=False,
        )
    try:
        ray.init(**init)
    except Exception as exc:  # its own errors are many lines of log and traceback
        first = next((line for line in str(exc).splitlines() if line.strip()), "")
        where = workers.ray_address or "a local Ray"
        raise WorkerError(
            f"{where} did not start ({type(exc).__name__}: {first.strip()}); with a busy "
            "machine retry, check `ray status` and free memory, or set workers.ray_address"
        ) from None
    return True


def wait_for_cluster(address: str, timeout_s: float) -> None:
    """Wait until the cluster ``ray.init(address=address)`` would join takes a TCP connection
    (a head still starting gets ``timeout_s``); :class:`WorkerError` in one line if it does
    not. An address Ray finds itself ("auto" with no ``RAY_ADDRESS``) is left to Ray."""
    target = _host_port(address)
    if target is None:
        return
    host, port = target
    deadline = time.monotonic() + timeout_s
    while True:
        left = deadline - time.monotonic()
        try:  # a connect that hangs (a firewall dropping packets) ends by the deadline too
            with socket.create_connection((host, port), timeout=min(2.0, max(0.1, left))):
                return
        except OSError as exc:
            failed = exc
        left = deadline - time.monotonic()
        if left <= 0:
            break
        time.sleep(min(0.5, left))  # refused at once: try again until the deadline
    name = address if address == f"{host}:{port}" else f"{address} ({host}:{port})"
    raise WorkerError(
        f"Ray cluster {name} did not answer within workers.start_timeout_s={timeout_s:g} s "
        f"({_first_line(failed)}): check that it is up (`ray status --address {host}:{port}` "
        "on its head), the host and port in workers.ray_address or RAY_ADDRESS, and the "
        "firewall between here and there"
    )


def _host_port(address: str) -> tuple[str, int] | None:
    """The host and port ``ray.init`` dials for ``address`` ("auto" reads ``RAY_ADDRESS``, as
    Ray does); None when Ray resolves it itself, or the address is not host:port."""
    if address == "auto":
        address = os.environ.get("RAY_ADDRESS", "") or "auto"
    if address in ("auto", "local"):
        return None
    netloc = address.split("://", 1)[-1].split("/", 1)[0]  # ray://host:port: Ray Client
    host, _, port = netloc.rpartition(":")
    if not host or not port.isdigit():
        return None  # Ray's own error says what is wrong with it
    return host.strip("[]"), int(port)  # [::1]:6379


#: How long a failed task's peers are watched for a death that caused the failure: a rank
#: killed mid-collective makes its peers' gloo/NCCL calls fail, often before Ray reports the
#: dead actor; the death is the error worth reporting.
PEER_DEATH_GRACE_S = 10.0


def wait_all(refs: Any, timeout: float | None, what: str) -> Any:
    """``ray.get`` that raises on the *first* failure among ``refs`` (a list or one ref):
    :class:`WorkerError` for a dead actor (also when a peer's failure is only its consequence),
    a timeout or a crash (with the remote traceback); a task's own ``DrivetrainError`` as is."""
    import ray

    single = not isinstance(refs, list)
    pending = [refs] if single else list(refs)
    try:
        while pending:
            ready, pending = ray.wait(pending, num_returns=1, timeout=timeout)
            if not ready:
                raise WorkerError(f"Ray workers timed out after {timeout}s {what}")
            try:
                ray.get(ready[0])  # raises now if this one failed, whatever the others do
            except ray.exceptions.RayTaskError:
                dead = _dead_peer(pending, PEER_DEATH_GRACE_S)
                if dead is not None:
                    raise dead from None
                raise
        results = ray.get([refs] if single else list(refs))
    except ray.exceptions.GetTimeoutError:
        raise WorkerError(f"Ray workers timed out after {timeout}s {what}") from None
    except ray.exceptions.RayActorError as exc:
        raise WorkerError(f"a Ray worker died while {what}: {_first_line(exc)}") from None
    except ray.exceptions.RayTaskError as exc:
        if isinstance(exc.cause, DrivetrainError):  # a deliberate error: its message says it all
            raise exc.cause from None
        raise WorkerError(f"a Ray worker failed while {what}: {exc}") from None
    return results[0] if single else results


def _dead_peer(pending: list[Any], grace: float) -> BaseException | None:
    """The ``RayActorError`` of a peer among ``pending`` that died, waiting at most ``grace``
    seconds (returns as soon as one is found or all have finished)."""
    import ray

    deadline = time.monotonic() + grace
    while pending and (left := deadline - time.monotonic()) > 0:
        ready, pending = ray.wait(pending, num_returns=1, timeout=left)
        for ref in ready:
            try:
                ray.get(ref)
            except ray.exceptions.RayActorError as exc:
                return exc
            except Exception:  # another failure: keep looking for a death
                continue
    return None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
