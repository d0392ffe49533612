"""A trajectory grown turn by turn: what the episode runner and the endpoint's sessions both
record, in one place, so both build the same :class:`~drivetrain.trainer.trajectory.Trajectory`."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from drivetrain.api import Completion, FinishReason
from drivetrain.trainer.trajectory import OBSERVATION_VERSION, Trajectory


@dataclass
class GrowingTrajectory:
    """The first prompt, then sampled turns and observations as they come."""

    prompt: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    sampled: list[int] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    turn_ends: list[int] = field(default_factory=list)
    first_version: int | None = None
    last_reason: FinishReason = FinishReason.STOP

    def add_observation(self, ids: Sequence[int]) -> None:
        """Observation tokens: prompt for the next turn, never trained on."""
        n = len(ids)
        self.tokens += ids
        self.log_probs += [0.0] * n
        self.sampled += [0] * n
        self.versions += [OBSERVATION_VERSION] * n

    def add_turn(self, completion: Completion) -> None:
        """A sampled turn (a turn that sampled nothing leaves no turn end)."""
        ids = completion.token_ids
        if self.first_version is None:
            self.first_version = completion.weight_version
        self.tokens += ids
        self.log_probs += completion.log_probs
        self.sampled += [1] * len(ids)
        self.versions += list(completion.token_versions) or [completion.weight_version] * len(ids)
        self.last_reason = completion.finish_reason
        if ids:
            self.turn_ends.append(len(self.tokens) - 1)

    def trajectory(self, number: int) -> Trajectory:
        return Trajectory(
            prompt_index=number,
            prompt_ids=tuple(self.prompt),
            token_ids=tuple(self.tokens),
            log_probs=tuple(self.log_probs),
            finish_reason=self.last_reason,
            weight_version=self.first_version or 0,
            token_versions=tuple(self.versions),
            sampled=tuple(self.sampled),
            turn_ends=tuple(self.turn_ends),
        )
