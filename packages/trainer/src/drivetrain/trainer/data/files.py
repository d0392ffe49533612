"""Read rows (dicts) from local JSONL, JSON or Parquet files, with errors that point at the row."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from drivetrain.trainer.errors import DataError

SUFFIXES = (".jsonl", ".json", ".parquet")


def read_rows(path: str | Path) -> list[dict[str, Any]]:
    """All rows of ``path``; the format follows the suffix (``.jsonl``, ``.json``, ``.parquet``)."""
    file = Path(path)
    if not file.is_file():
        raise DataError(f"data file {str(file)!r} does not exist")
    suffix = file.suffix.lower()
    if suffix == ".jsonl":
        return _read_jsonl(file)
    if suffix == ".json":
        return _read_json(file)
    if suffix == ".parquet":
        return _read_parquet(file)
    raise DataError(f"data file {str(file)!r}: unknown format; use one of {', '.join(SUFFIXES)}")


def _check_row(file: Path, where: str, row: Any) -> dict[str, Any]:
    if not isinstance(row, dict):
        raise DataError(f"{file}:{where}: expected a JSON object, got {type(row).__name__}")
    return row


def _read_jsonl(file: Path) -> list[dict[str, Any]]:
    rows = []
    with open(file, encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataError(f"{file}:{number}: not valid JSON ({exc.msg})") from None
            rows.append(_check_row(file, str(number), row))
    return rows


def _read_json(file: Path) -> list[dict[str, Any]]:
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise DataError(f"{file}:{exc.lineno}: not valid JSON ({exc.msg})") from None
    if not isinstance(data, list):
        raise DataError(f"{file}: a .json data file must hold a list of objects")
    return [_check_row(file, f"item {i}", row) for i, row in enumerate(data)]


def _read_parquet(file: Path) -> list[dict[str, Any]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(file)
    except (pa.ArrowException, OSError) as exc:
        raise DataError(f"{file}: not a readable Parquet file ({exc})") from None
    return table.to_pylist()
