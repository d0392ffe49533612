"""What an engine author supplies to run the conformance kit against their engine."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from drivetrain.api.batch import Batch
from drivetrain.api.config import MicroBatchConfig, OffloadConfig, OptimConfig
from drivetrain.api.engine import Engine


class EngineHarness(Protocol):
    """Builds engines and batches in the engine's own types.

    Every engine from ``make_engine`` must start from the same weights (same seed), with an
    optimizer config whose steps visibly change the weights (a learning rate around 1e-2 and
    no warm-up suits the kit's tiny data). On a multi-rank engine every rank builds the same
    global batch; the kit shards it with ``engine.parallel.shard_of``,
    as the trainer does.
    """

    #: The vocabulary size: the kit draws token ids below it.
    vocab_size: int
    #: Absolute/relative tolerance for comparisons (fp32 engines: about 1e-5).
    atol: float
    rtol: float
    #: Whether the engine takes ``Layout.PACKED`` batches (the "packed" capability).
    packed: bool
    #: The capabilities its plugin declares (``PluginSpec.capabilities``); checks of optional
    #: features (``offload``, ``dynamic_batch``) run only for engines that declare them, and
    #: fail for a harness that does not say.
    capabilities: frozenset[str]

    def make_engine(
        self,
        micro_batch: MicroBatchConfig,
        *,
        optim: OptimConfig | None = None,
        offload: OffloadConfig | None = None,
        dropout: float = 0.0,
        dtype: str | None = None,
    ) -> Engine:
        """A fresh, initialized engine using ``micro_batch`` as its micro-batching config.

        ``optim`` replaces the harness's optimizer config (the kit's clipping, schedule and
        checkpoint checks set their own), ``offload`` its offload config. ``dropout`` > 0 asks
        for a model whose training forward draws from the engine's RNG (e.g. attention
        dropout), for the RNG-restore check; a harness that cannot make one leaves the keyword
        out and that check is skipped. ``dtype`` sets ``model.dtype`` (for ``model_dtypes``)."""
        ...

    #: Optional: the model dtypes to check outputs under (``make_engine(dtype=)``, e.g.
    #: ``("float32", "bfloat16")``), with ``dtype_of(value)`` (a column's dtype as torch names
    #: it, e.g. ``"float32"``) and ``device_of(value)`` (``"cpu"``, ``"cuda:0"``). Without
    #: ``dtype_of`` the dtype check is skipped.

    def make_batch(
        self, sequences: Sequence[Sequence[int]], loss_mask: Sequence[Sequence[int]]
    ) -> Batch:
        """A padded batch with ``input_ids`` and ``loss_mask`` columns in the engine's types
        (``loss_mask`` as a floating type, so losses can multiply by it)."""
        ...

    def to_list(self, value: Any) -> Any:
        """A column or weight value as nested Python lists of floats."""
        ...

    def all_gather_object(self, obj: Any) -> list[Any]:
        """``obj`` from every rank of the engine's world, in rank order (``[obj]`` for one
        process), e.g. ``torch.distributed.all_gather_object``. Also acts as a barrier."""
        ...

    def reference_weights(self) -> Mapping[str, Any]:
        """The initial weights by Hugging Face name, built independently of the engine (e.g.
        from the HF model the engine loads); values in any type ``to_list`` accepts."""
        ...
