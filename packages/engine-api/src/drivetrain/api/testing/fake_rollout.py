"""A pure-Python rollout over the bigram model of :mod:`fake_model`.

Samples with temperature, top-k and top-p, reports the sampled tokens' log-probs under the
processed distribution, takes new weights from a stream (atomically: a bad name changes
nothing) and counts weight versions, so weight-sync and RL orchestration can be tested
without torch. Token 0 is EOS.
"""

from __future__ import annotations

import copy
import math
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from drivetrain.api.config import RolloutConfig
from drivetrain.api.engine import NamedTensor
from drivetrain.api.rollout import Completion, FinishReason, Prompt, Rollout, SamplingParams
from drivetrain.api.testing import fake_model
from drivetrain.api.testing.nested import shape_of


@dataclass(frozen=True)
class FakeRolloutConfig(RolloutConfig):
    vocab_size: int = 16
    init_scale: float = 0.5


def processed_log_probs(logits: Sequence[float], params: SamplingParams) -> list[float]:
    """Log-probs after temperature, top-k and top-p; filtered tokens get ``-inf``."""
    if params.greedy:  # the unscaled distribution; sampling picks its argmax
        return fake_model.log_softmax(list(logits))
    logp = fake_model.log_softmax([x / params.temperature for x in logits])
    order = sorted(range(len(logp)), key=lambda i: -logp[i])
    keep = order[: params.top_k] if params.top_k > 0 else order
    if params.top_p < 1.0:  # nucleus over the top-k distribution, renormalised (as vLLM/HF do)
        renormalised = fake_model.log_softmax([logp[i] for i in keep])
        kept, mass = [], 0.0
        for i, lp in zip(keep, renormalised, strict=True):
            kept.append(i)
            mass += math.exp(lp)
            if mass >= params.top_p:
                break
        keep = kept
    kept_logp = fake_model.log_softmax([logp[i] for i in keep])
    out = [-math.inf] * len(logp)
    for i, value in zip(keep, kept_logp, strict=True):
        out[i] = value
    return out


class FakeRollout(Rollout):
    config: FakeRolloutConfig

    def __init__(self, config: RolloutConfig) -> None:
        if not isinstance(config, FakeRolloutConfig):
            config = FakeRolloutConfig(**{k: getattr(config, k) for k in vars(config)})
        super().__init__(config)
        self.weights = fake_model.init_weights(config.vocab_size, config.seed, config.init_scale)
        self._version = 0
        self.asleep = False

    @property
    def weight_version(self) -> int:
        return self._version

    def generate(self, prompts: Sequence[Prompt], params: SamplingParams) -> list[Completion]:
        if self.asleep:
            raise RuntimeError("the rollout is asleep; call wake_up() first")
        for i, prompt in enumerate(prompts):
            if prompt.messages:
                raise ValueError("the fake rollout takes token-id prompts only")
            if len(prompt.token_ids) + params.max_new_tokens > self.config.max_model_len:
                raise ValueError(
                    f"prompt {i}: {len(prompt.token_ids)} tokens + max_new_tokens "
                    f"{params.max_new_tokens} exceed max_model_len {self.config.max_model_len}"
                )
            bad = [t for t in prompt.token_ids if not 0 <= t < self.config.vocab_size]
            if bad:
                raise ValueError(f"prompt {i}: token ids {bad[:5]} outside the vocabulary")
        seed = self.config.seed if params.seed is None else params.seed
        rng = random.Random(seed)
        return [
            self._sample(i, prompt.token_ids, params, rng)
            for i, prompt in enumerate(prompts)
            for _ in range(params.n)
        ]

    def _sample(
        self, index: int, prompt: tuple[int, ...], params: SamplingParams, rng: random.Random
    ) -> Completion:
        tokens: list[int] = []
        log_probs: list[float] = []
        prev = prompt[-1]
        reason = FinishReason.LENGTH
        for _ in range(params.max_new_tokens):
            logp = processed_log_probs(fake_model.next_token_logits(self.weights, prev), params)
            if params.greedy:
                token = max(range(len(logp)), key=logp.__getitem__)
            else:
                token = rng.choices(range(len(logp)), weights=[math.exp(x) for x in logp])[0]
            tokens.append(token)
            log_probs.append(logp[token])
            prev = token
            if token in params.stop_token_ids or (
                token == fake_model.EOS_TOKEN_ID and not params.ignore_eos
            ):
                reason = FinishReason.STOP
                break
        return Completion(
            index, tuple(prompt), tuple(tokens), tuple(log_probs), reason, self._version
        )

    def update_weights(self, weights: Iterable[NamedTensor], *, version: int) -> None:
        staged: dict[str, Any] = {}
        for name, value in weights:
            if name not in self.weights:
                raise KeyError(f"unknown weight {name!r}; the model has {sorted(self.weights)}")
            if shape_of(value) != shape_of(self.weights[name]):
                raise ValueError(f"weight {name!r} has shape {shape_of(value)}")
            staged[name] = copy.deepcopy(value)
        self.weights.update(staged)
        self._version = version

    def sleep(self, level: int = 1) -> bool:
        super().sleep(level)
        self.asleep = True
        return False  # pure Python: nothing on an accelerator to free

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        super().wake_up(tags)
        if tags is None or "kv_cache" in tags:
            self.asleep = False
