"""The hf rollout's ops while it generates given tokens (``Rollout.trace_ops``), for
``drivetrain diagnose mismatch`` to compare with the engine's op by op."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import DynamicCache

from drivetrain.engine_core.op_trace import trace_modules


@torch.inference_mode()
def trace_generation(
    model: torch.nn.Module, prompt_ids: Sequence[int], token_ids: Sequence[int]
) -> dict[str, torch.Tensor]:
    """Every module's output at positions ``0 .. len(prompt) + len(tokens) - 2`` as the
    batcher computes them for a request alone (the prompt's prefill over a fresh cache, then
    one decode step per token), and ``log_probs`` of ``token_ids`` at temperature 1."""
    device = next(model.parameters()).device
    feed = [list(prompt_ids)] + [[t] for t in token_ids[:-1]]
    cache, seen, logits = DynamicCache(), 0, []
    with trace_modules(model) as trace:
        for chunk in feed:
            ids = torch.tensor([chunk], device=device)
            out = model(
                input_ids=ids,
                attention_mask=torch.ones(1, seen + len(chunk), dtype=torch.long, device=device),
                position_ids=torch.arange(seen, seen + len(chunk), device=device)[None],
                past_key_values=cache,
                use_cache=True,
            )
            logits.append(out.logits[0].float())
            seen += len(chunk)
    ops = trace.outputs()
    predicting = torch.log_softmax(torch.cat(logits)[len(prompt_ids) - 1 :], -1)
    targets = torch.tensor(list(token_ids), device=predicting.device)[:, None]
    ops["log_probs"] = predicting.gather(1, targets)[:, 0].cpu()
    return ops
