"""Agentic RL's pieces without a model: the chat tokens an observation adds, the calculator
environment, and the config refusals of multi-turn jobs."""

from __future__ import annotations

import pytest

from drivetrain.api.environment import AssistantTurn, ToolCall
from drivetrain.api.errors import ConfigError
from drivetrain.trainer.agentic.chat_tokens import ChatTokens
from drivetrain.trainer.agentic.episodes import EpisodeLimits
from drivetrain.trainer.builtin.calculator import CalculatorEnvironment, calculate
from drivetrain.trainer.builtin.char_tokenizer import build_char_tokenizer
from drivetrain.trainer.config_loader import load_config
from drivetrain.trainer.rl.config import RLConfig

#: ChatML's shape: a character after every end of turn (ChatML's newline; the character
#: tokenizer has no newline), which a sampled turn does not write
NEWLINE_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>#{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    path = tmp_path_factory.mktemp("chat") / "tok"
    build_char_tokenizer(path, chat_template=NEWLINE_TEMPLATE)
    return AutoTokenizer.from_pretrained(str(path))


def test_observations_close_the_sampled_turn_as_the_template_does(tokenizer):
    chat = ChatTokens(tokenizer)
    user = [{"role": "user", "content": "2+2?"}]
    prompt = chat.prompt(user)
    end = tokenizer.eos_token_id
    sampled = [*tokenizer("ask", add_special_tokens=False)["input_ids"], end]
    tool = [{"role": "tool", "content": "4"}]
    observed = chat.observation(tool, sampled)
    assert tokenizer.decode(observed) == "#<|tool|>4<|end|>#<|assistant|>"
    # a turn that ended by itself: the ids are exactly the whole conversation rendered
    whole = chat.render([*user, {"role": "assistant", "content": "ask"}, *tool], generation=True)
    assert prompt + sampled + observed == chat.encode(whole)
    # a turn cut at its budget gets the whole end of turn
    cut = chat.observation(tool, sampled[:-1])
    assert tokenizer.decode(cut).startswith("<|end|>#<|tool|>")


#: Qwen3's shape: the conversation's last assistant turn gets an empty think block, earlier
#: ones do not (so a stand-in's rendering is not a prefix of the longer conversation's)
THINKING_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'assistant' and loop.last %}"
    "<|assistant|>[think]{{ m['content'] }}<|end|>#{% else %}"
    "<|{{ m['role'] }}|>{{ m['content'] }}<|end|>#{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def test_observations_follow_a_template_that_renders_the_last_turn_differently(tmp_path):
    from transformers import AutoTokenizer

    build_char_tokenizer(tmp_path, chat_template=THINKING_TEMPLATE)
    tokenizer = AutoTokenizer.from_pretrained(str(tmp_path))
    chat = ChatTokens(tokenizer)
    sampled = [*tokenizer("x", add_special_tokens=False)["input_ids"], tokenizer.eos_token_id]
    observed = chat.observation([{"role": "tool", "content": "4"}], sampled)
    assert tokenizer.decode(observed) == "#<|tool|>4<|end|>#<|assistant|>"


def test_a_tokenizer_without_chat_template_is_refused(tokenizer):
    from drivetrain.trainer.errors import DataError

    class Plain:
        chat_template = None

    with pytest.raises(DataError, match="chat template"):
        ChatTokens(Plain())


def test_the_calculator_does_one_operation():
    assert calculate("47*83") == "3901" and calculate(" 10 - 12 ") == "-2"
    for bad in ("47*83+1", "2**10", "__import__('os')", "1/2", ""):
        with pytest.raises(ValueError, match="one operation"):
            calculate(bad)


def call(index: int, expression: str) -> AssistantTurn:
    calls = (ToolCall("calculator", {"expression": expression}, f"call_{index}"),)
    return AssistantTurn(index, "", "", calls)


def test_a_calculator_episode_rewards_the_exact_answer_and_survives_bad_calls():
    env = CalculatorEnvironment()
    assert [t["function"]["name"] for t in env.tools()] == ["calculator"]
    task = {"question": "What is (47*83)+12?", "answer": "3913"}
    episode = env.episode(task)
    assert episode.reset() == [{"role": "user", "content": "What is (47*83)+12?"}]
    first = episode.step(call(0, "47*83"))
    assert not first.done and first.observations[0]["content"] == "3901"
    assert first.info["tools/succeeded"] == 1
    broken = episode.step(AssistantTurn(1, "<tool_call>{", "", (), ("malformed JSON",)))
    assert not broken.done and broken.observations[0]["content"].startswith("error:")
    wrong_tool = episode.step(AssistantTurn(2, "", "", (ToolCall("python", {}, "c"),)))
    assert "unknown tool" in wrong_tool.observations[0]["content"]
    bad = episode.step(call(3, "3901+12+1"))
    assert bad.observations[0]["content"].startswith("error: ValueError")
    assert episode.step(AssistantTurn(4, "3913", " 3913 ")).reward == 1.0
    again = env.episode(task)
    final = again.step(AssistantTurn(0, "3914", "3914"))
    assert final.done and final.reward == 0.0
    assert env.tasks("train", 3, 0) == env.tasks("train", 3, 0) != env.tasks("val", 3, 0)
    with pytest.raises(ValueError, match="no options"):
        CalculatorEnvironment({"digits": 3})


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        (["algorithm.mode=async"], "algorithm.mode=async"),
        (["algorithm.dapo.dynamic_sampling=true"], "algorithm.dapo.dynamic_sampling"),
        (["algorithm.dapo.overlong_buffer=0.2"], "algorithm.dapo.overlong_buffer"),
        (["reward.model_path=/models/rm"], "reward.model_path"),
    ],
)
def test_multi_turn_jobs_refuse_what_they_do_not_support(overrides, key):
    with pytest.raises(ConfigError, match=key):
        load_config(RLConfig, overrides=["env=calculator", *overrides])
    load_config(RLConfig, overrides=["env=calculator"])  # alone it loads


def test_episode_limits_say_what_bounds_a_turn():
    limits = EpisodeLimits(max_turns=4, turn_tokens=16, episode_tokens=40, context=100)
    assert limits.budget(10, 0) == (16, "")
    assert limits.budget(10, 30) == (10, "episode_tokens")
    assert limits.budget(80, 10) == (10, "context")
    assert limits.budget(10, 0, asked=4) == (4, "")
    with pytest.raises(ValueError):
        EpisodeLimits(max_turns=0, turn_tokens=16, episode_tokens=0, context=100)
