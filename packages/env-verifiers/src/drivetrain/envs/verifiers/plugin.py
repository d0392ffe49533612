"""Entry-point declaration (``env=verifiers``): imports only ``drivetrain.api``, so
``drivetrain environments`` lists it without starting anything."""

from drivetrain.api.plugin import PluginSpec

VERIFIERS = PluginSpec(
    name="verifiers",
    factory="drivetrain.envs.verifiers.environment:VerifiersEnvironment",
    api=">=0.1,<0.2",
    install_hint="pip install drivetrain-env-verifiers",
    description="a verifiers (Prime Intellect hub) environment by id (episode.options.id), "
    "served by the hub's own server in its own Python (episode.options.python), its rewards",
)
