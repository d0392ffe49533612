"""Multi-turn episodes on the hf rollout are token-exact: the training batch holds exactly
the tokens the rollout sampled plus the observation tokens between turns (loss mask 0 there),
every turn's request continued exactly those ids, and the rollout's log-probs equal
engine-fsdp's on the sampled positions (the vllm rollout: tests/test_rollout_vllm.py)."""

from __future__ import annotations

import pytest
import torch

from drivetrain.api import SamplingParams
from drivetrain.api.columns import LOSS_MASK
from drivetrain.api.registry import rollouts
from drivetrain.rollout.config import HFRolloutConfig
from drivetrain.runtime.rollout_service import RolloutService
from drivetrain.trainer.agentic.chat_tokens import ChatTokens
from drivetrain.trainer.agentic.episodes import EpisodeLimits, EpisodeRunner
from drivetrain.trainer.agentic.samples import episode_metrics, turn_rewards
from drivetrain.trainer.agentic.tool_parsers import tool_parser
from episode_support import TOOLS, TURNS, ThreeTurnEpisode, ThreeTurns, play_and_check
from rollout_support import build_model

pytestmark = pytest.mark.timeout(600)


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
    hf = rollouts.load("hf")(HFRolloutConfig(model_path=str(model_dir), max_model_len=256))
    # fp32 on both sides: measured max 9.5e-7
    played, batch = play_and_check(hf, model_dir, 25, 4, mean_gap=1e-6, max_gap=1e-5)
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
        RolloutService([hf], threads=False), ThreeTurns(), tool_parser("hermes"), chat,
        EpisodeLimits(max_turns=2, turn_tokens=8, episode_tokens=0, context=256),
    )  # fmt: skip
    played = few_turns.play([{"k": 1}], 3, params)
    assert all(e.truncation == "max_turns" and e.turns == 2 for e in played)
    assert all(e.turn_rewards == (0.25, 0.25) for e in played)
    short = EpisodeRunner(
        RolloutService([hf], threads=False), ThreeTurns(), tool_parser("hermes"), chat,
        EpisodeLimits(max_turns=5, turn_tokens=8, episode_tokens=20, context=256),
    )  # fmt: skip
    played = short.play([{"k": 2}], 3, params)
    assert all(e.truncation == "episode_tokens" for e in played)
    assert all(len(e.trajectory.token_ids) <= 20 for e in played)
    assert episode_metrics(played)["episode/truncated/episode_tokens"] == 1.0


class Hangs(ThreeTurnEpisode):
    """Answers no turn until ``release`` is set."""

    def __init__(self, task, seen, release) -> None:
        super().__init__(task, seen)
        self.release = release

    def step(self, turn):
        self.release.wait(30)
        return super().step(turn)


class Hanging(ThreeTurns):
    def __init__(self, release) -> None:
        super().__init__()
        self.release = release

    def episode(self, task):
        return Hangs(task, self.seen, self.release)


def test_a_hanging_environment_fails_the_play_and_frees_the_rollout(model_dir):
    import threading
    import time

    from transformers import AutoTokenizer

    from drivetrain.trainer.agentic.episodes import EpisodeError

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    hf = rollouts.load("hf")(HFRolloutConfig(model_path=str(model_dir), max_model_len=256))
    chat = ChatTokens(tokenizer, TOOLS)
    limits = EpisodeLimits(max_turns=3, turn_tokens=8, episode_tokens=0, context=256)
    params = SamplingParams(temperature=1.0, max_new_tokens=8, seed=2)
    release = threading.Event()
    try:
        service = RolloutService([hf], threads=False)
        hanging = EpisodeRunner(
            service, Hanging(release), tool_parser("hermes"), chat, limits, step_timeout_s=0.5
        )
        began = time.monotonic()
        with pytest.raises(EpisodeError, match="did not answer .* within 0.5 s"):
            hanging.play([{"k": 0}, {"k": 1}], 2, params)
        assert time.monotonic() - began < 20
    finally:
        release.set()
    again = EpisodeRunner(
        RolloutService([hf], threads=False), ThreeTurns(), tool_parser("hermes"), chat, limits
    )
    assert len(again.play([{"k": 0}], 2, params)) == 2  # the rollout serves the next play
