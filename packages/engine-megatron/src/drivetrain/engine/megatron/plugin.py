"""Entry-point declaration of the ``megatron`` engine (light: imports only ``drivetrain.api``)."""

from drivetrain.api.plugin import PluginSpec

MEGATRON = PluginSpec(
    name="megatron",
    factory="drivetrain.engine.megatron.engine:MegatronEngine",
    config="drivetrain.engine.megatron.config:MegatronConfig",
    api=">=0.1,<0.2",
    capabilities=frozenset(
        {
            "data_parallel",
            "tensor_parallel",
            "pipeline_parallel",
            "sequence_parallel",
            "context_parallel",
            "expert_parallel",
            "routing_replay",  # routed_experts in and out (routing.py; tests/test_routing.py)
            "offload",
            "value_head",  # model.value_head: a per-token scalar head (tests/test_model_parity)
            "packed",
            "dynamic_batch",
            "resharding_checkpoint",
            "device:cpu",
            "device:cuda",
        }
    ),
    install_hint="pip install drivetrain-engine-megatron",
    planner="drivetrain.engine.megatron.plan:plan_memory",
    description="Megatron-Core GPTModel: TP, PP, SP, CP, EP/MoE, DDP + distributed optimizer",
)
