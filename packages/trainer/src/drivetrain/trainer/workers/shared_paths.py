"""What a run on several machines assumes of the filesystem, checked before any engine is built.

The ranks of a Ray job run on the cluster's nodes, each a machine with its own disks. Every rank
writes its checkpoint shards under ``run.output_dir`` and loads the model from the path in the
config, so those must lie on a filesystem every node mounts at the same path (NFS, Lustre, a
mounted bucket), as must ``DRIVETRAIN_CACHE`` where a built-in job keeps the model it makes. A
directory of the same name on a node's own disk would let the run start and then scatter or lose
its checkpoints: the controller writes a marker with a fresh token into the output directory and
every rank reads it back before the engines are built.
"""

from __future__ import annotations

import contextlib
import secrets
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from drivetrain.api.errors import ConfigError

MARKER = ".drivetrain-node-check"


@dataclass(frozen=True)
class SharedPaths:
    """The paths every rank's node must see: ``output_dir`` (written there) and ``read``
    (config key -> a local path the ranks load from; hub ids are not paths and are left out)."""

    output_dir: str
    read: Mapping[str, str] = field(default_factory=dict)
    token: str = ""

    @staticmethod
    def of(output_dir: str, read: Mapping[str, str]) -> SharedPaths:
        """The paths of ``read`` that exist here (what the ranks would load from a hub is not
        a path), beside ``output_dir``."""
        return SharedPaths(output_dir, {k: p for k, p in read.items() if p and Path(p).exists()})


@contextlib.contextmanager
def marked(paths: SharedPaths) -> Iterator[SharedPaths]:
    """``paths`` with a fresh token, written into the output directory for the ranks to read
    back; removed afterwards."""
    token = secrets.token_hex(16)
    marker = Path(paths.output_dir) / MARKER
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.write_text(token)
    try:
        yield SharedPaths(paths.output_dir, dict(paths.read), token)
    finally:
        marker.unlink(missing_ok=True)


def unseen(paths: SharedPaths) -> list[str]:
    """Run on a rank's node: what of ``paths`` it cannot see, as ``key=path (why)``."""
    missing = []
    marker = Path(paths.output_dir) / MARKER
    try:
        found = marker.read_text()
    except OSError as exc:
        found = f"({type(exc).__name__})"
    if found != paths.token:
        why = "no marker from the controller" if found.startswith("(") else "another marker"
        missing.append(f"run.output_dir={paths.output_dir} ({why}: not the controller's disk)")
    missing += [f"{key}={path} (no such path)" for key, path in paths.read.items()
                if not Path(path).exists()]  # fmt: skip
    return missing


def refuse_unseen(missing_by_rank: Mapping[int, tuple[str, list[str]]]) -> None:
    """:class:`ConfigError` in one line naming the first rank (and its node) that cannot see
    what it must, when any cannot. ``missing_by_rank``: rank -> (its node, :func:`unseen`)."""
    blind = {rank: found for rank, found in missing_by_rank.items() if found[1]}
    if not blind:
        return
    rank = min(blind)
    node, missing = blind[rank]
    others = f" (and {len(blind) - 1} more rank(s))" if len(blind) > 1 else ""
    raise ConfigError(
        f"rank {rank} on node {node}{others} cannot see {'; '.join(missing)}: every node of a "
        "cluster must mount the output directory and the model at the same path (a shared "
        "filesystem: NFS, Lustre, a mounted bucket); see 'Running on a cluster' in the README"
    )
