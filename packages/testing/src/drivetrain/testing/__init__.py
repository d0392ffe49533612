"""drivetrain-testing: the conformance kits and fakes. Test an engine, rollout, transport or
environment against its contract, and test orchestration without torch (the kits and fakes
need the standard library, drivetrain-runtime and pytest; ``torch_engines`` needs torch).
"""

from drivetrain.testing.conformance import (
    ENGINE_CHECKS,
    CheckResult,
    run_conformance,
    sample_data,
    token_mean_nll,
)
from drivetrain.testing.environments import EchoEnvironment
from drivetrain.testing.fake_engine import FakeEngine, FakeEngineConfig
from drivetrain.testing.fake_harness import FakeHarness
from drivetrain.testing.fake_rollout import FakeRollout, FakeRolloutConfig
from drivetrain.testing.harness import EngineHarness
from drivetrain.testing.suite import EngineConformance

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
