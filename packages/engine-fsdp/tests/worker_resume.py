"""torchrun worker for resume and export tests.

argv: OUT_DIR MODEL_DIR DATA_JSON MODE CKPT_DIR
MODE "train": 3 steps, checkpoint after step 1, HF export at the end.
MODE "resume": load the checkpoint, run steps 2..3.
"""

import json
import sys
from pathlib import Path

import torch

from drivetrain.api import MicroBatchConfig, OutputSpec
from drivetrain.testing import token_mean_nll
from drivetrain.testing.torch_engines.kit_harness import padded_batch
from drivetrain.trainer.hf_export import write_hf_model
from fsdp_harness import FSDPHarness, single_thread
from launch import write_result


def step(engine, batch):
    with engine.train_mode():
        engine.optimizer_zero_grad()
        result = engine.forward_backward(engine.parallel.shard_of(batch), token_mean_nll)
        norm = engine.optimizer_step()
        engine.lr_scheduler_step()
    return result.loss, norm


if __name__ == "__main__":
    single_thread()
    out_dir, model_dir, data, mode, ckpt = (
        sys.argv[1],
        sys.argv[2],
        json.loads(sys.argv[3]),
        sys.argv[4],
        sys.argv[5],
    )
    batch = padded_batch(data["sequences"], data["masks"])
    harness = FSDPHarness(
        model_dir, overrides={"optim": {"scheduler": "cosine", "warmup_steps": 1, "total_steps": 4}}
    )
    engine = harness.make_engine(MicroBatchConfig(max_tokens=48))
    record = {"losses": [], "norms": []}
    if mode == "train":
        for k in range(3):
            loss, norm = step(engine, batch)
            record["losses"].append(loss)
            record["norms"].append(norm)
            if k == 0:
                engine.save_checkpoint(ckpt, step=1)
        export = str(Path(out_dir) / "hf")
        write_hf_model(
            export,
            engine.export_weights(),
            source_dir=model_dir,
            writer=torch.distributed.get_rank() == 0,
        )
        torch.distributed.barrier()  # rank 0 finished writing before anyone reads
        with engine.eval_mode():
            scored = engine.infer(batch, OutputSpec(log_probs=True))
        if torch.distributed.get_rank() == 0:
            torch.save(scored["log_probs"], Path(out_dir) / "engine_log_probs.pt")
    else:
        info = engine.load_checkpoint(ckpt)
        record["loaded_step"] = info.step
        for _ in range(2):
            loss, norm = step(engine, batch)
            record["losses"].append(loss)
            record["norms"].append(norm)
    write_result(out_dir, record)
    engine.close()  # its threads and process-group resources end before the group does
    torch.distributed.destroy_process_group()
