"""Publishing a directory over another: a crash at any point leaves the old or the new one."""

import contextlib

import pytest

from drivetrain.runtime import atomic_dir
from drivetrain.runtime.atomic_dir import publish, staging_path
from drivetrain.testing.crash import Crashed, crash_at


def _write(directory, text):
    directory.mkdir()
    (directory / "data").write_text(text)


@pytest.mark.parametrize("exchange", [True, False], ids=["renameat2", "two-renames"])
def test_replacing_survives_a_crash_at_every_point(tmp_path, monkeypatch, exchange):
    if not exchange:  # the fallback where the system cannot swap: a window remains
        monkeypatch.setattr(atomic_dir, "_exchange", lambda a, b: False)
    seen = set()
    for n in range(1, 20):
        target = tmp_path / f"t{n}"
        _write(target, "old")
        staging = staging_path(target)
        _write(staging, "new")
        with crash_at(n, tmp_path) as plan, contextlib.suppress(Crashed):
            publish(staging, target)
        atomic_dir.remove_stale_staging(tmp_path)  # what the next start does
        state = (target / "data").read_text() if target.exists() else "missing"
        seen.add(state)
        if not plan.crashed_at:
            break
    if exchange:  # the swap is one system call: a crash comes before it (old) or after (new)
        assert seen == {"new"}
    else:  # a crash between the two renames: clean-up puts the previous one back
        assert seen == {"old", "new"}
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # nothing left over
