"""DCP's ``.metadata`` read once, checked once, and handed to torch from memory.

torch's ``FileSystemReader.read_metadata`` unpickles the file itself. Checking the file first
(allow-listed unpickling, :mod:`drivetrain.runtime.untrusted`) and letting torch read it again
left a window: a writer able to swap the file in between got past the check. Within
:func:`metadata_read_once`, every ``FileSystemReader`` of the checkpoint (torch's own, and the
ones megatron-core's dist_checkpointing builds several times per load) gets the object
unpickled, through the allow-list, from the one read whose bytes were also checked against the
checkpoint's manifest (``read_verified``).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import StorageMeta

from drivetrain.runtime.manifest import read_verified
from drivetrain.runtime.untrusted import DCP_METADATA_GLOBALS, load_pickle

_METADATA = ".metadata"


def _metadata_path(reader: FileSystemReader, rank: int | None) -> Path:
    find = getattr(reader, "_get_metadata_path", None)  # private in torch: fall back
    if find is not None:
        return Path(os.fspath(find(rank)))
    return Path(os.fspath(reader.path)) / (_METADATA if rank is None else f"__{rank}{_METADATA}")


@contextlib.contextmanager
def metadata_read_once(checkpoint_dir: str | os.PathLike[str]) -> Iterator[None]:
    """Around loading ``checkpoint_dir`` with DCP (process-wide, as torch's own loading
    switches are: use it around a load, not beside unrelated DCP work)."""
    target = Path(checkpoint_dir).absolute()
    first = target / _METADATA
    # read and checked here, so a refusal is our one-line error, not one wrapped by DCP
    read: dict[Path, bytes] = {first: read_verified(first)}
    load_pickle(read[first], DCP_METADATA_GLOBALS, first)
    original = FileSystemReader.read_metadata

    def read_metadata(reader: FileSystemReader, *args: Any, **kwargs: Any) -> Any:
        path = _metadata_path(reader, kwargs.get("rank")).absolute()
        if path.parent != target:  # another checkpoint: not this load's business
            return original(reader, *args, **kwargs)
        if path not in read:
            read[path] = read_verified(path)
        metadata: Any = load_pickle(read[path], DCP_METADATA_GLOBALS, path)
        if getattr(metadata, "storage_meta", None) is None:  # as torch's reader does
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = getattr(reader, "load_id", None)
        return metadata

    FileSystemReader.read_metadata = read_metadata  # type: ignore[method-assign]
    try:
        yield
    finally:
        FileSystemReader.read_metadata = original  # type: ignore[method-assign]
