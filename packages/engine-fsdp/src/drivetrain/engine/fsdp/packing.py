"""Between the api's batches and the packed token row the model computes on.

Whatever the input layout, the engine computes on one packed row per micro-batch: tokens of all
samples back to back, position ids restarting at 0 per sample, spans describing what each
position attends to. With prefix sharing (:mod:`drivetrain.engine.fsdp.prefix_sharing`) a group
of samples with the same prompt is laid out as ``[prompt, own tokens of each sample]``: the
prompt's positions are computed once and serve every sample of the group.

Outputs are aligned with ``input_ids`` (position ``t``: about token ``t``; 0 at each sample's
first token); the engine puts them back in the micro-batch's own layout
(:func:`drivetrain.engine_core.to_layout`). A token's output comes from the row
position of the token before it; where that position is not directly followed by the token in
the row (the first own token of a sharing sample), the model computes an extra output for the
pair (``extra_src``, ``extra_targets``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from drivetrain.api import Batch
from drivetrain.api.columns import INPUT_IDS
from drivetrain.engine.fsdp.prefix_sharing import prefix_groups
from drivetrain.engine_core import flat_column
from drivetrain.engine_core.packed_attention import Span


@dataclass(frozen=True)
class PackedRow:
    input_ids: torch.Tensor  # [T] (T padded to a multiple of the sequence-parallel size)
    position_ids: torch.Tensor  # [T]
    targets: torch.Tensor  # [T]: the token after each position in the row (0 at the end)
    spans: tuple[Span, ...]  # what each position attends to (every position in one span)
    num_tokens: int  # real tokens of the batch (shared ones counted per sample)
    extra_src: torch.Tensor  # [E] row positions whose hidden state predicts ...
    extra_targets: torch.Tensor  # [E] ... these tokens (a shared prompt's next tokens)
    output_index: torch.Tensor  # [num_tokens]: each token's output in cat(row, extras, [0])
    sources: torch.Tensor  # [row length without padding]: the flat token each position holds
    token_rows: torch.Tensor  # [num_tokens]: the row position holding each token

    @property
    def shared_tokens(self) -> int:
        """Tokens the row saves against one copy per sample."""
        return self.num_tokens - sum(s.length for s in self.spans)


class _RowBuilder:
    """Appends runs of the batch's flat tokens to the row, recording where each token lives."""

    def __init__(self, num_tokens: int, device: torch.device) -> None:
        self.device = device
        self.sources: list[torch.Tensor] = []  # flat token index of each row position
        self.positions: list[torch.Tensor] = []
        self.spans: list[Span] = []
        self.row_of_token = torch.empty(num_tokens, dtype=torch.long, device=device)
        self.length = 0

    def add(self, flat_start: int, count: int, position: int, prefix: Span | None = None) -> Span:
        span = Span(
            self.length, count, prefix.start if prefix else 0, prefix.length if prefix else 0
        )
        steps = torch.arange(count, device=self.device)
        self.sources.append(flat_start + steps)
        self.positions.append(position + steps)
        self.row_of_token[flat_start : flat_start + count] = self.length + steps
        self.spans.append(span)
        self.length += count
        return span


def pack(
    batch: Batch, device: torch.device, multiple: int = 1, *, share_prefixes: bool = False
) -> PackedRow:
    ids = flat_column(batch, INPUT_IDS).to(device=device, dtype=torch.long)
    offsets, lens, real = batch.offsets, batch.seq_lens, batch.num_tokens
    groups = prefix_groups(batch, ids.tolist()) if share_prefixes else []
    builder = _RowBuilder(real, device)
    leaders = {g.samples[0]: g for g in groups}  # a group goes where its first sample was
    followers = {j for g in groups for j in g.samples[1:]}
    for i, n in enumerate(lens):
        group = leaders.get(i)
        if group is not None:
            prefix = builder.add(offsets[i], group.length, 0)
            for j in group.samples:
                builder.add(offsets[j] + group.length, lens[j] - group.length, group.length, prefix)
                if j != i:  # its prompt tokens live in the first member's copy
                    builder.row_of_token[offsets[j] : offsets[j] + group.length] = (
                        builder.row_of_token[offsets[i] : offsets[i] + group.length]
                    )
        elif i not in followers and n:
            builder.add(offsets[i], n, 0)
    sources = torch.cat(builder.sources) if builder.sources else ids[:0]
    row_ids = ids[sources]
    positions = torch.cat(builder.positions) if builder.positions else ids[:0]
    spans = list(builder.spans)
    length = builder.length
    pad = (-length) % multiple if length else multiple
    if pad:  # a dummy tail span so the row splits evenly over sequence-parallel ranks
        row_ids = torch.cat([row_ids, row_ids.new_zeros(pad)])
        positions = torch.cat([positions, torch.arange(pad, device=device)])
        spans.append(Span(length, pad))
    targets = torch.cat([row_ids[1:], row_ids.new_zeros(1)])
    extra_src, extra_targets, index = _output_index(
        ids, builder.row_of_token, offsets, len(row_ids)
    )
    return PackedRow(
        row_ids,
        positions,
        targets,
        tuple(spans),
        real,
        extra_src,
        extra_targets,
        index,
        sources,
        builder.row_of_token,
    )


def row_routing(flat: torch.Tensor, row: PackedRow) -> torch.Tensor:
    """Per-token routing ``[num_tokens, layers, top_k]`` laid out as the row's positions (a
    shared prefix's positions hold its first sample's), -1 on the padding tail."""
    rows = flat[row.sources.to(flat.device)]
    pad = len(row.input_ids) - len(rows)
    return torch.cat([rows, rows.new_full((pad, *rows.shape[1:]), -1)]) if pad else rows


def _output_index(
    ids: torch.Tensor, row_of_token: torch.Tensor, offsets: tuple[int, ...], row_length: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Token ``t`` of a sample is predicted at the row position of token ``t - 1``: that
    position's row output when token ``t`` follows it in the row, an extra output otherwise."""
    n = len(ids)
    first = torch.zeros(n, dtype=torch.bool, device=ids.device)
    starts = torch.tensor(offsets[:-1], device=ids.device, dtype=torch.long)
    first[starts[starts < n]] = True
    prev = torch.roll(row_of_token, 1)
    follows = (row_of_token == prev + 1) & ~first
    extra = ~first & ~follows
    extra_src, extra_targets = prev[extra], ids[extra]
    index = torch.full((n,), row_length + len(extra_src), dtype=torch.long, device=ids.device)
    index[follows] = prev[follows]
    index[extra] = row_length + torch.arange(len(extra_src), device=ids.device)
    return extra_src, extra_targets, index


def outputs_per_token(row_outputs: torch.Tensor, row: PackedRow) -> torch.Tensor:
    """Per-position outputs of the row and its extras ``[T + E]`` -> per token of the batch
    ``[num_tokens]`` (``out[t]`` from the position of token ``t - 1``; 0 at first tokens)."""
    return torch.cat([row_outputs, row_outputs.new_zeros(1)])[row.output_index]
