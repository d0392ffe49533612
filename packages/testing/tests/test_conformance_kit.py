"""The kit passes the fake engine and fails engines that break the contract."""

import json
import math
import os
import random
import shutil
from dataclasses import replace

import pytest

from drivetrain.api import Batch, CheckpointInfo, LossContext, OutputSpec, merge_metrics
from drivetrain.api.columns import SHARED_PREFIX_LEN
from drivetrain.runtime.schedule import lr_multiplier
from drivetrain.testing import (
    EngineConformance,
    FakeEngine,
    FakeHarness,
    fake_model,
    run_conformance,
)
from drivetrain.testing import conformance as kit
from drivetrain.testing.nested import flatten


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


class OverlongSampleAlone(FakeEngine):
    """Puts a sample over the token budget in a micro-batch of its own instead of failing: on a
    peer rank that cut its shard, the two would disagree on the micro-batch count."""

    def _micro_batches(self, batch):
        if self.config.micro_batch.max_tokens is None:
            return super()._micro_batches(batch)
        return [[i] for i in range(len(batch))]


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


class ForgetsSchedulePosition(FakeEngine):
    def load_checkpoint(self, path):
        info = super().load_checkpoint(path)
        self.sched_steps = 0
        return info


class ForgetsWeights(FakeEngine):
    def load_checkpoint(self, path):
        info = super().load_checkpoint(path)
        self.params = fake_model.init_weights(self.config.vocab_size, self.config.seed, 0.5)
        return info


class ForgetsRng(FakeEngine):
    def load_checkpoint(self, path):
        info = super().load_checkpoint(path)
        self.rng = random.Random(self.config.seed)
        return info


class WritesCheckpointInPlace(FakeEngine):
    """Writes straight under the final name: a crash leaves a partial checkpoint there."""

    def save_checkpoint(self, path, *, step):
        shutil.rmtree(path, ignore_errors=True)
        os.makedirs(path)
        with open(os.path.join(path, "state.json"), "w") as f:
            json.dump(self._state(step), f)
        return CheckpointInfo(path, step)


class IgnoresClipGrad(FakeEngine):
    def initialize(self):
        super().initialize()
        self.config = replace(self.config, optim=replace(self.config.optim, clip_grad=None))


class ReportsClippedNorm(FakeEngine):
    def optimizer_step(self):
        return min(super().optimizer_step(), self.config.optim.clip_grad or math.inf)


class ClipsEveryNorm(FakeEngine):
    """Scales the gradient to clip_grad even when its norm is below: clipping as normalising."""

    def optimizer_step(self):
        norm = math.sqrt(sum(g * g for g in self._flat(self.grads)))
        clip = self.config.optim.clip_grad
        if clip is not None and 0 < norm < clip:
            self.grads = {k: _scaled(v, clip / norm) for k, v in self.grads.items()}
        super().optimizer_step()
        return norm


def _scaled(value, factor):
    return [_scaled(v, factor) for v in value] if isinstance(value, list) else value * factor


class AppliesNextLr(FakeEngine):
    """The optimizer runs one schedule step ahead of lr_scheduler_step (skips a warm-up step)."""

    def optimizer_step(self):
        self.sched_steps += 1
        try:
            return super().optimizer_step()
        finally:
            self.sched_steps -= 1


class ReportsPreviousLr(FakeEngine):
    def lr_scheduler_step(self):
        lr = self.config.optim.lr * lr_multiplier(self.sched_steps, self.config.optim)
        super().lr_scheduler_step()
        return lr


class CountsSkippedSteps(FakeEngine):
    """Skips the update on a non-finite norm but advances AdamW's step count."""

    def optimizer_step(self):
        norm = super().optimizer_step()
        if not math.isfinite(norm):
            self.optim_steps += 1
        return norm


