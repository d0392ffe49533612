"""The rollout (generation) contract.

A rollout backend holds an inference copy of the policy, generates completions for prompts, and
receives new weights after every training step. It may live in another process or another
Python environment than the trainer (vLLM and SGLang pin their own torch): everything crossing
this interface is plain Python data (ints, floats, strings) except the weight stream, which a
weight-sync transport delivers.
"""

from __future__ import annotations

import abc
import enum
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from drivetrain.api.config import RolloutConfig
from drivetrain.api.engine import NamedTensor
from drivetrain.api.routing import RoutedExperts

if TYPE_CHECKING:
    from drivetrain.api.requests import Chunk, Request

#: Parts of a rollout's accelerator memory that sleep/wake_up handle separately.
MEMORY_TAGS = frozenset({"weights", "kv_cache"})


@dataclass(frozen=True)
class SamplingParams:
    """How to sample. ``temperature == 0`` means greedy. ``n`` completions per prompt.

    ``top_k <= 0`` and ``top_p == 1`` disable those filters. Generation stops at
    ``max_new_tokens``, at any of ``stop_token_ids``, at the model's EOS unless
    ``ignore_eos``, or at any of ``stop`` strings. The token that ended a request stays in
    ``token_ids`` (with its log-prob: the policy sampled it and is trained on it): an EOS or a
    stop token as vLLM keeps them, and for a stop string the token that completed it, so the
    cut falls at a token boundary and the decoded text may run a few characters past the
    string (never before it). Greedy decoding reports log-probs of the unscaled distribution
    (temperature 1), as vLLM does.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 64
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    seed: int | None = None

    def __post_init__(self) -> None:
        problems = []
        if self.n < 1:
            problems.append(f"n={self.n} must be >= 1")
        if self.temperature < 0:
            problems.append(f"temperature={self.temperature} must be >= 0")
        if not 0 < self.top_p <= 1:
            problems.append(f"top_p={self.top_p} must be in (0, 1]")
        if self.max_new_tokens < 1:
            problems.append(f"max_new_tokens={self.max_new_tokens} must be >= 1")
        if any(not s for s in self.stop):
            problems.append("stop strings must be non-empty")
        if any(t < 0 for t in self.stop_token_ids):
            problems.append(f"stop_token_ids {self.stop_token_ids} must be >= 0")
        if problems:
            raise ValueError("invalid sampling params: " + "; ".join(problems))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


class FinishReason(enum.Enum):
    STOP = "stop"  # EOS, a stop token or a stop string
    LENGTH = "length"  # max_new_tokens or the context length
    ABORT = "abort"  # the request was aborted (e.g. for a weight update)


@dataclass(frozen=True)
class Prompt:
    """One prompt as token ids, or as chat ``messages`` the backend renders with the
    tokenizer's chat template (adding the generation prompt)."""

    token_ids: tuple[int, ...] = ()
    messages: tuple[Mapping[str, str], ...] = ()

    def __post_init__(self) -> None:
        if bool(self.token_ids) == bool(self.messages):
            raise ValueError("a Prompt needs exactly one of token_ids and messages")


@dataclass(frozen=True)
class Completion:
    """One sampled completion.

    ``log_probs[i]`` is the log-probability of ``token_ids[i]`` under the distribution it was
    sampled from (after temperature and top-k/top-p), so that it equals what the trainer
    recomputes at the same temperature. ``prompt_ids`` is the rendered prompt.
    ``weight_version`` is the version of the first token's weights; ``token_versions`` (when
    not empty) holds each token's, for a completion sampled across a weight update.
    ``text`` is optional: the request path (``drivetrain.runtime.collector``, which
    ``generate_with_requests`` and the trainer use) leaves it ``None``, and the trainer decodes
    ``token_ids`` itself; a backend's own batch ``generate`` may fill it for its callers.
    ``routed_experts`` (a rollout asked to return it) covers positions ``0 ..
    len(prompt_ids) + len(token_ids) - 2`` (:mod:`drivetrain.api.routing`).
    """

    prompt_index: int
    prompt_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    log_probs: tuple[float, ...]
    finish_reason: FinishReason
    weight_version: int
    text: str | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)
    token_versions: tuple[int, ...] = ()
    routed_experts: RoutedExperts | None = None


