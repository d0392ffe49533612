"""safetensors shard files written straight from tensors and read back as views of a mapping.

The files are standard safetensors (any reader loads them), but writing goes tensor by tensor
from the tensors' own memory (one kernel copy into the page cache, no serialised copy in
between) and reading maps the file and hands out views (the consumer's copy is the only one).
Tensors are laid out by element size, largest first, so every view has its dtype's alignment.
"""

from __future__ import annotations

import json
import mmap
import os
import struct
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch

from drivetrain.api.engine import NamedTensor
from drivetrain.api.weight_sync import WeightSyncError
from drivetrain.ckpt.buckets import ALIGN, dtype_from_name, dtype_name

#: torch dtype name -> safetensors dtype code
CODES = {
    "float64": "F64",
    "float32": "F32",
    "float16": "F16",
    "bfloat16": "BF16",
    "int64": "I64",
    "int32": "I32",
    "int16": "I16",
    "int8": "I8",
    "uint8": "U8",
    "bool": "BOOL",
    "float8_e4m3fn": "F8_E4M3",
    "float8_e5m2": "F8_E5M2",
}
NAMES = {code: name for name, code in CODES.items()}


def aligned(position: int) -> int:
    return -(-position // ALIGN) * ALIGN


def write_shard(
    path: Path, entries: Sequence[tuple[str, torch.Tensor, int]], data: torch.Tensor
) -> int:
    """Write a shard whose tensors' bytes are already in ``data`` (CPU ``uint8``): ``entries``
    are (name, tensor for its dtype/shape, offset in ``data``). safetensors wants the data
    contiguous, so the file lays tensors out by element size, largest first: every offset is
    then a multiple of its dtype's size and the reader's views are aligned. Returns the data
    bytes."""
    header: dict[str, dict] = {}
    layout = sorted(entries, key=lambda entry: -entry[1].element_size())  # stable
    position = 0
    for name, tensor, _ in layout:
        code = CODES.get(dtype_name(tensor.dtype))
        if code is None:
            raise WeightSyncError(f"{name}: dtype {tensor.dtype} has no safetensors code")
        nbytes = tensor.numel() * tensor.element_size()
        header[name] = {
            "dtype": code,
            "shape": list(tensor.shape),
            "data_offsets": [position, position + nbytes],
        }
        position += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-(8 + len(raw)) % ALIGN)  # data starts aligned
    with open(path, "wb", buffering=1 << 20) as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for _, tensor, offset in layout:
            nbytes = tensor.numel() * tensor.element_size()
            f.write(memoryview(data[offset : offset + nbytes].numpy()))
    return position  # not fsynced: a crash loses the sync, never a published version


def read_shard(path: Path, names: Sequence[str], device: torch.device) -> Iterator[NamedTensor]:
    """Yield ``names`` from the shard, in that order, as views of the mapped file (copied to
    ``device`` when it is not the CPU)."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        mapped = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_READ) if size else None
    if mapped is None:
        raise WeightSyncError(f"{path} is empty")
    (header_len,) = struct.unpack("<Q", mapped[:8])
    header = json.loads(mapped[8 : 8 + header_len])
    base = 8 + header_len
    with warnings.catch_warnings():  # read-only on purpose: consumers copy, never write
        warnings.simplefilter("ignore", UserWarning)
        data = torch.frombuffer(memoryview(mapped), dtype=torch.uint8)
    for name in names:
        entry = header.get(name)
        if entry is None:
            raise WeightSyncError(f"{path} has no tensor {name!r}")
        start, stop = entry["data_offsets"]
        dtype = dtype_from_name(NAMES[entry["dtype"]])
        tensor = data[base + start : base + stop].view(dtype).reshape(entry["shape"])
        yield name, tensor if device.type == "cpu" else tensor.to(device)