class StepsOnNonFiniteGrads(FakeEngine):
    """Zeroes non-finite gradients and steps anyway (momentum moves the weights)."""

    def optimizer_step(self):
        norm = math.sqrt(sum(g * g for g in self._flat(self.grads)))
        if not math.isfinite(norm):
            self.grads = self._zeros()
            super().optimizer_step()
            return norm
        return super().optimizer_step()


class OffloadDropsOptimizerState(FakeEngine):
    def to(self, device, *, model=True, optimizer=True):
        super().to(device, model=model, optimizer=optimizer)
        if device == "cpu" and optimizer:
            self.exp_avg, self.exp_avg_sq = self._zeros(), self._zeros()


class Float64(list):
    dtype = "float64"


class InfersInDoublePrecision(FakeEngine):
    """Returns log-probs and entropy as float64 (e.g. upcast past the contract's float32)."""

    def infer(self, batch, outputs):
        out = super().infer(batch, outputs)
        return out.with_columns(**{name: Float64(out[name]) for name in outputs.names})


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


class ShardsItsOwnWay(FakeEngine):
    """Still defines the ``shard_data`` that left the contract: no caller would run it."""

    def shard_data(self, batch):
        return batch.select(list(range(self.parallel.dp_rank, len(batch), self.parallel.dp_size)))


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


def test_the_pytest_suite_runs_every_check():
    tests = {name for name in dir(EngineConformance) if name.startswith("test_")}
    assert tests == {check.__name__.replace("check_", "test_", 1) for check in kit.ENGINE_CHECKS}


def test_fake_engine_passes_everything():
    assert failures(FakeEngine) == {}


