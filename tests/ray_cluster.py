"""A Ray cluster of several nodes on this machine, started the way users start one.

Each node is its own ``ray start --block`` (the head with ``--head``, the others with
``--address``), with its own resources and temp directory, all on loopback. A node can be
started *blind* to a directory (its processes run in their own mount namespace, with an empty
tmpfs over that directory: the machine-local disk a node of a real cluster would have), and a
node's raylet can be killed, as when a machine of a cluster dies.

Nodes are stopped by signalling their own process groups: ``ray stop`` would kill every Ray
process on the machine, other jobs' included.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

RAY = str(Path(sys.executable).parent / "ray")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def can_hide_directories() -> bool:
    """Whether this machine lets a process have its own mount namespace (root, or a user
    namespace): what a blind node needs."""
    try:
        done = subprocess.run(
            ["unshare", "-m", "--propagation", "private", "true"], capture_output=True, timeout=30
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


@dataclass
class Node:
    name: str
    process: subprocess.Popen
    temp_dir: Path
    log: Path

    def raylet_pid(self) -> int:
        """The raylet this node's ``ray start`` runs (found among its descendants)."""
        for child in psutil.Process(self.process.pid).children(recursive=True):
            with contextlib.suppress(psutil.Error):
                if "raylet" in Path(child.exe()).name or "raylet" in " ".join(child.cmdline()[:1]):
                    return child.pid
        raise AssertionError(f"no raylet under node {self.name}: {self.log.read_text()[-2000:]}")


class RayCluster:
    """``with RayCluster(env) as cluster: cluster.add_node(cpus=1)`` — ``cluster.address`` is
    what ``workers.ray_address`` takes. The head has no CPUs: drivers only, no work."""

    def __init__(self, env: dict[str, str], *, start_timeout_s: float = 120.0) -> None:
        self.env = env
        self.timeout = start_timeout_s
        self.nodes: list[Node] = []
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"

    def __enter__(self) -> RayCluster:
        try:
            self._start("head", ["--head", f"--port={self.port}", "--num-cpus=0",
                                 f"--ray-client-server-port={free_port()}",
                                 "--include-dashboard=false"])  # fmt: skip
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def add_node(self, *, cpus: float = 1, blind_to: Path | None = None) -> Node:
        """Start a node joining the head; ``blind_to``: a directory this node cannot see."""
        return self._start(
            f"node{len(self.nodes)}", [f"--address={self.address}", f"--num-cpus={cpus:g}"],
            blind_to=blind_to,
        )  # fmt: skip

    def _start(self, name: str, args: list[str], *, blind_to: Path | None = None) -> Node:
        temp_dir = Path(tempfile.mkdtemp(prefix=f"rc{name}_", dir="/tmp"))  # sockets: <= 107 B
        command = [
            RAY, "start", "--block", "--node-ip-address=127.0.0.1", "--num-gpus=0",
            "--dashboard-agent-listen-port=0", f"--temp-dir={temp_dir}",
            "--disable-usage-stats", *args,
        ]  # fmt: skip
        if blind_to is not None:
            hide = (
                f"mount -t tmpfs blind {shlex.quote(str(blind_to))} && exec {shlex.join(command)}"
            )
            command = ["unshare", "-m", "--propagation", "private", "sh", "-c", hide]
        log = temp_dir / "node.log"
        with open(log, "w") as out:
            process = subprocess.Popen(
                command, env=self.env, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip
        node = Node(name, process, temp_dir, log)
        self.nodes.append(node)
        self._wait_started(node)
        return node

    def _wait_started(self, node: Node) -> None:
        """Until ``ray start`` says the node is up (it has registered with the head)."""
        deadline = time.monotonic() + self.timeout
        while "Ray runtime started" not in node.log.read_text():
            assert node.process.poll() is None, node.log.read_text()[-3000:]
            assert time.monotonic() < deadline, f"{node.name} did not start in {self.timeout} s"
            time.sleep(0.2)

    def kill_raylet(self, node: Node) -> None:
        os.kill(node.raylet_pid(), signal.SIGKILL)

    def stop(self) -> None:
        for node in reversed(self.nodes):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(node.process.pid, signal.SIGTERM)
        for node in reversed(self.nodes):
            with contextlib.suppress(subprocess.TimeoutExpired):
                node.process.wait(timeout=30)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(node.process.pid, signal.SIGKILL)  # its workers share its session
            shutil.rmtree(node.temp_dir, ignore_errors=True)
        self.nodes = []
