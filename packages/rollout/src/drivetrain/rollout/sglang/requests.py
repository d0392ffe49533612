"""Requests to SGLang's offline ``Engine`` and its answers turned into :class:`Completion` s.

Nothing here imports sglang, so all of it is tested without a GPU. Facts about SGLang relied on
(checked against sgl-project/sglang ``main`` and the 0.5 series):

* ``Engine.generate(input_ids=[[...], ...], sampling_params=[{...}, ...], return_logprob=True)``
  answers one dict per request, in request order: ``output_ids``, ``text`` and ``meta_info`` with
  ``finish_reason`` (``{"type": "stop" | "length" | "abort", ...}``) and
  ``output_token_logprobs``, one ``(logprob, token_id, text_or_None)`` per generated token.
* ``temperature == 0`` is greedy: SGLang turns it into ``top_k = 1`` at temperature 1;
  ``top_k = -1`` disables top-k. ``no_stop_trim=True`` keeps a matched stop token or string in
  the output (without it a matched stop token is cut from ``output_ids`` but not from the
  log-probs). ``sampling_seed`` is only honoured with ``enable_deterministic_inference``.
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
from typing import Any

import torch

from drivetrain.api.requests import sample_seed
from drivetrain.api.rollout import Completion, FinishReason, SamplingParams

TOP_K_DISABLED = -1  # SGLang's "no top-k" (its SamplingParams maps it to the whole vocabulary)
KV_CACHE = "kv_cache"  # SGLang's memory tags (sglang.srt.constants)

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

    ``n`` is always 1 (:func:`generate_kwargs` repeats the prompt, so the order of samples is
    ours). Top-k/top-p travel in ``custom_params`` for :class:`TopKTopPFilter` and SGLang's own
    filters stay off, so they are not applied twice. ``seed`` becomes ``sampling_seed``.
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


def request_seeds(seed: int, count: int) -> list[int]:
    """A distinct seed per request (:func:`drivetrain.api.requests.sample_seed`, as every
    backend derives them): SGLang derives each step's randomness from the request's seed and
    the position only, so ``n`` samples of a prompt sharing one seed would be equal."""
    return [sample_seed(seed, index) for index in range(count)]


def generate_kwargs(
    prompt_ids: Sequence[Sequence[int]],
    budgets: Sequence[int],
    params: SamplingParams,
    *,
    processor: str | None = None,
    seeds: Sequence[int] | None = None,
    lora_name: str | None = None,
) -> dict[str, Any]:
    """Keyword arguments of ``Engine.generate`` for ``params.n`` samples of every prompt.

    Each prompt is repeated ``n`` times, so the answer's ``result[i * n + j]`` is sample ``j``
    of prompt ``i``. ``processor`` (:func:`processor_string`) is required when the request
    filters; ``seeds`` holds one ``sampling_seed`` per request; ``lora_name`` names a loaded
    adapter.
    """
    if len(prompt_ids) != len(budgets):
        raise ValueError(f"{len(prompt_ids)} prompts but {len(budgets)} token budgets")
    count = len(prompt_ids) * params.n
    if seeds is not None and len(seeds) != count:
        raise ValueError(f"{len(seeds)} seeds for {count} requests")
    input_ids: list[list[int]] = []
    sampling: list[dict[str, Any]] = []
    for ids, budget in zip(prompt_ids, budgets, strict=True):
        for _ in range(params.n):
            seed = None if seeds is None else seeds[len(input_ids)]
            input_ids.append(list(ids))
            sampling.append(sampling_params_dict(params, budget, seed=seed))
    kwargs: dict[str, Any] = {
        "input_ids": input_ids,
        "sampling_params": sampling,
        "return_logprob": True,
    }
    if needs_filter(params):
        if processor is None:
            raise ValueError("top-k/top-p sampling needs the TopKTopPFilter logit processor")
        kwargs["custom_logit_processor"] = [processor] * count
    if lora_name is not None:
        kwargs["lora_path"] = [lora_name] * count
    return kwargs


# ---- answers ------------------------------------------------------------------------------
def parse_outputs(
    outputs: Sequence[Mapping[str, Any]] | Mapping[str, Any],
    prompt_ids: Sequence[Sequence[int]],
    n: int,
    weight_version: int,
) -> list[Completion]:
    """Completions from ``Engine.generate``'s answer to :func:`generate_kwargs`'s request.

    Raises ``RuntimeError`` when the answer does not fit the request (count, or tokens and
    log-probs that disagree): a silent misalignment would train on wrong log-probs.
    """
    if isinstance(outputs, Mapping):  # a batch of one may come back unwrapped
        outputs = [outputs]
    expected = len(prompt_ids) * n
    if len(outputs) != expected:
        raise RuntimeError(f"SGLang answered {len(outputs)} outputs to {expected} requests")
    return [
        _completion(output, k // n, prompt_ids[k // n], weight_version)
        for k, output in enumerate(outputs)
    ]


def _completion(
    output: Mapping[str, Any], index: int, prompt: Sequence[int], weight_version: int
) -> Completion:
    meta = output.get("meta_info") or {}
    token_ids, log_probs = sampled_log_probs(
        output.get("output_ids"), meta.get("output_token_logprobs")
    )
    return Completion(
        prompt_index=index,
        prompt_ids=tuple(prompt),
        token_ids=token_ids,
        log_probs=log_probs,
        finish_reason=finish_reason(meta.get("finish_reason")),
        weight_version=weight_version,
        text=output.get("text"),
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


def check_weight_metadata(
    names: Sequence[str],
    dtypes: Sequence[str],
    shapes: Sequence[Sequence[int]],
    expected: Mapping[str, tuple[int, ...]],
) -> None:
    """The checks :func:`~drivetrain.rollout.weights.stage_weights` makes, for a broadcast
    update known only by its metadata: ``KeyError`` for an unknown name, ``ValueError`` for a
    wrong shape, before anything is received."""
    if not len(names) == len(dtypes) == len(shapes):
        raise ValueError(
            f"{len(names)} names, {len(dtypes)} dtypes and {len(shapes)} shapes do not pair up"
        )
    for name, shape in zip(names, shapes, strict=True):
        if name not in expected:
            raise KeyError(f"unknown weight {name!r}; the model has e.g. {sorted(expected)[:8]}")
        if tuple(shape) != tuple(expected[name]):
            raise ValueError(
                f"weight {name!r} has shape {tuple(shape)}, the model has {tuple(expected[name])}"
            )


def weight_buckets(
    tensors: Sequence[tuple[str, torch.Tensor]], bucket_bytes: int
) -> list[list[tuple[str, torch.Tensor]]]:
    """Consecutive groups of at most ``bucket_bytes`` (a larger tensor goes alone), so that
    only one group at a time is copied to the GPU for SGLang."""
    buckets: list[list[tuple[str, torch.Tensor]]] = []
    size = 0
    for name, tensor in tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if not buckets or size + nbytes > bucket_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append((name, tensor))
        size += nbytes
    return buckets


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
