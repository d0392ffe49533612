"""Multi-turn episodes on the hf rollout are token-exact: the training batch holds exactly
the tokens the rollout sampled plus the observation tokens between turns (loss mask 0 there),
every turn's request continued exactly those ids, and the rollout's log-probs equal
engine-fsdp's on the sampled positions."""

from __future__ import annotations

import threading
from collections.abc import Sequence

import pytest
import torch

from drivetrain.api import SamplingParams
from drivetrain.api.columns import INPUT_IDS, LOSS_MASK, ROLLOUT_LOG_PROBS
from drivetrain.api.environment import AssistantTurn, Environment, Episode, StepResult, Task
from drivetrain.api.registry import rollouts
from drivetrain.api.tool_parsers import tool_parser
from drivetrain.rollout.config import HFRolloutConfig
from drivetrain.trainer.agentic.chat_tokens import ChatTokens
from drivetrain.trainer.agentic.episodes import EpisodeLimits, EpisodeRunner
from drivetrain.trainer.agentic.samples import episode_metrics, turn_rewards
from rollout_support import as_batch, build_model, fsdp_engine, recomputed_log_probs

pytestmark = pytest.mark.timeout(600)

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


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_model(tmp_path_factory.mktemp("episodes") / "model")


def test_100_episodes_of_three_turns_are_token_exact(model_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    hf = rollouts.load("hf")(HFRolloutConfig(model_path=str(model_dir), max_model_len=256))
    rollout = Recording(hf)
    chat = ChatTokens(tokenizer, TOOLS)
    environment = ThreeTurns()
    runner = EpisodeRunner(
        [rollout], environment, tool_parser("hermes"), chat,
        EpisodeLimits(max_turns=5, turn_tokens=12, episode_tokens=0, context=256),
    )  # fmt: skip
    tasks = [{"k": k} for k in range(25)]
    params = SamplingParams(temperature=0.8, max_new_tokens=12, seed=3)
    played = runner.play(tasks, 4, params)

    assert len(played) == 100
    assert [e.task for e in played] == [k // 4 for k in range(100)]
    assert all(e.turns == TURNS and e.truncation == "" for e in played)
    assert all(e.turn_rewards == (0.25, 0.25, 1.0) for e in played)
    batch = as_batch([e.trajectory for e in played])
    for row, episode in enumerate(played):
        t = episode.trajectory
        rebuilt, mask = list(t.prompt_ids), [0] * len(t.prompt_ids)
        for turn in range(TURNS):
            request = f"e{row}-t{turn}"
            # each turn continued exactly the ids the batch holds before it
            assert list(rollout.requests[request]) == rebuilt
            sampled = rollout.sampled[request]
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
    # the rollout's log-probs are the engine's on every sampled token (fp32, T=0.8)
    engine = fsdp_engine(model_dir)
    recomputed = recomputed_log_probs(engine, [e.trajectory for e in played], 0.8)
    gaps = []
    for row, (episode, again) in enumerate(zip(played, recomputed, strict=True)):
        sampled = torch.tensor(episode.trajectory.sampled, dtype=torch.bool)
        rollout_lp = batch[ROLLOUT_LOG_PROBS][row, len(episode.trajectory.prompt_ids) :]
        rollout_lp = rollout_lp[: len(sampled)]
        gaps.append((rollout_lp[sampled] - again[sampled]).abs())
        assert not rollout_lp[~sampled].any()  # observation tokens carry no log-prob
    gap = torch.cat(gaps)
    print(f"episode log-probs, hf vs engine-fsdp: max {gap.max():.2e} mean {gap.mean():.2e}")
    assert gap.max() < 1e-5
    # per-turn rewards land on each turn's last sampled token, and sum to the episode's
    placed = turn_rewards(batch.with_columns(loss_mask=batch[LOSS_MASK].float()), played)
    assert torch.allclose(placed.sum(-1), torch.full((100,), 1.5))
    metrics = episode_metrics(played)
    assert metrics["episode/turns_mean"] == TURNS and metrics["episode/done_frac"] == 1.0
    assert metrics["tools/calls_per_episode"] == 2.0


def test_limits_end_episodes_with_their_reason(model_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    hf = rollouts.load("hf")(HFRolloutConfig(model_path=str(model_dir), max_model_len=256))
    chat = ChatTokens(tokenizer, TOOLS)
    params = SamplingParams(temperature=1.0, max_new_tokens=8, seed=1)
    few_turns = EpisodeRunner(
        [hf], ThreeTurns(), tool_parser("hermes"), chat,
        EpisodeLimits(max_turns=2, turn_tokens=8, episode_tokens=0, context=256),
    )  # fmt: skip
    played = few_turns.play([{"k": 1}], 3, params)
    assert all(e.truncation == "max_turns" and e.turns == 2 for e in played)
    assert all(e.turn_rewards == (0.25, 0.25) for e in played)
    short = EpisodeRunner(
        [hf], ThreeTurns(), tool_parser("hermes"), chat,
        EpisodeLimits(max_turns=5, turn_tokens=8, episode_tokens=20, context=256),
    )  # fmt: skip
    played = short.play([{"k": 2}], 3, params)
    assert all(e.truncation == "episode_tokens" for e in played)
    assert all(len(e.trajectory.token_ids) <= 20 for e in played)
    assert episode_metrics(played)["episode/truncated/episode_tokens"] == 1.0
