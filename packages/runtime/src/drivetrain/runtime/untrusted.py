"""Reading files that someone else may have written, without running their code.

A pickle can name any importable callable and call it while it is read (``__reduce__``), so a
checkpoint directory that another person could write is code. drivetrain writes its own files
as safetensors or JSON, and reads the two pickled formats it cannot avoid this way:

- **torch.save files** (an engine's per-rank RNG/scheduler state, DCP's non-tensor entries):
  always with ``weights_only=True``. :func:`torch_loads_weights_only` extends that to
  ``torch.load`` calls inside libraries we call (DCP's planner passes ``weights_only=False``
  for non-tensor entries), through torch's own ``TORCH_FORCE_WEIGHTS_ONLY_LOAD`` switch.
- **DCP's ``.metadata``** (``pickle.load`` inside torch): :func:`load_pickle` unpickles it
  resolving only allow-listed names (:data:`DCP_METADATA_GLOBALS`), so a file naming anything
  else is refused; the engines hand torch that object, from one read whose bytes were also
  checked against the checkpoint's manifest (``drivetrain.engine_core.dcp_metadata``): nothing
  swapped in after the check is ever read.

This module is the only place in drivetrain that unpickles (a test enforces it).
"""

from __future__ import annotations

import contextlib
import io
import os
import pickle
from collections.abc import Iterator
from pathlib import Path

from drivetrain.api.errors import DrivetrainError

_TORCH_DTYPES = [
    "float64",
    "float32",
    "float16",
    "bfloat16",
    "complex128",
    "complex64",
    "int64",
    "int32",
    "int16",
    "int8",
    "uint64",
    "uint32",
    "uint16",
    "uint8",
    "bool",
    "float8_e4m3fn",
    "float8_e5m2",
    "float8_e4m3fnuz",
    "float8_e5m2fnuz",
    "float8_e8m0fnu",
    "float4_e2m1fn_x2",
]

#: What torch.distributed.checkpoint (and megatron-core's dist_checkpointing on top of it)
#: pickles into ``.metadata``: its metadata dataclasses, sizes, dtypes, paths and the layout
#: decoder. Nothing here runs a command or imports a module.
DCP_METADATA_GLOBALS: frozenset[str] = frozenset(
    {
        *(
            f"torch.distributed.checkpoint.metadata.{name}"
            for name in (
                "Metadata",
                "MetadataIndex",
                "StorageMeta",
                "TensorProperties",
                "TensorStorageMetadata",
                "BytesStorageMetadata",
                "ChunkStorageMetadata",
                "_MEM_FORMAT_ENCODING",
            )
        ),
        "torch.distributed.checkpoint.filesystem._StorageInfo",
        # megatron-core keeps the global save plan beside the metadata (plain dataclasses, enum)
        *(
            f"torch.distributed.checkpoint.planner.{name}"
            for name in ("SavePlan", "WriteItem", "WriteItemType", "TensorWriteData")
        ),
        "torch.Size",
        "torch.serialization._get_layout",
        *(f"pathlib.{name}" for name in ("PosixPath", "WindowsPath", "PurePosixPath")),
        "pathlib.PureWindowsPath",
        "collections.OrderedDict",
        *(f"torch.{name}" for name in _TORCH_DTYPES),
    }
)


class UnsafeFileError(DrivetrainError):
    """A file we were about to read would run code, or names what its format never holds."""


class _AllowListUnpickler(pickle.Unpickler):
    def __init__(self, file: object, allowed: frozenset[str], path: Path) -> None:
        super().__init__(file)  # type: ignore[arg-type]
        self._allowed = allowed
        self._path = path

    def find_class(self, module: str, name: str) -> object:
        if f"{module}.{name}" not in self._allowed:
            raise UnsafeFileError(
                f"{self._path} refers to {module}.{name}, which this file format never holds: "
                "refusing to read it (it could run code)"
            )
        return super().find_class(module, name)


def load_pickle(data: bytes, allowed: frozenset[str], source: str | os.PathLike[str]) -> object:
    """What the pickle ``data`` (read from ``source``) holds, resolving only ``allowed``
    globals (``module.name``); :class:`UnsafeFileError` names the first other one, or says the
    bytes are not a pickle."""
    try:
        return _AllowListUnpickler(io.BytesIO(data), allowed, Path(source)).load()
    except UnsafeFileError:
        raise
    except Exception as exc:  # truncated or not a pickle: still never executed
        raise UnsafeFileError(f"{source} is not a readable pickle: {exc}") from None


def check_pickle(path: str | os.PathLike[str], allowed: frozenset[str]) -> None:
    """Read the pickle at ``path`` resolving only ``allowed`` globals (``module.name``);
    :class:`UnsafeFileError` names the first other one, or says the file is not a pickle."""
    load_pickle(Path(path).read_bytes(), allowed, path)


_FORCE = "TORCH_FORCE_WEIGHTS_ONLY_LOAD"
_FORCE_NOT = "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"


@contextlib.contextmanager
def torch_loads_weights_only(source: str | os.PathLike[str]) -> Iterator[None]:
    """Every ``torch.load`` in this process loads with ``weights_only=True`` while inside, even
    where a library passes ``weights_only=False`` (torch reads the variable at each call); a
    file holding anything but tensors and plain data raises :class:`UnsafeFileError` naming
    ``source`` instead of torch's many-line message. Process-wide: use it around a checkpoint
    load, not around concurrent unrelated work."""
    saved = {key: os.environ.get(key) for key in (_FORCE, _FORCE_NOT)}
    os.environ[_FORCE] = "1"
    os.environ.pop(_FORCE_NOT, None)  # torch refuses both set at once
    try:
        yield
    except pickle.UnpicklingError as exc:  # what torch's weights-only unpickler raises
        first = next((line for line in str(exc).splitlines() if "Unsupported" in line), "")
        raise UnsafeFileError(
            f"{source} holds more than tensors and plain data, refusing to read it (it could "
            f"run code){': ' + first.strip() if first else ''}"
        ) from None
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
