"""The built-in calculator environment passes the environment kit: its solution is the two
calculator calls of the task's steps, then the answer."""

from drivetrain.api.environment import AssistantTurn, ToolCall
from drivetrain.testing.environment_kit import EnvironmentConformance, EnvironmentHarness
from drivetrain.trainer.builtin.calculator import CalculatorEnvironment


class CalculatorHarness(EnvironmentHarness):
    def make_environment(self, options=None):
        return CalculatorEnvironment(options)

    def solution(self, task):
        calls = [
            AssistantTurn(i, "", "", (ToolCall("calculator", {"expression": step}, f"c{i}"),))
            for i, step in enumerate(task["steps"])
        ]
        answer = str(task["answer"])
        return [*calls, AssistantTurn(len(calls), answer, answer)]


class TestCalculatorEnvironment(EnvironmentConformance):
    def harness(self):
        return CalculatorHarness()