@pytest.mark.parametrize(
    ("engine_class", "check", "message"),
    [
        (PerMicroBatchMean, "check_micro_batch_invariance", "loss with"),
        (UnorderedInfer, "check_order_restored", "order not restored"),
        (
            OverlongSampleAlone,
            "check_split_failure_reaches_every_rank",
            "must fail every rank with a BatchError",
        ),
        (MissingWeight, "check_weight_export", "missing weights ['bigram.bias']"),
        (ForgetsOptimizerState, "check_checkpoint_round_trip", "optimizer state not restored"),
        (ForgetsSchedulePosition, "check_checkpoint_round_trip", "LR schedule position was not"),
        (ForgetsWeights, "check_checkpoint_round_trip", "model weights not restored"),
        (ForgetsRng, "check_rng_restored", "RNG state was not restored"),
        (WritesCheckpointInPlace, "check_checkpoint_atomic", "that does not load"),
        (IgnoresClipGrad, "check_gradient_clipping", "gradient clipping not applied"),
        (ReportsClippedNorm, "check_gradient_clipping", "norm before clipping"),
        (ClipsEveryNorm, "check_gradient_clipping", "only norms above clip_grad are clipped"),
        (AppliesNextLr, "check_lr_schedule", "learning rate in effect at step 0"),
        (ReportsPreviousLr, "check_lr_schedule", "lr_scheduler_step after step 0 returned"),
        (CountsSkippedSteps, "check_nonfinite_step_skipped", "after a skipped one differs"),
        (StepsOnNonFiniteGrads, "check_nonfinite_step_skipped", "non-finite gradient norm changed"),
        (
            OffloadDropsOptimizerState,
            "check_offload_round_trip",
            "optimizer state lost in to('cpu')",
        ),
        (InfersInDoublePrecision, "check_output_dtypes", "log_probs are float64"),
        (NoModeChecks, "check_contract_shapes", "must raise EngineStateError"),
        (ShardsItsOwnWay, "check_contract_shapes", "ShardsItsOwnWay.shard_data is never called"),
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

    def _forward(self, batch, spec, weights, **kw):
        if batch.layout.value != "packed":
            return super()._forward(batch, spec, weights, **kw)
        merged = batch.__class__.from_columns(
            dict(batch.columns), seq_lens=[batch.num_tokens], layout=batch.layout
        )
        return super()._forward(merged, spec, weights, **kw)


class SharesPrefixesByLengthOnly(FakeEngine):
    """Trusts ``shared_prefix_len`` without checking that the prefixes hold the same tokens."""

    def _forward(self, batch, spec, weights, **kw):
        if SHARED_PREFIX_LEN not in batch:
            return super()._forward(batch, spec, weights, **kw)
        ids = [list(row) for row in batch["input_ids"]]
        first: dict[int, list[int]] = {}
        for row, n in zip(ids, batch[SHARED_PREFIX_LEN], strict=True):
            prefix = first.setdefault(n, row[:n])
            row[: len(prefix)] = prefix[: len(row)]
        return super()._forward(batch.with_columns(input_ids=ids), spec, weights, **kw)


def test_kit_fails_engine_that_shares_different_prefixes():
    found = failures(SharesPrefixesByLengthOnly)
    assert set(found) == {"check_shared_prefix_is_only_a_hint"}
    assert "differ from without" in found["check_shared_prefix_is_only_a_hint"]


def test_kit_fails_engine_that_leaks_across_packed_sequences():
    found = failures(IgnoresPackedOffsets)
    assert "check_packed_matches_padded" in found
    assert "differ from padded" in found["check_packed_matches_padded"]


def test_offload_is_checked_only_for_engines_declaring_it():
    harness = FakeHarness(engine_class=OffloadDropsOptimizerState, capabilities=frozenset())
    (result,) = run_conformance(harness, [kit.check_offload_round_trip])
    assert result.passed and "skipped" in result.error and "'offload'" in result.error


def test_a_harness_that_declares_no_capabilities_fails_the_checks_that_depend_on_them():
    class Undeclared(FakeHarness):
        def __getattribute__(self, name):
            if name == "capabilities":
                raise AttributeError(name)
            return super().__getattribute__(name)

    found = {r.name: r.error for r in run_conformance(Undeclared()) if not r.passed}
    for check in ("check_split_failure_reaches_every_rank", "check_offload_round_trip"):
        assert "the harness declares no capabilities" in found[check]


def test_a_harness_without_dropout_skips_the_rng_check():
    class Deterministic(FakeHarness):
        def make_engine(self, micro_batch, *, optim=None, offload=None):
            return super().make_engine(micro_batch, optim=optim, offload=offload)

    (result,) = run_conformance(Deterministic(), [kit.check_rng_restored])
    assert result.passed and "skipped" in result.error


def test_a_harness_that_cannot_set_the_optimizer_fails_the_checks_that_need_it():
    class Fixed(FakeHarness):
        def make_engine(self, micro_batch):
            return super().make_engine(micro_batch)

    (result,) = run_conformance(Fixed(), [kit.check_gradient_clipping])
    assert not result.passed and "make_engine takes no optim= keyword" in result.error


def test_a_dropout_harness_whose_engine_ignores_it_fails_the_rng_check():
    class IgnoresDropout(FakeHarness):
        def make_engine(self, micro_batch, *, optim=None, offload=None, dropout=0.0):
            return super().make_engine(micro_batch, optim=optim, offload=offload)

    (result,) = run_conformance(IgnoresDropout(), [kit.check_rng_restored])
    assert not result.passed and "trains deterministically" in result.error


def test_every_check_closes_every_engine_it_makes():
    """An engine left to the garbage collector is finalised at a different moment on each
    rank (see ``steps.fresh_step``): no check may leave one open."""
    made = []

    class Tracked(FakeEngine):
        def initialize(self):
            super().initialize()
            self.is_open = True
            made.append(self)

        def close(self):
            self.is_open = False
            super().close()

    harness = FakeHarness(engine_class=Tracked)
    for check in kit.ENGINE_CHECKS:
        made.clear()
        (result,) = run_conformance(harness, [check])
        assert result.passed, result.error
        left = sum(engine.is_open for engine in made)
        assert not left, f"{check.__name__} left {left} of its {len(made)} engines open"
