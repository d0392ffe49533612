"""The same SFT job in-process, under torchrun and on Ray (one machine, or two nodes of a
cluster) gives the same loss curve (fp32); a node that cannot see the job's files is refused."""

from __future__ import annotations

import pytest

from cli_run import run_command
from ray_cluster import RayCluster, can_hide_directories
from sft_support import make_job, run_sft, sft_command, sft_env, train_losses

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    root = tmp_path_factory.mktemp("launchers")
    base = make_job(root)
    out = root / "inprocess"
    run_sft(root, out, *base)
    return root, base, train_losses(out)


def assert_same_curve(reference: dict[int, float], other: dict[int, float]) -> None:
    assert list(other) == list(reference) == [1, 2, 3, 4, 5, 6]
    for step, loss in reference.items():
        assert other[step] == pytest.approx(loss, abs=1e-5), (step, reference, other)
    assert reference[6] < reference[1]  # it trains


def test_torchrun_two_ranks(job):
    root, base, reference = job
    run_sft(root, root / "torchrun", *base, nproc=2)
    assert_same_curve(reference, train_losses(root / "torchrun"))


@pytest.mark.slow  # a local Ray cluster's start: 30 s
def test_ray_two_actors_local(job):
    root, base, reference = job
    run_sft(root, root / "ray", *base, "workers.num=2")
    assert_same_curve(reference, train_losses(root / "ray"))


@pytest.fixture
def two_nodes(job):
    """A Ray cluster of two one-CPU nodes (and a head with none) on this machine."""
    root, _, _ = job
    with RayCluster(sft_env(root)) as cluster:
        nodes = [cluster.add_node(cpus=1) for _ in range(2)]
        yield cluster, nodes


@pytest.mark.slow  # a cluster of three Ray nodes and two actors: 40 s
def test_ray_ranks_on_two_nodes_of_a_cluster(job, two_nodes):
    """Each node holds one CPU, so the two ranks land on two nodes (one per machine, as on a
    real cluster), rendezvous across them and train the same curve as one process."""
    root, base, reference = job
    cluster, _ = two_nodes
    out = root / "two-nodes"
    cmd = sft_command(f"run.output_dir={out}", *base, "workers.num=2",
                      f"workers.ray_address={cluster.address}")  # fmt: skip
    done = run_command(cmd, env=sft_env(root), timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    placed = next(line for line in done.stderr.splitlines() if line.startswith("actor ranks on"))
    assert placed.startswith("actor ranks on 2 node(s): 0 "), placed
    assert_same_curve(reference, train_losses(out))


@pytest.mark.slow  # a cluster of three Ray nodes, refused before any engine: 25 s
@pytest.mark.skipif(not can_hide_directories(), reason="needs a mount namespace (unshare -m)")
def test_a_node_that_cannot_see_the_output_directory_fails_in_one_line(job):
    """One node has its own empty disk where the others see the job's directory (the model,
    the output directory): the run stops before any engine is built, naming the node and what
    it cannot see, and nothing of a checkpoint is written."""
    root, base, _ = job
    out = root / "blind"
    with RayCluster(sft_env(root)) as cluster:
        cluster.add_node(cpus=1)
        cluster.add_node(cpus=1, blind_to=root)
        cmd = sft_command(f"run.output_dir={out}", *base, "workers.num=2",
                          f"workers.ray_address={cluster.address}")  # fmt: skip
        done = run_command(cmd, env=sft_env(root), timeout=300)
    assert done.returncode == 2, done.stderr[-3000:]
    error = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(error) == 1, done.stderr[-3000:]
    assert f"cannot see run.output_dir={out} (no marker from the controller" in error[0]
    assert f"engine.model.path={root / 'model'} (no such path)" in error[0]
    assert "shared filesystem" in error[0]
    assert not (out / "checkpoints").exists() or not any((out / "checkpoints").iterdir())
