"""A pure-Python rollout over the bigram model of :mod:`fake_model`.

Samples with temperature, top-k and top-p, reports the sampled tokens' log-probs under the
processed distribution, ends requests at stop strings (over :func:`fake_model.decode`'s
text: a letter a token), takes new weights from a stream (atomically: a bad name changes
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

from drivetrain.api.config import RolloutConfig, coerce_config
from drivetrain.api.engine import NamedTensor
from drivetrain.api.requests import Request
from drivetrain.api.rollout import Completion, FinishReason, Prompt, SamplingParams
from drivetrain.runtime.collector import call_requests
from drivetrain.runtime.request_poller import generate_with_requests
from drivetrain.runtime.request_queue import QueuedRollout, RequestQueue, TokenEvent
from drivetrain.testing import fake_model
from drivetrain.testing.nested import shape_of


@dataclass(frozen=True)
class FakeRolloutConfig(RolloutConfig):
    vocab_size: int = 16
    init_scale: float = 0.5
    max_batch: int = 64  # requests running at once; more wait for a free slot


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


@dataclass
class _Sequence:
    request: Request
    rng: random.Random
    previous: int
    generated: int = 0
    text: str = ""  # of the generated tokens, for stop strings

    def sample_next(self, weights: dict[str, Any]) -> TokenEvent:
        params = self.request.params
        logp = processed_log_probs(fake_model.next_token_logits(weights, self.previous), params)
        if params.greedy:
            token = max(range(len(logp)), key=logp.__getitem__)
        else:
            token = self.rng.choices(range(len(logp)), weights=[math.exp(x) for x in logp])[0]
        self.previous = token
        self.generated += 1
        self.text += fake_model.decode([token])
        reason = None
        if (
            token in params.stop_token_ids
            or (token == fake_model.EOS_TOKEN_ID and not params.ignore_eos)
            or any(stop in self.text for stop in params.stop)
        ):
            reason = FinishReason.STOP
        elif self.generated >= params.max_new_tokens:
            reason = FinishReason.LENGTH
        return TokenEvent(self.request.request_id, [token], [logp[token]], reason)


class FakeRollout(QueuedRollout):
    """Request-level: generation advances one token per running request each time the caller
    polls (:class:`~drivetrain.runtime.request_queue.RequestQueue`); every request samples from
    its own seeded generator, so a seeded request gives the same tokens in any batch."""

    config: FakeRolloutConfig

    def __init__(self, config: RolloutConfig) -> None:
        config = coerce_config(config, FakeRolloutConfig)
        super().__init__(config)
        self.weights = fake_model.init_weights(config.vocab_size, config.seed, config.init_scale)
        self._version = 0
        self.asleep = False
        self._seeds = random.Random(config.seed)  # seeds of unseeded requests, call after call
        self._running: dict[str, _Sequence] = {}
        self.requests = RequestQueue(
            self._step, lambda: self._version, capacity=config.max_batch, reset=self._running.clear
        )
        self.steps = 0  # token steps run so far

    @property
    def weight_version(self) -> int:
        return self._version

    # ---- requests -----------------------------------------------------------------------
    def generate(self, prompts: Sequence[Prompt], params: SamplingParams) -> list[Completion]:
        self.check_ready()
        ids = []
        for i, prompt in enumerate(prompts):
            if prompt.messages:
                raise ValueError("the fake rollout takes token-id prompts only")
            ids.append(prompt.token_ids)
            self._check_prompt(f"prompt {i}", prompt.token_ids, params.max_new_tokens)
        budgets = [params.max_new_tokens] * len(ids)
        return generate_with_requests(self, call_requests(ids, budgets, params, seed=params.seed))

    def check_ready(self) -> None:
        super().check_ready()
        if self.asleep:
            raise RuntimeError("the rollout is asleep; call wake_up() first")

    def _check_prompt(self, what: str, prompt: tuple[int, ...], max_new_tokens: int) -> None:
        if len(prompt) + max_new_tokens > self.config.max_model_len:
            raise ValueError(
                f"{what}: {len(prompt)} tokens + max_new_tokens {max_new_tokens} exceed "
                f"max_model_len {self.config.max_model_len}"
            )
        bad = [t for t in prompt if not 0 <= t < self.config.vocab_size]
        if bad:
            raise ValueError(f"{what}: token ids {bad[:5]} outside the vocabulary")

    def validate_request(self, request: Request) -> None:
        self._check_prompt(
            f"request {request.request_id!r}", request.prompt_ids, request.params.max_new_tokens
        )

    def _step(self, joining: list[Request], aborted: list[str]) -> list[TokenEvent]:
        for request_id in aborted:
            del self._running[request_id]
        for request in joining:
            seed = request.params.seed
            rng = random.Random(self._seeds.getrandbits(62) if seed is None else seed)
            self._running[request.request_id] = _Sequence(request, rng, request.prompt_ids[-1])
        self.steps += 1
        events = []
        for request_id, sequence in list(self._running.items()):
            event = sequence.sample_next(self.weights)
            if event.finish_reason is not None:
                del self._running[request_id]
            events.append(event)
        return events

    def update_weights(self, weights: Iterable[NamedTensor], *, version: int) -> None:
        with self.updating_weights(version) as update:  # applied as they arrive
            for name, value in weights:
                if name not in self.weights:
                    raise KeyError(f"unknown weight {name!r}; the model has {sorted(self.weights)}")
                if shape_of(value) != shape_of(self.weights[name]):
                    raise ValueError(f"weight {name!r} has shape {shape_of(value)}")
                update.changed = True
                self.weights[name] = copy.deepcopy(value)
            self._version = version

    def sleep(self, level: int = 1) -> bool:
        super().sleep(level)
        self.asleep = True
        return False  # pure Python: nothing on an accelerator to free

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        super().wake_up(tags)
        if tags is None or "kv_cache" in tags:
            self.asleep = False
