"""The torch-level mechanics drivetrain's training engines share (fsdp, megatron,
megatron_fsdp, and any third-party engine that wants them).

The protocol-level part, the micro-batch driver, lives in the stdlib-only api
(:mod:`drivetrain.runtime.micro_batching`) so an engine on another tensor library can use it too;
this package supplies its ``torch.distributed`` collectives and what every torch engine does
around it: token columns between layouts, batches on the compute device, loss-free dummy
micro-batches for short shards, and ``infer`` results in the caller's order.
"""

from drivetrain.engine_core.collectives import TorchCollectives
from drivetrain.engine_core.outputs import InferOutputs
from drivetrain.engine_core.tokens import flat_column, loss_free_batch, on_device, to_layout

__all__ = [
    "InferOutputs",
    "TorchCollectives",
    "flat_column",
    "loss_free_batch",
    "on_device",
    "to_layout",
]
