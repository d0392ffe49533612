"""Which experts a mixture-of-experts model routed tokens to, as a rollout reports it.

A rollout asked for it (``RolloutConfig.return_routed_experts``) reports, for every position it
computed, the ``top_k`` experts each MoE layer chose: the prompt's positions at the prefill,
then the position of each generated token when the next step consumes it, so a completion of
``P`` prompt and ``N`` generated tokens has ``P + N - 1`` positions (the last token is never
fed back). The trainer turns them into the token column ``routed_experts`` (int16
``[tokens, layers, top_k]``, -1 where nothing was recorded) and an engine that replays routing
makes its forward choose exactly those experts.

Positions travel as :class:`RoutedExperts`, int16 little-endian bytes: 2 bytes per layer and
pick (Qwen3-30B-A3B: 48 layers x top-8 = 768 B a position; base64 on the JSON wire adds a
third), not a Python int each. Standard library only.
"""

from __future__ import annotations

import sys
from array import array
from dataclasses import dataclass

#: bytes per expert index
ITEM_BYTES = 2
#: a position no rollout recorded (the sequence's last token, padding, an observation)
NOT_RECORDED = -1


@dataclass(frozen=True)
class RoutedExperts:
    """Routing of consecutive positions ``start ..`` of one sequence: ``data`` is int16
    little-endian, row-major ``[positions, layers, top_k]``."""

    start: int
    layers: int
    top_k: int
    data: bytes

    def __post_init__(self) -> None:
        row = self.layers * self.top_k * ITEM_BYTES
        if self.start < 0 or self.layers < 1 or self.top_k < 1 or len(self.data) % row:
            raise ValueError(
                f"routed experts: start {self.start}, {self.layers} layers x top-{self.top_k} "
                f"do not describe {len(self.data)} bytes of int16"
            )

    @classmethod
    def from_indices(
        cls, start: int, layers: int, top_k: int, indices: list[int] | array
    ) -> RoutedExperts:
        """From flat expert indices ``[positions, layers, top_k]`` (row-major)."""
        values = array("h", indices)
        if sys.byteorder != "little":
            values.byteswap()
        return cls(start, layers, top_k, values.tobytes())

    @property
    def positions(self) -> int:
        return len(self.data) // (self.layers * self.top_k * ITEM_BYTES)

    @property
    def end(self) -> int:
        """The position after the last one."""
        return self.start + self.positions

    def indices(self) -> array:
        """The flat expert indices (``array('h')``, native byte order)."""
        values = array("h")
        values.frombytes(self.data)
        if sys.byteorder != "little":
            values.byteswap()
        return values

    def then(self, later: RoutedExperts | None) -> RoutedExperts:
        """These positions followed by ``later``'s beyond them. Positions both hold keep this
        one's routing: a resumed request prefills its prompt and tokens again, and the tokens
        already generated were sampled under the routing first recorded."""
        if later is None or later.end <= self.end:
            return self
        if (later.layers, later.top_k) != (self.layers, self.top_k):
            raise ValueError(
                f"routed experts of {later.layers} layers x top-{later.top_k} cannot follow "
                f"{self.layers} x top-{self.top_k}"
            )
        if later.start > self.end:
            raise ValueError(
                f"routed experts from position {later.start} cannot follow positions "
                f"{self.start}..{self.end - 1}: positions in between are missing"
            )
        row = self.layers * self.top_k * ITEM_BYTES
        return RoutedExperts(
            self.start,
            self.layers,
            self.top_k,
            self.data + later.data[(self.end - later.start) * row :],
        )


def join_routing(first: RoutedExperts | None, later: RoutedExperts | None) -> RoutedExperts | None:
    """``first`` then ``later`` (either may be ``None``)."""
    return later if first is None else first.then(later)
