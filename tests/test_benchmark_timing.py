"""The benchmarks' shared helpers: interleaved timing (``benchmarks/timing.py``) and model
FLOPs (``benchmarks/flops.py``), against hand-computed values."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from flops import matmul_params, training_flops
from timing import (
    Measured,
    Ratio,
    add_arguments,
    interleaved,
    order,
    print_result,
    rounds_of,
    speedup,
)


def test_order_rotates_every_round():
    assert order(["a", "b"], 0) == ["a", "b"]
    assert order(["a", "b"], 1) == ["b", "a"]
    assert [order(["a", "b", "c"], r) for r in range(4)] == [
        ["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"], ["a", "b", "c"],
    ]  # fmt: skip


def test_interleaved_runs_sides_alternately_and_drops_the_warm_up():
    calls: list[str] = []
    seen: list[tuple[int, bool]] = []
    sides = {
        "a": lambda: calls.append("a") or Measured(1.0 + len(calls)),
        "b": lambda: calls.append("b") or Measured(10.0 + len(calls)),
    }
    times = interleaved(sides, rounds=3, warmup=1, progress=lambda i, _, t: seen.append((i, t)))
    assert calls == ["a", "b", "b", "a", "a", "b", "b", "a"]
    # the warm-up round (calls 1-2) is not kept; each kept value is what the side measured
    assert times == {"a": [5.0, 6.0, 9.0], "b": [13.0, 16.0, 17.0]}
    assert seen == [(0, False), (1, True), (2, True), (3, True)]


def test_a_proof_run_times_one_round_and_warms_nothing_up():
    calls: list[str] = []
    times = interleaved({"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}, 1)
    assert calls == ["a", "b"] and {k: len(v) for k, v in times.items()} == {"a": 1, "b": 1}


def test_interleaved_times_sides_that_return_anything_else():
    times = interleaved({"x": lambda: 3.0, "y": lambda: None}, rounds=2, warmup=0)
    # a float return is not a measurement: the wall clock times the call
    assert all(0 <= s < 1.0 for values in times.values() for s in values)


def test_ratio_per_round_median_and_spread(capsys):
    times = {"ours": [1.0, 2.0, 1.0, 4.0, 1.0], "base": [2.0, 2.0, 3.0, 4.0, 10.0]}
    ratio = speedup(times, "ours", "base")
    assert ratio.values == (2.0, 1.0, 3.0, 1.0, 10.0)
    assert ratio.median == 2.0  # one burst (10x) does not move it
    assert ratio.spread == [1.0, 10.0]
    result = print_result({"speedup": ratio}, rounds=5)
    assert result == {"speedup": 2.0, "speedup_spread": [1.0, 10.0], "rounds": 5}
    assert capsys.readouterr().out.strip().endswith('"rounds": 5}')


def test_ratio_refuses_rounds_that_do_not_pair():
    with pytest.raises(ValueError, match="rounds differ: 2 vs 1"):
        Ratio.of([1.0, 2.0], [1.0])


def test_a_result_needs_five_rounds_and_quick_needs_one():
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert rounds_of(parser.parse_args([])) == 5
    assert rounds_of(parser.parse_args(["--quick"])) == 1
    with pytest.raises(SystemExit, match="at least 5 rounds"):
        rounds_of(parser.parse_args(["--pairs", "3"]))


def test_training_flops_count_matmuls_and_causal_attention():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=100, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
    )  # fmt: skip
    model = LlamaForCausalLM(config)
    # per layer q 16x16, k and v 8x16 (2 KV heads of 4), o 16x16, gate/up/down 32x16 each;
    # the tied LM head 100x16 multiplies every token too
    per_layer = 256 + 128 + 128 + 256 + 3 * 512
    assert matmul_params(model) == 2 * per_layer + 1600
    # two documents of 3 and 5 tokens: 6*N per token, attention 6 * layers * 16 * n(n+1)
    want = 6 * (2 * per_layer + 1600) * 8 + 6 * 2 * 16 * (3 * 4 + 5 * 6)
    assert training_flops(model, [3, 5]) == want
    # the documents' order does not matter (nor, having no argument, does padding)
    assert training_flops(model, [5, 3]) == want
