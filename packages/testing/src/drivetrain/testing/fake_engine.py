"""A pure-Python training engine that honours the whole engine contract.

It trains the bigram model of :mod:`fake_model` with real gradients (see :mod:`autodiff`),
AdamW, gradient clipping, the shared LR schedule, optional dropout on the logits (its RNG
checkpointed), fixed-size and token-budget micro-batching with order restoration, padded and
packed layouts, atomic checkpoints and streamed export.
Use it to test orchestration (trainer, controller, Ray workers) without torch, and as the
reference the conformance kit is proven against. Single process: its data-parallel world is 1.
Columns are nested Python lists (``input_ids`` and ``loss_mask`` as ``[n][T]`` padded rows, or
flat lists when packed).
"""

from __future__ import annotations

import copy
import itertools
import json
import math
import os
import random
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from drivetrain.api.batch import Batch, Layout
from drivetrain.api.columns import ENTROPY, INPUT_IDS, LOG_PROBS, LOSS_MASK
from drivetrain.api.config import EngineConfig, coerce_config
from drivetrain.api.engine import CheckpointInfo, NamedTensor, ParallelInfo, StepResult
from drivetrain.api.errors import EngineStateError
from drivetrain.api.loss import LossContext, LossFn, OutputSpec, merge_metrics
from drivetrain.api.partition import inverse_permutation
from drivetrain.runtime.atomic_dir import publish, staging_path
from drivetrain.runtime.modes import ModalEngine
from drivetrain.runtime.schedule import lr_multiplier
from drivetrain.testing import fake_model
from drivetrain.testing.autodiff import Array, Scalar, lift, logsumexp


@dataclass(frozen=True)
class FakeEngineConfig(EngineConfig):
    vocab_size: int = 16
    init_scale: float = 0.5
    #: Dropout on the logits while training: makes steps draw from the engine's RNG.
    dropout: float = 0.0


def _rows(batch: Batch, name: str) -> list[list[Any]]:
    """A token column as one list per sample, without padding, in either layout."""
    value = batch[name]
    if batch.layout is Layout.PACKED:
        offsets = batch.offsets
        return [list(value[a:b]) for a, b in itertools.pairwise(offsets)]
    return [list(row[:n]) for row, n in zip(value, batch.seq_lens, strict=True)]


def _layout_like(batch: Batch, rows: list[list[Any]], pad: Any) -> list[Any]:
    """Per-sample rows back into ``batch``'s layout (flat when packed, padded otherwise)."""
    if batch.layout is Layout.PACKED:
        return [x for row in rows for x in row]
    width = max(batch.seq_lens, default=0)
    if INPUT_IDS in batch:
        width = max(width, max((len(r) for r in batch[INPUT_IDS]), default=0))
    return [row + [pad] * (width - len(row)) for row in rows]


