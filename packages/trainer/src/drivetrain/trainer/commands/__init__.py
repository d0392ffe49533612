"""The training commands: each runs its job through one skeleton, with its built-in task."""
