"""Which samples of a micro-batch share a prompt, so the packed row carries it once.

GRPO draws n responses per prompt; computed one sample at a time, the prompt's tokens go
through the model n times with identical results. A batch that carries the api column
``shared_prefix_len`` (per sample: how many leading tokens it may share, usually the prompt
length) lets the engine group samples whose leading tokens are *identical* (checked, not
assumed) and lay each group out as ``[prefix, own tokens of sample 1, ..., of sample k]``.
The outputs are the same as without sharing; only the work shrinks.
"""

from __future__ import annotations

from dataclasses import dataclass

from drivetrain.api import Batch
from drivetrain.api.columns import SHARED_PREFIX_LEN

#: Shorter shared prefixes are not worth a span of their own.
MIN_SHARED_TOKENS = 2


@dataclass(frozen=True)
class PrefixGroup:
    samples: tuple[int, ...]  # indices into the micro-batch, at least two
    length: int  # shared leading tokens; every member keeps at least one token of its own


def prefix_groups(batch: Batch, ids: list[int]) -> list[PrefixGroup]:
    """Groups of samples of ``batch`` (flat token ids ``ids``) with an identical prefix of
    the length their ``shared_prefix_len`` asks for; samples that share nothing are left out."""
    if SHARED_PREFIX_LEN not in batch:
        return []
    hint = batch[SHARED_PREFIX_LEN]
    wanted = [int(n) for n in (hint.tolist() if hasattr(hint, "tolist") else hint)]
    offsets = batch.offsets
    found: dict[tuple[int, ...], list[int]] = {}
    for i, n in enumerate(batch.seq_lens):
        length = min(wanted[i], n - 1)  # the last token's prediction is the sample's own
        if length >= MIN_SHARED_TOKENS:
            found.setdefault(tuple(ids[offsets[i] : offsets[i] + length]), []).append(i)
    return [
        PrefixGroup(tuple(members), len(key)) for key, members in found.items() if len(members) > 1
    ]
