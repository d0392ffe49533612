"""The ``hf`` rollout: transformers ``generate``."""
