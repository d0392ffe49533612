"""Worker (one rank): parameters / gradients / optimizer state offloaded between steps and
brought back leave training bit-identical, and the device memory is really released.

argv: OUT_DIR MODEL_DIR DEVICE. On ``cpu`` the engine's own ``to()`` is a no-op (the state is
in host RAM already), so the offloader's storage swap is driven directly against the host
"device"; on ``cuda`` the engine offloads by itself when it leaves ``train_mode`` (its
``OffloadConfig``) and the device memory it frees is measured.
"""

import sys

import torch

from drivetrain.api import MicroBatchConfig, OffloadConfig
from drivetrain.testing import token_mean_nll
from megatron_harness import MegatronHarness
from megatron_launch import single_thread, write_result
from parity_data import training_batch


def run(model_dir, device, *, distributed_optimizer, offload):
    from drivetrain.engine.megatron.offload import Offloader

    overrides = {"device": device, "distributed_optimizer": distributed_optimizer}
    harness = MegatronHarness(model_dir, overrides=overrides)
    # the harness's own ``offload`` keyword (an override would pass it to the config twice)
    moved = OffloadConfig(params=True, optimizer=True) if offload and device != "cpu" else None
    engine = harness.make_engine(MicroBatchConfig(micro_batch_size=2), offload=moved)
    host = (
        Offloader(engine.model, engine.optimizer, torch.device("cpu")) if device == "cpu" else None
    )
    batch = harness.make_batch(*training_batch())
    steps, memory = [], []
    try:
        for _ in range(3):
            with engine.train_mode():
                engine.optimizer_zero_grad()
                loss = engine.forward_backward(batch, token_mean_nll).loss
                norm = engine.optimizer_step()
                engine.lr_scheduler_step()
                resident = engine.offloader.device_bytes()
                allocated = torch.cuda.memory_allocated() if device != "cpu" else 0
            steps.append({"loss": loss, "grad_norm": norm})
            if offload and host is not None:  # CPU: swap the storages out and back by hand
                before = host.device_bytes()
                host.offload(model=True, optimizer=True)
                after = host.device_bytes()
                host.reload(model=True, optimizer=True)
                memory.append({"before": before, "offloaded": after})
            elif offload:  # CUDA: the engine offloaded when train_mode exited
                memory.append({"resident": resident, "allocated_in_train": allocated,
                               "allocated_idle": torch.cuda.memory_allocated(),
                               "offloaded": engine.offloader.device_bytes()})  # fmt: skip
        exported = {name: t.detach().cpu().clone() for name, t in engine.export_weights()}
    finally:
        engine.close()
    return {"steps": steps, "memory": memory, "exported": exported}


if __name__ == "__main__":
    single_thread()
    out_dir, model_dir, device = sys.argv[1], sys.argv[2], sys.argv[3]
    results = {}
    for dopt in (True, False):
        for offload in (False, True):
            results[f"dopt={dopt},offload={offload}"] = run(
                model_dir, device, distributed_optimizer=dopt, offload=offload
            )
    write_result(out_dir, results)
    torch.distributed.destroy_process_group()
