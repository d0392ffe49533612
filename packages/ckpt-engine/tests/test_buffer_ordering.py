"""How the colocated links order a bucket buffer's writes and reads, checked on the CPU with the
real links and pipeline over a pipe: the order of the ordering calls is what a GPU's
interprocess events rely on (each side records before it sends the message the other side waits
for), and no host waits for the device per bucket, only once per received stream."""

from __future__ import annotations

import re
import threading
from multiprocessing import Pipe

import torch

from drivetrain.ckpt import pipeline
from drivetrain.ckpt.buckets import digest_of
from drivetrain.ckpt.colocated import _Receiver, _Sender
from drivetrain.ckpt.pipeline import receive_stream, send_stream
from weights_for_tests import make_weights


class RecordingBuffers:
    """Host buffers whose ordering calls are logged, with what the other side had done then."""

    def __init__(self, buffers: list[torch.Tensor], log: list[tuple[str, int]]) -> None:
        self.buffers, self.log = buffers, log

    def packed(self, index: int) -> None:
        self.log.append(("packed", index))

    def reusable(self, index: int) -> None:
        self.log.append(("reusable", index))

    def arrived(self, index: int) -> None:
        self.log.append(("arrived", index))

    def consumed(self, index: int) -> None:
        self.log.append(("consumed", index))


def test_each_buffer_round_is_ordered_and_the_host_waits_once_per_stream(monkeypatch):
    waits: list[str] = []
    monkeypatch.setattr(pipeline, "synchronize", lambda device: waits.append(str(device)))
    buffers = [torch.zeros(4096, dtype=torch.uint8) for _ in (0, 1)]
    lock = threading.Lock()

    class Logged(list):  # both threads append; keep each entry whole
        def append(self, item):
            with lock:
                super().append(item)

    log = Logged()
    ours, theirs = Pipe()
    sender = _Sender(RecordingBuffers(buffers, log), {1: ours}, timeout=30.0)
    receiver = _Receiver(RecordingBuffers(buffers, log), theirs, timeout=30.0)
    weights = make_weights(3)
    sent: dict[str, object] = {}

    def send() -> None:
        try:
            sent["stats"] = send_stream(sender, iter(weights), version=4, verify=True)
        except BaseException as exc:
            sent["error"] = exc

    thread = threading.Thread(target=send)
    thread.start()
    got = []
    for name, tensor in receive_stream(
        receiver,
        device=torch.device("cpu"),
        verify=True,
        timeout_s=30.0,
        on_stats=lambda stats: sent.setdefault("received", stats),
    ):
        log.append(("read", -1))
        got.append((name, tensor.clone()))
    thread.join(timeout=30)
    assert "error" not in sent and not thread.is_alive()
    assert digest_of(got) == digest_of(weights) == sent["stats"].digest
    buckets = sent["stats"].num_buckets
    assert buckets > 4  # the buffers were reused many times

    by_kind = {kind: [i for k, i in log if k == kind] for kind, _ in log}
    # every bucket goes around once, alternating buffers
    assert (
        by_kind["packed"]
        == by_kind["arrived"]
        == by_kind["consumed"]
        == [n % 2 for n in range(buckets)]
    )
    position = {}
    for at, entry in enumerate(log):
        position.setdefault(entry, []).append(at)
    for n in range(buckets):
        index = n % 2
        packed = position[("packed", index)][n // 2]
        arrived = position[("arrived", index)][n // 2]
        consumed = position[("consumed", index)][n // 2]
        assert packed < arrived < consumed  # written, then waited for, then read
        if n + 2 < buckets:  # refilled only after this round's reads were queued
            reusable = position[("reusable", index)][n // 2]
            refilled = position[("packed", index)][n // 2 + 1]
            assert consumed < reusable < refilled
    # the consumer read each bucket's tensors between its arrival and its release: on the
    # receiver's side the log is (arrived, read*, consumed) for every bucket
    receiving = "".join(
        {"arrived": "<", "read": "r", "consumed": ">"}.get(kind, "") for kind, _ in log
    )
    assert re.fullmatch(r"(<r*>)+", receiving) and receiving.count("<") == buckets
    assert waits == ["cpu"]  # one host wait per received stream, none per bucket, none sending
