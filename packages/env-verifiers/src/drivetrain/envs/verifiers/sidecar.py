"""The adapter's half that runs in the verifiers environment (``episode.options.python``).

Started by :mod:`drivetrain.envs.verifiers.hub` as ``PYTHON -P sidecar.py`` (by path: drivetrain
is not installed there, and ``-P`` keeps this folder's modules from shadowing others). It
imports the standard library only until the job says what to load, then:

1. hosts the hub's own env server, ``verifiers.v1.serve.serve_env`` (an ``EnvServer``, or an
   ``EnvServerPool`` of ``workers``), in a process of its own (``sidecar.py serve``: the job as
   JSON on its stdin, whose end stops it), on a ZMQ ``ipc://`` socket in the adapter's 0700
   folder;
2. is that server's client, through the hub's own ``EnvClient`` (DEALER socket, msgpack frames:
   ``health``, ``run`` with its ``delta`` stream, ``cancel``);
3. lists tasks with the hub's own ``Taskset`` views (the server never loads data: "the client
   owns the taskset").

It talks to the adapter in JSON lines: the job on the first line of stdin, then requests
``{"id", "op": "tasks" | "run" | "cancel", ...}``; replies and events on a private copy of
stdout (fd 1 itself goes to the log, so nothing the hub prints can break the channel). stdin's
end stops everything.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.metadata
import json
import os
import signal
import subprocess
import sys
import threading
import traceback
from typing import Any

#: the environment variable the hub's client reads the endpoint's key from (its subprocess
#: runtime strips every variable whose name holds ``API_KEY`` from the programs it runs)
KEY_VAR = "DRIVETRAIN_VERIFIERS_API_KEY"


class Channel:
    """JSON lines to the adapter, one writer at a time."""

    def __init__(self) -> None:
        self.out = os.fdopen(os.dup(1), "w", buffering=1, encoding="utf-8")
        os.dup2(2, 1)  # print() and the hub's own output go to the log
        self.lock = threading.Lock()

    def send(self, message: dict[str, Any]) -> None:
        line = json.dumps(message, default=str)
        with self.lock:
            self.out.write(line + "\n")
            self.out.flush()


def log_to_stderr() -> None:
    """The hub's own log lines (rollouts started and done, failures) into the adapter's log
    file, from this process, the server's and its pool's workers (``serve_env``'s
    ``log_setup``)."""
    import logging

    logging.basicConfig(
        level=logging.INFO,
        stream=sys.stderr,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )
    for chatty in ("httpx", "aiohttp.access"):  # a line per model call: rollouts are enough
        logging.getLogger(chatty).setLevel(logging.WARNING)


class ProtocolMismatch(Exception):
    """The installed verifiers lacks the API this sidecar speaks the hub's protocol with."""


def check_hub_api() -> None:
    """Imports everything of verifiers this sidecar uses, so a verifiers without it (another
    release's protocol) fails at start rather than at the first run."""
    try:
        from verifiers.v1.configs.agent import agent_config_fields  # noqa: F401
        from verifiers.v1.configs.client import EvalClientConfig  # noqa: F401
        from verifiers.v1.serve import EnvClient, env_config_data, serve_env  # noqa: F401
        from verifiers.v1.types import SamplingConfig  # noqa: F401
        from verifiers.v1.utils.loaders import (  # noqa: F401
            load_taskset,
            resolve_env_config,
            taskset_config_type,
        )
    except ImportError as exc:
        raise ProtocolMismatch(f"{type(exc).__name__}: {exc}") from exc


def deep_merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def env_config(job: dict[str, Any]) -> Any:
    """The hub's ``EnvConfig`` for the job: ``config`` with the taskset ``id``, and every seat
    the config leaves unpinned on the ``runtime`` the job names (none: the hub's default)."""
    from verifiers.v1.configs.agent import agent_config_fields
    from verifiers.v1.utils.loaders import resolve_env_config

    data = deep_merge(job.get("config") or {}, {"taskset": {"id": job["id"]}})
    config = resolve_env_config(data)
    if job.get("runtime"):
        for seat in agent_config_fields(config):
            pinned = isinstance(data.get(seat), dict) and "runtime" in data[seat]
            if not pinned:
                data = deep_merge(data, {seat: {"runtime": {"type": job["runtime"]}}})
        config = resolve_env_config(data)
    return config


