"""What the request-level rollouts of a Hugging Face model share: requests checked against
the model's vocabulary and context, and batch ``generate`` rendered and decoded with its
tokenizer over the rollout's own submit/poll."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from drivetrain.api.requests import Request
from drivetrain.api.rollout import Completion, Prompt, SamplingParams
from drivetrain.rollout.prompts import check_request, generate_prompts
from drivetrain.runtime.request_queue import QueuedRollout


class TokenizedRollout(QueuedRollout):
    """A :class:`QueuedRollout` whose ``__init__`` also sets :attr:`tokenizer`,
    :attr:`vocab_size` and :attr:`max_model_len`."""

    tokenizer: Any
    vocab_size: int
    max_model_len: int

    def validate_request(self, request: Request) -> None:
        check_request(request, self.vocab_size, self.max_model_len)

    def generate(self, prompts: Sequence[Prompt], params: SamplingParams) -> list[Completion]:
        self.check_ready()  # asleep or torn: say so before rendering anything
        return generate_prompts(
            self,
            self.tokenizer,
            prompts,
            params,
            vocab_size=self.vocab_size,
            max_model_len=self.max_model_len,
        )
