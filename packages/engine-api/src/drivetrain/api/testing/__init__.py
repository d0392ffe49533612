"""The conformance kit and fakes: test engines against the contract, and test orchestration
without torch. Standard library only; running the kit under pytest needs the ``testing`` extra.
"""

from drivetrain.api.testing.conformance import (
    ENGINE_CHECKS,
    CheckResult,
    run_conformance,
    sample_data,
    token_mean_nll,
)
from drivetrain.api.testing.environments import EchoEnvironment
from drivetrain.api.testing.fake_engine import FakeEngine, FakeEngineConfig
from drivetrain.api.testing.fake_harness import FakeHarness
from drivetrain.api.testing.fake_rollout import FakeRollout, FakeRolloutConfig
from drivetrain.api.testing.harness import EngineHarness
from drivetrain.api.testing.suite import EngineConformance

__all__ = [
    "ENGINE_CHECKS",
    "CheckResult",
    "EchoEnvironment",
    "EngineConformance",
    "EngineHarness",
    "FakeEngine",
    "FakeEngineConfig",
    "FakeHarness",
    "FakeRollout",
    "FakeRolloutConfig",
    "run_conformance",
    "sample_data",
    "token_mean_nll",
]
