import pytest
from hypothesis import given
from hypothesis import strategies as st

from drivetrain.api.errors import BatchError
from drivetrain.api.partition import (
    balanced_partition,
    chunk_sizes,
    fixed_size_partition,
    inverse_permutation,
    token_budget_partition,
)

weights_st = st.lists(st.integers(0, 1000), min_size=1, max_size=40)


@given(weights_st, st.integers(1, 8))
def test_balanced_partition_obeys_list_scheduling_bound(weights, parts):
    if parts > len(weights):
        with pytest.raises(BatchError, match="non-empty"):
            balanced_partition(weights, parts)
        return
    groups = balanced_partition(weights, parts)
    assert len(groups) == parts and all(groups)
    assert sorted(i for g in groups for i in g) == list(range(len(weights)))
    assert all(g == sorted(g) for g in groups)
    loads = [sum(weights[i] for i in g) for g in groups]
    assert max(loads) <= sum(weights) / parts + max(weights)


@given(weights_st, st.integers(1, 4))
def test_equal_size_partition(weights, parts):
    weights = weights[: len(weights) - len(weights) % parts] or [1] * parts
    groups = balanced_partition(weights, parts, equal_size=True)
    assert {len(g) for g in groups} == {len(weights) // parts}


def test_balanced_partition_beats_contiguous_split():
    weights = [100, 100, 1, 1, 1, 1]
    loads = sorted(sum(weights[i] for i in g) for g in balanced_partition(weights, 2))
    assert loads == [102, 102]


@given(st.lists(st.integers(1, 64), min_size=1, max_size=40), st.integers(64, 300))
def test_token_budget_fits_and_uses_few_parts(lengths, budget):
    groups = token_budget_partition(lengths, budget)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in g) <= budget for g in groups)
    # never more than twice the lower bound (first-fit style guarantee)
    assert len(groups) <= max(1, 2 * -(-sum(lengths) // budget))


def test_token_budget_min_parts_for_collective_agreement():
    assert len(token_budget_partition([5, 5, 5, 5], 100, min_parts=3)) == 3


def test_token_budget_rejects_overlong_sample():
    with pytest.raises(BatchError, match="sample 1 has 9 tokens"):
        token_budget_partition([2, 9], 8)


def test_fixed_and_chunk_sizes():
    assert fixed_size_partition(5, 2) == [[0, 1], [2, 3], [4]]
    assert chunk_sizes(7, 3) == [3, 2, 2]
    assert inverse_permutation([2, 0, 1]) == [1, 2, 0]
