"""Decode text files as UTF-8, or fail in one line naming the file, line and byte offset."""

from __future__ import annotations

from pathlib import Path

from drivetrain.api.errors import DrivetrainError


def decode_utf8(
    raw: bytes, file: Path, error: type[DrivetrainError], *, line: int = 1, offset: int = 0
) -> str:
    """``raw`` as text. ``line`` and ``offset`` are where ``raw`` starts in ``file`` (1-based
    line, 0-based byte), so a chunk read line by line reports the file's own position."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        where = line + raw.count(b"\n", 0, exc.start)
        raise error(
            f"{file}:{where}: not UTF-8 (byte offset {offset + exc.start}: {exc.reason}); "
            "save the file as UTF-8"
        ) from None
