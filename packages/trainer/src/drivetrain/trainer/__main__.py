"""``python -m drivetrain.trainer``: the ``drivetrain`` command (what torchrun launches)."""

from drivetrain.trainer.cli import main

main()
