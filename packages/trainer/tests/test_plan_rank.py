"""A rank's phases: the busy role's own peak plus what the others hold (offloaded states
excepted), the colocated rollout's share while it generates, and held throughout when it
cannot sleep."""

from __future__ import annotations

import dataclasses

from drivetrain.api import EngineConfig, OffloadConfig
from drivetrain.api.plan import GiB, MemoryPlan
from drivetrain.trainer.plan_rank import RolloutShare, busiest, phases

STATES = {"parameters": 2 * GiB, "optimizer": 4 * GiB, "buffers": 0, "activations": 9 * GiB}


def _roles(offload: OffloadConfig | None = None):
    actor = MemoryPlan("fsdp2", 8, 17 * GiB, dict(STATES, gradients=2 * GiB))
    reference = MemoryPlan("fsdp2", 8, 3 * GiB, {"parameters": 2 * GiB, "activations": GiB})
    return [
        (
            "actor",
            dataclasses.replace(EngineConfig(), offload=offload or OffloadConfig()),
            actor,
            True,
        ),
        ("reference", EngineConfig(), reference, False),
    ]


def test_each_phase_holds_the_others_states_and_the_rollout_its_share():
    found = {p.name: p for p in phases(_roles(), RolloutShare("vllm", fraction=0.5), 80 * GiB)}
    assert found["rollout generates"].parts == {
        "actor (held)": 6 * GiB, "reference (held)": 2 * GiB, "rollout vllm": 40 * GiB,
    }  # fmt: skip
    assert found["actor trains"].bytes == 17 * GiB + 2 * GiB
    assert found["reference scores"].bytes == 3 * GiB + 6 * GiB
    assert busiest(list(found.values())).name == "rollout generates"


def test_offloaded_states_leave_the_device_while_others_run():
    offload = OffloadConfig(params=True, optimizer=True)
    found = {p.name: p for p in phases(_roles(offload), RolloutShare("vllm", 0.5), 80 * GiB)}
    assert found["rollout generates"].parts["actor (held)"] == 0
    assert found["actor trains"].bytes == 19 * GiB  # its own step brings them back


def test_a_rollout_that_cannot_sleep_is_held_while_the_roles_run():
    awake = RolloutShare("hf", fixed_bytes=5 * GiB, sleeps=False)
    found = {p.name: p for p in phases(_roles(), awake, 80 * GiB)}
    assert found["actor trains"].parts["rollout hf (awake: no sleep)"] == 5 * GiB
    assert found["actor trains"].bytes == 24 * GiB
