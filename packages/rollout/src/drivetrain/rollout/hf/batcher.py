"""Continuous batching over a transformers causal LM: requests join and leave between steps.

The running batch is one left-padded ``DynamicCache`` (``[rows, heads, T, dim]`` per layer), a
``[rows, T]`` attention mask and each row's next position. A step

1. drops aborted rows;
2. prefills the joining requests — each distinct prompt once (the n samples of a GRPO prompt
   share it), batched and left padded — samples every request's first token from its prompt's
   last logits, copies the prompt's KV rows to its requests and appends them to the running
   cache (both sides left padded to a common width);
3. runs one decode forward over all rows and samples each row's next token;
4. drops finished rows (index-select, then trims leading columns that are padding everywhere).

Sampling is per row (temperature, top-k, top-p as transformers' warpers apply them) from the
request's own ``torch.Generator`` (an exponential race, equivalent to multinomial sampling), so
a seeded request samples the same tokens in any batch. Each token's log-prob is taken under
the distribution it was sampled from (the unscaled one for greedy). Why not transformers' own
continuous batching (``generate_batch``): it has no per-request seed, cannot mix greedy and
sampled requests, does not share a prompt's prefill between its samples, and its cancel
returns nothing of what was generated.

With ``record_routing`` (a mixture-of-experts model, ``rollout.return_routed_experts``) every
forward records the experts each router chose: a joining request gets its prompt's positions
(its own rows of the shared prefill), every decode step the position of the token it consumed
(:mod:`drivetrain.api.routing`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from drivetrain.api.requests import Request
from drivetrain.api.rollout import FinishReason, SamplingParams
from drivetrain.api.routing import RoutedExperts
from drivetrain.engine_core.moe_routing import RoutingRecorder, routing_hooks
from drivetrain.rollout.routed import routed_from_array
from drivetrain.runtime.request_queue import TokenEvent


@dataclass
class _Row:
    request: Request
    generator: torch.Generator
    stop_ids: frozenset[int]
    tokens: list[int] = field(default_factory=list)

    def finish_after(
        self, token: int, decode: Callable[[Sequence[int]], str]
    ) -> FinishReason | None:
        self.tokens.append(token)
        return finish_reason(self.tokens, self.request.params, self.stop_ids, decode)


def finish_reason(
    tokens: Sequence[int],
    params: SamplingParams,
    stop_ids: Collection[int],
    decode: Callable[[Sequence[int]], str],
) -> FinishReason | None:
    """Why a request ends with ``tokens[-1]``, or ``None`` if it goes on: a stop token (kept, as
    vLLM keeps EOS), a stop string completed by this token, or the token budget."""
    if tokens[-1] in stop_ids:
        return FinishReason.STOP
    if params.stop and any(s in decode(tokens) for s in params.stop):
        return FinishReason.STOP
    if len(tokens) >= params.max_new_tokens:
        return FinishReason.LENGTH
    return None


class ContinuousBatcher:
    """The ``step`` of a :class:`~drivetrain.runtime.request_queue.RequestQueue` for an HF model.

    ``eos_ids`` end a request unless it sets ``ignore_eos``; ``seed_for`` gives an unseeded
    request its seed; ``decode`` renders tokens for stop strings.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        pad_id: int,
        eos_ids: frozenset[int],
        share_prefill: bool,
        seed_for: Callable[[], int],
        decode: Callable[[Sequence[int]], str],
        record_routing: bool = False,
    ) -> None:
        self.model = model
        self.routing = RoutingRecorder() if record_routing else None
        self.device = next(model.parameters()).device
        self.pad_id = pad_id
        self.eos_ids = eos_ids
        self.share_prefill = share_prefill
        self.seed_for = seed_for
        self.decode = decode
        self.reset()

    def reset(self) -> None:
        """Drop the running batch (after a failed step: its state may be half-updated, and its
        routers may have recorded part of a forward)."""
        if self.routing is not None:
            self.routing.clear()
        self.rows: list[_Row] = []
        self.cache: DynamicCache | None = None
        self.mask = torch.zeros(0, 0, dtype=torch.long, device=self.device)
        self.positions = torch.zeros(0, dtype=torch.long, device=self.device)
        self.next_tokens = torch.zeros(0, dtype=torch.long, device=self.device)

    @torch.inference_mode()
    def step(self, joining: list[Request], aborted: list[str]) -> list[TokenEvent]:
        """Aborted rows leave, joining requests get their first token from the prefill, then
        every row (the joined ones too) decodes one token; finished rows leave."""
        if aborted:
            gone = set(aborted)
            self._keep([i for i, row in enumerate(self.rows) if row.request.request_id not in gone])
        events: list[TokenEvent] = []
        if joining:
            self._join(joining, events)
        if self.rows:
            self._decode(events)
        done = {e.request_id for e in events if e.finish_reason is not None}
        if done:
            self._keep([i for i, row in enumerate(self.rows) if row.request.request_id not in done])
        return events

    # ---- sampling -------------------------------------------------------------------------
    def _sample(self, logits: torch.Tensor, rows: list[_Row]) -> tuple[list[int], list[float]]:
        """``logits`` ``[rows, vocab]`` (float32) -> each row's token and its log-prob."""
        params = [row.request.params for row in rows]
        device = logits.device
        greedy = torch.tensor([p.greedy for p in params], device=device)
        temperature = torch.tensor(
            [p.temperature if not p.greedy else 1.0 for p in params], device=device
        )
        scores = logits / temperature[:, None]
        if any(p.top_k > 0 and not p.greedy for p in params):
            vocab = scores.shape[-1]
            k = torch.tensor(
                [min(p.top_k, vocab) if p.top_k > 0 else vocab for p in params], device=device
            )
            kth = scores.sort(-1, descending=True).values.gather(1, (k - 1)[:, None])
            scores = scores.masked_fill((scores < kth) & ~greedy[:, None], float("-inf"))
        if any(p.top_p < 1 and not p.greedy for p in params):
            # as transformers' TopPLogitsWarper: drop the low tail of mass <= 1 - top_p, keep >= 1
            top_p = torch.tensor([p.top_p for p in params], device=device)
            ordered, order = scores.sort(-1)
            drop = ordered.softmax(-1).cumsum(-1) <= (1 - top_p)[:, None]
            drop[:, -1] = False
            drop = drop.scatter(1, order, drop) & ~greedy[:, None]
            scores = scores.masked_fill(drop, float("-inf"))
        log_probs = torch.log_softmax(scores, -1)
        race = torch.ones_like(scores)
        for i, row in enumerate(rows):
            if not params[i].greedy:  # argmax(p / Exp(1)) samples from p
                race[i].exponential_(generator=row.generator)
        tokens = torch.where(greedy, logits.argmax(-1), (log_probs.exp() / race).argmax(-1))
        picked = log_probs.gather(1, tokens[:, None])[:, 0]
        return tokens.tolist(), picked.tolist()

    def _emit(
        self,
        rows: list[_Row],
        tokens: list[int],
        log_probs: list[float],
        events: list[TokenEvent],
        routed: Sequence[RoutedExperts | None] | None = None,
    ) -> None:
        routed = routed or [None] * len(rows)
        for row, token, log_prob, experts in zip(rows, tokens, log_probs, routed, strict=True):
            reason = row.finish_after(token, self.decode)
            events.append(TokenEvent(row.request.request_id, [token], [log_prob], reason, experts))

    # ---- routing (mixture-of-experts models) -----------------------------------------------
    @contextlib.contextmanager
    def _recording(self) -> Iterator[None]:
        if self.routing is None:
            yield
            return
        with routing_hooks(self.model, record=self.routing):
            yield

    def _routed(self, rows: int, spans: Sequence[tuple[int, int, int]]) -> list[RoutedExperts]:
        """The last forward's routing (``rows`` rows of equal width) as each request's
        positions: ``(row, first column, first position)`` per request."""
        if self.routing is None:
            return []
        chosen = self.routing.take()
        layers, top_k = chosen.shape[1], chosen.shape[2]
        chosen = chosen.reshape(rows, -1, layers, top_k).cpu()
        every = range(layers)
        return [
            routed_from_array(chosen[row, column:], every, top_k, start)
            for row, column, start in spans
        ]

    # ---- joining and decoding ---------------------------------------------------------------
    def _new_row(self, request: Request) -> _Row:
        seed = request.params.seed if request.params.seed is not None else self.seed_for()
        generator = torch.Generator(device=self.device)
        generator.manual_seed(seed)
        stops = frozenset(request.params.stop_token_ids)
        if not request.params.ignore_eos:
            stops |= self.eos_ids
        return _Row(request, generator, stops)

    def _join(self, requests: list[Request], events: list[TokenEvent]) -> None:
        rows = [self._new_row(r) for r in requests]
        if self.share_prefill:
            distinct: dict[tuple[int, ...], int] = {}
            group = [distinct.setdefault(r.prompt_ids, len(distinct)) for r in requests]
            prompts = list(distinct)
        else:
            group, prompts = list(range(len(requests))), [r.prompt_ids for r in requests]
        width = max(map(len, prompts))
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, prompt in enumerate(prompts):
            ids[i, width - len(prompt) :] = torch.tensor(prompt)
            mask[i, width - len(prompt) :] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        # full-width layers (no config): rows are index-selected and left padded in place,
        # which a sliding-window layer's own bookkeeping would not follow; a sliding window
        # still applies through the model's attention mask
        cache = DynamicCache()
        with self._recording():
            out = self.model(
                input_ids=ids,
                attention_mask=mask,
                position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
                past_key_values=cache,
                use_cache=True,
                logits_to_keep=1,
            )
        routed = self._routed(len(prompts), [(g, width - len(prompts[g]), 0) for g in group])
        select = torch.tensor(group, device=self.device)
        tokens, log_probs = self._sample(out.logits[:, -1].float().index_select(0, select), rows)
        self._emit(rows, tokens, log_probs, events, routed)
        ended = {e.request_id for e in events if e.finish_reason is not None}
        live = [i for i, row in enumerate(rows) if row.request.request_id not in ended]
        if not live:
            return
        select = select[live]  # one row per unfinished request
        cache.batch_select_indices(select)
        mask = mask.index_select(0, select)
        next_tokens = torch.tensor([tokens[i] for i in live], device=self.device)
        self._append([rows[i] for i in live], cache, mask, mask.sum(-1), next_tokens)

    def _append(
        self,
        rows: list[_Row],
        cache: DynamicCache,
        mask: torch.Tensor,
        positions: torch.Tensor,
        next_tokens: torch.Tensor,
    ) -> None:
        if self.cache is None:
            self.cache, self.mask, self.rows = cache, mask, rows
            self.positions, self.next_tokens = positions, next_tokens
            return
        width = max(self.mask.shape[1], mask.shape[1])
        for old, new in zip(self.cache.layers, cache.layers, strict=True):
            old.keys = torch.cat([_left_pad(old.keys, width, 2), _left_pad(new.keys, width, 2)])
            old.values = torch.cat(
                [_left_pad(old.values, width, 2), _left_pad(new.values, width, 2)]
            )
        self.mask = torch.cat([_left_pad(self.mask, width, 1), _left_pad(mask, width, 1)])
        self.positions = torch.cat([self.positions, positions])
        self.next_tokens = torch.cat([self.next_tokens, next_tokens])
        self.rows = self.rows + rows

    def _decode(self, events: list[TokenEvent]) -> None:
        self.mask = torch.cat([self.mask, self.mask.new_ones(len(self.rows), 1)], 1)
        with self._recording():
            out = self.model(
                input_ids=self.next_tokens[:, None],
                attention_mask=self.mask,
                position_ids=self.positions[:, None],
                past_key_values=self.cache,
                use_cache=True,
            )
        consumed = self.positions.tolist() if self.routing is not None else []
        routed = self._routed(len(self.rows), [(i, 0, p) for i, p in enumerate(consumed)])
        self.positions = self.positions + 1
        tokens, log_probs = self._sample(out.logits[:, -1].float(), self.rows)
        self._emit(self.rows, tokens, log_probs, events, routed)
        self.next_tokens = torch.tensor(tokens, device=self.device)

    def _keep(self, keep: list[int]) -> None:
        """Only rows ``keep`` stay (in order); leading columns that are padding in every kept
        row are trimmed."""
        if not keep:
            self.rows, self.cache = [], None
            self.mask = self.mask[:0, :0]
            self.positions, self.next_tokens = self.positions[:0], self.next_tokens[:0]
            return
        if len(keep) == len(self.rows):
            return
        index = torch.tensor(keep, device=self.device)
        mask = self.mask.index_select(0, index)
        lead = int((mask.sum(0) == 0).long().cumprod(0).sum())  # padding in every kept row
        assert self.cache is not None
        for layer in self.cache.layers:
            layer.keys = layer.keys.index_select(0, index)[:, :, lead:]
            layer.values = layer.values.index_select(0, index)[:, :, lead:]
        self.mask = mask[:, lead:]
        self.positions = self.positions.index_select(0, index)
        self.next_tokens = self.next_tokens.index_select(0, index)
        self.rows = [self.rows[i] for i in keep]


def _left_pad(t: torch.Tensor, width: int, dim: int) -> torch.Tensor:
    extra = width - t.shape[dim]
    if extra == 0:
        return t
    shape = list(t.shape)
    shape[dim] = extra
    return torch.cat([t.new_zeros(shape), t], dim)
