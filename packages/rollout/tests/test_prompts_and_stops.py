import pytest

from drivetrain.api import FinishReason, Prompt, SamplingParams
from drivetrain.rollout.hf.batcher import finish_reason
from drivetrain.rollout.prompts import check_stop_token_ids, new_token_budgets, render_prompts


class CharTokenizer:
    """Enough of a tokenizer for prompt rendering: one id per character, a chat template."""

    chat_template = "{user}"

    def apply_chat_template(self, messages, *, add_generation_prompt, tokenize, return_dict):
        assert add_generation_prompt and tokenize and not return_dict
        text = "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"
        return [ord(c) % 50 for c in text]

    @staticmethod
    def decode(ids):
        return "".join(chr(ord("a") + i) for i in ids)


def test_token_prompts_pass_through_and_chat_prompts_render():
    tok = CharTokenizer()
    ids = render_prompts(
        [Prompt(token_ids=(1, 2)), Prompt(messages=({"role": "user", "content": "hi"},))], tok, 50
    )
    assert ids[0] == [1, 2]
    assert ids[1] == tok.apply_chat_template(
        [{"role": "user", "content": "hi"}],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=False,
    )


def test_bad_prompts_are_errors_before_generation():
    tok = CharTokenizer()
    with pytest.raises(ValueError, match="outside the vocabulary"):
        render_prompts([Prompt(token_ids=(1, 99))], tok, 50)
    with pytest.raises(ValueError, match="no prompts"):
        render_prompts([], tok, 50)
    tok.chat_template = None
    with pytest.raises(ValueError, match="no chat template"):
        render_prompts([Prompt(messages=({"role": "user", "content": "x"},))], tok, 50)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        check_stop_token_ids(SamplingParams(stop_token_ids=(60,)), 50)


def test_budgets_are_cut_at_the_context_and_a_full_prompt_is_refused():
    params = SamplingParams(max_new_tokens=8)
    assert new_token_budgets([[1] * 3, [1] * 10], params, max_model_len=14) == [8, 4]
    with pytest.raises(ValueError, match="leaves no room"):
        new_token_budgets([[1] * 14], params, max_model_len=14)


@pytest.mark.parametrize(
    ("tokens", "budget", "stop_ids", "stops", "expected"),
    [
        ([1, 2, 3, 4], 4, set(), (), (4, FinishReason.LENGTH)),
        ([1, 2, 3, 4], 3, set(), (), (3, FinishReason.LENGTH)),
        ([1, 2, 9, 4], 4, {9}, (), (3, FinishReason.STOP)),  # the stop token is kept
        ([1, 2, 3, 4], 4, set(), ("cd",), (3, FinishReason.STOP)),  # "bcde": ends at "d"
        ([1, 2, 3, 4], 4, set(), ("zz", "bc"), (2, FinishReason.STOP)),
        ([2, 9, 2, 3], 4, {9}, ("cd",), (2, FinishReason.STOP)),  # the earlier one wins
    ],
)
def test_a_request_ends_at_its_first_stop(tokens, budget, stop_ids, stops, expected):
    params = SamplingParams(max_new_tokens=budget, stop=stops)
    for end in range(1, len(tokens) + 1):  # as generated: one token at a time
        reason = finish_reason(tokens[:end], params, stop_ids, CharTokenizer.decode)
        if reason is not None:
            break
    assert (end, reason) == expected
