"""The digest manifest: a directory verifies only while every file is as written."""

from __future__ import annotations

import json

import pytest

from drivetrain.runtime.manifest import (
    MANIFEST_FILE,
    ManifestError,
    verify_manifest,
    write_manifest,
)

pytestmark = pytest.mark.fault


@pytest.fixture
def saved(tmp_path):
    (tmp_path / "engine").mkdir()
    (tmp_path / "engine" / "weights.bin").write_bytes(bytes(range(256)) * 64)
    (tmp_path / "state.json").write_text('{"step": 3}')
    write_manifest(tmp_path)
    return tmp_path


def test_an_untouched_directory_verifies(saved):
    assert verify_manifest(saved) == 256 * 64 + len('{"step": 3}')
    files = json.loads((saved / MANIFEST_FILE).read_text())["files"]
    assert sorted(files) == ["engine/weights.bin", "state.json"]


def flip_one_bit(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x40
    path.write_bytes(bytes(data))


def truncate(path):
    path.write_bytes(path.read_bytes()[:100])


def remove(path):
    path.unlink()


@pytest.mark.parametrize("damage", [flip_one_bit, truncate, remove])
def test_damage_names_the_file(saved, damage):
    damage(saved / "engine" / "weights.bin")
    with pytest.raises(ManifestError, match=r"engine/weights\.bin"):
        verify_manifest(saved)


def test_a_file_added_later_is_refused_unless_allowed(saved):
    (saved / "engine" / "extra_rank1.pt").write_bytes(b"x")
    with pytest.raises(ManifestError, match="extra_rank1.pt was not written"):
        verify_manifest(saved)
    assert verify_manifest(saved, allow_extra=True) > 0


@pytest.mark.parametrize("text", ["", "{not json", '{"format": 9}', '{"format": 1}'])
def test_a_corrupt_or_missing_manifest_is_one_clear_error(saved, text):
    (saved / MANIFEST_FILE).write_text(text)
    with pytest.raises(ManifestError, match="unreadable or corrupt"):
        verify_manifest(saved)
    (saved / MANIFEST_FILE).unlink()
    with pytest.raises(ManifestError, match="has no"):
        verify_manifest(saved)
