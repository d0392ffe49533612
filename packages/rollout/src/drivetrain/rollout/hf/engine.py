"""The ``hf`` rollout engine: batched transformers ``generate`` on CPU or GPU."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from drivetrain.api.engine import NamedTensor
from drivetrain.api.rollout import Completion, Prompt, Rollout, SamplingParams
from drivetrain.rollout.config import HFRolloutConfig
from drivetrain.rollout.devices import model_dir, resolve_device
from drivetrain.rollout.hf.prefill import prompt_groups, shared_prompt_cache
from drivetrain.rollout.hf.sampling import sampling_processors
from drivetrain.rollout.hf.stops import cut_at_stop
from drivetrain.rollout.prompts import check_stop_token_ids, new_token_budgets, render_prompts
from drivetrain.rollout.weights import stage_weights


@dataclass(frozen=True)
class _Request:
    prompt_index: int
    prompt_ids: list[int]
    budget: int


class HFEngine(Rollout):
    config: HFRolloutConfig

    def __init__(self, config: HFRolloutConfig) -> None:
        super().__init__(config)
        path = model_dir(config.model_path)
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.device = torch.device(resolve_device(config.device))
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.model = AutoModelForCausalLM.from_pretrained(
            path, dtype=getattr(torch, config.dtype), attn_implementation=config.attn_implementation
        ).to(self.device)
        self.model.eval().requires_grad_(False)
        positions = getattr(self.model.config, "max_position_embeddings", None)
        self.max_model_len = min(config.max_model_len, positions or config.max_model_len)
        self.vocab_size = self.model.get_input_embeddings().weight.shape[0]
        self.eos_ids = _eos_ids(self.model, self.tokenizer)
        pad = self.tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else next(iter(sorted(self.eos_ids)), 0)
        # generate() fills every unset field of a call's config from the model's: start from a
        # clean one so no model default (EOS when ignore_eos, top_k=50, repetition penalty...)
        # changes what a request asked for
        self.model.generation_config = GenerationConfig(pad_token_id=self.pad_id)
        self._shapes = {name: tuple(t.shape) for name, t in self.model.state_dict().items()}
        self._version = 0
        self._rng = torch.Generator().manual_seed(config.seed)

    @property
    def weight_version(self) -> int:
        return self._version

    # ---- generation ---------------------------------------------------------------------
    def generate(self, prompts: Sequence[Prompt], params: SamplingParams) -> list[Completion]:
        prompt_ids = render_prompts(prompts, self.tokenizer, self.vocab_size)
        budgets = new_token_budgets(prompt_ids, params, self.max_model_len)
        check_stop_token_ids(params, self.vocab_size)
        requests = [
            _Request(i, ids, budget)
            for i, (ids, budget) in enumerate(zip(prompt_ids, budgets, strict=True))
            for _ in range(params.n)
        ]
        # one seed per call: an explicit seed reproduces a call; otherwise the rollout's own
        # generator (seeded from the config) moves on between calls
        seed = (
            params.seed
            if params.seed is not None
            else int(torch.randint(2**62, (1,), generator=self._rng))
        )
        completions: list[Completion] = []
        with _seeded(seed, self.device):
            size = self.config.max_batch_size
            for start in range(0, len(requests), size):
                completions += self._generate_chunk(requests[start : start + size], params)
        return completions

    def _generate_chunk(self, requests: list[_Request], params: SamplingParams) -> list[Completion]:
        width = max(len(r.prompt_ids) for r in requests)
        ids = torch.full((len(requests), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, r in enumerate(requests):  # left padding: generation continues every row
            ids[row, width - len(r.prompt_ids) :] = torch.tensor(r.prompt_ids)
            mask[row, width - len(r.prompt_ids) :] = 1
        stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else self.eos_ids)
        processors, recorder = sampling_processors(params)
        generation = GenerationConfig(
            max_new_tokens=max(r.budget for r in requests),
            do_sample=not params.greedy,
            temperature=1.0,  # the warpers are in `processors`, see hf/sampling.py
            top_k=0,
            top_p=1.0,
            eos_token_id=sorted(stop_ids) or None,
            pad_token_id=self.pad_id,
            stop_strings=list(params.stop) or None,
            cache_implementation="static" if self.config.cache == "static" else None,
            return_dict_in_generate=True,
        )
        ids, mask = ids.to(self.device), mask.to(self.device)
        with torch.inference_mode():
            cache = (
                shared_prompt_cache(
                    self.model, ids, mask, prompt_groups([tuple(r.prompt_ids) for r in requests])
                )
                if self.config.share_prompt_prefill and self.config.cache == "dynamic"
                else None
            )
            out = self.model.generate(
                input_ids=ids,
                attention_mask=mask,
                past_key_values=cache,
                generation_config=generation,
                logits_processor=processors,
                tokenizer=self.tokenizer if params.stop else None,
            )
        generated = out.sequences[:, width:].cpu()
        log_probs = recorder.finish(out.sequences)
        completions = []
        for row, r in enumerate(requests):
            tokens = generated[row].tolist()
            end, reason = cut_at_stop(
                tokens, r.budget, stop_ids, params.stop, self.tokenizer.decode
            )
            kept = tokens[:end]
            completions.append(
                Completion(
                    prompt_index=r.prompt_index,
                    prompt_ids=tuple(r.prompt_ids),
                    token_ids=tuple(kept),
                    log_probs=tuple(log_probs[row, :end].tolist()),
                    finish_reason=reason,
                    weight_version=self._version,
                    text=self.tokenizer.decode(kept, skip_special_tokens=True),
                )
            )
        return completions

    # ---- weights ------------------------------------------------------------------------
    def update_weights(self, weights: Iterable[NamedTensor], *, version: int) -> None:
        staged = stage_weights(weights, self._shapes)
        params = self.model.state_dict()
        with torch.no_grad():
            for name, tensor in staged:
                params[name].copy_(tensor)
        self._version = version

    def shutdown(self) -> None:
        self.model = None  # type: ignore[assignment]
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


def _eos_ids(model: torch.nn.Module, tokenizer: object) -> set[int]:
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), model.config, tokenizer):
        value = getattr(source, "eos_token_id", None)
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    return ids


@contextlib.contextmanager
def _seeded(seed: int, device: torch.device) -> Iterator[None]:
    """transformers samples from torch's global generator: seed it for this call only."""
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        yield
