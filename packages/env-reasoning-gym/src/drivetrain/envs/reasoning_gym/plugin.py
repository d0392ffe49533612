"""Entry-point declaration (``env=reasoning_gym``): imports only ``drivetrain.api``, so
``drivetrain environments`` lists it without importing reasoning-gym."""

from drivetrain.api.plugin import PluginSpec

REASONING_GYM = PluginSpec(
    name="reasoning_gym",
    factory="drivetrain.envs.reasoning_gym.environment:ReasoningGymEnvironment",
    api=">=0.1,<0.2",
    install_hint="pip install drivetrain-env-reasoning-gym",
    description="reasoning-gym's procedural tasks by name (episode.options.dataset), scored by "
    "the dataset's own scorer",
)
