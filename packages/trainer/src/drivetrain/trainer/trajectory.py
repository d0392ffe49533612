"""A multi-turn episode as one training sample: sampled turns with observations between them.

An agentic episode samples an assistant turn, gets observation tokens (tool results, the next
user turn) appended as prompt, samples the next turn after them, and so on. The trainer
trains on exactly the token ids the rollout sampled (never on a re-tokenised chat, which
drifts: the same text can tokenise differently), so the episode is kept as the token ids in
the order the model saw them, with a mask telling sampled tokens from observation tokens.

A :class:`Trajectory` is a :class:`~drivetrain.api.rollout.Completion` whose ``token_ids``
(after the first prompt) interleave both: ``sampled[i]`` is 1 where ``token_ids[i]`` was
sampled, 0 on observation tokens, whose ``log_probs`` are 0 and ``token_versions`` -1. Code
that handles completions (lengths, finish reasons, batching) handles trajectories too;
:func:`~drivetrain.trainer.rollout_batch.completions_to_batch` gives observation tokens loss
mask 0.
"""

from __future__ import annotations

from dataclasses import dataclass

from drivetrain.api.rollout import Completion

#: ``token_versions`` of an observation token (as of a prompt token in a batch)
OBSERVATION_VERSION = -1


@dataclass(frozen=True)
class Trajectory(Completion):
    """An episode's tokens after its first prompt (see the module docstring).

    ``turn_ends[k]`` is the index in ``token_ids`` of turn ``k``'s last sampled token, where
    a per-turn reward lands; ``finish_reason`` is the last turn's.
    """

    sampled: tuple[int, ...] = ()
    turn_ends: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        n = len(self.token_ids)
        problems = []
        if len(self.sampled) != n:
            problems.append(f"{len(self.sampled)} sampled flags")
        if len(self.log_probs) != n:
            problems.append(f"{len(self.log_probs)} log-probs")
        if self.token_versions and len(self.token_versions) != n:
            problems.append(f"{len(self.token_versions)} token versions")
        if problems:
            raise ValueError(f"trajectory of {n} tokens but " + ", ".join(problems))
        if any(not 0 <= end < n or not self.sampled[end] for end in self.turn_ends):
            raise ValueError(f"turn ends {self.turn_ends} must index sampled tokens")

    @property
    def sampled_count(self) -> int:
        return sum(self.sampled)


def sampled_mask(completion: Completion) -> list[int]:
    """1 on the tokens a completion's model sampled: all of a plain completion's, a
    trajectory's ``sampled``."""
    if isinstance(completion, Trajectory):
        return list(completion.sampled)
    return [1] * len(completion.token_ids)
