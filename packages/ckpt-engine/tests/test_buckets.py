"""Packing and rejoining in one process: every byte, name, dtype and shape survives any bucket
size, and a piece out of order is refused."""

from __future__ import annotations

import pytest
import torch

from drivetrain.api.weight_sync import WeightSyncError
from drivetrain.ckpt.buckets import (
    ALIGN,
    Layout,
    Layouts,
    Piece,
    Reassembler,
    StreamDigest,
    decode_pieces,
    digest_of,
    encode_pieces,
    pack,
    plan_buckets,
)
from weights_for_tests import make_weights


def round_trip(weights, bucket_bytes, into=None):
    out, buckets = [], 0
    rebuild = Reassembler(torch.device("cpu"), into)
    digest = StreamDigest()
    buffer = torch.zeros(bucket_bytes, dtype=torch.uint8)
    for bucket in plan_buckets(weights, bucket_bytes):
        buffer.fill_(0)
        sent = pack(bucket, buffer)
        assert sent.used <= bucket_bytes
        buckets += 1
        layout = Layout.build(decode_pieces(sent.text), buffer)  # through the wire format
        assert layout.pieces == [p for p, _ in bucket] and sent.text == encode_pieces(layout.pieces)
        for piece in layout.pieces:
            assert piece.offset % ALIGN == 0
            digest.update(piece, buffer[piece.offset : piece.offset + piece.nbytes])
        for name, tensor in rebuild.add_bucket(layout):
            out.append((name, tensor.clone()))  # a view of the reused buffer
    rebuild.check_complete()
    return out, buckets, digest.hexdigest()


@pytest.mark.parametrize("bucket_bytes", [40, 100, 4096, 1 << 20])
def test_every_tensor_survives_any_bucket_size(bucket_bytes):
    weights = make_weights(0)
    out, buckets, digest = round_trip(weights, bucket_bytes)
    assert [n for n, _ in out] == [n for n, _ in weights]
    for (name, want), (_, got) in zip(weights, out, strict=True):
        assert got.dtype == want.dtype and got.shape == want.shape, name
        assert torch.equal(got.view(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8))
    assert digest == digest_of(weights)
    if bucket_bytes == 1 << 20:
        assert buckets == 1  # tiny tensors share a bucket
    if bucket_bytes == 4096:
        big = 3000 * 7 * 4
        assert buckets >= big // 4096  # the big tensor is split across buckets


def test_every_tensor_is_written_straight_into_the_consumers_tensor():
    """Given a destination, a whole tensor and the pieces of a split one land in it and the
    stream yields it itself (no allocation, no second copy); a destination of another dtype
    is not used and that tensor arrives as usual."""
    weights = make_weights(0)
    live = {name: torch.zeros_like(t) for name, t in weights}
    asked = []

    def into(name, shape, dtype):
        asked.append(name)
        return live[name] if dtype != "bfloat16" else live[name].float()  # wrong dtype

    out, _, _ = round_trip(weights, 4096, into)
    assert asked == [name for name, _ in weights]
    for (name, want), (_, got) in zip(weights, out, strict=True):
        assert torch.equal(got, want), name
        assert torch.equal(live[name], want) == (want.dtype != torch.bfloat16), name


def test_a_bucket_is_packed_and_applied_in_one_batched_copy_each():
    """Per-tensor host work is what a fast device waits on: packing a bucket of many tensors
    and applying it into the consumer's tensors are one multi-tensor copy each, and no tensor
    is copied on its own. From the second sync of the same layout on, that copy is the only
    tensor op on either side: the views into the buffer are kept (``Layouts``)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(func.__name__)
            return func(*args, **(kwargs or {}))

    weights = make_weights(0, big=30, tiny=100)
    live = {name: torch.zeros_like(t) for name, t in weights}
    buffer = torch.zeros(1 << 20, dtype=torch.uint8)
    sending, receiving = Layouts(), Layouts()
    for sync in range(2):
        (bucket,) = plan_buckets(weights, 1 << 20)
        with Count() as packing:
            text = pack(bucket, buffer, sending).text
        rebuild = Reassembler(torch.device("cpu"), lambda name, *_: live[name])
        with Count() as applying:
            out = rebuild.add_bucket(receiving.receiving(text, buffer))
        assert len(out) == len(weights) > 100
        copies = [op for op in packing.ops + applying.ops if "copy" in op]
        assert copies == ["_foreach_copy_.default"] * 2
        if sync:
            assert packing.ops == applying.ops == ["_foreach_copy_.default"]
        for name, want in weights:
            assert torch.equal(live[name], want), name
        for t in live.values():
            t.zero_()


def test_small_tensors_are_not_split_and_big_ones_are():
    weights = [
        ("a", torch.zeros(300, dtype=torch.uint8)),
        ("b", torch.zeros(300, dtype=torch.uint8)),
    ]
    buckets = list(plan_buckets(weights, 512))
    assert [[(p.name, p.start, p.stop) for p, _ in b] for b in buckets] == [
        [("a", 0, 300)],
        [("b", 0, 300)],  # b fits a fresh bucket: moved whole, not split
    ]
    big = list(plan_buckets([("c", torch.zeros(1000, dtype=torch.uint8))], 512))
    assert [[(p.start, p.stop) for p, _ in b] for b in big] == [[(0, 512)], [(512, 1000)]]


def test_digest_sees_any_changed_byte_name_or_dtype():
    weights = make_weights(1)
    base = digest_of(weights)
    changed = list(weights)
    t = changed[1][1].clone()
    t.view(-1)[123] += 1e-6
    changed[1] = (changed[1][0], t)
    assert digest_of(changed) != base
    assert digest_of([("x", torch.zeros(2))]) != digest_of([("y", torch.zeros(2))])
    assert digest_of([("x", torch.zeros(2))]) != digest_of(
        [("x", torch.zeros(1, dtype=torch.int64))]
    )


def test_pieces_out_of_order_are_refused():
    rebuild = Reassembler(torch.device("cpu"))
    middle = Piece("w", (10,), "float32", 40, 16, 32, 0)
    with pytest.raises(WeightSyncError, match="without its beginning"):
        rebuild.add(middle, torch.zeros(16, dtype=torch.uint8))
    rebuild.add(Piece("w", (10,), "float32", 40, 0, 16, 0), torch.zeros(16, dtype=torch.uint8))
    with pytest.raises(WeightSyncError, match="ended inside"):
        rebuild.check_complete()


def test_a_piece_table_that_does_not_add_up_is_refused():
    """The receiver builds its views from the header: a piece past the buffer, or one whose
    bytes do not make its shape, is a WeightSyncError, not a torch error."""
    buffer = torch.zeros(64, dtype=torch.uint8)
    past = Piece("w", (40,), "uint8", 40, 0, 40, 32)
    with pytest.raises(WeightSyncError, match="does not fit"):
        Layout.build([past], buffer)
    wrong = Piece("w", (3, 3), "float32", 12, 0, 12, 0)
    with pytest.raises(WeightSyncError, match="piece of 'w' is malformed"):
        Layout.build([wrong], buffer)
