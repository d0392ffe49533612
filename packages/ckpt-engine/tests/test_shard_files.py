"""The disk transport's shards are standard safetensors files: the safetensors library reads
what we write, and our mapped reader returns the same bytes."""

from __future__ import annotations

import torch
from safetensors.torch import load_file

from drivetrain.ckpt.buckets import byte_view
from drivetrain.ckpt.shard_files import aligned, read_shard, write_shard
from weights_for_tests import make_weights


def test_shards_round_trip_through_safetensors_and_our_reader(tmp_path):
    weights = [(n, t) for n, t in make_weights(4) if n != "lm_head.weight"]  # unique names
    data = torch.zeros(1 << 20, dtype=torch.uint8)
    entries, used = [], 0
    for name, tensor in weights:
        offset = aligned(used) if used else 0
        raw = byte_view(tensor)
        data[offset : offset + raw.numel()].copy_(raw)
        entries.append((name, tensor, offset))
        used = offset + raw.numel()
    path = tmp_path / "shard.safetensors"
    assert write_shard(path, entries, data) == sum(byte_view(t).numel() for _, t in weights)
    loaded = load_file(str(path))
    ours = dict(read_shard(path, [n for n, _ in weights], torch.device("cpu")))
    for name, tensor in weights:
        for got in (loaded[name], ours[name]):
            assert got.dtype == tensor.dtype and got.shape == tensor.shape
            assert torch.equal(byte_view(got), byte_view(tensor)), name
