"""A receiver process for the transport tests: ``python transport_worker.py SPEC.json``.

Joins the transport, receives ``versions`` syncs and writes one JSON line per sync to
``out``: the digest of what it received (computed here, from the tensors themselves), or the
error. ``die_after`` makes it exit abruptly after that many tensors of the first sync.
"""

from __future__ import annotations

import json
import os
import sys

import torch

from drivetrain.api.config import WeightSyncConfig
from drivetrain.api.registry import ckpt_engines
from drivetrain.api.weight_sync import Topology, TransportRole, WeightSyncError
from drivetrain.ckpt.buckets import digest_of


def main(spec_path: str) -> None:
    torch.set_num_threads(1)
    with open(spec_path) as f:
        spec = json.load(f)
    on_gpu = spec["config"].get("device") == "cuda" and torch.cuda.device_count() > spec["rank"]
    if on_gpu and spec["transport"] == "broadcast":  # NCCL: one GPU per rank
        torch.cuda.set_device(spec["rank"])
    config_class = ckpt_engines.load_config_class(spec["transport"], WeightSyncConfig)
    transport = ckpt_engines.load(spec["transport"])(config_class(**spec["config"]))
    topology = Topology(tuple(spec["senders"]), tuple(spec["receivers"]))
    transport.connect(TransportRole.RECEIVER, spec["rank"], topology, spec["endpoint"])
    with open(spec["out"], "a") as out:
        for _ in spec["versions"]:
            received = []
            try:
                for name, tensor in transport.receive():
                    if spec["die_after"] is not None and len(received) == spec["die_after"]:
                        os._exit(17)
                    received.append((name, tensor.clone()))  # views: valid until next
            except WeightSyncError as exc:
                out.write(json.dumps({"error": str(exc)}) + "\n")
                out.flush()
                if spec["die_after"] is not None or "sender" not in str(exc):
                    break  # the connection is gone; a sender-side abort leaves it usable
                continue
            stats = transport.last_stats
            out.write(
                json.dumps(
                    {
                        "digest": digest_of(received),
                        "version": stats.version,
                        "reported_digest": stats.digest,
                        "num_tensors": stats.num_tensors,
                        "bytes": stats.bytes,
                    }
                )
                + "\n"
            )
            out.flush()
    transport.finalize()


if __name__ == "__main__":
    main(sys.argv[1])
