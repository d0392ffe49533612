"""Worker (one rank): a packed micro-batch of 1, 10 and 100 documents through the megatron engine
with a variable-length kernel (the CPU reference of
``drivetrain.testing.torch_engines.kernels``, registered here): kernel calls per forward, the
largest tensor of the forward, and log-probs against the grouped SDPA path. Then one training
step with the log-prob path in chunks of 7 tokens (checkpointed) and in one piece: loss and
gradient norm.

argv: OUT_DIR MODEL_DIR.
"""

import random
import sys

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from drivetrain.api import MicroBatchConfig, OutputSpec
from drivetrain.engine_core import packed_kernels
from drivetrain.testing.torch_engines.kernels import ReferenceKernel
from megatron_harness import MegatronHarness
from megatron_launch import single_thread, write_result


class LargestTensor(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.bytes = max(self.bytes, t.numel() * t.element_size())
        return out


def main(out_dir: str, model_dir: str) -> None:
    single_thread()
    kernel = ReferenceKernel()
    packed_kernels.VARLEN_KERNELS["reference"] = kernel
    results = {}
    engines = {
        name: MegatronHarness(model_dir, overrides={"packed_kernel": name}).make_engine(
            MicroBatchConfig(micro_batch_size=100)
        )
        for name in ("reference", "grouped_sdpa")
    }
    for documents in (1, 10, 100):
        rng = random.Random(documents)
        seqs = [[rng.randint(3, 60) for _ in range(rng.randint(2, 30))] for _ in range(documents)]
        harness = MegatronHarness(model_dir)
        batch = harness.make_batch(seqs, [[1] * len(s) for s in seqs])
        outputs, largest = {}, 0
        for name, engine in engines.items():
            kernel.calls = 0
            spy = LargestTensor()
            with engine.eval_mode(), spy:
                outputs[name] = engine.infer(batch, OutputSpec(log_probs=True))["log_probs"]
            largest = max(largest, spy.bytes)
            if name == "reference":
                calls = kernel.calls
        results[documents] = {
            "tokens": sum(len(s) for s in seqs),
            "calls": calls,
            "largest_bytes": largest,
            "log_probs": {name: [list(map(float, x)) for x in lp] for name, lp in outputs.items()},
        }
    for engine in engines.values():
        engine.close()
    results["chunked"] = {bytes_: train_step(model_dir, bytes_) for bytes_ in (None, 7)}
    write_result(out_dir, results)


def train_step(model_dir: str, chunk_tokens: int | None) -> list[float]:
    """Loss and gradient norm of one step; ``chunk_tokens`` per log-prob chunk (None: one)."""
    from drivetrain.engine.megatron import token_outputs
    from drivetrain.testing import token_mean_nll
    from parity_data import training_batch

    harness = MegatronHarness(model_dir)
    engine = harness.make_engine(MicroBatchConfig(micro_batch_size=100))
    vocab = engine.hf_config.vocab_size
    token_outputs.CHUNK_BYTES = 4 * 128 * chunk_tokens if chunk_tokens else 1 << 40
    assert vocab <= 128  # the padded vocabulary of a rank: 128 columns
    batch = harness.make_batch(*training_batch())
    with engine.train_mode():
        engine.optimizer_zero_grad()
        loss = engine.forward_backward(batch, token_mean_nll).loss
        norm = engine.optimizer_step()
    engine.close()
    return [float(loss), float(norm)]


if __name__ == "__main__":
    main(*sys.argv[1:])