def task_rows(config: Any, request: dict[str, Any]) -> list[dict[str, Any]]:
    """``count`` tasks as JSON rows: a bounded taskset shuffled by ``seed`` (the hub's own
    views), an infinite one from its start; ``val`` tasks from the taskset config ``val``."""
    from verifiers.v1.utils.loaders import load_taskset, taskset_config_type

    taskset_config = config.taskset
    if request["split"] != "train":
        over = request.get("val") or {}
        data = deep_merge(taskset_config.model_dump(), over)
        taskset_config = taskset_config_type(config.taskset.id).model_validate(data)
    view = load_taskset(taskset_config)
    if view.bounded:
        view = view.shuffle(seed=request["seed"])
    view = view.take(request["count"])
    # defaults left out: the server restores them when it validates the row
    return [task.data.model_dump(mode="json", exclude_defaults=True) for task in view]


def summary(episode: Any) -> dict[str, Any]:
    """What the adapter needs of a finished episode: its reward (the sum of every trace's
    weighted rewards), the named parts, metrics, standing and first errors."""
    rewards: dict[str, float] = {}
    metrics: dict[str, float] = {}
    errors = [f"{e.type}: {e.message}" for e in episode.errors]
    for trace in episode.traces:
        for name, reward in trace.rewards.items():
            if reward is not None:
                rewards[name] = rewards.get(name, 0.0) + reward.value
        for name, value in trace.metrics.items():
            if value is not None:
                metrics[name] = float(value)
        errors += [f"{e.type}: {e.message}" for e in trace.errors]
    return {
        "reward": sum(rewards.values()),
        "rewards": rewards,
        "metrics": metrics,
        "ok": bool(episode.ok),
        "errors": [line.splitlines()[0] if line else line for line in errors[:3]],
        "stop": next((t.stop_condition for t in episode.traces if t.stop_condition), None),
    }


class Sidecar:
    def __init__(self, channel: Channel, job: dict[str, Any]) -> None:
        self.channel, self.job = channel, job
        self.running: dict[int, asyncio.Task[None]] = {}
        self.cancelled: set[int] = set()
        self.server: Any = None

    def launch(self) -> None:
        """Starts the hub's server process first: it imports verifiers while this one does."""
        self.server = subprocess.Popen(
            [sys.executable, "-P", __file__, "serve"],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,  # its stderr is this one's: the adapter's log
            text=True,
        )
        assert self.server.stdin is not None
        self.server.stdin.write(json.dumps(self.job) + "\n")
        self.server.stdin.flush()  # kept open: its end tells the server to stop

    async def start(self) -> None:
        self.launch()
        check_hub_api()
        from verifiers.v1.serve import EnvClient

        self.config = env_config(self.job)  # an unknown id fails here, in one line
        self.client = EnvClient(self.job["address"])
        deadline = asyncio.get_running_loop().time() + float(self.job["start_timeout_s"])
        while not await self.client.health(timeout=1.0):
            if self.server.poll() is not None:
                raise RuntimeError(f"the env server exited ({self.server.returncode}) at start")
            if asyncio.get_running_loop().time() > deadline:
                raise TimeoutError("the env server did not answer health in time")

    async def serve(self, requests: asyncio.Queue[dict[str, Any] | None]) -> int:
        """Answers requests until stdin ends (0) or the server dies (4): the hub's client
        waits for a run untimed, so a dead server must end this process for the adapter to
        fail the runs in flight."""
        watchdog = asyncio.create_task(self.watch())
        while True:
            getter = asyncio.create_task(requests.get())
            await asyncio.wait({getter, watchdog}, return_when=asyncio.FIRST_COMPLETED)
            if watchdog.done():
                getter.cancel()
                return 4
            request = getter.result()
            if request is None:
                watchdog.cancel()
                return 0
            op, rid = request.get("op"), request.get("id")
            if op == "cancel":
                task = self.running.get(request["target"])
                if task is not None:
                    self.cancelled.add(request["target"])
                    task.cancel()  # the hub's client sends the server its `cancel`
                continue
            work = self.tasks(request) if op == "tasks" else self.run(request)
            self.running[rid] = asyncio.create_task(self.answer(rid, work))

    async def watch(self) -> None:
        while self.server.poll() is None:
            await asyncio.sleep(1.0)
        print(f"the env server exited (code {self.server.returncode})", file=sys.stderr, flush=True)

    async def answer(self, rid: int, work: Any) -> None:
        try:
            reply = {"id": rid, **(await work)}
        except asyncio.CancelledError:
            if rid not in self.cancelled:
                raise  # this process is ending: the adapter fails what is in flight
            reply = {"id": rid, "cancelled": True}
        except Exception as exc:  # one request's failure is data; the others go on
            traceback.print_exc()
            reply = {"id": rid, "error": f"{type(exc).__name__}: {exc}".splitlines()[0]}
        self.running.pop(rid, None)
        self.cancelled.discard(rid)
        self.channel.send(reply)

    async def tasks(self, request: dict[str, Any]) -> dict[str, Any]:
        rows = await asyncio.to_thread(task_rows, self.config, request)
        return {"tasks": rows}

    async def run(self, request: dict[str, Any]) -> dict[str, Any]:
        from verifiers.v1.configs.client import EvalClientConfig
        from verifiers.v1.types import SamplingConfig

        client = EvalClientConfig(base_url=request["base_url"], api_key_var=KEY_VAR)
        episode = await self.client.run(
            client=client,
            model=request["model"],
            sampling=SamplingConfig.model_validate(request.get("sampling") or {}),
            task_data=request["task"],
        )
        return summary(episode)

    def stop(self) -> None:
        """Stops the server: its stdin's end (the hub's SIGTERM teardown: rollouts, tool
        servers), then SIGTERM, then SIGKILL."""
        if self.server is None:
            return
        with contextlib.suppress(OSError):
            self.server.stdin.close()
        for ending in (None, self.server.terminate, self.server.kill):
            if ending is not None:
                ending()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.server.wait(10)
                return


