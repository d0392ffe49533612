"""``wait_all`` reports the root cause when a Ray rank dies mid-collective: its peers' own
errors (gloo "connection closed") often reach the driver first."""

import os

import pytest

from drivetrain.trainer.errors import DataError, WorkerError
from drivetrain.trainer.job_config import WorkersConfig
from drivetrain.trainer.workers.ray_runtime import ensure_ray, wait_all

ray = pytest.importorskip("ray")

pytestmark = pytest.mark.serial  # a local Ray cluster and its actors; a 10 s grace for a death


@pytest.fixture(scope="module")
def local_ray():
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    started = ensure_ray(WorkersConfig())
    yield
    if started:
        ray.shutdown()


@ray.remote(num_cpus=0)
class Rank:
    def block(self) -> None:
        import threading

        threading.Event().wait()  # a peer stuck in a collective

    def fail_then_kill(self, peer) -> None:
        """This rank's error reaches the driver first; the peer's death a second later."""
        import threading

        threading.Timer(1.0, ray.kill, args=(peer,)).start()
        raise RuntimeError("[/__w/gloo/transport/tcp/pair.cc:537] Connection closed by peer")


def test_peer_death_is_reported_instead_of_its_consequence(local_ray):
    victim, survivor = Rank.remote(), Rank.remote()
    refs = [survivor.fail_then_kill.remote(victim), victim.block.remote()]
    with pytest.raises(WorkerError, match="a Ray worker died while training"):
        wait_all(refs, timeout=60, what="training")


def test_task_errors_without_a_death(local_ray):
    @ray.remote(num_cpus=0)
    def fails(error: Exception) -> None:
        raise error

    with pytest.raises(WorkerError, match="a Ray worker failed while training: (.|\\n)*bad input"):
        wait_all([fails.remote(ValueError("bad input"))], timeout=60, what="training")
    with pytest.raises(DataError, match="^no usable example$"):  # deliberate: as is
        wait_all(fails.remote(DataError("no usable example")), timeout=60, what="training")
