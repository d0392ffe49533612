"""``numerics=exact`` between the hf rollout and the fsdp2 engine: every sampled token's
log-prob is the same bits on both sides, float32 and bfloat16, greedy and sampled, whatever
the batch (prompts of 1 to 40 tokens, n samples sharing a prefill, requests joining a running
batch), the engine's packing (rows of at most 96 tokens, not the rollout's batches) and
across training steps and full weight syncs. The same pairs in default numerics differ (so
the check can fail)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from drivetrain.api import ModelConfig, OptimConfig, Prompt, SamplingParams
from drivetrain.api.config import MicroBatchConfig
from drivetrain.api.registry import engines, rollouts
from drivetrain.api.rollout import Completion, FinishReason
from drivetrain.rollout.config import HFRolloutConfig
from drivetrain.testing.kit_runner import run_checks
from drivetrain.testing.rollout_kit_exact import check_exact_numerics
from rollout_support import (
    TransformersRolloutHarness,
    build_model,
    recomputed_log_probs,
    train_step,
)

pytestmark = pytest.mark.timeout(300)

DTYPES = ["float32", "bfloat16"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    torch.set_num_threads(1)
    return build_model(tmp_path_factory.mktemp("exact") / "model")


def pair(model_dir, numerics: str, dtype: str):
    config_cls = engines.load_config_class("fsdp2", object)
    engine = engines.load("fsdp2")(
        config_cls(
            model=ModelConfig(path=str(model_dir), dtype=dtype),
            optim=OptimConfig(lr=5e-2, weight_decay=0.0, clip_grad=None),
            micro_batch=MicroBatchConfig(max_tokens=96),
            device="cpu",
            numerics=numerics,
        )
    )
    engine.initialize()
    rollout = rollouts.load("hf")(
        HFRolloutConfig(
            model_path=str(model_dir),
            max_model_len=128,
            dtype=dtype,
            numerics=numerics,
            max_batch_size=8,
        )
    )
    return engine, rollout


def sync(engine, rollout, version: int) -> None:
    with engine.eval_mode():
        rollout.update_weights(engine.export_weights(), version=version)


def prompts(round_: int) -> list[Prompt]:
    """Prompts of 1 to 40 tokens, another mix each round."""
    lengths = [1 + (round_ * 7 + 13 * i) % 40 for i in range(6 + round_)]
    return [
        Prompt(token_ids=tuple(3 + (j * 5 + i) % 40 for j in range(n)))
        for i, n in enumerate(lengths)
    ]


def gaps(engine, completions) -> torch.Tensor:
    recomputed = recomputed_log_probs(engine, completions, temperature=1.0)
    return torch.cat(
        [
            (torch.tensor(c.log_probs, dtype=torch.float64) - r.double()).abs()
            for c, r in zip(completions, recomputed, strict=True)
        ]
    )


def generate(rollout, round_: int):
    """Sampled and greedy requests; at most 8 run at once, so each joins a running batch of
    others as rows finish."""
    params = SamplingParams(temperature=1.0, max_new_tokens=10, n=4, seed=round_)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=6)
    return rollout.generate(prompts(round_), params) + rollout.generate(prompts(9), greedy)


@pytest.mark.parametrize("dtype", DTYPES)
def test_exact_log_probs_are_the_trainers_through_steps_and_syncs(model_dir, dtype):
    engine, rollout = pair(model_dir, "exact", dtype)
    try:
        sync(engine, rollout, 1)
        for round_ in range(3):
            completions = generate(rollout, round_)
            found = gaps(engine, completions)
            assert len(found) > 100 and float(found.max()) == 0.0, (round_, found.max())
            train_step(engine, completions)
            sync(engine, rollout, round_ + 2)
    finally:
        rollout.shutdown()
        engine.close()


@pytest.mark.parametrize("dtype", DTYPES)
def test_default_numerics_differ(model_dir, dtype):
    engine, rollout = pair(model_dir, "default", dtype)
    try:
        sync(engine, rollout, 1)
        found = gaps(engine, generate(rollout, 0))
        assert int((found > 0).sum()) > 0
    finally:
        rollout.shutdown()
        engine.close()


class ExactHarness(TransformersRolloutHarness):
    """The hf rollout opted in to the kit's exact check: the engine's log-probs are an fsdp2
    engine's under ``numerics=exact``, one per weight set. ``rollout_numerics``: what the
    rollout is configured with (``default`` must fail the check)."""

    def __init__(self, model_dir: Path, rollout_numerics: str = "exact") -> None:
        super().__init__(model_dir, lambda: None)
        self.model_dir, self.rollout_numerics = model_dir, rollout_numerics
        changed = model_dir.parent / "changed"
        if not changed.exists():
            self.models[True].save_pretrained(changed)
            self.tokenizer.save_pretrained(changed)
        self.engines = {flag: pair_engine(d) for flag, d in ((False, model_dir), (True, changed))}

    def exact_rollout(self):
        return rollouts.load("hf")(
            HFRolloutConfig(
                model_path=str(self.model_dir), max_model_len=128, numerics=self.rollout_numerics
            )
        )

    def exact_log_probs(self, prompt_ids, token_ids, temperature, changed):
        done = Completion(
            0, tuple(prompt_ids), tuple(token_ids), (0.0,) * len(token_ids), FinishReason.LENGTH, 0
        )
        return recomputed_log_probs(self.engines[changed], [done], temperature or 1.0)[0].tolist()

    def close(self) -> None:
        for engine in self.engines.values():
            engine.close()


def pair_engine(model_dir: Path):
    config_cls = engines.load_config_class("fsdp2", object)
    engine = engines.load("fsdp2")(
        config_cls(model=ModelConfig(path=str(model_dir)), device="cpu", numerics="exact")
    )
    engine.initialize()
    return engine


@pytest.mark.parametrize("numerics", ["exact", "default"])
def test_the_kits_exact_check_passes_exact_and_fails_default(model_dir, numerics):
    harness = ExactHarness(model_dir, numerics)
    try:
        [result] = run_checks({"exact_numerics": check_exact_numerics}, harness)
    finally:
        harness.close()
    if numerics == "exact":
        assert result.error is None and result.skipped is None, result
    else:
        assert result.error is not None and "under numerics=exact" in result.error, result


def test_a_harness_that_does_not_opt_in_is_skipped(model_dir):
    plain = TransformersRolloutHarness(model_dir, lambda: None)
    [result] = run_checks({"exact_numerics": check_exact_numerics}, plain)
    assert result.error is None and "exact_rollout" in result.skipped
