"""The entry point's value: what ``drivetrain environments`` shows, read without importing
the environment itself (this module imports only ``drivetrain.api``)."""

from drivetrain.api import PluginSpec

ACME_LOOKUP = PluginSpec(
    name="acme_lookup",
    factory="acme_env.environment:LookupEnvironment",  # imported only when a job selects it
    api=">=0.1,<0.2",  # the engine-api versions this environment is written against
    install_hint="pip install ./examples/third_party_environment",
    description="inventory questions answered with a lookup tool, over several turns",
)
