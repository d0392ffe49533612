"""Every batch the trainer sends obeys the api's column contract: each column named in
:data:`drivetrain.api.columns.DTYPES` has that dtype and lives on the CPU (engines move each
micro-batch to their device). The builders (SFT, DPO, the RL roles' views) run this on what
they hand out, so a column built with another dtype fails where it is built, not inside an
engine's loss."""

from __future__ import annotations

from drivetrain.api import Batch
from drivetrain.api.columns import DTYPES
from drivetrain.api.errors import BatchError


def check_columns(batch: Batch) -> Batch:
    """``batch`` itself; raises :class:`BatchError` naming the first column off the contract."""
    for name in batch.columns:
        want = DTYPES.get(name)
        if want is None:
            continue
        value = batch[name]
        dtype = str(getattr(value, "dtype", type(value).__name__)).removeprefix("torch.")
        device = str(getattr(value, "device", "cpu"))
        if dtype != want or device != "cpu":
            raise BatchError(
                f"column {name!r} is {dtype} on {device}, but the column contract "
                f"(drivetrain.api.columns.DTYPES) says {want} on the CPU"
            )
    return batch
