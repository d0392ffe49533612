"""Worker (2 ranks, gloo): Ulysses attention through a variable-length kernel equals the grouped
SDPA path on the whole row, values and gradients, plain documents and shared prefixes, with KV
heads that divide the group and with one KV head (sent repeated).

argv: OUT_DIR. Each rank reports its largest differences and the kernel's call count.
"""

import sys

import torch
import torch.distributed as dist

from drivetrain.engine.fsdp.attention import _repeat_kv, set_packed_row, varlen_attention
from drivetrain.engine_core import packed_kernels
from drivetrain.engine_core.packed_attention import Span, attend_spans, plain_spans
from drivetrain.testing.torch_engines.kernels import ReferenceKernel
from fsdp_harness import single_thread
from launch import write_result

HEADS, DIM = 4, 8
ROWS = {  # spans over a 32-token row
    "plain": plain_spans([0, 3, 13, 14, 27, 32]),
    "shared_prefix": (Span(0, 6), Span(6, 9, 0, 6), Span(15, 11, 0, 6), Span(26, 6)),
}


class _Attention(torch.nn.Module):  # what transformers passes as ``module``
    pass


def _compare(spans: tuple[Span, ...], kv_heads: int, group: dist.ProcessGroup) -> dict:
    rank, size = dist.get_rank(), dist.get_world_size()
    total = sum(s.length for s in spans)
    gen = torch.Generator().manual_seed(kv_heads)  # the same row on every rank
    q, k, v = (torch.randn(1, h, total, DIM, generator=gen) for h in (HEADS, kv_heads, kv_heads))
    weight = torch.randn(1, total, HEADS, DIM, generator=gen)
    mine = slice(rank * total // size, (rank + 1) * total // size)

    full = [t.clone().requires_grad_() for t in (q, k, v)]
    times = HEADS // kv_heads
    want = attend_spans(full[0], _repeat_kv(full[1], times), _repeat_kv(full[2], times),
                        spans, 0.0, None).transpose(1, 2)  # fmt: skip
    (want * weight).sum().backward()

    local = [t[:, :, mine].clone().requires_grad_() for t in (q, k, v)]
    set_packed_row(spans, group, "reference")
    got, _ = varlen_attention(_Attention().eval(), *local, None)
    (got * weight[:, mine]).sum().backward()
    errors = [(got - want[:, mine]).abs().max().item()]
    errors += [
        (a.grad - b.grad[:, :, mine]).abs().max().item() for a, b in zip(local, full, strict=True)
    ]
    return {"max_error": max(errors)}


if __name__ == "__main__":
    single_thread()
    out_dir = sys.argv[1]
    dist.init_process_group("gloo")
    kernel = ReferenceKernel()
    packed_kernels.VARLEN_KERNELS["reference"] = kernel
    group = dist.new_group([0, 1])
    report = {}
    for name, spans in ROWS.items():
        for kv_heads in (2, 1):
            before = kernel.calls
            result = _compare(spans, kv_heads, group)
            report[f"{name}/kv{kv_heads}"] = {**result, "calls": kernel.calls - before}
    write_result(out_dir, report)
    dist.destroy_process_group()
