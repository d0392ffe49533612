"""DCP's .metadata is read once, checked once (manifest digest, allow-list) and handed to torch
from memory: a file swapped after the check is never read, and a changed one is refused."""

from __future__ import annotations

import os
import pickle

import pytest
import torch
import torch.distributed.checkpoint as dcp

from drivetrain.engine_core.dcp_metadata import metadata_read_once
from drivetrain.runtime.manifest import ManifestError, write_manifest
from drivetrain.runtime.untrusted import UnsafeFileError


class RunsACommand:
    def __init__(self, marker) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.fixture
def checkpoint(tmp_path):
    """A checkpoint directory as the trainer publishes it: engine/ inside, a manifest above."""
    engine = tmp_path / "step" / "engine"
    dcp.save({"w": torch.arange(6.0)}, checkpoint_id=str(engine), no_dist=True)
    write_manifest(tmp_path / "step")
    return engine


def load(engine):
    state = {"w": torch.zeros(6)}
    dcp.load(state, checkpoint_id=str(engine), no_dist=True)
    return state["w"]


@pytest.mark.fault
def test_a_swap_after_the_check_is_never_read(checkpoint, tmp_path):
    marker = tmp_path / "pwned"
    with metadata_read_once(checkpoint):
        assert load(checkpoint).tolist() == [0, 1, 2, 3, 4, 5]  # the one read
        # megatron-core reads the metadata several times per load: a writer swaps it now
        (checkpoint / ".metadata").write_bytes(pickle.dumps(RunsACommand(marker)))
        assert load(checkpoint).tolist() == [0, 1, 2, 3, 4, 5]
    assert not marker.exists()


@pytest.mark.fault
def test_changed_or_hostile_metadata_is_refused_before_torch_reads_it(checkpoint, tmp_path):
    metadata = checkpoint / ".metadata"
    metadata.write_bytes(metadata.read_bytes() + b"\0")  # not what the manifest says
    refused = pytest.raises(ManifestError, match=r"\.metadata differs from what was written")
    with refused, metadata_read_once(checkpoint):
        load(checkpoint)
    marker = tmp_path / "pwned"
    metadata.write_bytes(pickle.dumps(RunsACommand(marker)))
    write_manifest(checkpoint.parent)  # whoever can write the files can rewrite the manifest
    with pytest.raises(UnsafeFileError, match="could run code"), metadata_read_once(checkpoint):
        load(checkpoint)
    assert not marker.exists()
