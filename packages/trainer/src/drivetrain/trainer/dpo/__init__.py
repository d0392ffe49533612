"""Preference optimisation (``drivetrain dpo``): DPO, IPO and SimPO over any installed engine."""
