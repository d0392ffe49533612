"""Entry-point declarations of the fake engine, rollout and transport (``--engine fake``) and
of the ``echo`` environment (``env=echo``): test doubles, hidden outside tests."""

from drivetrain.api.plugin import PluginSpec

FAKE_ENGINE = PluginSpec(
    name="fake",
    factory="drivetrain.testing.fake_engine:FakeEngine",
    config="drivetrain.testing.fake_engine:FakeEngineConfig",
    api=">=0.1,<0.2",
    capabilities=frozenset({"packed", "dynamic_batch", "offload", "device:cpu"}),
    description="pure-Python bigram engine for orchestration tests (no torch)",
)

FAKE_ROLLOUT = PluginSpec(
    name="fake",
    factory="drivetrain.testing.fake_rollout:FakeRollout",
    config="drivetrain.testing.fake_rollout:FakeRolloutConfig",
    api=">=0.1,<0.2",
    capabilities=frozenset({"device:cpu"}),
    description="pure-Python bigram rollout for orchestration tests (no torch)",
)

FAKE_TRANSPORT = PluginSpec(
    name="fake",
    factory="drivetrain.testing.fake_transport:FakeTransport",
    config="drivetrain.testing.fake_transport:FakeTransportConfig",
    api=">=0.1,<0.2",
    capabilities=frozenset({"device:cpu"}),
    description="pure-Python in-process weight sync for orchestration tests (no torch)",
)

ECHO_ENVIRONMENT = PluginSpec(
    name="echo",
    factory="drivetrain.testing.environments:EchoEnvironment",
    api=">=0.1,<0.2",
    description="say a number, with an echo tool, for agentic orchestration tests",
)
