"""Where two forwards of the same tokens part: op by op, the rollout's against the engine's
(``drivetrain diagnose mismatch``'s ops stage).

Both sides record each op (a module of the Hugging Face model, by name) at every position
(``Rollout.trace_ops``, ``Engine.trace_ops``); ops are taken in the order the rollout ran
them, over the positions both hold. An op *differs* when any bit does; it is *beyond the
tolerance* when its largest difference exceeds the tolerance times the op's scale (its
largest magnitude, at least 1): activations of size 50 and log-probs of size 1 are judged
alike. Per decoder layer (``.layers.<i>.`` in the name), the first op that differs is where
that layer's gap starts.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

LAYER = re.compile(r"\.layers\.(\d+)\.")


@dataclass(frozen=True)
class OpGap:
    name: str
    largest: float  # max |rollout - engine|
    scale: float  # max |engine|, at least 1

    @property
    def relative(self) -> float:
        return self.largest / self.scale


def op_gaps(served: Mapping[str, Any], trained: Mapping[str, Any]) -> list[OpGap]:
    """Each op both sides recorded with the same per-position shape, in the rollout's order,
    over their common positions."""
    gaps = []
    for name, mine in served.items():
        theirs = trained.get(name)
        if theirs is None or tuple(mine.shape[1:]) != tuple(theirs.shape[1:]):
            continue
        n = min(mine.shape[0], theirs.shape[0])
        a, b = mine[:n].double(), theirs[:n].double()
        largest = float((a - b).abs().max()) if n else 0.0
        gaps.append(OpGap(name, largest, max(1.0, float(b.abs().max()) if n else 1.0)))
    return gaps


def compare_ops(
    served: Mapping[str, Any] | None, trained: Mapping[str, Any] | None, tolerance: float
) -> tuple[bool | None, str]:
    """Whether the two sides' ops agree within ``tolerance`` (``None``: not compared), and
    what was found."""
    if served is None:
        return None, "the rollout cannot trace its ops (Rollout.trace_ops)"
    if trained is None:
        return None, "the engine cannot trace its ops (Engine.trace_ops)"
    gaps = op_gaps(served, trained)
    if not gaps:
        return None, "the two sides recorded no op under the same name"
    first = next((g for g in gaps if g.largest > 0), None)
    beyond = next((g for g in gaps if g.relative > tolerance), None)
    if first is None:
        return True, f"all {len(gaps)} ops equal bit for bit"
    layers: dict[str, OpGap] = {}
    for gap in gaps:
        found = LAYER.search(gap.name)
        if found and gap.largest > 0:
            layers.setdefault(found.group(1), gap)
    per_layer = "; ".join(
        f"layer {i}: {g.name.split(f'.layers.{i}.', 1)[1]} {g.largest:.2e}"
        for i, g in layers.items()
    )
    detail = f"{len(gaps)} ops; first to differ: {first.name} (by {first.largest:.2e})"
    if beyond is not None:
        detail += f"; first beyond tolerance {tolerance:g}: {beyond.name} ({beyond.largest:.2e})"
    if per_layer:
        detail += f"; per layer, where it starts: {per_layer}"
    return beyond is None, detail
