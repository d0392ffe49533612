"""Packing with shared prompts: each prompt once in the row, every token's output still
predicted from the position of the token before it, with the right target."""

from __future__ import annotations

import torch

from drivetrain.api import Batch
from drivetrain.api.columns import SHARED_PREFIX_LEN
from drivetrain.engine.fsdp.packing import outputs_per_token, pack
from drivetrain.engine.fsdp.prefix_sharing import prefix_groups
from drivetrain.testing.conformance import shared_prefix_data


def _batch() -> tuple[Batch, list[list[int]]]:
    (sequences, _), shared = shared_prefix_data(50)
    width = max(map(len, sequences))
    ids = torch.tensor([s + [0] * (width - len(s)) for s in sequences])
    batch = Batch.from_columns({"input_ids": ids}, seq_lens=[len(s) for s in sequences])
    return batch.with_columns(**{SHARED_PREFIX_LEN: shared}), sequences


def test_groups_need_identical_tokens():
    batch, sequences = _batch()
    groups = prefix_groups(batch, torch.cat([torch.tensor(s) for s in sequences]).tolist())
    # prompt 1 (3 responses + a repeat), prompt 2 (2), the two cut samples (prefix capped at 2);
    # prompt 3 and 4 stand alone (4 has prompt 2's length, not its tokens)
    assert sorted((g.samples, g.length) for g in groups) == [
        ((0, 1, 2, 7), 6), ((3, 4), 4), ((8, 9), 2)
    ]  # fmt: skip


def test_row_carries_each_prompt_once_and_outputs_line_up():
    batch, sequences = _batch()
    row = pack(batch, torch.device("cpu"), share_prefixes=True)
    assert row.shared_tokens == 3 * 6 + 4 + 2 and len(row.input_ids) == row.num_tokens - 24
    assert len(row.extra_src) == 3 + 1 + 1  # every member but the first of each group
    # the model's "output" at a position = the token it predicts; per token it must be the
    # token itself (0 at each sample's first token)
    predicted = torch.cat([row.targets, row.extra_targets])
    got = outputs_per_token(predicted, row)
    want = torch.cat([torch.tensor([0, *s[1:]]) for s in sequences])
    assert torch.equal(got, want)
    # and every position's id is the token at its position id within its sample
    for span in row.spans:
        ids = row.input_ids[span.start : span.start + span.length]
        pos = row.position_ids[span.start : span.start + span.length]
        assert any(
            torch.equal(torch.tensor(s)[pos], ids) for s in sequences if len(s) > int(pos.max())
        )


def test_without_the_hint_nothing_is_shared():
    batch, sequences = _batch()
    row = pack(batch.drop(SHARED_PREFIX_LEN), torch.device("cpu"), share_prefixes=True)
    assert row.shared_tokens == 0 and len(row.extra_src) == 0
    assert torch.equal(row.input_ids, torch.cat([torch.tensor(s) for s in sequences]))
