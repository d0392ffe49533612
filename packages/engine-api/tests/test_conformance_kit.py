"""The kit passes the fake engine and fails engines that break the contract."""

from dataclasses import replace

import pytest

from drivetrain.api import Batch, LossContext, OutputSpec, merge_metrics
from drivetrain.api.columns import SHARED_PREFIX_LEN
from drivetrain.api.testing import EngineConformance, FakeEngine, FakeHarness, run_conformance
from drivetrain.api.testing import conformance as kit
from drivetrain.api.testing.nested import flatten


class TestFakeEngineConforms(EngineConformance):
    def harness(self):
        return FakeHarness()


class PerMicroBatchMean(FakeEngine):
    """Normalises each micro-batch by its own token count: the verl/Megatron parity bug."""

    def forward_backward(self, batch, loss_fn, *, outputs=None):
        def local_mean(out, mb, ctx):
            tokens = int(sum(flatten(mb["loss_mask"])))
            return loss_fn(out, mb, replace(ctx, global_tokens=tokens))

        result = super().forward_backward(batch, local_mean, outputs=outputs)
        return replace(result, loss=result.loss / result.num_micro_batches)


class UnorderedInfer(FakeEngine):
    """Returns infer outputs in micro-batch order instead of the caller's."""

    def infer(self, batch, outputs):
        parts = self._micro_batches(batch)
        regrouped = batch.select([i for part in parts for i in part])
        return super().infer(regrouped, outputs)


class MissingWeight(FakeEngine):
    def export_weights(self, *, adapter_only=False):
        for name, value in super().export_weights(adapter_only=adapter_only):
            if name != "bigram.bias":
                yield name, value


class ForgetsOptimizerState(FakeEngine):
    def load_checkpoint(self, path):
        info = super().load_checkpoint(path)
        self.exp_avg, self.exp_avg_sq, self.optim_steps = self._zeros(), self._zeros(), 0
        return info


class NoModeChecks(FakeEngine):
    def _require(self, mode, what):
        pass


class SumsEveryMetric(FakeEngine):
    """Sums a loss's ``*_max`` metrics over micro-batches like every other metric."""

    def forward_backward(self, batch, loss_fn, *, outputs=None):
        def renamed(out, mb, ctx):
            loss, metrics = loss_fn(out, mb, ctx)
            return loss, {f"{k}.": v for k, v in metrics.items()}  # no name ends in _max now

        result = super().forward_backward(batch, renamed, outputs=outputs)
        metrics = {k[:-1]: v for k, v in result.metrics.items()}
        return replace(result, metrics=metrics)


class InferChangesWeights(FakeEngine):
    def infer(self, batch, outputs):
        self.params["bigram.bias"][0] += 1e-3
        return super().infer(batch, outputs)


def failures(engine_class):
    return {
        r.name: r.error
        for r in run_conformance(FakeHarness(engine_class=engine_class))
        if not r.passed
    }


def test_fake_engine_passes_everything():
    assert failures(FakeEngine) == {}


@pytest.mark.parametrize(
    ("engine_class", "check", "message"),
    [
        (PerMicroBatchMean, "check_micro_batch_invariance", "loss with"),
        (UnorderedInfer, "check_order_restored", "order not restored"),
        (MissingWeight, "check_weight_export", "missing weights ['bigram.bias']"),
        (ForgetsOptimizerState, "check_checkpoint_round_trip", "after resume"),
        (NoModeChecks, "check_contract_shapes", "must raise EngineStateError"),
        (InferChangesWeights, "check_modes", "deterministic"),
        (SumsEveryMetric, "check_micro_batch_invariance", "must be the largest"),
    ],
)
def test_kit_fails_contract_breakers(engine_class, check, message):
    found = failures(engine_class)
    assert check in found, f"{check} did not catch {engine_class.__name__}: {found}"
    assert message in found[check]


def test_kit_loss_is_backend_neutral():
    """The kit's loss uses operators only, so array libraries run it unchanged."""
    np = pytest.importorskip("numpy")
    ctx = LossContext(
        global_tokens=4, global_sequences=2, dp_size=1, micro_batch_index=0, num_micro_batches=2
    )
    outputs = {"log_probs": np.array([[0.0, -1.0, -2.0]])}
    loss, metrics = kit.token_mean_nll(outputs, {"loss_mask": np.array([[0.0, 1.0, 1.0]])}, ctx)
    assert loss == pytest.approx(0.75)
    assert metrics == {"loss_tokens": 2.0, "loss_tokens_max": 2.0}


def test_merge_metrics_sums_and_keeps_the_largest_max():
    totals = merge_metrics({}, {"a": 1, "a_max": 3.0})
    merge_metrics(totals, {"a": 2.5, "a_max": 2.0, "b_max": -1.0})
    assert totals == {"a": 3.5, "a_max": 3.0, "b_max": -1.0}


def test_forward_backward_reports_global_counts():
    harness = FakeHarness()
    engine = harness.make_engine(kit.MicroBatchConfig(micro_batch_size=3))
    batch: Batch = harness.make_batch(*kit.sample_data(harness.vocab_size))
    seen = []

    def spy(outputs, micro_batch, ctx):
        seen.append((len(micro_batch), ctx))
        return kit.token_mean_nll(outputs, micro_batch, ctx)

    with engine.train_mode():
        result = engine.forward_backward(batch, spy, outputs=OutputSpec())
    assert [n for n, _ in seen] == [3, 3, 2] and result.num_micro_batches == 3
    assert {ctx.global_tokens for _, ctx in seen} == {result.num_tokens}
    assert {ctx.global_sequences for _, ctx in seen} == {len(batch)}


class IgnoresPackedOffsets(FakeEngine):
    """Treats a packed row as one long sequence: attention leaks across samples."""

    def _forward(self, batch, spec, weights):
        if batch.layout.value != "packed":
            return super()._forward(batch, spec, weights)
        merged = batch.__class__.from_columns(
            dict(batch.columns), seq_lens=[batch.num_tokens], layout=batch.layout
        )
        return super()._forward(merged, spec, weights)


class SharesPrefixesByLengthOnly(FakeEngine):
    """Trusts ``shared_prefix_len`` without checking that the prefixes hold the same tokens."""

    def _forward(self, batch, spec, weights):
        if SHARED_PREFIX_LEN not in batch:
            return super()._forward(batch, spec, weights)
        ids = [list(row) for row in batch["input_ids"]]
        first: dict[int, list[int]] = {}
        for row, n in zip(ids, batch[SHARED_PREFIX_LEN], strict=True):
            prefix = first.setdefault(n, row[:n])
            row[: len(prefix)] = prefix[: len(row)]
        return super()._forward(batch.with_columns(input_ids=ids), spec, weights)


def test_kit_fails_engine_that_shares_different_prefixes():
    found = failures(SharesPrefixesByLengthOnly)
    assert set(found) == {"check_shared_prefix_is_only_a_hint"}
    assert "differ from without" in found["check_shared_prefix_is_only_a_hint"]


def test_kit_fails_engine_that_leaks_across_packed_sequences():
    found = failures(IgnoresPackedOffsets)
    assert "check_packed_matches_padded" in found
    assert "differ from padded" in found["check_packed_matches_padded"]
