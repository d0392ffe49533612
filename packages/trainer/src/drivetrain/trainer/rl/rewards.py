"""Rule-based rewards, registered by name, and custom ones by dotted import path.

A reward function is ``fn(response: str, ground_truth: str) -> float``. ``reward.functions``
lists names (``exact_match``, ``numeric_match``, ``format``) or paths
(``my_pkg.rewards:score`` or ``my_pkg.rewards.score``); their weighted sum is the sample's
reward. Functions run on the controller, on decoded responses.
"""

from __future__ import annotations

import importlib
import math
import re
from collections.abc import Callable, Sequence

from drivetrain.api.errors import ConfigError
from drivetrain.trainer.named_registry import NamedRegistry

RewardFn = Callable[[str, str], float]
REWARDS: NamedRegistry[RewardFn] = NamedRegistry("reward function")

ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def extract_answer(response: str) -> str:
    """The text inside ``<answer>…</answer>`` if present, else the whole response."""
    tagged = ANSWER_TAG.findall(response)
    return (tagged[-1] if tagged else response).strip()


@REWARDS.register("exact_match")
def exact_match(response: str, ground_truth: str) -> float:
    """1 if the (tagged) answer equals the ground truth after stripping whitespace."""
    return float(extract_answer(response) == ground_truth.strip())


def _last_number(text: str) -> float | None:
    found = NUMBER.findall(text)
    if not found:
        return None
    try:
        return float(found[-1].replace(",", ""))
    except ValueError:
        return None


@REWARDS.register("numeric_match")
def numeric_match(response: str, ground_truth: str) -> float:
    """1 if the last number of the answer equals the ground truth's (GSM8K ``#### 42`` style
    ground truths work: their last number is the answer)."""
    got, want = _last_number(extract_answer(response)), _last_number(ground_truth)
    if got is None or want is None:
        return 0.0
    return float(math.isclose(got, want, rel_tol=1e-9, abs_tol=1e-9))


@REWARDS.register("digit_match")
def digit_match(response: str, ground_truth: str) -> float:
    """Partial credit for numeric answers: the fraction of digit positions that agree, aligned
    from the units digit (as columns are in written addition), over the longer of the two; a
    denser signal than exact match, still checked against the ground truth only."""
    got, want = extract_answer(response), ground_truth.strip()
    if not got or not want:
        return 0.0
    same = sum(a == b for a, b in zip(reversed(got), reversed(want), strict=False))
    return same / max(len(got), len(want))


@REWARDS.register("format")
def answer_format(response: str, ground_truth: str) -> float:
    """1 if the response puts exactly one answer in ``<answer>…</answer>`` tags."""
    return float(len(ANSWER_TAG.findall(response)) == 1)


def resolve_reward(name: str) -> RewardFn:
    """A registered name, or ``module:function`` / ``module.function``."""
    if name in REWARDS.names():
        return REWARDS.get(name)
    module, sep, attr = name.partition(":")
    if not sep:
        module, _, attr = name.rpartition(".")
    if not module or not attr:
        raise ConfigError(
            f"reward {name!r} is neither registered ({', '.join(REWARDS.names())}) nor a "
            "dotted path like my_pkg.rewards:score"
        )
    try:
        fn = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"cannot import reward {name!r}: {exc}") from None
    if not callable(fn):
        raise ConfigError(f"reward {name!r} is not callable")
    return fn


#: registered functions that never read the ground truth (one given by path is taken to read it)
NO_GROUND_TRUTH = {"format"}


def uses_ground_truth(names: Sequence[str], weights: Sequence[float] = ()) -> bool:
    """Whether the weighted functions read a ground truth: one weighing anything that is not
    known to ignore it."""
    weights = list(weights) or [1.0] * len(names)
    return any(w != 0 and n not in NO_GROUND_TRUTH for n, w in zip(names, weights, strict=False))


class RewardScorer:
    """The weighted sum of the configured reward functions."""

    def __init__(self, names: Sequence[str], weights: Sequence[float] = ()) -> None:
        if not names:
            raise ConfigError("reward.functions is empty")
        if weights and len(weights) != len(names):
            raise ConfigError(
                f"reward.weights has {len(weights)} entries for {len(names)} reward functions"
            )
        self.names = list(names)
        self.fns = [resolve_reward(n) for n in names]
        self.weights = list(weights) or [1.0] * len(names)

    def __call__(self, response: str, ground_truth: str) -> tuple[float, dict[str, float]]:
        parts = {
            name: float(fn(response, ground_truth))
            for name, fn in zip(self.names, self.fns, strict=True)
        }
        total = sum(w * parts[n] for n, w in zip(self.names, self.weights, strict=True))
        return total, parts
