"""Sampled-token log-probs from transformers ``generate``, of the distribution actually sampled.

transformers applies a caller's logits processors *before* its own temperature/top-k/top-p
warpers, so a processor cannot observe the final distribution. We therefore switch the built-in
warpers off and install the same public warper classes ourselves, followed by a recorder that
keeps one ``[batch, vocab]`` log-softmax at a time (never the whole ``scores`` history).
"""

from __future__ import annotations

import torch
from transformers import (
    LogitsProcessor,
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from drivetrain.api.rollout import SamplingParams


class SampledLogProbs(LogitsProcessor):
    """Records log p(token) for each generated token under the scores it sees last.

    Called once per step with the sequences so far; the token sampled at the previous step is
    their last column, so its log-prob is gathered from the previous step's distribution.
    """

    def __init__(self) -> None:
        self.previous: torch.Tensor | None = None
        self.steps: list[torch.Tensor] = []

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if self.previous is not None:
            self.steps.append(self._gather(input_ids[:, -1]))
        self.previous = torch.log_softmax(scores.float(), dim=-1)
        return scores

    def _gather(self, tokens: torch.Tensor) -> torch.Tensor:
        assert self.previous is not None
        return self.previous.gather(1, tokens[:, None].to(self.previous.device))[:, 0].cpu()

    def finish(self, sequences: torch.Tensor) -> torch.Tensor:
        """``[batch, generated]`` log-probs once ``generate`` returned ``sequences``."""
        if self.previous is not None:
            self.steps.append(self._gather(sequences[:, -1]))
            self.previous = None
        return torch.stack(self.steps, dim=1) if self.steps else torch.zeros(len(sequences), 0)


def sampling_processors(params: SamplingParams) -> tuple[LogitsProcessorList, SampledLogProbs]:
    """Warpers in vLLM's and transformers' order (temperature, top-k, top-p), then the recorder.
    Greedy decoding records the unscaled distribution."""
    processors: list[LogitsProcessor] = []
    if not params.greedy:
        if params.temperature != 1.0:
            processors.append(TemperatureLogitsWarper(params.temperature))
        if params.top_k > 0:
            processors.append(TopKLogitsWarper(top_k=params.top_k))
        if params.top_p < 1.0:
            processors.append(TopPLogitsWarper(top_p=params.top_p))
    recorder = SampledLogProbs()
    return LogitsProcessorList([*processors, recorder]), recorder
