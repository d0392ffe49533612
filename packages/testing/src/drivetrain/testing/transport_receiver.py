"""A receiver process of the transport kit: ``python -m drivetrain.testing.transport_receiver
SPEC.json``.

Imports the harness the spec names (``module:Class``, built with no arguments), makes its
transport, joins as a receiver and takes one sync per entry of ``versions``, writing a JSON
line for each to ``out``: the digest of what it received (computed here from the tensors, by
the harness) and what the transport reported, or the error. ``die_after`` makes it exit
abruptly (code 17) after that many tensors of its first sync; ``destination`` makes it offer
its own tensors through ``receive(into=...)``, as a rollout does.
"""

from __future__ import annotations

import importlib
import json
import os
import signal
import sys
from typing import Any

from drivetrain.api.weight_sync import Topology, TransportRole, WeightSyncError

DIED = 17


def load_harness(path: str) -> Any:
    module, _, name = path.partition(":")
    target: Any = importlib.import_module(module)
    for part in name.split("."):
        target = getattr(target, part)
    return target()


def main(spec_path: str) -> None:
    with open(spec_path) as f:
        spec = json.load(f)
    sys.path[:0] = spec["sys_path"]
    harness = load_harness(spec["harness"])
    transport = harness.make_transport(**spec["overrides"])
    with open(spec["ready"], "w"):  # imports done: the kit's timed part starts now
        pass
    topology = Topology(tuple(spec["senders"]), tuple(spec["receivers"]))
    transport.connect(TransportRole.RECEIVER, spec["rank"], topology, spec["endpoint"])
    own = {name: harness.copy(t) for name, t in harness.weights(0)} if spec["destination"] else {}

    def into(name: str, shape: tuple[int, ...], dtype: str) -> Any:
        target = own.get(name)
        return target if target is not None and harness.spec_of(target) == (shape, dtype) else None

    with open(spec["out"], "a") as out:
        for _ in spec["versions"]:
            received = []
            try:
                for name, tensor in transport.receive(into if own else None):
                    if spec["die_after"] is not None and len(received) == spec["die_after"]:
                        os._exit(DIED)
                    if spec.get("stop_after") is not None and len(received) == spec["stop_after"]:
                        os.kill(os.getpid(), signal.SIGSTOP)  # alive, silent: stuck for good
                    received.append((name, harness.copy(tensor)))  # views: valid until next
                    if own and tensor is not own.get(name):  # not written in place: a
                        harness.write_into(own[name], tensor)  # rollout copies it in
            except WeightSyncError as exc:
                out.write(json.dumps({"error": str(exc)}) + "\n")
                out.flush()
                continue
            stats = transport.last_stats
            line = {
                "digest": harness.digest(received),
                "names": [name for name, _ in received],
                # each tensor's spec and digest: a differing stream names its tensor and how
                "tensors": [
                    [name, *_spec(harness, tensor), harness.digest([(name, tensor)])]
                    for name, tensor in received
                ],
                "version": None if stats is None else stats.version,
                "reported_digest": None if stats is None else stats.digest,
                "num_tensors": None if stats is None else stats.num_tensors,
            }
            if own:
                line["own_digest"] = harness.digest([(n, own[n]) for n, _ in received])
            out.write(json.dumps(line) + "\n")
            out.flush()
    transport.finalize()


def _spec(harness: Any, tensor: Any) -> tuple[list[int], str]:
    shape, dtype = harness.spec_of(tensor)
    return list(shape), dtype


if __name__ == "__main__":
    main(sys.argv[1])
