"""A manifest of per-file digests, written when a directory is saved and checked when it is read.

A checkpoint or model directory that resumed after a flipped bit or a truncated copy trains on
with a different loss and says nothing. The writer of a directory (a checkpoint, an HF export)
calls :func:`write_manifest` last, before publishing it; the reader calls
:func:`verify_manifest` before loading anything, and a mismatch names the file and refuses.

Format (``drivetrain-manifest.json``)::

    {"format": 1, "algorithm": "sha256",
     "files": {"engine/__0_0.distcp": {"size": 1234, "sha256": "..."}, ...}}

Hashing streams each file (no file is held in memory) on a few threads: ``hashlib`` releases
the GIL while it hashes, so files are hashed in parallel (about 1.6 GB/s per core here).

A manifest detects corruption, not an attacker: whoever can rewrite the files can rewrite the
manifest. What keeps a hostile file from running code is :mod:`drivetrain.runtime.untrusted`.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from drivetrain.api.errors import DrivetrainError

MANIFEST_FILE = "drivetrain-manifest.json"
ALGORITHM = "sha256"
FORMAT = 1


class ManifestError(DrivetrainError):
    """A directory's files differ from its manifest, or it has none where one is required."""


def _files(directory: Path) -> list[str]:
    found = []
    for root, _dirs, names in os.walk(directory):
        for name in names:
            rel = (Path(root) / name).relative_to(directory).as_posix()
            if rel != MANIFEST_FILE:
                found.append(rel)
    return sorted(found)


def _digest(path: Path) -> tuple[int, str]:
    with open(path, "rb") as f:
        digest = hashlib.file_digest(f, ALGORITHM).hexdigest()
    return path.stat().st_size, digest


def _digests(directory: Path, names: list[str]) -> dict[str, tuple[int, str]]:
    workers = max(1, min(8, len(names), os.cpu_count() or 1))
    with ThreadPoolExecutor(workers) as pool:
        results = pool.map(lambda rel: _digest(directory / rel), names)
        return dict(zip(names, results, strict=True))


def write_manifest(directory: str | os.PathLike[str]) -> Path:
    """Digest every file below ``directory`` into its manifest (flushed to disk); returns the
    manifest's path. Call it after the last file is written and before publishing."""
    root = Path(directory)
    entries = {
        rel: {"size": size, ALGORITHM: digest}
        for rel, (size, digest) in _digests(root, _files(root)).items()
    }
    target = root / MANIFEST_FILE
    with open(target, "w") as f:
        json.dump({"format": FORMAT, "algorithm": ALGORITHM, "files": entries}, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    return target


def has_manifest(directory: str | os.PathLike[str]) -> bool:
    return (Path(directory) / MANIFEST_FILE).is_file()


def _read(root: Path) -> Mapping[str, Mapping[str, object]]:
    path = root / MANIFEST_FILE
    try:
        manifest = json.loads(path.read_text())
        if manifest.get("format") != FORMAT or manifest.get("algorithm") != ALGORITHM:
            raise ValueError(f"format {manifest.get('format')}, {manifest.get('algorithm')}")
        files = manifest["files"]
        if not isinstance(files, dict):
            raise ValueError("'files' is not a mapping")
        return files
    except FileNotFoundError:
        raise ManifestError(
            f"{root} has no {MANIFEST_FILE}: its files cannot be verified"
        ) from None
    except (OSError, ValueError, KeyError, AttributeError) as exc:
        raise ManifestError(f"{path} is unreadable or corrupt ({exc})") from None


def verify_manifest(directory: str | os.PathLike[str], *, allow_extra: bool = False) -> int:
    """Check every file of ``directory`` against its manifest; returns the bytes verified.

    :class:`ManifestError` names the first file that is missing, has another size or digest,
    or (unless ``allow_extra``, for directories people add files to, like a model folder) is
    not in the manifest."""
    root = Path(directory)
    expected = _read(root)
    present = set(_files(root))
    for rel in sorted(expected):
        if rel not in present:
            raise ManifestError(f"{root / rel} is missing (listed in {MANIFEST_FILE})")
    extra = sorted(present - set(expected))
    if extra and not allow_extra:
        raise ManifestError(
            f"{root / extra[0]} was not written with this directory (not in {MANIFEST_FILE})"
        )
    for rel in sorted(expected):  # sizes first: a truncated file is found without hashing
        size = (root / rel).stat().st_size
        if size != expected[rel].get("size"):
            raise ManifestError(
                f"{root / rel} has {size} bytes, {expected[rel].get('size')} when it was "
                "written: truncated or changed"
            )
    actual = _digests(root, sorted(expected))
    for rel, (_size, digest) in actual.items():
        if digest != expected[rel].get(ALGORITHM):
            raise ManifestError(
                f"{root / rel} differs from what was written ({ALGORITHM} mismatch): corrupt "
                "or changed since it was saved"
            )
    return sum(size for size, _digest in actual.values())


def read_verified(path: str | os.PathLike[str]) -> bytes:
    """The bytes of ``path``, read once and checked against the manifest of the nearest
    directory above it that has one (a file that manifest does not list, or a directory with
    none, is returned as read): whoever uses the bytes uses what was checked, not a second read
    someone could have swapped in between."""
    source = Path(path)
    data = source.read_bytes()
    for root in source.parents:
        if has_manifest(root):
            entry = _read(root).get(source.relative_to(root).as_posix())
            if entry is not None and hashlib.new(ALGORITHM, data).hexdigest() != entry.get(
                ALGORITHM
            ):
                raise ManifestError(
                    f"{source} differs from what was written ({ALGORITHM} mismatch): corrupt "
                    "or changed since it was saved"
                )
            break
    return data
