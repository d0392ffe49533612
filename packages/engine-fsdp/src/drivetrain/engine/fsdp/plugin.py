"""Entry points ``fsdp2`` (default) and ``fsdp`` (FSDP1). Imports nothing but drivetrain.api."""

from drivetrain.api import PluginSpec

_CAPABILITIES = frozenset(
    {
        "lora",
        "value_head",
        "packed",
        "dynamic_batch",
        "data_parallel",
        "sequence_parallel",
        "offload",
        "resharding_checkpoint",
        "device:cpu",
        "device:cuda",
        "device:npu",
    }
)

FSDP2 = PluginSpec(
    name="fsdp2",
    factory="drivetrain.engine.fsdp.engine:FSDP2Engine",
    config="drivetrain.engine.fsdp.config:FSDPConfig",
    api=">=0.1,<0.2",
    capabilities=_CAPABILITIES | {"exact_numerics", "routing_replay"},  # fsdp2 only: tested there
    install_hint="pip install drivetrain-engine-fsdp",
    planner="drivetrain.engine.fsdp.plan:plan_memory",
    description="PyTorch FSDP2 (fully_shard) over Hugging Face causal LMs",
)

FSDP1 = PluginSpec(
    name="fsdp",
    factory="drivetrain.engine.fsdp.engine:FSDP1Engine",
    config="drivetrain.engine.fsdp.config:FSDPConfig",
    api=">=0.1,<0.2",
    capabilities=_CAPABILITIES,
    install_hint="pip install drivetrain-engine-fsdp",
    description="PyTorch FSDP1 (FullyShardedDataParallel) over Hugging Face causal LMs",
)
