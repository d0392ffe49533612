"""Supervised fine-tuning (``drivetrain sft``): chat or prompt/response data, packed or padded,
over any installed engine, in-process, under torchrun or on Ray workers."""
