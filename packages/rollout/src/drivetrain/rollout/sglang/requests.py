"""Requests to SGLang's offline ``Engine`` and its streamed answers turned into token events.

Nothing here imports sglang, so all of it is tested without a GPU. Facts about SGLang relied on
(checked against sgl-project/sglang 0.5.23 and the 0.5 series):

* ``await Engine.async_generate(input_ids=[...], sampling_params={...}, return_logprob=True,
  rid=..., stream=True)`` is an async iterator of dicts, each the request's output so far:
  ``output_ids`` and ``meta_info`` with ``completion_tokens``, ``finish_reason`` (``None``
  until the last, then ``{"type": "stop" | "length" | "abort", ...}``) and
  ``output_token_logprobs``, one ``(logprob, token_id, text_or_None)`` per generated token.
  Cancelling the consuming task aborts the request in the scheduler (the tokenizer manager's
  cleanup sends ``AbortReq``).
* A request's ``rid`` is SGLang's: aborting one aborts every request whose ``rid`` starts
  with it, and a ``rid`` still in use is refused.
* ``temperature == 0`` is greedy: SGLang turns it into ``top_k = 1`` at temperature 1;
  ``top_k = -1`` disables top-k. ``no_stop_trim=True`` keeps a matched stop string in the text
  (``output_ids`` keep every generated token either way). ``sampling_seed`` is only honoured
  with ``enable_deterministic_inference``.
* Log-probs: since PR sgl-project/sglang#5961 (May 2025, so in every 0.5 release) the sampler
  reports ``log softmax(logits / temperature)`` of the sampled token over the *whole*
  vocabulary, not renormalised after top-k/top-p (``SGLANG_RETURN_ORIGINAL_LOGPROB=1`` would
  report the unscaled distribution instead; the engine forces it off). Greedy requests report
  the unscaled distribution, as our contract wants. No SGLang option reports the distribution
  renormalised after top-k/top-p, which our contract asks for; so when a request filters, its
  SGLang top-k/top-p stay off and :class:`TopKTopPFilter`, a custom logit processor (server
  arg ``enable_custom_logit_processor``), sets the filtered tokens' logits to ``-inf`` before
  SGLang divides by the temperature. Sampling and its log-prob are then both of the processed
  distribution.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from drivetrain.api.requests import Request
from drivetrain.api.rollout import FinishReason, SamplingParams
from drivetrain.rollout.routed import routed_from_base64
from drivetrain.runtime.request_queue import TokenEvent

#: SGLang's ``MAX_STOP_COUNT`` (sglang.srt.sampling.sampling_params)
MAX_STOP_STRINGS = 32
TOP_K_DISABLED = -1  # SGLang's "no top-k" (its SamplingParams maps it to the whole vocabulary)
KV_CACHE = "kv_cache"  # SGLang's memory tags (sglang.srt.constants)
WEIGHTS = "weights"

FINISH_REASONS = {
    "stop": FinishReason.STOP,
    "length": FinishReason.LENGTH,
    "abort": FinishReason.ABORT,
}


# ---- requests -----------------------------------------------------------------------------
def needs_filter(params: SamplingParams) -> bool:
    """Whether a request samples from a top-k/top-p filtered distribution (greedy never does)."""
    return not params.greedy and (params.top_k > 0 or params.top_p < 1.0)


def sampling_params_dict(
    params: SamplingParams, budget: int, *, seed: int | None = None
) -> dict[str, Any]:
    """SGLang's ``sampling_params`` for one request generating at most ``budget`` tokens.

    ``n`` is always 1 (``n`` samples are ``n`` requests). Top-k/top-p travel in
    ``custom_params`` for :class:`TopKTopPFilter` and SGLang's own filters stay off, so they
    are not applied twice. ``seed`` becomes ``sampling_seed``.
    """
    request: dict[str, Any] = {
        "max_new_tokens": budget,
        "temperature": params.temperature,
        "top_p": 1.0,
        "top_k": TOP_K_DISABLED,
        "stop": list(params.stop) or None,
        "stop_token_ids": list(params.stop_token_ids) or None,
        "ignore_eos": params.ignore_eos,
        "no_stop_trim": True,
        "n": 1,
    }
    if needs_filter(params):
        request["custom_params"] = {
            "temperature": params.temperature,
            "top_k": params.top_k,
            "top_p": params.top_p,
        }
    if seed is not None:
        request["sampling_seed"] = seed
    return request


def check_stops(params: SamplingParams) -> None:
    """``ValueError`` for more stop strings than SGLang takes (it would fail the request
    inside the engine, after it joined the running batch)."""
    if len(params.stop) > MAX_STOP_STRINGS:
        raise ValueError(
            f"SGLang takes at most {MAX_STOP_STRINGS} stop strings, got {len(params.stop)}"
        )


def request_kwargs(
    request: Request,
    rid: str,
    *,
    processor: str | None = None,
    seed: int | None = None,
    lora_name: str | None = None,
    routed_experts: bool = False,
) -> dict[str, Any]:
    """Keyword arguments of ``Engine.async_generate`` streaming one request under SGLang's id
    ``rid`` (see :mod:`drivetrain.rollout.sglang.streams` on why it is not the request's own).
    ``processor`` (:func:`processor_string`) is required when the request filters; ``seed``
    becomes its ``sampling_seed``; ``lora_name`` names a loaded adapter; ``routed_experts``
    asks for its routing (returned when it finishes)."""
    params = request.params
    kwargs: dict[str, Any] = {
        "input_ids": list(request.prompt_ids),
        "sampling_params": sampling_params_dict(params, params.max_new_tokens, seed=seed),
        "return_logprob": True,
        "rid": rid,
        "stream": True,
    }
    if needs_filter(params):
        if processor is None:
            raise ValueError("top-k/top-p sampling needs the TopKTopPFilter logit processor")
        kwargs["custom_logit_processor"] = processor
    if lora_name is not None:
        kwargs["lora_path"] = lora_name
    if routed_experts:
        kwargs["return_routed_experts"] = True
    return kwargs


# ---- answers ------------------------------------------------------------------------------
@dataclass(frozen=True)
class RoutingShape:
    """What SGLang's routed experts hold (``hidden_layers`` x ``top_k`` per position) and the
    router ``layers`` among them."""

    hidden_layers: int
    layers: list[int]
    top_k: int


def stream_event(
    request_id: str,
    output: Mapping[str, Any],
    reported: int,
    routing: RoutingShape | None = None,
) -> TokenEvent:
    """The tokens of a streamed output beyond the first ``reported``, with their log-probs,
    and the finish reason once the request ended (with its routed experts, given ``routing``).
    Each streamed output holds the request's whole output so far (``output_ids``, and
    ``output_token_logprobs`` in ``meta_info``); SGLang's incremental streaming, which sends
    only the new part, is refused: it would be read as missing tokens."""
    meta = output.get("meta_info") or {}
    output_ids = output.get("output_ids")
    entries = meta.get("output_token_logprobs")
    generated = meta.get("completion_tokens")
    if output_ids is not None and generated is not None and len(output_ids) != generated:
        raise RuntimeError(
            f"SGLang streamed {len(output_ids)} output ids of request {request_id!r}, which "
            f"has {generated} generated tokens: turn SGLang's incremental streaming off"
        )
    tokens, log_probs = sampled_log_probs(
        None if output_ids is None else output_ids[reported:],
        None if entries is None else entries[reported:],
    )
    reason = meta.get("finish_reason")
    routed = None
    if routing is not None and reason is not None and meta.get("routed_experts"):
        shape = routing
        routed = routed_from_base64(
            meta["routed_experts"], shape.hidden_layers, shape.layers, shape.top_k
        )
    return TokenEvent(
        request_id,
        list(tokens),
        list(log_probs),
        None if reason is None else finish_reason(reason),
        routed,
    )


def sampled_log_probs(
    output_ids: Sequence[int] | None, entries: Sequence[Sequence[Any]] | None
) -> tuple[tuple[int, ...], tuple[float, ...]]:
    """The generated tokens and their log-probs, checked to be the same tokens in order.

    ``entries`` are SGLang's ``(logprob, token_id, text)`` triples. Without ``output_ids`` the
    tokens are taken from the entries.
    """
    if entries is None:
        if output_ids:
            raise RuntimeError("SGLang returned no log-probs; was return_logprob dropped?")
        return (), ()
    logged = [int(entry[1]) for entry in entries]
    tokens = logged if output_ids is None else [int(t) for t in output_ids]
    if len(tokens) != len(logged):
        raise RuntimeError(
            f"SGLang returned {len(tokens)} generated tokens but {len(logged)} log-probs"
        )
    if tokens != logged:
        first = next(i for i, (a, b) in enumerate(zip(tokens, logged, strict=True)) if a != b)
        raise RuntimeError(
            f"SGLang's log-prob {first} is for token {logged[first]}, but token {first} of "
            f"the output is {tokens[first]}"
        )
    values = [entry[0] for entry in entries]
    if any(value is None for value in values):
        raise RuntimeError("SGLang returned a missing (None) log-prob for a generated token")
    return tuple(tokens), tuple(float(value) for value in values)


def finish_reason(value: Mapping[str, Any] | str | None) -> FinishReason:
    """Our finish reason from SGLang's (``{"type": ..., "matched"/"length"/"message": ...}``)."""
    if value is None:
        raise RuntimeError("SGLang returned a finished request without a finish reason")
    kind = value.get("type") if isinstance(value, Mapping) else value
    if kind not in FINISH_REASONS:
        raise RuntimeError(f"SGLang returned an unknown finish reason {value!r}")
    return FINISH_REASONS[kind]


