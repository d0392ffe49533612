"""The FSDP engine's configuration (no torch import: the trainer reads it to validate runs)."""

from __future__ import annotations

from dataclasses import dataclass

from drivetrain.api import ConfigError, EngineConfig

STRATEGIES = ("full_shard", "shard_grad_op", "hybrid_shard", "no_shard")
ATTENTION = ("varlen", "sdpa", "eager", "flash_attention_2")


@dataclass(frozen=True)
class FSDPConfig(EngineConfig):
    """Knobs of drivetrain's FSDP engines (``fsdp2`` and ``fsdp``).

    ``strategy``: ``full_shard`` (ZeRO-3), ``shard_grad_op`` (ZeRO-2: parameters stay gathered
    between forward and backward), ``hybrid_shard`` (shard within groups of
    ``hybrid_shard_size`` ranks, replicate across them), ``no_shard`` (DDP-like).
    ``reduce_dtype``: gradient reduction dtype under mixed precision (params in ``model.dtype``).
    ``attention``: ``varlen`` runs causal SDPA per packed sequence (no cross-sequence leakage,
    no dense mask; required for Ulysses; on CPU faster than one masked call); ``sdpa``/``eager``
    use the model's own; on GPUs with flash-attn installed ``flash_attention_2`` runs packed
    rows through its variable-length kernel (transformers reads the restarting position ids).
    ``packed_kernel`` (``attention='varlen'``): what attends over a packed row. ``auto``: on CUDA
    one variable-length kernel call per layer (flash-attn's when installed, else PyTorch's
    ``varlen_attn``; bfloat16/float16 models only), elsewhere ``grouped_sdpa`` (one SDPA call
    per group of similar-length documents, the fastest measured on the CPU); or name one
    (``flash_attn``, ``torch_varlen``, ``grouped_sdpa``: ``drivetrain.engine_core.
    packed_kernels``, checked when the engine starts). The choice is printed once.
    ``remove_padding``: compute on packed sequences whatever the input layout.
    ``share_prefixes``: samples of a micro-batch that carry the api column
    ``shared_prefix_len`` and start with the same tokens (GRPO's n responses to one prompt)
    compute that prefix once (``attention='varlen'``, no Ulysses); outputs are unchanged.
    ``ulysses_size``: sequence-parallel group size (divides the world size).
    ``logits_chunk``: tokens per chunk when turning hidden states into log-probs/entropy, so
    full-vocabulary logits exist for at most this many tokens at a time; 0 picks the count whose
    fp32 logits fill ``logits_chunk_mib`` (4,096 tokens at a 16k vocabulary, 440 at 152k).
    ``cpu_offload_policy``: FSDP2's ``CPUOffloadPolicy`` (parameters live on host during steps);
    distinct from ``offload`` (move state to host between train/eval phases).
    ``torch_compile``: each decoder layer's ``forward`` through ``torch.compile`` (dynamic
    shapes; FSDP's hooks stay outside the compiled code): fused elementwise kernels around the
    matmuls on a GPU, at a compile of about half a minute (CPU, a tiny model) to minutes at
    the first step. Off by default: measured per model and device (``benchmarks/gpu/mfu.py``'s
    ``fsdp2_compiled`` row); ``numerics=exact`` refuses it (compiled kernels reorder sums).
    """

    strategy: str = "full_shard"
    hybrid_shard_size: int = 0
    reduce_dtype: str = "float32"
    attention: str = "varlen"
    packed_kernel: str = "auto"
    remove_padding: bool = True
    share_prefixes: bool = True
    ulysses_size: int = 1
    logits_chunk: int = 0
    logits_chunk_mib: int = 256
    cpu_offload_policy: bool = False
    torch_compile: bool = False
    meta_init: bool = True  # multi-rank FSDP2: only rank 0 reads the weights, others build on meta
    tokenizer_path: str = ""  # defaults to model.path when it holds a tokenizer

    def chunk_tokens(self, vocab_size: int) -> int:
        if self.logits_chunk:
            return self.logits_chunk
        return max(1, self.logits_chunk_mib * 2**20 // (4 * vocab_size))

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.strategy not in STRATEGIES:
            raise ConfigError(f"strategy={self.strategy!r} is not one of {', '.join(STRATEGIES)}")
        if self.attention not in ATTENTION:
            raise ConfigError(f"attention={self.attention!r} is not one of {', '.join(ATTENTION)}")
        if self.reduce_dtype not in ("float32", "bfloat16"):
            raise ConfigError(f"reduce_dtype={self.reduce_dtype!r} must be float32 or bfloat16")
        if self.ulysses_size < 1 or self.logits_chunk < 0 or self.logits_chunk_mib < 1:
            raise ConfigError("ulysses_size and logits_chunk_mib must be >= 1, logits_chunk >= 0")
        if self.ulysses_size > 1 and (self.attention != "varlen" or not self.remove_padding):
            raise ConfigError("ulysses_size > 1 needs attention='varlen' and remove_padding")
        if self.attention == "varlen" and not self.remove_padding:
            raise ConfigError("attention='varlen' computes packed rows: keep remove_padding on")
        if self.torch_compile and self.numerics == "exact":
            raise ConfigError(
                "torch_compile with numerics=exact: compiled kernels sum in another order than "
                "the rollout's; turn one of them off"
            )
        if self.strategy == "hybrid_shard" and self.hybrid_shard_size < 1:
            raise ConfigError("strategy='hybrid_shard' needs hybrid_shard_size >= 1")