class FakeEngine(ModalEngine):
    config: FakeEngineConfig

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(coerce_config(config, FakeEngineConfig))
        self._ready = False

    # ---- life cycle ---------------------------------------------------------------------
    def initialize(self) -> None:
        cfg = self.config
        self.params = fake_model.init_weights(cfg.vocab_size, cfg.seed, cfg.init_scale)
        self.grads = self._zeros()
        self.exp_avg = self._zeros()
        self.exp_avg_sq = self._zeros()
        self.optim_steps = 0
        self.sched_steps = 0
        self.rng = random.Random(cfg.seed)
        self._ready = True

    def _zeros(self) -> dict[str, Any]:
        v = self.config.vocab_size
        return {fake_model.WEIGHT: [[0.0] * v for _ in range(v)], fake_model.BIAS: [0.0] * v}

    @property
    def parallel(self) -> ParallelInfo:
        return ParallelInfo()

    # ---- modes --------------------------------------------------------------------------
    def _initialized(self) -> bool:
        return self._ready

    def _place(self, mode: str | None) -> None:
        if mode is None:  # idle: offload as configured
            offload = self.config.offload
            self.to("cpu", model=offload.params, optimizer=offload.optimizer)
        else:
            self.to("device", model=True, optimizer=mode == "train")

    # ---- compute ------------------------------------------------------------------------
    def _micro_batches(self, batch: Batch) -> list[list[int]]:
        spec = self.config.micro_batch
        if spec.max_tokens is not None:
            return batch.token_budget_parts(spec.max_tokens)
        return batch.fixed_size_parts(spec.micro_batch_size or 1)

    def _dropout(self, logits: list[Any]) -> list[Any]:
        keep = 1.0 - self.config.dropout
        return [x * (1.0 / keep if self.rng.random() < keep else 0.0) for x in logits]

    def _forward(
        self, batch: Batch, spec: OutputSpec, weights: dict[str, Any], *, train: bool = False
    ) -> dict[str, Any]:
        """Per-token outputs as autodiff arrays laid out like ``batch[INPUT_IDS]``."""
        if spec.values:
            raise EngineStateError("the fake engine has no value head")
        rows: dict[str, list[list[Any]]] = {name: [] for name in spec.names}
        for tokens in _rows(batch, INPUT_IDS):
            log_probs: list[Any] = [Scalar(0.0)] * min(1, len(tokens))
            entropy: list[Any] = list(log_probs)
            for prev, token in itertools.pairwise(tokens):
                logits = fake_model.next_token_logits(weights, prev)
                if train and self.config.dropout:
                    logits = self._dropout(logits)
                scaled = [lift(x) / spec.temperature for x in logits]
                norm = logsumexp(scaled)
                log_probs.append(scaled[token] - norm)
                if spec.entropy:
                    logp = [x - norm for x in scaled]
                    entropy.append(-sum((lp.exp() * lp for lp in logp), Scalar(0.0)))
            for name, row in ((LOG_PROBS, log_probs), (ENTROPY, entropy)):
                if name in rows:
                    rows[name].append(row)
        return {
            name: Array.from_nested(_layout_like(batch, value, Scalar(0.0)))
            for name, value in rows.items()
        }

    def _leaves(self) -> dict[str, Any]:
        return {
            fake_model.WEIGHT: [[Scalar(x) for x in row] for row in self.params[fake_model.WEIGHT]],
            fake_model.BIAS: [Scalar(x) for x in self.params[fake_model.BIAS]],
        }

    def forward_backward(
        self, batch: Batch, loss_fn: LossFn, *, outputs: OutputSpec | None = None
    ) -> StepResult:
        self._require("train", "forward_backward")
        spec = outputs or OutputSpec()
        masks = _rows(batch, LOSS_MASK)
        global_tokens = int(sum(sum(row) for row in masks))
        parts = self._micro_batches(batch)
        total, metrics = 0.0, {}
        for k, indices in enumerate(parts):
            micro = batch.select(indices)
            ctx = LossContext(global_tokens, len(batch), 1, k, len(parts))
            leaves = self._leaves()
            loss, mb_metrics = loss_fn(self._forward(micro, spec, leaves, train=True), micro, ctx)
            loss = lift(loss)
            loss.backward()
            self._accumulate(leaves)
            total += loss.value
            merge_metrics(metrics, mb_metrics)
        return StepResult(total, metrics, len(parts), global_tokens)

    def _accumulate(self, leaves: dict[str, Any]) -> None:
        for i, row in enumerate(leaves[fake_model.WEIGHT]):
            grad_row = self.grads[fake_model.WEIGHT][i]
            for j, leaf in enumerate(row):
                grad_row[j] += leaf.grad
        for j, leaf in enumerate(leaves[fake_model.BIAS]):
            self.grads[fake_model.BIAS][j] += leaf.grad

    def infer(self, batch: Batch, outputs: OutputSpec) -> Batch | None:
        self._require("eval", "infer")
        parts = self._micro_batches(batch)
        if not parts:
            return (
                batch.slice(0, 0)
                .with_columns(token_keys=outputs.names, **{name: [] for name in outputs.names})
                .drop(*batch.columns)
            )
        pieces = []
        for indices in parts:
            micro = batch.select(indices)
            computed = {
                k: v.tolist() for k, v in self._forward(micro, outputs, self.params).items()
            }
            pieces.append(micro.with_columns(token_keys=computed, **computed))
        joined = Batch.concat(pieces)
        # micro-batches may have regrouped the samples: put them back in the caller's order
        restored = joined.select(inverse_permutation([i for part in parts for i in part]))
        return restored.drop(*[c for c in restored.columns if c not in outputs.names])

    # ---- optimizer ----------------------------------------------------------------------
    def _flat(self, tree: dict[str, Any]) -> list[float]:
        return [x for row in tree[fake_model.WEIGHT] for x in row] + list(tree[fake_model.BIAS])

    def optimizer_zero_grad(self) -> None:
        self._require("train", "optimizer_zero_grad")
        self.grads = self._zeros()

    def optimizer_step(self) -> float:
        self._require("train", "optimizer_step")
        optim = self.config.optim
        norm = math.sqrt(sum(g * g for g in self._flat(self.grads)))
        if not math.isfinite(norm):
            return norm
        scale = 1.0
        if optim.clip_grad is not None and norm > optim.clip_grad:
            scale = optim.clip_grad / (norm + 1e-6)
        self.optim_steps += 1
        lr = optim.lr * lr_multiplier(self.sched_steps, optim)
        b1, b2 = optim.betas
        fix1, fix2 = 1 - b1**self.optim_steps, 1 - b2**self.optim_steps

        def update(p: float, g: float, m: float, v: float) -> tuple[float, float, float]:
            g *= scale
            m = b1 * m + (1 - b1) * g
            v = b2 * v + (1 - b2) * g * g
            p *= 1 - lr * optim.weight_decay
            p -= lr * (m / fix1) / (math.sqrt(v / fix2) + optim.eps)
            return p, m, v

        w, b = fake_model.WEIGHT, fake_model.BIAS
        for i in range(self.config.vocab_size):
            for j in range(self.config.vocab_size):
                new = update(
                    self.params[w][i][j],
                    self.grads[w][i][j],
                    self.exp_avg[w][i][j],
                    self.exp_avg_sq[w][i][j],
                )
                self.params[w][i][j], self.exp_avg[w][i][j], self.exp_avg_sq[w][i][j] = new
            new = update(
                self.params[b][i], self.grads[b][i], self.exp_avg[b][i], self.exp_avg_sq[b][i]
            )
            self.params[b][i], self.exp_avg[b][i], self.exp_avg_sq[b][i] = new
        return norm

    def lr_scheduler_step(self) -> float:
        self._require("train", "lr_scheduler_step")
        self.sched_steps += 1
        return self.config.optim.lr * lr_multiplier(self.sched_steps, self.config.optim)

    # ---- placement ----------------------------------------------------------------------
    def to(self, device: str, *, model: bool = True, optimizer: bool = True) -> None:
        if device not in ("cpu", "device"):  # the contract's two places
            raise ValueError(f"the fake engine knows devices 'cpu' and 'device', not {device!r}")
        # pure-Python state lives in host memory either way: nothing to move

    # ---- weights and checkpoints --------------------------------------------------------
    def export_weights(self, *, adapter_only: bool = False) -> Iterator[NamedTensor]:
        if adapter_only:
            raise EngineStateError("the fake engine has no adapter")
        for name in (fake_model.WEIGHT, fake_model.BIAS):
            yield name, copy.deepcopy(self.params[name])

    def _state(self, step: int) -> dict[str, Any]:
        return {
            "step": step,
            "params": self.params,
            "exp_avg": self.exp_avg,
            "exp_avg_sq": self.exp_avg_sq,
            "optim_steps": self.optim_steps,
            "sched_steps": self.sched_steps,
            "rng": self.rng.getstate(),
        }

    def save_checkpoint(self, path: str, *, step: int) -> CheckpointInfo:
        target = Path(path).absolute()
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = staging_path(target)
        staging.mkdir()
        try:
            with open(staging / "state.json", "w") as f:
                json.dump(self._state(step), f)
                f.flush()
                os.fsync(f.fileno())
            publish(staging, target)  # the checkpoint appears whole, or not at all
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        return CheckpointInfo(str(target), step)

    def load_checkpoint(self, path: str) -> CheckpointInfo:
        if not self._ready:
            raise EngineStateError("call initialize() before load_checkpoint()")
        with open(os.path.join(path, "state.json")) as f:
            state = json.load(f)
        self.params = state["params"]
        self.exp_avg = state["exp_avg"]
        self.exp_avg_sq = state["exp_avg_sq"]
        self.optim_steps = state["optim_steps"]
        self.sched_steps = state["sched_steps"]
        version, internal, gauss = state["rng"]  # JSON turned the state's tuples into lists
        self.rng.setstate((version, tuple(internal), gauss))
        self.grads = self._zeros()
        return CheckpointInfo(os.path.abspath(path), state["step"])
