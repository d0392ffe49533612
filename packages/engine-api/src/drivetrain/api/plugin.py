"""What a plugin declares about itself, readable without importing its heavy code.

A distribution registers an entry point in ``drivetrain.engines``, ``drivetrain.rollouts``,
``drivetrain.ckpt_engines`` (weight-sync transports) or ``drivetrain.environments`` whose value
is a :class:`PluginSpec` in a light module (one that imports only ``drivetrain.api``)::

    # acme_engine/plugin.py
    ACME = PluginSpec(
        name="acme",
        factory="acme_engine.engine:AcmeEngine",   # imported only when selected
        config="acme_engine.config:AcmeConfig",    # a dataclass; light module too
        api=">=0.1,<0.2",
        capabilities=frozenset({"lora", "sequence_parallel", "device:cpu", "device:cuda"}),
        install_hint="pip install acme-engine",
    )

    # pyproject.toml
    [project.entry-points."drivetrain.engines"]
    acme = "acme_engine.plugin:ACME"

Tool-call parsers are plugins too, simpler ones: the group ``drivetrain.tool_parsers`` names a
parser class or instance directly, no spec (``drivetrain.trainer.agentic.tool_parsers``).
"""

from __future__ import annotations

from dataclasses import dataclass

from drivetrain.api.version import VersionRange

#: Capabilities drivetrain's own components look for. Plugins may declare others. When a job
#: loads, the trainer gives a plugin only what it declares: it adapts where it can (padded
#: batches, fixed micro-batches) and refuses the rest in one line naming the config key. A
#: plugin declaring nothing gets padded batches and fixed-size micro-batches (engine-api
#: README, "Capabilities", says which key asks for which).
KNOWN_CAPABILITIES = frozenset(
    {
        "lora",  # model.lora adapters, disable_adapter(), export_weights(adapter_only=True)
        "value_head",  # model.value_head: a per-token `values` output (critics, reward models)
        "packed",  # accepts Layout.PACKED batches, outputs as for the same batch padded
        "dynamic_batch",  # honours micro_batch.max_tokens (token-budget micro-batches)
        "data_parallel",  # the parallelisms are informational: set by the plugin's own keys
        "tensor_parallel",
        "pipeline_parallel",
        "context_parallel",
        "sequence_parallel",
        "expert_parallel",
        "offload",  # honours offload.params / offload.optimizer between modes
        "resharding_checkpoint",  # load a checkpoint saved at another world size/layout
        "sleep",  # rollouts: sleep() frees accelerator memory (colocated placement needs it)
        "separate_process",  # rollouts: runs in a process/environment of its own
        "exact_numerics",  # numerics=exact: log-probs bitwise equal to a peer that declares it
        "routing_replay",  # engines: replay a batch's routed_experts; report their own routing
        "routed_experts",  # rollouts: rollout.return_routed_experts (mixture-of-experts models)
        "cross_node",  # transports: reaches a rollout on another machine of a cluster
        "device:cpu",  # runs on that device; a plugin listing no device:* makes no claim
        "device:cuda",
        "device:npu",
    }
)


@dataclass(frozen=True)
class PluginSpec:
    """A plugin's self-description; the registry checks it before importing ``factory``."""

    name: str
    factory: str  # "module:attribute" of the class to instantiate with a config
    api: str  # engine-api versions implemented, e.g. ">=0.1,<0.2"
    capabilities: frozenset[str] = frozenset()
    config: str = ""  # "module:attribute" of the config dataclass; empty: the api's default
    install_hint: str = ""  # what to run when it fails to import
    description: str = ""
    #: engines: "module:function" planning a step's memory (``drivetrain.api.plan``); empty:
    #: ``drivetrain plan`` reports the engine as unplanned
    planner: str = ""

    def __post_init__(self) -> None:
        targets = (("factory", self.factory), ("config", self.config), ("planner", self.planner))
        for label, target in targets:
            if target and (target.count(":") != 1 or not all(target.split(":"))):
                raise ValueError(f"plugin {self.name!r}: {label} must be 'module:attribute'")
        if not self.factory:
            raise ValueError(f"plugin {self.name!r}: factory is required")
        VersionRange.parse(self.api)  # fail early on a malformed range
        object.__setattr__(self, "capabilities", frozenset(self.capabilities))
