"""The ``hf`` rollout: a transformers model on CPU or GPU serving requests with
continuous batching (:mod:`drivetrain.rollout.hf.batcher`), driven by whoever polls it."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from drivetrain.api.engine import NamedTensor
from drivetrain.api.errors import ConfigError
from drivetrain.api.requests import Request
from drivetrain.api.rollout import MEMORY_TAGS
from drivetrain.rollout.config import HFRolloutConfig
from drivetrain.rollout.devices import model_dir
from drivetrain.rollout.hf.batcher import ContinuousBatcher
from drivetrain.rollout.tokenized import TokenizedRollout
from drivetrain.rollout.weights import apply_weights, destination
from drivetrain.runtime.devices import resolve_device
from drivetrain.runtime.fingerprint import fingerprint_like
from drivetrain.runtime.request_queue import RequestQueue

#: where transformers runs a model for us: ``auto`` picks CUDA, else the CPU (as it always has)
DEVICES = ("cpu", "cuda", "mps", "xpu")


class HFRollout(TokenizedRollout):
    config: HFRolloutConfig

    def __init__(self, config: HFRolloutConfig) -> None:
        super().__init__(config)
        path = model_dir(config.model_path)
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.device = resolve_device(config.device, setting="rollout.device", kinds=DEVICES)
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        exact = config.numerics == "exact"
        if exact:  # registers the attention it names
            from drivetrain.rollout.hf.exact import NAME as EXACT_ATTENTION
            from drivetrain.rollout.hf.exact import make_rollout_exact
        self.model = AutoModelForCausalLM.from_pretrained(
            path,
            dtype=getattr(torch, config.dtype),
            attn_implementation=EXACT_ATTENTION if exact else config.attn_implementation,
        ).to(self.device)
        self.model.eval().requires_grad_(False)
        if exact:
            make_rollout_exact(self.model, self.device)
        if self.device.type == "cpu":
            _own_parameters(self.model)
        self._index_weights()
        positions = getattr(self.model.config, "max_position_embeddings", None)
        self.max_model_len = min(config.max_model_len, positions or config.max_model_len)
        self.vocab_size = self.model.get_input_embeddings().weight.shape[0]
        self.eos_ids = _eos_ids(self.model, self.tokenizer)
        pad = self.tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else next(iter(sorted(self.eos_ids)), 0)
        self._version = 0
        self._woken: set[str] | None = None  # asleep: the memory tags woken so far
        # seeds of unseeded requests: from the config's seed, moving on request after request
        self._seeds = torch.Generator().manual_seed(config.seed)
        self.batcher = ContinuousBatcher(
            self.model,
            pad_id=self.pad_id,
            eos_ids=frozenset(self.eos_ids),
            share_prefill=config.share_prompt_prefill,
            seed_for=lambda: int(torch.randint(2**62, (1,), generator=self._seeds)),
            decode=self.tokenizer.decode,
            record_routing=_records_routing(self.model, config),
        )
        self.exact = exact
        self.requests = RequestQueue(
            self.batcher.step,
            lambda: self._version,
            capacity=config.max_batch_size,
            reset=self.batcher.reset,
        )

    def validate_request(self, request: Request) -> None:
        super().validate_request(request)
        params = request.params
        if self.exact and not params.greedy and (params.top_k > 0 or params.top_p < 1):
            raise ValueError(
                "numerics=exact samples from the full distribution the trainer computes: "
                f"request {request.request_id!r} sets top_k={params.top_k}, top_p={params.top_p}"
            )

    @property
    def weight_version(self) -> int:
        return self._version

    # ---- weights ------------------------------------------------------------------------
    def update_weights(self, weights: Iterable[NamedTensor], *, version: int) -> None:
        # applied as they arrive, between token steps (see QueuedRollout.updating_weights)
        with self.updating_weights(version) as update:
            apply_weights(weights, self._weights, update)
            self._version = version

    def weight_destination(self, name: str, shape: tuple[int, ...], dtype: str) -> Any:
        return destination(self._weights, self.weight_update, name, shape, dtype)

    def weights_fingerprint(self, expected: Mapping[str, str]) -> Mapping[str, str] | None:
        with self.requests.lock:  # not while an update writes
            return fingerprint_like(self._weights, expected)

    def _index_weights(self) -> None:
        """The name -> tensor table every update writes through, built once (a state_dict()
        per update cost more than copying a small model): the parameters themselves, which
        keep their identity when ``.to()`` moves their memory; the buffers, which do not,
        are looked up again after every move."""
        self._weights = self.model.state_dict(keep_vars=True)

    def trace_ops(
        self, prompt_ids: Sequence[int], token_ids: Sequence[int]
    ) -> Mapping[str, Any] | None:
        from drivetrain.rollout.hf.trace import trace_generation

        with self.requests.lock:  # not while a step or an update runs
            return trace_generation(self.model, prompt_ids, token_ids)

    # ---- memory -------------------------------------------------------------------------
    def sleep(self, level: int = 1) -> bool:
        """On CUDA: abort what runs (its KV cache goes with it) and move the weights to host
        memory, for both levels (a level-2 sleeper may keep its weights; they are re-sent
        anyway). On the CPU nothing would be freed."""
        super().sleep(level)
        if self.device.type != "cuda":
            return False
        with self.requests.lock:  # nothing runs on a sleeping rollout
            self.requests.pause(abort=True)
            self.batcher.reset()
            self.model.to("cpu")
            self._index_weights()
        torch.cuda.empty_cache()
        self._woken = set()
        return True

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """``("weights",)`` brings the weights back (a colocated update then writes into them on
        the device); the KV cache grows again as requests run; requests resume once both are
        awake."""
        super().wake_up(tags)
        if self._woken is None:
            return  # not asleep
        wanted = set(MEMORY_TAGS if tags is None else tags)
        if "weights" in wanted - self._woken:
            with self.requests.lock:
                self.model.to(self.device)
                self._index_weights()
        self._woken |= wanted
        if self._woken >= MEMORY_TAGS:
            self._woken = None
            self.requests.resume()

    def resume_generation(self) -> None:
        if self._woken is None:  # asleep, requests resume once weights and KV cache are awake
            super().resume_generation()

    def shutdown(self) -> None:
        self.model = None  # type: ignore[assignment]
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


def _records_routing(model: torch.nn.Module, config: HFRolloutConfig) -> bool:
    """Whether to record routing: asked for, of a mixture-of-experts model (refused in one line
    for a dense one: there is nothing to replay)."""
    if not config.return_routed_experts:
        return False
    from drivetrain.engine_core.moe_routing import moe_routers

    if not moe_routers(model):
        raise ConfigError(
            f"rollout.return_routed_experts: {type(model).__name__} has no mixture-of-experts "
            "router to record"
        )
    return True


def _own_parameters(model: torch.nn.Module) -> None:
    """Give every parameter memory of its own. On the CPU transformers leaves parameters of
    the file's dtype as views of the memory-mapped safetensors file, so the first weight update
    faulted and copied every page of them (8x slower than later ones: 0.15 s vs 0.018 s for
    SmolLM2-135M, 3.2 s for a 500M model); copying once here, while loading, costs less."""
    with torch.no_grad():
        for param in model.parameters():  # a tied parameter is listed once
            param.data = param.data.clone()


def _eos_ids(model: torch.nn.Module, tokenizer: object) -> set[int]:
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), model.config, tokenizer):
        value = getattr(source, "eos_token_id", None)
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    return ids
