"""Hostile and damaged checkpoints, as a user meets them with `drivetrain sft` (issue: reliability
items 1-4). Each case runs the real command on a tiny fsdp2 job in a subprocess.

- a checkpoint file that would run a command when unpickled is refused, and nothing runs
  (the attacker rewrites the manifest too, so this is the unpickling defence, not the digest);
- flipped exponent bits in 2,048 floats of a weight, 4 KB of optimizer state XOR-ed, or a
  truncated file: an explicit --resume refuses in one line naming the file; --resume auto
  takes the newest checkpoint that verifies and says which it skipped;
- a new run into another run's directory is refused; --overwrite moves the old one aside;
  the finished run resumed trains nothing, writes nothing and says so (issue 34, item 2).
"""

from __future__ import annotations

import json
import os
import pickle
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from drivetrain.runtime.manifest import verify_manifest, write_manifest
from sft_support import (
    CHECKPOINTED_STEPS,
    make_job,
    run_sft,
    sft_again,
    sft_command,
    sft_env,
    step_dir,
    train_losses,
)

pytestmark = [pytest.mark.fault, pytest.mark.timeout(300)]

STEPS = CHECKPOINTED_STEPS
sft = sft_again


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("faults")
    base = make_job(root)
    run_sft(root, root / "run", *base, *STEPS, "run.export_hf=true")
    return root, base


def copy_run(trained, tmp_path) -> Path:
    root, _ = trained
    out = tmp_path / "run"
    shutil.copytree(root / "run", out)
    return out


class RunsACommand:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def plant_extra(engine_dir: Path, marker: Path) -> Path:
    torch.save({"step": 4, "rng": RunsACommand(marker)}, engine_dir / "extra_rank0.pt")
    return engine_dir / "extra_rank0.pt"


def plant_metadata(engine_dir: Path, marker: Path) -> Path:
    (engine_dir / ".metadata").write_bytes(pickle.dumps(RunsACommand(marker)))
    return engine_dir / ".metadata"


@pytest.mark.parametrize("plant", [plant_extra, plant_metadata])
def test_a_checkpoint_that_would_run_code_is_refused(trained, tmp_path, plant):
    out = copy_run(trained, tmp_path)
    marker = tmp_path / "pwned"
    checkpoint = step_dir(out, 3)
    planted = plant(checkpoint / "engine", marker)
    write_manifest(checkpoint)  # whoever can write the files can rewrite the manifest
    done = sft(trained, tmp_path / "new", "--resume", str(checkpoint))
    assert not marker.exists(), "the checkpoint ran a command"
    assert done.returncode == 2, done.stderr
    error = done.stderr.strip().splitlines()[-1]
    assert str(planted) in error and "could run code" in error, done.stderr


def read_tensor(engine_dir: Path, key: str) -> torch.Tensor:
    """A tensor as the checkpoint holds it (a trusted read, in the test)."""
    meta = dcp.FileSystemReader(str(engine_dir)).read_metadata()
    template = torch.empty(meta.state_dict_metadata[key].size)
    state = {key: template}
    dcp.load(state, checkpoint_id=str(engine_dir), no_dist=True)
    return state[key]


def damage_bytes(path: Path, needle: bytes, change) -> None:
    data = bytearray(path.read_bytes())
    at = data.find(needle)
    assert at >= 0, "tensor bytes not found in the checkpoint file"
    data[at : at + len(needle)] = change(bytes(data[at : at + len(needle)]))
    path.write_bytes(bytes(data))


def flip_weight_exponents(engine_dir: Path) -> None:
    """2,048 floats of one weight with the top exponent bit flipped (x -> x * 2^128-ish)."""
    meta = dcp.FileSystemReader(str(engine_dir)).read_metadata()
    key = max((k for k in meta.state_dict_metadata if k.startswith("model.")),
              key=lambda k: meta.state_dict_metadata[k].size.numel())  # fmt: skip
    floats = read_tensor(engine_dir, key).flatten()[:2048].contiguous()
    flipped = (floats.view(torch.int32) ^ (1 << 30)).view(torch.float32)
    assert floats.numel() == 2048
    damage_bytes(engine_dir / "__0_0.distcp", floats.numpy().tobytes(),
                 lambda _: flipped.numpy().tobytes())  # fmt: skip


def xor_optimizer_state(engine_dir: Path) -> None:
    """4 KB of one exp_avg_sq XOR-ed."""
    meta = dcp.FileSystemReader(str(engine_dir)).read_metadata()
    key = max((k for k in meta.state_dict_metadata if k.endswith("exp_avg_sq")),
              key=lambda k: meta.state_dict_metadata[k].size.numel())  # fmt: skip
    state = read_tensor(engine_dir, key).flatten()[:1024].contiguous().numpy().tobytes()
    damage_bytes(engine_dir / "__0_0.distcp", state, lambda b: bytes(x ^ 0x5A for x in b))


def truncate_shard(engine_dir: Path) -> None:
    shard = engine_dir / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])


