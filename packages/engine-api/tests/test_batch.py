import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from drivetrain.api import Batch, BatchError, BatchMeta, Layout


def make_batch(lengths, layout=Layout.PADDED):
    width = max(lengths, default=0)
    ids = [[100 * i + t for t in range(n)] + [0] * (width - n) for i, n in enumerate(lengths)]
    batch = Batch.from_columns(
        {"input_ids": ids, "reward": [float(i) for i in range(len(lengths))]},
        seq_lens=lengths,
        meta=BatchMeta(pad_token_id=0),
    )
    return batch.to_packed() if layout is Layout.PACKED else batch


def sample_tokens(batch):
    """Per-sample token lists, whatever the layout."""
    ids = batch["input_ids"]
    if batch.layout is Layout.PACKED:
        o = batch.offsets
        return [ids[a:b] for a, b in itertools.pairwise(o)]
    return [row[:n] for row, n in zip(ids, batch.seq_lens, strict=True)]


lengths_st = st.lists(st.integers(0, 9), min_size=1, max_size=12)
layout_st = st.sampled_from(list(Layout))


def test_token_keys_default_to_standard_token_columns():
    batch = make_batch([2, 3])
    assert batch.token_keys == {"input_ids"}
    assert len(batch) == 2 and batch.num_tokens == 5 and batch.offsets == (0, 2, 5)


def test_rejects_ragged_columns():
    with pytest.raises(BatchError, match="'reward' has 1 rows, expected 2"):
        Batch.from_columns({"reward": [1.0]}, seq_lens=[1, 2])


def test_packed_token_columns_must_cover_all_tokens():
    with pytest.raises(BatchError, match="expected 5 tokens"):
        Batch.from_columns({"input_ids": [1, 2, 3]}, seq_lens=[2, 3], layout=Layout.PACKED)


def test_unknown_column_type_names_the_fix():
    class Opaque:
        pass

    with pytest.raises(BatchError, match="register_column_ops"):
        Batch.from_columns({"x": Opaque()}, seq_lens=[1])


def test_missing_column_lists_columns():
    with pytest.raises(KeyError, match="columns are"):
        make_batch([1])["nope"]


def test_concat_rejects_mismatched_columns():
    a = make_batch([1])
    b = a.drop("reward")
    with pytest.raises(BatchError, match="columns"):
        Batch.concat([a, b])


def test_reorder_requires_permutation():
    with pytest.raises(BatchError, match="not a permutation"):
        make_batch([1, 2]).reorder([0, 0])


def test_with_columns_and_meta_do_not_modify_original():
    batch = make_batch([1, 2])
    changed = batch.with_columns(token_keys=["scores"], scores=[[0.5, 0], [1, 2]]).with_meta(step=3)
    assert "scores" not in batch and batch.meta.step is None
    assert changed.token_keys == {"input_ids", "scores"} and changed.meta.step == 3


@given(lengths_st, layout_st, st.data())
def test_split_concat_round_trip(lengths, layout, data):
    batch = make_batch(lengths, layout)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(lengths)), max_size=4)))
    sizes = [b - a for a, b in zip([0, *cuts], [*cuts, len(lengths)], strict=True)]
    pieces = batch.split(sizes)
    assert [len(p) for p in pieces] == sizes
    joined = Batch.concat(pieces)
    assert joined.seq_lens == batch.seq_lens
    assert sample_tokens(joined) == sample_tokens(batch)
    assert list(joined["reward"]) == list(batch["reward"])


@given(lengths_st, layout_st, st.integers(1, 5))
def test_chunk_sizes_differ_by_at_most_one(lengths, layout, chunks):
    pieces = make_batch(lengths, layout).chunk(chunks)
    sizes = [len(p) for p in pieces]
    assert sum(sizes) == len(lengths) and max(sizes) - min(sizes) <= 1


@given(lengths_st, layout_st, st.randoms())
def test_reorder_then_inverse_restores(lengths, layout, rnd):
    batch = make_batch(lengths, layout)
    order = list(range(len(lengths)))
    rnd.shuffle(order)
    shuffled = batch.reorder(order)
    assert sample_tokens(shuffled) == [sample_tokens(batch)[i] for i in order]
    back = shuffled.reorder([order.index(i) for i in range(len(order))])
    assert sample_tokens(back) == sample_tokens(batch)


