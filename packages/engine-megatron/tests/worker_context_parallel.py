"""Worker: the CP output gather over a 2-rank group (argv: OUT_DIR LENGTHS_JSON)."""

import json
import sys

import torch
import torch.distributed as dist

from megatron_launch import single_thread, write_result

if __name__ == "__main__":
    single_thread()
    from drivetrain.engine.megatron.context import gather_outputs, padded_lengths, split

    out_dir, lengths = sys.argv[1], json.loads(sys.argv[2])
    dist.init_process_group("gloo")
    rank, cp = dist.get_rank(), dist.get_world_size()
    padded = padded_lengths(lengths, cp)
    # the padded row: real tokens numbered 1.., padding -1
    row = torch.full((sum(padded),), -1.0)
    real, offset = [], 0
    for n, length in zip(lengths, padded, strict=True):
        row[offset : offset + n] = torch.arange(len(real) + 1, len(real) + n + 1, dtype=torch.float)
        real += list(range(len(real) + 1, len(real) + n + 1))
        offset += length
    local = split(row, padded, cp, rank).clone().requires_grad_(True)
    gathered = gather_outputs(local, lengths, padded, group=dist.group.WORLD)
    (gathered * gathered).sum().backward()  # the same loss on every rank: d/dx = 2x
    expected_grad = [2 * v if v > 0 else 0.0 for v in split(row, padded, cp, rank).tolist()]
    result = {"gathered": gathered.tolist(), "expected": [float(v) for v in real]}
    result.update(grad=local.grad.tolist(), expected_grad=expected_grad)
    write_result(out_dir, result)
    dist.destroy_process_group()