def check_result(result: Any, action: str) -> None:
    """Raise if one of SGLang's control calls reports failure.

    They answer ``(success, message)`` tuples (weight updates, update groups) or objects with
    ``success`` and ``error_message``/``message`` (LoRA, memory); ``None`` means no report.
    """
    if isinstance(result, tuple) and len(result) >= 2 and isinstance(result[0], bool):
        success, message = result[0], result[1]
    elif isinstance(result, Mapping) and "success" in result:
        success, message = result["success"], result.get("message", "")
    elif hasattr(result, "success"):
        success = result.success
        message = getattr(result, "error_message", None) or getattr(result, "message", "")
    else:
        return
    if not success:
        raise RuntimeError(f"SGLang {action} failed: {message}")


# ---- engine limits and weights ------------------------------------------------------------
def context_limits(max_model_len: int, max_positions: int | None) -> tuple[int, int]:
    """SGLang's ``context_length`` and the sequence length we allow.

    SGLang refuses a request whose prompt plus ``max_new_tokens`` *reaches* its context length,
    one token short of the other backends; so it is given one position more than
    ``max_model_len`` where the model has it, and we allow one less than it has otherwise.
    """
    context = max_model_len + 1
    if max_positions is not None:
        context = min(context, max_positions)
    return context, context - 1


