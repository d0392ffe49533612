"""Entry-point declaration of the ``megatron_fsdp`` engine (light: imports only
``drivetrain.api``)."""

from drivetrain.api.plugin import PluginSpec

MEGATRON_FSDP = PluginSpec(
    name="megatron_fsdp",
    factory="drivetrain.engine.megatron_fsdp.engine:MegatronFSDPEngine",
    config="drivetrain.engine.megatron_fsdp.config:MegatronFSDPConfig",
    api=">=0.1,<0.2",
    capabilities=frozenset(
        {
            "data_parallel",
            "fully_sharded",
            "tensor_parallel",
            "pipeline_parallel",
            "sequence_parallel",
            "packed",
            "dynamic_batch",
            "resharding_checkpoint",
            "device:cpu",
            "device:cuda",
        }
    ),
    install_hint="pip install drivetrain-engine-megatron-fsdp",
    description="Megatron-Core GPTModel sharded by Megatron-FSDP (ZeRO-1/2/3), with TP and PP",
)
