"""What a rank's node must see, and which transports may cross nodes (no Ray: the cluster runs
of these checks are tests/test_sft_launchers.py and tests/test_rl_jobs.py)."""

from __future__ import annotations

import pytest

from drivetrain.api.errors import ConfigError
from drivetrain.trainer.rl.placement import check_reaches
from drivetrain.trainer.workers.ray_group import NodeOf, placement_line
from drivetrain.trainer.workers.shared_paths import (
    MARKER,
    SharedPaths,
    marked,
    refuse_unseen,
    unseen,
)


def test_a_node_seeing_the_controllers_marker_and_the_model_passes(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    paths = SharedPaths.of(str(tmp_path / "out"), {"engine.model.path": str(model)})
    with marked(paths) as sent:
        assert (tmp_path / "out" / MARKER).read_text() == sent.token
        assert unseen(sent) == []
    assert not (tmp_path / "out" / MARKER).exists()  # nothing left behind


def test_a_hub_id_is_not_a_path_to_check():
    paths = SharedPaths.of("/out", {"engine.model.path": "Qwen/Qwen3-8B", "ref": ""})
    assert paths.read == {}


def test_another_disk_at_the_same_path_is_told_apart(tmp_path):
    """A node's own directory of that name: no marker, or one of another run (its token)."""
    model = tmp_path / "model"
    model.mkdir()
    paths = SharedPaths.of(str(tmp_path / "out"), {"engine.model.path": str(model)})
    with marked(paths) as sent:
        elsewhere = SharedPaths(str(tmp_path / "elsewhere"), {"m": str(tmp_path / "gone")}, "x")
        assert unseen(elsewhere) == [
            f"run.output_dir={tmp_path / 'elsewhere'} (no marker from the controller: not "
            "the controller's disk)",
            f"m={tmp_path / 'gone'} (no such path)",
        ]
        stale = SharedPaths(sent.output_dir, {}, "another run's token")
        assert "another marker" in unseen(stale)[0]


def test_the_refusal_names_the_first_blind_rank_its_node_and_the_fix():
    refuse_unseen({0: ("a (1.2.3.4)", []), 1: ("b (1.2.3.5)", [])})  # all see: no error
    with pytest.raises(ConfigError) as refused:
        refuse_unseen({0: ("a", []), 2: ("c (10.0.0.3)", ["x=/y (no such path)"]), 1: ("b", ["z"])})
    message = str(refused.value)
    assert "\n" not in message
    assert message.startswith("rank 1 on node b (and 1 more rank(s)) cannot see z: ")
    assert "shared filesystem" in message


def test_only_a_cross_node_transport_reaches_a_rollout_on_another_node():
    here, there = NodeOf("a" * 56, "10.0.0.1"), NodeOf("b" * 56, "10.0.0.1")  # same address
    check_reaches("colocated", here, [here, here])  # one machine: shared memory is fine
    check_reaches("broadcast", here, [here, there])
    check_reaches("disk", here, [there])
    with pytest.raises(ConfigError, match=r"rollout 1 runs on node bbbbbbbb \(10.0.0.1\) .* "
                       r"colocated weight-sync transport stays on one machine"):  # fmt: skip
        check_reaches("colocated", here, [here, there])


def test_the_placement_line_counts_nodes_and_lists_each_rank():
    a, b = NodeOf("a" * 56, "10.0.0.1"), NodeOf("b" * 56, "10.0.0.2")
    assert placement_line("actor ranks", [a, b, a]) == (
        "actor ranks on 2 node(s): 0 aaaaaaaa (10.0.0.1), 1 bbbbbbbb (10.0.0.2), "
        "2 aaaaaaaa (10.0.0.1)"
    )
