"""Entry-point declaration (``env=openenv``): imports only ``drivetrain.api``, so
``drivetrain environments`` lists it without importing websockets."""

from drivetrain.api.plugin import PluginSpec

OPENENV = PluginSpec(
    name="openenv",
    factory="drivetrain.envs.openenv.environment:OpenEnvEnvironment",
    api=">=0.1,<0.2",
    install_hint="pip install drivetrain-env-openenv",
    description="an OpenEnv environment server by URL (episode.options.url), one session an "
    "episode, the server's rewards",
)
