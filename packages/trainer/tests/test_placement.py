"""Which transport carries the weights for each placement."""

import pytest

from drivetrain.api.errors import ConfigError
from drivetrain.trainer.rl.placement import resolve_transport


def test_in_process_weights_go_direct_unless_the_rollout_has_its_own_process():
    assert resolve_transport("auto", "inprocess") == "direct"
    # a rollout in a server process (rollout.python) is another address space
    assert resolve_transport("auto", "inprocess", rollout_process=True) == "colocated"
    assert resolve_transport("disk", "inprocess", rollout_process=True) == "disk"
    with pytest.raises(ConfigError, match="direct transport cannot reach a rollout"):
        resolve_transport("direct", "inprocess", rollout_process=True)


def test_ray_placements_default_to_their_transport():
    assert resolve_transport("auto", "colocated") == "colocated"
    assert resolve_transport("auto", "separate") == "broadcast"
    assert resolve_transport("disk", "separate") == "disk"
