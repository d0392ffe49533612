"""Worker: load HF checkpoints into Megatron chunks, forward a fixed batch, export.

argv: OUT_DIR SPEC_JSON, SPEC = {"layouts": [{"name", "tp", "pp", "vp", "ep"?, "etp"?, "sp"?}],
"cases": [{"name", "hf_dir", "value_head"}], "tokens": [[int]]}. Per (layout, case) each rank
reports the gathered logits (the last pipeline stage only) and a digest of its export stream;
rank 0 also writes the export as an HF checkpoint directory OUT_DIR/<layout>-<case>.
"""

import json
import shutil
import sys
from pathlib import Path

import torch

from megatron_launch import single_thread, write_result


def forward_logits(models, tokens, value_head):
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    captured = []

    def loss_func(output):
        captured.append(output.detach())
        return output.sum() * 0.0, {}

    def step(iterator, model):
        ids = next(iterator)
        positions = torch.arange(ids.shape[1]).unsqueeze(0).expand_as(ids)
        return model(ids, positions, None), loss_func

    get_forward_backward_func()(
        forward_step_func=step,
        # one row per micro-batch: the interleaved schedule needs at least PP micro-batches
        data_iterator=[iter(tokens.split(1)) for _ in models],
        model=models,
        num_microbatches=tokens.shape[0],
        seq_length=tokens.shape[1],
        micro_batch_size=1,
        forward_only=True,
    )
    if not parallel_state.is_pipeline_last_stage():
        return None
    logits = torch.cat(captured)
    if value_head:  # replicated on every TP rank
        return logits
    tp = parallel_state.get_tensor_model_parallel_world_size()
    parts = [torch.empty_like(logits) for _ in range(tp)]
    torch.distributed.all_gather(
        parts, logits, group=parallel_state.get_tensor_model_parallel_group()
    )
    return torch.cat(parts, dim=-1)


def run_case(layout, case, tokens, out_dir):
    from safetensors.torch import save_file
    from transformers import AutoConfig

    from drivetrain.engine.megatron.convert import export_hf_weights, load_hf_weights
    from drivetrain.engine.megatron.model import build_model, transformer_config

    hf_config = AutoConfig.from_pretrained(case["hf_dir"])
    tcfg = transformer_config(
        hf_config, dtype=torch.float32, tensor_parallel=layout["tp"],
        pipeline_parallel=layout["pp"], virtual_pipeline=layout["vp"], context_parallel=1,
        sequence_parallel=layout.get("sp", False), recompute=False, device="cpu",
        expert_parallel=layout.get("ep", 1), expert_tensor_parallel=layout.get("etp"),
    )  # fmt: skip
    value_head = case.get("value_head", False)
    models = build_model(hf_config, tcfg, value_head=value_head)
    load_hf_weights(models, case["hf_dir"], hf_config, tcfg)
    for model in models:
        model.eval()
    with torch.no_grad():
        logits = forward_logits(models, tokens, value_head)
    if logits is not None and not value_head:
        logits = logits[..., : hf_config.vocab_size].clone()
    digest, exported = [], {}
    for name, tensor in export_hf_weights(models, hf_config, tcfg):
        digest.append((name, tuple(tensor.shape), float(tensor.double().sum())))
        exported[name] = tensor.detach().cpu().clone()
    if torch.distributed.get_rank() == 0:
        target = Path(out_dir) / f"{layout['name']}-{case['name']}"
        target.mkdir()
        save_file(exported, target / "model.safetensors", metadata={"format": "pt"})
        shutil.copy(Path(case["hf_dir"]) / "config.json", target / "config.json")
    return {"logits": logits, "digest": digest}


if __name__ == "__main__":  # megatron's checkpoint writer re-imports the entry script
    single_thread()
    from drivetrain.engine.megatron.parallel import destroy_parallel, init_parallel

    out_dir, spec = sys.argv[1], json.loads(sys.argv[2])
    tokens = torch.tensor(spec["tokens"])
    results = {}
    for layout in spec["layouts"]:
        init_parallel(
            tensor_parallel=layout["tp"], pipeline_parallel=layout["pp"],
            virtual_pipeline=layout["vp"], context_parallel=1,
            expert_parallel=layout.get("ep", 1), expert_tensor_parallel=layout.get("etp"),
            device="cpu", seed=1234,
        )  # fmt: skip
        for case in spec["cases"]:
            results[f"{layout['name']}-{case['name']}"] = run_case(layout, case, tokens, out_dir)
    write_result(out_dir, results)
    destroy_parallel()
