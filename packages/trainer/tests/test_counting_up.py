"""The counting-up workload's data: every answer moves the second operand's tens to the first,
then sums; its last number is what ``numeric_match`` checks, and lengths vary as the
generation-heavy benchmark needs (short and long answers, none past the token budget)."""

from __future__ import annotations

import json

from drivetrain.trainer.builtin.counting_up import MAX_ANSWER_CHARS, counting_up, make_rows
from drivetrain.trainer.rl.rewards import numeric_match


def test_counting_up_adds_the_tens_then_the_units() -> None:
    assert counting_up(38, 45) == "38+45 48+35 58+25 68+15 78+5 =83"
    assert counting_up(7, 0) == "07+00 =7"
    assert counting_up(0, 13) == "00+13 10+3 =13"
    assert len(counting_up(99, 99)) == MAX_ANSWER_CHARS


def test_rows_end_on_the_sum_skip_held_out_problems_and_vary_in_length() -> None:
    held_out = {"What is 07+60?"}
    rows = make_rows(2000, seed=4, exclude=held_out)
    lengths = []
    for row in rows:
        prompt, answer = (m["content"] for m in row["messages"])  # type: ignore[index]
        assert prompt not in held_out
        a, b = map(int, prompt.removeprefix("What is ").removesuffix("?").split("+"))
        assert numeric_match(answer, str(a + b)) == 1.0
        assert len(answer) <= MAX_ANSWER_CHARS
        lengths.append(len(answer))
    assert min(lengths) <= 8 and max(lengths) >= 60
    assert 15 <= sum(lengths) / len(lengths) <= 40
    assert make_rows(5, seed=4, exclude=held_out) == rows[:5]  # seeded: every machine alike
    json.dumps(rows)
