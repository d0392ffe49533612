"""The ``sglang`` rollout: SGLang's offline ``Engine`` (CUDA GPUs only)."""
