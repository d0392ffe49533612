"""A plain PyTorch + transformers training loop (no drivetrain code): the parity baseline."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM


def reference_run(model_dir: str, sequences, masks, *, steps: int, lr: float = 1e-2) -> dict:
    """Token-mean NLL over the whole batch, AdamW, ``steps`` full-batch steps."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.train()
    optim = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    total = sum(sum(m[1:]) for m in masks)
    losses, norms = [], []
    for _ in range(steps):
        optim.zero_grad()
        loss_value = 0.0
        for seq, mask in zip(sequences, masks, strict=True):
            ids = torch.tensor(seq)[None]
            logits = model(input_ids=ids, use_cache=False).logits[0, :-1].float()
            lp = torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None]).squeeze(-1)
            loss = -(lp * torch.tensor(mask[1:], dtype=torch.float32)).sum() / total
            loss.backward()
            loss_value += loss.item()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf"))))
        optim.step()
        losses.append(loss_value)
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"losses": losses, "grad_norms": norms, "weights": weights}
