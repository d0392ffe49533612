"""``drivetrain diagnose mismatch``: where a rollout and the trainer stop agreeing, stage by
stage, through the contracts alone (any engine, any rollout):

1. **weights**: every tensor of the engine's export against what the rollout serves, by
   fingerprint (``Rollout.weights_fingerprint``; a rollout that cannot tell is not checked);
2. **log_probs**: the rollout samples a few prompts (seeded, temperature 1); the engine scores
   the same tokens; the first token whose log-probs differ beyond the tolerance;
3. **ops**: one completion's forward on both sides (``Rollout.trace_ops``,
   ``Engine.trace_ops``: optional; a side that cannot trace leaves it not checked), op by op
   in the order they ran: the first op whose outputs differ at all, the first beyond the
   tolerance, and per layer the first that differs and by how much
   (:mod:`drivetrain.trainer.op_diff`).

The first stage that diverges is where to look: a weight names the lost, perturbed or cast
tensor; log-probs with equal weights point at the forward or at sampling, and the ops stage
says which: attention, a norm, the MLP, the head (equal ops with unequal log-probs: the
sampler).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from drivetrain.api import Engine, OutputSpec, Prompt, SamplingParams
from drivetrain.api.engine import NamedTensor
from drivetrain.api.rollout import Completion, Rollout
from drivetrain.runtime.fingerprint import fingerprints, first_difference
from drivetrain.trainer.op_diff import compare_ops
from drivetrain.trainer.rollout_batch import completions_to_batch

#: How far a rollout's log-probs may sit from the trainer's for the same tokens: float32 on
#: both sides agrees to ~1e-6 here; a 16-bit dtype's rounding alone moves them by ~0.01.
FLOAT32_TOLERANCE = 0.002
HALF_TOLERANCE = 0.05


def log_prob_tolerance(*dtypes: str) -> float:
    """The tolerance for sides computing in ``dtypes`` (also ``run.log_prob_alarm``'s
    default)."""
    exact = all(dtype in ("float32", "float64") for dtype in dtypes)
    return FLOAT32_TOLERANCE if exact else HALF_TOLERANCE


@dataclass(frozen=True)
class Stage:
    """One comparison: ``agrees`` is ``None`` when it could not be made."""

    name: str
    agrees: bool | None
    detail: str


@dataclass(frozen=True)
class Diagnosis:
    stages: tuple[Stage, ...]

    @property
    def first_divergence(self) -> Stage | None:
        return next((s for s in self.stages if s.agrees is False), None)

    def summary(self) -> str:
        found = self.first_divergence
        if found is None:
            return "the rollout and the trainer agree at every stage checked"
        return f"first divergence: {found.name}: {found.detail}"


def compare_weights(export: Iterable[NamedTensor], rollout: Rollout) -> Stage:
    expected = fingerprints(export)
    served = rollout.weights_fingerprint(expected)
    if served is None:
        return Stage("weights", None, "the rollout cannot fingerprint its weights")
    differs = first_difference(expected, served)
    if differs is None:
        return Stage("weights", True, f"all {len(expected)} tensors equal")
    name, want, got = differs
    return Stage("weights", False, f"tensor {name!r}: rollout {got}, trainer {want}")


def compare_log_probs(
    engine: Engine,
    completions: Sequence[Completion],
    *,
    tolerance: float,
    pad_token_id: int = 0,
) -> Stage:
    worst = 0.0
    for index, (completion, scored) in enumerate(
        zip(completions, _scored(engine, completions, pad_token_id), strict=True)
    ):
        for position, (sampled, recomputed) in enumerate(
            zip(completion.log_probs, scored, strict=True)
        ):
            gap = abs(sampled - recomputed)
            if gap > tolerance:
                token = completion.token_ids[position]
                return Stage(
                    "log_probs",
                    False,
                    f"prompt {index}, generated token {position} (id {token}): rollout "
                    f"{sampled:.5f}, trainer {recomputed:.5f} (tolerance {tolerance:g})",
                )
            worst = max(worst, gap)
    tokens = sum(len(c.token_ids) for c in completions)
    return Stage("log_probs", True, f"{tokens} sampled tokens, largest gap {worst:.2e}")


def _scored(
    engine: Engine, completions: Sequence[Completion], pad_token_id: int
) -> list[list[float]]:
    import torch

    batch = completions_to_batch(completions, pad_token_id=pad_token_id, as_tensor=torch.tensor)
    with engine.eval_mode():
        out = engine.infer(batch, OutputSpec(log_probs=True, temperature=1.0))
    rows = []
    for i, completion in enumerate(completions):
        start = len(completion.prompt_ids)
        rows.append(out["log_probs"][i, start : start + len(completion.token_ids)].tolist())
    return rows


def trace_both(
    engine: Engine, rollout: Rollout, completion: Completion, pad_token_id: int
) -> tuple[Mapping[str, Any] | None, Mapping[str, Any] | None]:
    """The rollout's and the engine's ops over ``completion`` (``trace_ops``; ``None`` where a
    side cannot trace); the engine's ``log_probs`` cut to the generated tokens."""
    import torch

    served = rollout.trace_ops(completion.prompt_ids, completion.token_ids)
    batch = completions_to_batch([completion], pad_token_id=pad_token_id, as_tensor=torch.tensor)
    with engine.eval_mode():
        trained = engine.trace_ops(batch)
    if trained is not None and "log_probs" in trained:
        start = len(completion.prompt_ids)
        cut = trained["log_probs"][start : start + len(completion.token_ids)]
        trained = {**trained, "log_probs": cut}
    return served, trained


def diagnose(
    engine: Engine,
    rollout: Rollout,
    prompts: Sequence[Prompt],
    *,
    dtype: str = "float32",
    tolerance: float | None = None,
    pad_token_id: int = 0,
    max_new_tokens: int = 16,
) -> Diagnosis:
    """Every stage, in order (each runs even when an earlier one diverged: the later ones
    say how far the divergence reaches)."""
    tolerance = tolerance if tolerance is not None else log_prob_tolerance(dtype)
    with engine.eval_mode():
        weights = compare_weights(engine.export_weights(), rollout)
    params = SamplingParams(temperature=1.0, max_new_tokens=max_new_tokens, seed=0)
    completions = rollout.generate(prompts, params)
    log_probs = compare_log_probs(
        engine, completions, tolerance=tolerance, pad_token_id=pad_token_id
    )
    traced = next((c for c in completions if len(c.token_ids) > 1), None)
    if traced is None:
        ops = Stage("ops", None, "no completion of two tokens or more to trace")
    else:
        served, trained = trace_both(engine, rollout, traced, pad_token_id)
        ops = Stage("ops", *compare_ops(served, trained, tolerance))
    return Diagnosis((weights, log_probs, ops))
