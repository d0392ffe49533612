"""Entry-point declaration of the built-in environment (``env=calculator``): a light module
that imports only ``drivetrain.api``, so ``drivetrain environments`` lists it without
importing the environment."""

from drivetrain.api.plugin import PluginSpec

CALCULATOR = PluginSpec(
    name="calculator",
    factory="drivetrain.trainer.builtin.calculator:CalculatorEnvironment",
    api=">=0.1,<0.2",
    install_hint="pip install drivetrain-trainer",
    description="multi-step arithmetic with a calculator tool (the built-in agentic task)",
)
