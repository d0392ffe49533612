"""Entry-point declarations of the weight-sync transports (light: only drivetrain.api)."""

from drivetrain.api.plugin import PluginSpec

API = ">=0.1,<0.2"
INSTALL = "pip install drivetrain-ckpt-engine"

COLOCATED = PluginSpec(
    name="colocated",
    factory="drivetrain.ckpt.colocated:ColocatedTransport",
    config="drivetrain.ckpt.config:ColocatedConfig",
    api=API,
    capabilities=frozenset({"device:cpu", "device:cuda"}),
    install_hint=INSTALL,
    description="same machine/device: shared memory (CPU) or CUDA IPC handles, no collective",
)

BROADCAST = PluginSpec(
    name="broadcast",
    factory="drivetrain.ckpt.broadcast:BroadcastTransport",
    config="drivetrain.ckpt.config:BroadcastConfig",
    api=API,
    capabilities=frozenset({"device:cpu", "device:cuda", "device:npu", "cross_node"}),
    install_hint=INSTALL,
    description="process group from the trainer to every rollout: NCCL, HCCL or gloo by device",
)

DISK = PluginSpec(
    name="disk",
    factory="drivetrain.ckpt.disk:DiskTransport",
    config="drivetrain.ckpt.config:DiskConfig",
    api=API,
    capabilities=frozenset({"device:cpu", "device:cuda", "device:npu", "cross_node"}),
    install_hint=INSTALL,
    description="safetensors shards in a shared directory, published atomically",
)