class Rollout(abc.ABC):
    """Base class of every rollout backend.

    A rollout serves requests (:mod:`drivetrain.api.requests`): :meth:`submit`, :meth:`poll`,
    :meth:`abort`, with requests joining and leaving the running batch at any time; batch
    :meth:`generate` is a helper over them. Weights change only between token steps: a weight
    update waits for the step in progress, and the tokens of the next step carry the new
    version.
    """

    config: RolloutConfig

    def __init__(self, config: RolloutConfig) -> None:
        self.config = config

    # ---- requests ----------------------------------------------------------------------
    def submit(self, requests: Sequence[Request]) -> None:
        """Start generating ``requests`` (ids unique among the requests not yet fully polled).
        A prompt plus ``max_new_tokens`` beyond the context, token ids outside the vocabulary
        or an id in use raise ``ValueError`` before any of them starts. Returns at once."""
        raise NotImplementedError(f"{type(self).__name__} serves batch generate calls only")

    def poll(self, timeout_s: float = 0.0) -> list[Chunk]:
        """The chunks generated since the last poll (one per request and weight version, in
        sampling order), waiting up to ``timeout_s`` for at least one while requests are
        unfinished. A backend whose generation is driven by its caller advances in here (at
        least one token step when requests are running), so a caller that polls keeps
        generation going. Chunks go to whoever polls: a rollout has one poller at a time."""
        raise NotImplementedError(f"{type(self).__name__} serves batch generate calls only")

    def abort(self, request_ids: Sequence[str] | None = None) -> int:
        """End requests now (``None``: all unfinished): each one's last chunk, at the next
        poll, carries its remaining tokens and finish reason ``ABORT``. Unknown or finished
        ids are ignored. Returns how many requests were aborted."""
        raise NotImplementedError(f"{type(self).__name__} serves batch generate calls only")

    @abc.abstractmethod
    def generate(self, prompts: Sequence[Prompt], params: SamplingParams) -> list[Completion]:
        """Sample ``params.n`` completions for every prompt and wait for all of them.

        Returns ``len(prompts) * params.n`` completions grouped by prompt, in prompt order
        (``result[i * n + j]`` is sample ``j`` of prompt ``i``). A prompt longer than the
        context, or invalid params, raise ``ValueError`` before anything is generated.
        Request-level rollouts implement it with
        :func:`drivetrain.runtime.request_poller.generate_with_requests`.
        """

    @abc.abstractmethod
    def update_weights(self, weights: Iterable[NamedTensor], *, version: int) -> None:
        """Load new weights, given as a stream of Hugging Face named full tensors.

        The stream may cover all weights or a subset (e.g. LoRA adapters); a name the model
        does not have raises ``KeyError``. A backend may apply tensors as they arrive: then a
        stream that fails after a weight changed leaves it refusing requests until a whole
        update lands (:meth:`~drivetrain.runtime.request_queue.QueuedRollout.updating_weights`);
        one that fails before leaves the old weights in use. After it returns, every
        generation uses the new weights and reports ``version``.
        """

    def weight_destination(self, name: str, shape: tuple[int, ...], dtype: str) -> Any:
        """During :meth:`update_weights`: the tensor the weight ``name`` is copied into, when
        it has this shape and dtype (``"bfloat16"``...), so a transport writes the bytes there
        directly and yields that tensor (see ``WeightTransport.receive``: copy a yielded
        tensor only when it is not already your own memory); else ``None``, the default. A
        backend that returns one applies weights as they arrive."""
        return None

    def weights_fingerprint(self, expected: Mapping[str, str]) -> Mapping[str, str] | None:
        """The fingerprints of the weights this rollout serves, for the names of ``expected``
        and each in its dtype and kind (``drivetrain.runtime.fingerprint.fingerprint_like`` does
        it for weights kept by those names), so the trainer can check after a sync that it
        serves what was sent (``weight_sync.provenance``). ``None``, the default, when the
        backend cannot tell (it fuses or shards weights under other names): it is then not
        checked."""
        return None

    def trace_ops(
        self, prompt_ids: Sequence[int], token_ids: Sequence[int]
    ) -> Mapping[str, Any] | None:
        """Optional, as :meth:`Engine.trace_ops`: each op's output at every position of
        ``prompt_ids + token_ids[:-1]`` as this rollout computes it generating ``token_ids``
        (its prefill, then a decode step per token), and ``log_probs`` of ``token_ids`` at
        temperature 1. ``None``, the default: it cannot tell."""
        return None

    @property
    @abc.abstractmethod
    def weight_version(self) -> int:
        """Version of the weights in use (0 for the weights it was started with)."""

    def sleep(self, level: int = 1) -> bool:
        """Free accelerator memory while training runs: level 1 drops the KV cache and moves
        weights to host, level 2 drops weights too (they must be re-sent). Returns whether memory
        was actually freed (``False`` where the backend cannot, e.g. on CPU)."""
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level}")
        return False

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """Undo :meth:`sleep`; a no-op when sleep freed nothing. ``tags`` restores only part of
        the memory: ``("weights",)`` before a weight update, ``("kv_cache",)`` after it (as vLLM
        and SGLang do for colocated training), ``None`` everything."""
        if tags is not None and not set(tags) <= MEMORY_TAGS:
            raise ValueError(f"unknown memory tags {sorted(set(tags) - MEMORY_TAGS)}")

    def background_generation(self, enabled: bool) -> bool:
        """Step on its own (a thread, or its server's loop) while requests run, polls only
        collecting (``enabled``); whether it now does (default ``False``: keep polling it)."""
        return False

    # ---- around a weight update -----------------------------------------------------------
    def pause_generation(self, *, abort: bool = False) -> int:
        """Hold new requests (submitted ones wait) and let none be in flight (before a weight
        update): ``abort`` aborts the running ones, else they run to their end. Returns how
        many requests were aborted. Backends that serve one call at a time, with nothing in
        flight between calls, need not override it."""
        return 0

    def resume_generation(self) -> None:
        """Undo :meth:`pause_generation`."""
        return None

    def shutdown(self) -> None:
        """Release processes and memory; the object is unusable afterwards."""
        return None
