"""The conformance kit as a pytest test class, for engine authors::

    from drivetrain.testing import EngineConformance

    class TestAcmeEngine(EngineConformance):
        def harness(self):
            return AcmeHarness()

pytest collects the inherited ``test_*`` methods; nothing here imports pytest.
"""

from __future__ import annotations

from drivetrain.testing import conformance
from drivetrain.testing.harness import EngineHarness


class EngineConformance:
    """Inherit and implement :meth:`harness`; each contract check becomes a test."""

    def harness(self) -> EngineHarness:
        raise NotImplementedError("return an EngineHarness for the engine under test")

    def test_contract_shapes(self) -> None:
        conformance.check_contract_shapes(self.harness())

    def test_micro_batch_invariance(self) -> None:
        conformance.check_micro_batch_invariance(self.harness())

    def test_order_restored(self) -> None:
        conformance.check_order_restored(self.harness())

    def test_sample_groups_stay_together(self) -> None:
        conformance.check_sample_groups_stay_together(self.harness())

    def test_packed_matches_padded(self) -> None:
        conformance.check_packed_matches_padded(self.harness())

    def test_shared_prefix_is_only_a_hint(self) -> None:
        conformance.check_shared_prefix_is_only_a_hint(self.harness())

    def test_modes(self) -> None:
        conformance.check_modes(self.harness())

    def test_checkpoint_round_trip(self) -> None:
        conformance.check_checkpoint_round_trip(self.harness())

    def test_rng_restored(self) -> None:
        conformance.check_rng_restored(self.harness())

    def test_checkpoint_atomic(self) -> None:
        conformance.check_checkpoint_atomic(self.harness())

    def test_split_failure_reaches_every_rank(self) -> None:
        conformance.check_split_failure_reaches_every_rank(self.harness())

    def test_gradient_clipping(self) -> None:
        conformance.check_gradient_clipping(self.harness())

    def test_lr_schedule(self) -> None:
        conformance.check_lr_schedule(self.harness())

    def test_nonfinite_step_skipped(self) -> None:
        conformance.check_nonfinite_step_skipped(self.harness())

    def test_offload_round_trip(self) -> None:
        conformance.check_offload_round_trip(self.harness())

    def test_output_dtypes(self) -> None:
        conformance.check_output_dtypes(self.harness())

    def test_weight_export(self) -> None:
        conformance.check_weight_export(self.harness())