@pytest.mark.parametrize("damage", [flip_weight_exponents, xor_optimizer_state, truncate_shard])
def test_a_damaged_checkpoint_is_refused_or_skipped(trained, tmp_path, damage):
    out = copy_run(trained, tmp_path)
    reference = train_losses(out)
    newest = step_dir(out, 4)
    damage(newest / "engine")
    # explicit: one line naming the damaged file
    done = sft(trained, tmp_path / "new", "--resume", str(newest))
    assert done.returncode == 2, done.stderr
    (error,) = [line for line in done.stderr.splitlines() if line.strip()][-1:]
    assert str(newest / "engine" / "__0_0.distcp") in error, done.stderr
    # auto: the newest that verifies (step 3), saying why step 4 was skipped; the same losses
    done = sft(trained, out, "--resume", "auto")
    assert done.returncode == 0, done.stderr
    assert f"skipping checkpoint {newest}" in done.stderr + done.stdout
    assert "resumed from" in done.stderr + done.stdout and "step_00000003" in done.stderr
    assert train_losses(out)[4] == pytest.approx(reference[4], abs=1e-6)
    verify_manifest(step_dir(out, 4))  # the re-trained step 4 replaced the damaged one


def test_a_damaged_hf_export_is_refused_as_a_model(trained, tmp_path):
    root, _ = trained
    model = tmp_path / "hf"
    shutil.copytree(root / "run" / "hf", model)
    weights = model / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-4096:] = bytes(b ^ 0xFF for b in data[-4096:])
    weights.write_bytes(bytes(data))
    done = sft(trained, tmp_path / "new", f"engine.model.path={model}", "--resume", "none")
    assert done.returncode == 2 and str(weights) in done.stderr.strip().splitlines()[-1]


def test_a_new_run_never_mixes_with_another_runs_directory(trained, tmp_path):
    out = copy_run(trained, tmp_path)
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    # the finished run again (a scheduler's requeue): nothing to train, nothing written
    done = sft(trained, out, "--resume", "auto")
    assert done.returncode == 0, done.stderr
    said = (done.stdout + done.stderr).strip().splitlines()[-1]
    assert said.startswith("nothing to train: ") and "is at step 4" in said, said
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before
    done = sft(trained, out, "--resume", "none")
    assert done.returncode == 2 and "--overwrite" in done.stderr.strip().splitlines()[-1]
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before
    done = sft(trained, out, "--resume", "none", "--overwrite")
    assert done.returncode == 0, done.stderr
    (aside,) = tmp_path.glob("run.replaced-*")
    assert {p.relative_to(aside) for p in aside.rglob("*") if p.is_file()} == {
        p.relative_to(out) for p in before
    }
    states = [json.loads((p / "trainer_state.json").read_text())
              for p in sorted((out / "checkpoints").glob("step_*"))]  # fmt: skip
    assert [s["step"] for s in states] == [1, 2, 3, 4]
    assert len({s["run_id"] for s in states}) == 1
    old_ids = {json.loads((p / "trainer_state.json").read_text())["run_id"]
               for p in (aside / "checkpoints").glob("step_*")}  # fmt: skip
    assert old_ids.isdisjoint({states[0]["run_id"]})


def test_a_full_disk_is_one_line_naming_what_to_free(trained, tmp_path):
    """The drill: the disk filled during a save and the run ended in a 94-line traceback
    (torch's 'unexpected pos 704 vs 598', no word of space). Here the output directory is a
    1 MB tmpfs (in a private mount namespace) that fills after a checkpoint or two."""
    if subprocess.run(["unshare", "--mount", "--map-root-user", "true"]).returncode:
        pytest.skip("no mount namespace here (unshare --mount --map-root-user)")
    root, base = trained
    disk = tmp_path / "disk"
    disk.mkdir()
    cmd = sft_command(f"run.output_dir={disk / 'run'}", *base, *STEPS)
    script = (
        f"mount -t tmpfs -o size=1m tmpfs {disk} && {shlex.join(cmd)}; status=$?; "
        f"ls -a {disk / 'run' / 'checkpoints'}; exit $status"
    )
    done = subprocess.run(
        ["unshare", "--mount", "--map-root-user", "sh", "-c", script],
        env=sft_env(root), capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    error = done.stderr.strip().splitlines()[-1]
    said = re.fullmatch(
        rf"error: no space left writing {re.escape(str(disk))}/run/checkpoints/"
        r"\.step_0000000(\d)\.partial \(\d+ KB free, a checkpoint takes about \d+ KB\); "
        r"free \d+ MB and rerun with --resume auto",
        error,
    )  # fmt: skip
    assert said, error
    step = int(said[1])
    listed = done.stdout.split()  # what the run left on the full disk
    assert f"step_{step - 1:08d}" in listed and f".step_{step:08d}.partial" not in listed


def test_a_full_disk_is_recognised_in_its_real_shapes(tmp_path):
    """The errors a full device really raises (/dev/full): our own write's ENOSPC is one;
    torch's zip writer's errno-less short write is one only where little space is left (the
    test above)."""
    from drivetrain.trainer.checkpoint_space import out_of_space

    with pytest.raises(OSError) as own, open("/dev/full", "w") as f:
        f.write("x")
        f.flush()
    assert out_of_space(own.value, tmp_path)
    with pytest.raises(RuntimeError, match="unexpected pos") as torch_writer:
        torch.save({"w": torch.zeros(1000)}, "/dev/full")
    assert not out_of_space(torch_writer.value, tmp_path)  # space left here: another cause
    assert not out_of_space(RuntimeError("shape mismatch"), tmp_path)