def memory_tags(level: int, weights_backup: bool) -> list[str] | None:
    """What ``release_memory_occupation`` frees for ``sleep(level)``; ``None`` is everything
    SGLang tracks (weights, KV cache, CUDA graphs). Level 1 keeps the weights: on the host
    when SGLang backs them up (``enable_weights_cpu_backup``), else on the GPU."""
    if level == 1 and not weights_backup:
        return [KV_CACHE]
    return None


# ---- the top-k/top-p logit processor ------------------------------------------------------
def filter_logits(
    logits: torch.Tensor, temperatures: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor
) -> torch.Tensor:
    """``logits`` with ``-inf`` where the processed distribution has no mass, else unchanged.

    Per row, as transformers' warpers and vLLM do: scale by the temperature, keep the top-k
    (ties at the k-th value kept; ``k <= 0`` keeps all), then the smallest set of the most
    likely tokens whose renormalised mass reaches ``top_p`` (``1`` keeps all).
    """
    scaled = logits.float() / temperatures.float()[:, None]
    ordered, order = scaled.sort(dim=-1, descending=True)
    vocab = scaled.shape[-1]
    k = torch.where(top_ks > 0, top_ks.clamp(max=vocab), torch.full_like(top_ks, vocab))
    kth = ordered.gather(1, (k - 1).long()[:, None])
    keep = ordered >= kth
    probs = torch.softmax(ordered.masked_fill(~keep, float("-inf")), dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    keep &= (mass_before < top_ps.float()[:, None]) | (top_ps[:, None] >= 1.0)
    keep[:, 0] = True  # the most likely token always survives
    kept = torch.zeros_like(keep).scatter(1, order, keep)
    return logits.masked_fill(~kept, float("-inf"))


class TopKTopPFilter:
    """SGLang custom logit processor applying each request's top-k/top-p (``custom_params``
    from :func:`sampling_params_dict`) before SGLang's temperature and softmax.

    SGLang calls it with the logits of the rows that use it and one params dict per row (to
    which SGLang adds ``__req__``), and keeps what it returns.
    """

    def __call__(
        self, logits: torch.Tensor, custom_param_list: Sequence[Mapping[str, Any]] | None = None
    ) -> torch.Tensor:
        rows = list(custom_param_list or [])
        if len(rows) != logits.shape[0]:
            raise ValueError(f"{len(rows)} custom_params for {logits.shape[0]} rows of logits")

        def column(key: str, dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor([row[key] for row in rows], dtype=dtype, device=logits.device)

        return filter_logits(
            logits,
            column("temperature", torch.float32),
            column("top_k", torch.long),
            column("top_p", torch.float32),
        )


def processor_string() -> str:
    """:class:`TopKTopPFilter` in SGLang's wire format (``CustomLogitProcessor.to_str``: the
    class dill-pickled, hex in JSON). dill pickles an importable class by reference, so
    SGLang's scheduler imports it from this module."""
    import dill  # a dependency of sglang, present wherever this backend runs

    return json.dumps({"callable": dill.dumps(TopKTopPFilter).hex()})
