"""Shared pieces of the multi-turn episode tests: a three-turn environment with a tool, a
rollout wrapper recording what it was asked and what it sampled, and the token-exactness
check every rollout backend passes."""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch

from drivetrain.api import SamplingParams
from drivetrain.api.columns import INPUT_IDS, LOSS_MASK, ROLLOUT_LOG_PROBS
from drivetrain.api.environment import AssistantTurn, Environment, Episode, StepResult, Task
from drivetrain.runtime.rollout_service import RolloutService
from drivetrain.trainer.agentic.chat_tokens import ChatTokens
from drivetrain.trainer.agentic.episodes import EpisodeLimits, EpisodeRunner
from drivetrain.trainer.agentic.tool_parsers import tool_parser
from rollout_support import as_batch, fsdp_engine, recomputed_log_probs

TURNS = 3
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "lookup",
            "description": "looks a key up",
            "parameters": {"type": "object", "properties": {"key": {"type": "string"}}},
        },
    }
]


class ThreeTurnEpisode(Episode):
    """Answers every turn with a tool result until the third; rewards each turn."""

    def __init__(self, task: Task, seen: list) -> None:
        self.task, self.seen = task, seen

    def reset(self):
        return [{"role": "user", "content": f"task {self.task['k']}"}]

    def step(self, turn: AssistantTurn) -> StepResult:
        self.seen.append(turn)
        if turn.index + 1 >= TURNS:
            return StepResult(reward=1.0, done=True)
        observation = {"role": "tool", "name": "lookup", "content": f"value {turn.index * 7}"}
        return StepResult((observation,), reward=0.25, info={"tools/calls": 1.0})


class ThreeTurns(Environment):
    def __init__(self) -> None:
        super().__init__()
        self.seen: list[AssistantTurn] = []
        self.lock = threading.Lock()

    def tools(self):
        return TOOLS

    def episode(self, task: Task) -> Episode:
        return ThreeTurnEpisode(task, self.seen)


class Recording:
    """The hf rollout, recording every request it was given and every token it sampled."""

    def __init__(self, rollout) -> None:
        self.rollout = rollout
        self.requests: dict[str, tuple[int, ...]] = {}
        self.sampled: dict[str, list[int]] = {}

    def submit(self, requests: Sequence) -> None:
        for r in requests:
            self.requests[r.request_id] = r.prompt_ids
        self.rollout.submit(requests)

    def poll(self, timeout_s: float = 0.0):
        chunks = self.rollout.poll(timeout_s)
        for chunk in chunks:
            self.sampled.setdefault(chunk.request_id, []).extend(chunk.token_ids)
        return chunks

    def abort(self, ids=None):
        return self.rollout.abort(ids)


def play_and_check(rollout, model_dir, tasks: int, n: int, *, mean_gap: float, max_gap: float):
    """``tasks x n`` three-turn episodes on ``rollout``: every turn continued exactly the ids
    the batch holds before it, observation tokens have loss mask 0 and no log-prob, and the
    rollout's log-probs are engine-fsdp's on the sampled tokens. Returns the episodes."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    recording = Recording(rollout)
    chat = ChatTokens(tokenizer, TOOLS)
    runner = EpisodeRunner(
        RolloutService([recording], threads=False), ThreeTurns(), tool_parser("hermes"), chat,
        EpisodeLimits(max_turns=5, turn_tokens=12, episode_tokens=0, context=256),
    )  # fmt: skip
    params = SamplingParams(temperature=0.8, max_new_tokens=12, seed=3)
    played = runner.play([{"k": k} for k in range(tasks)], n, params)
    assert len(played) == tasks * n
    assert [e.task for e in played] == [k // n for k in range(tasks * n)]
    assert all(e.turns == TURNS and e.truncation == "" for e in played)
    assert all(e.turn_rewards == (0.25, 0.25, 1.0) for e in played)
    batch = as_batch([e.trajectory for e in played])
    for row, episode in enumerate(played):
        t = episode.trajectory
        rebuilt, mask = list(t.prompt_ids), [0] * len(t.prompt_ids)
        for turn in range(TURNS):
            request = f"p0-e{row}-t{turn}"
            assert list(recording.requests[request]) == rebuilt
            sampled = recording.sampled[request]
            rebuilt += sampled
            mask += [1] * len(sampled)
            if turn + 1 < TURNS:
                observed = chat.observation(
                    [{"role": "tool", "name": "lookup", "content": f"value {turn * 7}"}], sampled
                )
                assert tokenizer.decode(observed).startswith("<|")  # a rendered turn
                rebuilt += observed
                mask += [0] * len(observed)
        width = len(rebuilt)
        assert batch[INPUT_IDS][row, :width].tolist() == rebuilt
        assert batch[LOSS_MASK][row, :width].tolist() == mask
        assert not batch[LOSS_MASK][row, width:].any()
    engine = fsdp_engine(model_dir)
    recomputed = recomputed_log_probs(engine, [e.trajectory for e in played], 0.8)
    gaps = []
    for row, (episode, again) in enumerate(zip(played, recomputed, strict=True)):
        sampled = torch.tensor(episode.trajectory.sampled, dtype=torch.bool)
        start = len(episode.trajectory.prompt_ids)
        rollout_lp = batch[ROLLOUT_LOG_PROBS][row, start : start + len(sampled)]
        gaps.append((rollout_lp[sampled] - again[sampled]).abs())
        assert not rollout_lp[~sampled].any()  # observation tokens carry no log-prob
    gap = torch.cat(gaps)
    print(f"episode log-probs vs engine-fsdp: max {gap.max():.2e} mean {gap.mean():.2e}")
    assert gap.mean() < mean_gap and gap.max() < max_gap
    return played, batch
