"""Stream rows (dicts) from local JSONL, JSON or Parquet files, each with where it came from.

JSONL is read line by line and Parquet by record batch, so a large file is never held in
memory whole; a ``.json`` file is one document and is parsed at once (use JSONL for big data).
Rows and errors name the file and the position: ``file:line`` (JSONL, and a JSON syntax or
encoding error), ``file item i`` (JSON), ``file row i`` (Parquet).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from drivetrain.trainer.errors import DataError
from drivetrain.trainer.utf8 import decode_utf8

SUFFIXES = (".jsonl", ".json", ".parquet")
#: rows converted to Python objects at once when reading Parquet
PARQUET_BATCH_ROWS = 1024

Row = tuple[str, dict[str, Any]]  # (where, row): "file:line", "file item i" or "file row i"


def iter_rows(path: str | Path) -> Iterator[Row]:
    """Rows of ``path`` as they are read; the format follows the suffix. The file is checked
    here, before the first row is asked for."""
    file = Path(path)
    if file.is_dir():
        raise DataError(f"data file {str(file)!r} is a directory; point at a file in it")
    if not file.is_file():
        raise DataError(f"data file {str(file)!r} does not exist")
    suffix = file.suffix.lower()
    if suffix == ".jsonl":
        return _jsonl_rows(file)
    if suffix == ".json":
        return _json_rows(file)
    if suffix == ".parquet":
        return _parquet_rows(file)
    raise DataError(f"data file {str(file)!r}: unknown format; use one of {', '.join(SUFFIXES)}")


def _check_row(where: str, row: Any) -> dict[str, Any]:
    if not isinstance(row, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(row).__name__}")
    return row


def _jsonl_rows(file: Path) -> Iterator[Row]:
    offset = 0  # of the line in the file, for the position of a non-UTF-8 byte
    with open(file, "rb") as f:
        for number, raw in enumerate(f, start=1):
            line = decode_utf8(raw, file, DataError, line=number, offset=offset)
            offset += len(raw)
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataError(f"{file}:{number}: not valid JSON ({exc.msg})") from None
            yield f"{file}:{number}", _check_row(f"{file}:{number}", row)


def _json_rows(file: Path) -> Iterator[Row]:
    try:
        data = json.loads(decode_utf8(file.read_bytes(), file, DataError))
    except json.JSONDecodeError as exc:
        raise DataError(f"{file}:{exc.lineno}: not valid JSON ({exc.msg})") from None
    if not isinstance(data, list):
        raise DataError(f"{file}: a .json data file must hold a list of objects")
    for i, row in enumerate(data):
        yield f"{file} item {i}", _check_row(f"{file} item {i}", row)


def _parquet_rows(file: Path) -> Iterator[Row]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    index = 0
    try:
        for batch in pq.ParquetFile(file).iter_batches(batch_size=PARQUET_BATCH_ROWS):
            for row in batch.to_pylist():
                yield f"{file} row {index}", row
                index += 1
    except (pa.ArrowException, OSError) as exc:
        raise DataError(f"{file}: not a readable Parquet file ({exc})") from None
