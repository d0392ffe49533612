"""Which rollout replica generates what: one policy for every caller (a step's prompts, the
groups generated ahead of training, episodes, the agent endpoint's sessions).

``count`` items (prompts, or samples numbered ``prompt * n + sample``) are cut into contiguous
chunks, one per replica, whose sizes differ by at most one: a prompt's samples and an episode's
growing prompt stay on one replica (where their prefix is cached), and a step spreads evenly.
Seeds are numbered within a chunk (``Slot.first``), so one replica and several give every
sample the same seed when it lands first in its chunk as it does overall with one.
"""

from __future__ import annotations

from dataclasses import dataclass

from drivetrain.api.partition import chunk_sizes


@dataclass(frozen=True)
class Slot:
    """Where one item goes: its replica, and the first item of that replica's chunk."""

    replica: int
    first: int


def replica_slots(count: int, replicas: int) -> list[Slot]:
    """The slot of each of ``count`` items over ``replicas`` replicas (contiguous chunks)."""
    if replicas < 1:
        raise ValueError(f"at least one rollout replica is needed, got {replicas}")
    if count == 0:
        return []
    sizes = chunk_sizes(count, min(replicas, count))
    slots: list[Slot] = []
    for replica, size in enumerate(sizes):
        slots += [Slot(replica, len(slots))] * size
    return slots