@given(lengths_st)
def test_packed_padded_round_trip(lengths):
    padded = make_batch(lengths)
    packed = padded.to_packed()
    assert packed.layout is Layout.PACKED
    assert len(packed["input_ids"]) == sum(lengths)
    assert packed.to_padded()["input_ids"] == padded["input_ids"]


@given(lengths_st, st.integers(1, 4))
def test_balanced_parts_cover_every_sample_once(lengths, parts):
    batch = make_batch(lengths)
    if parts > len(lengths):
        with pytest.raises(BatchError):
            batch.balanced_parts(parts)
        return
    groups = batch.balanced_parts(parts)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    shards = [batch.select(g) for g in groups]
    assert sum(s.num_tokens for s in shards) == batch.num_tokens


def test_column_ops_for_numpy_style_arrays_resolve_lazily():
    np = pytest.importorskip("numpy")
    batch = Batch.from_columns(
        {"input_ids": np.arange(6).reshape(2, 3), "reward": np.array([1.0, 2.0])},
        seq_lens=[3, 2],
    )
    packed = batch.to_packed()
    assert packed["input_ids"].tolist() == [0, 1, 2, 3, 4]
    assert Batch.concat([packed, packed]).select([3, 0])["reward"].tolist() == [2.0, 1.0]


def test_replacing_a_token_column_keeps_it_per_token():
    packed = make_batch([2, 3]).to_packed()
    replaced = packed.with_columns(input_ids=[9] * 5, loss_mask=[1] * 5)
    assert replaced.token_keys == {"input_ids", "loss_mask"}
    assert replaced.with_columns(token_keys=[], score=[1, 2]).token_keys == replaced.token_keys


def test_concat_drops_differing_optional_meta_but_not_pad_id():
    a, b = make_batch([1]).with_meta(weight_version=1), make_batch([2]).with_meta(weight_version=2)
    assert Batch.concat([a, b]).meta.weight_version is None
    assert Batch.concat([a, a]).meta.weight_version == 1
    with pytest.raises(BatchError, match="pad_token_id differ"):
        Batch.concat([a, a.with_meta(pad_token_id=5)])


@given(lengths_st, st.integers(1, 3), layout_st)
def test_dp_shards_restore_to_the_global_order(lengths, dp, layout):
    from drivetrain.api.batch import restore_order
    from drivetrain.api.partition import dp_shard_indices

    if dp > len(lengths):
        return
    batch = make_batch(lengths, layout)
    indices = dp_shard_indices(batch.seq_lens, dp)
    shards = [batch.select(group) for group in indices]
    if len(lengths) % dp == 0:
        assert len({len(s) for s in shards}) == 1
    assert sample_tokens(restore_order(shards, indices)) == sample_tokens(batch)


def test_sample_groups_are_never_split() -> None:
    """``sample_group``: every partition keeps a group's samples together (DPO pairs)."""
    lengths = [7, 3, 12, 5, 9, 4, 11, 6]
    groups = [0, 1, 1, 2, 3, 0, 2, 3]
    batch = Batch.from_columns(
        {"input_ids": [[1] * n for n in lengths], "sample_group": groups}, seq_lens=lengths
    )
    assert batch.units() == [[0, 5], [1, 2], [3, 6], [4, 7]]
    assert batch.fixed_size_parts(1) == [[0, 5], [1, 2], [3, 6], [4, 7]]
    assert batch.fixed_size_parts(3) == [[0, 1, 2, 5], [3, 4, 6, 7]]
    for parts in (batch.token_budget_parts(16), batch.dp_shards(2), batch.balanced_parts(3)):
        assert sorted(i for part in parts for i in part) == list(range(8))
        for part in parts:
            assert all(groups[j] != groups[i] or j in part for i in part for j in range(8))
    assert all(sum(lengths[i] for i in part) <= 16 for part in batch.token_budget_parts(16))
    assert [len(s) for s in batch.dp_shards(2)] == [4, 4]  # two pairs each
    with pytest.raises(BatchError, match="sample_group 2 .2 samples, kept together. has 16"):
        batch.token_budget_parts(15)
    with pytest.raises(BatchError, match="cannot split 4 sample groups .8 samples. into 5"):
        batch.dp_shards(5)
    plain = batch.drop("sample_group")
    assert plain.fixed_size_parts(3) == [[0, 1, 2], [3, 4, 5], [6, 7]]