def serve_main() -> int:
    """``sidecar.py serve``: the hub's own server (``serve_env``: an ``EnvServer``, or its
    ``EnvServerPool`` for ``workers`` > 1) for the job on stdin's first line, until stdin ends."""
    log_to_stderr()
    job = json.loads(sys.stdin.readline())

    def stop_at_eof() -> None:
        sys.stdin.read()
        os.kill(os.getpid(), signal.SIGTERM)  # serve_env turns it into a clean teardown

    threading.Thread(target=stop_at_eof, daemon=True).start()
    from verifiers.v1.serve import serve_env

    serve_env(
        config=env_config(job),
        address=job["address"],
        max_workers=int(job.get("workers", 1)),
        log_setup=log_to_stderr,  # the pool's workers log here too
    )
    return 0


def read_requests(loop: asyncio.AbstractEventLoop, queue: asyncio.Queue[Any]) -> None:
    """stdin's lines into the loop; its end (the adapter closed it, or died) is ``None``."""
    for line in sys.stdin:
        if line.strip():
            loop.call_soon_threadsafe(queue.put_nowait, json.loads(line))
    loop.call_soon_threadsafe(queue.put_nowait, None)


def start_error(exc: BaseException) -> dict[str, Any]:
    """A failed start as the adapter reports it: no such environment (the hub's loader found
    no taskset package by that id), verifiers without what this sidecar uses (another
    protocol), or anything else, in one line."""
    message = f"{type(exc).__name__}: {exc}".splitlines()[0]
    if isinstance(exc, ProtocolMismatch):
        return {"event": "error", "kind": "protocol", "message": str(exc).splitlines()[0]}
    if isinstance(exc, ModuleNotFoundError) and "not found (tried to import" in message:
        return {"event": "error", "kind": "unknown_env", "message": message}
    return {"event": "error", "kind": "start", "message": message}


async def main_async(channel: Channel, job: dict[str, Any]) -> int:
    sidecar = Sidecar(channel, job)
    try:
        await sidecar.start()
    except Exception as exc:
        traceback.print_exc()
        channel.send(start_error(exc))
        sidecar.stop()
        return 3
    channel.send({"event": "ready", "env_id": sidecar.config.env_id})
    queue: asyncio.Queue[Any] = asyncio.Queue()
    loop = asyncio.get_running_loop()
    threading.Thread(target=read_requests, args=(loop, queue), daemon=True).start()
    try:
        return await sidecar.serve(queue)
    finally:
        sidecar.stop()


def main() -> int:
    channel = Channel()
    log_to_stderr()
    job = json.loads(sys.stdin.readline() or "{}")
    try:
        version = importlib.metadata.version("verifiers")
    except importlib.metadata.PackageNotFoundError:
        channel.send({"event": "error", "kind": "not_installed", "message": sys.executable})
        return 3
    channel.send({"event": "hello", "verifiers": version, "python": sys.version.split()[0]})
    if not version.startswith(job.get("series", "0.4.")):
        channel.send({"event": "error", "kind": "version", "message": version})
        return 3
    return asyncio.run(main_async(channel, job))


if __name__ == "__main__":
    sys.exit(serve_main() if sys.argv[1:] == ["serve"] else main())
