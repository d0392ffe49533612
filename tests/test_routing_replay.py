"""Routing replay on mixture-of-experts models (issue 62), hf rollout -> fsdp2 engine, on a
tiny Qwen3-MoE / Qwen2-MoE / Mixtral (4 experts, top-2, weights drawn far from init so tokens
route apart):

- the hf rollout's recorded routing equals the routing of a plain forward of the same tokens;
- the fsdp2 engine's experts run exactly the replayed experts (seen at the experts' own input),
  replaying the engine's own routing changes nothing, a planted wrong expert changes the loss;
- routing crosses the rollout server's wire and a resumed request's positions join;
- the rollout kit's opt-in ``routed_experts`` check passes the hf rollout and fails one that
  records a wrong expert;
- ``drivetrain grpo`` with ``algorithm.routing_replay=rollout`` (the rollout in its server
  process) / ``old_policy`` / ``off`` (recording only) reports its router metrics, 0 mismatch
  where it replays the rollout's; an engine without the capability is refused in one line.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from drivetrain.api import ModelConfig, OptimConfig, OutputSpec, Prompt, SamplingParams
from drivetrain.api.columns import LOG_PROBS, ROUTED_EXPERTS, SHARED_PREFIX_LEN
from drivetrain.api.config import MicroBatchConfig
from drivetrain.api.errors import ConfigError
from drivetrain.api.registry import engines, rollouts
from drivetrain.api.requests import Chunk, Request
from drivetrain.api.rollout import FinishReason, Rollout
from drivetrain.api.routing import RoutedExperts
from drivetrain.engine_core.moe_routing import RoutingRecorder, routing_hooks
from drivetrain.rollout.config import HFRolloutConfig
from drivetrain.rollout.process.messages import decode, encode
from drivetrain.runtime.collector import Collector
from drivetrain.runtime.request_queue import RequestQueue, TokenEvent
from drivetrain.testing import token_mean_nll
from drivetrain.testing.kit_runner import KitCheckResult, run_checks
from drivetrain.testing.rollout_kit_routing import check_routed_experts
from drivetrain.trainer.builtin.char_tokenizer import build_char_tokenizer
from drivetrain.trainer.builtin.tiny_model import build_moe_model
from drivetrain.trainer.rl.batch_ops import completions_batch
from drivetrain.trainer.rl.routing import ROLLOUT_ROUTED_EXPERTS
from rollout_support import TransformersRolloutHarness

pytestmark = pytest.mark.timeout(300)

ROOT = Path(__file__).resolve().parents[1]
FAMILIES = ["qwen3_moe", "qwen2_moe", "mixtral"]
SHAPE = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256)  # fmt: skip


def build(path: Path, family: str) -> Path:
    build_char_tokenizer(path)
    build_moe_model(path, tokenizer_dir=path, family=family, **SHAPE)
    model = AutoModelForCausalLM.from_pretrained(path)
    torch.manual_seed(1)
    with torch.no_grad():  # far from init: tokens route apart
        for param in model.parameters():
            param.normal_(0, 0.3) if param.dim() > 1 else param.uniform_(0.5, 1.5)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("moe")
    return {family: build(root / family, family) for family in FAMILIES}


def hf(model_dir: Path, **overrides):
    config = HFRolloutConfig(model_path=str(model_dir), max_model_len=256, **overrides)
    return rollouts.load("hf")(config)


def fsdp2(model_dir: Path, **model: object):
    config_cls = engines.load_config_class("fsdp2", object)
    engine = engines.load("fsdp2")(
        config_cls(
            model=ModelConfig(path=str(model_dir), **model),
            optim=OptimConfig(lr=1e-2, weight_decay=0.0, clip_grad=None),
            micro_batch=MicroBatchConfig(max_tokens=128),  # several samples: shared prompts
            device="cpu",
        )
    )
    engine.initialize()
    return engine


PROMPTS = [Prompt(token_ids=tuple(range(5, 5 + n))) for n in (3, 7, 12, 5)]
SAMPLED = SamplingParams(n=3, temperature=1.0, max_new_tokens=12, seed=1)


def forward_routing(model, ids: list[int]) -> torch.Tensor:
    recorder = RoutingRecorder()
    with torch.no_grad(), routing_hooks(model, record=recorder):
        model(torch.tensor([ids]))
    return recorder.take()


@pytest.mark.parametrize("family", FAMILIES)
def test_hf_records_the_routing_of_a_forward_of_the_same_tokens(models, family):
    completions = hf(models[family], return_routed_experts=True).generate(PROMPTS, SAMPLED)
    model = AutoModelForCausalLM.from_pretrained(models[family]).eval()
    differ = total = 0
    for c in completions:
        ids = [*c.prompt_ids, *c.token_ids]
        routed = c.routed_experts
        assert routed is not None and (routed.start, routed.positions) == (0, len(ids) - 1)
        assert (routed.layers, routed.top_k) == (2, 2)
        own = forward_routing(model, ids[:-1])
        got = torch.tensor(routed.indices()).reshape(own.shape)
        differ += int((own.sort(-1).values != got.sort(-1).values).any(-1).sum())
        total += own.shape[0] * own.shape[1]
        assert len(set(got[:, 0].flatten().tolist())) > 1  # tokens do route apart
    assert total > 300 and differ == 0, f"{differ} of {total} (token, layer) routings differ"


def test_a_rollout_not_asked_records_nothing_and_a_dense_model_is_refused(models, tmp_path):
    assert all(c.routed_experts is None for c in hf(models["qwen3_moe"]).generate(PROMPTS, SAMPLED))
    from drivetrain.trainer.builtin.tiny_model import build_tiny_chat_model

    dense = build_tiny_chat_model(tmp_path / "dense")
    with pytest.raises(ConfigError, match="has no mixture-of-experts router to record"):
        hf(dense, return_routed_experts=True)


class ExpertInputs:
    """The expert indices each experts module actually ran (its forward's own argument)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.seen: list[torch.Tensor] = []
        self.handles = [
            m.register_forward_pre_hook(lambda _, args: self.seen.append(args[1].clone()))
            for m in model.modules()
            if type(m).__name__.endswith("Experts")
        ]

    def close(self, layers: int) -> torch.Tensor:
        """``[rows, layers, top_k]``: every forward's rows (calls go layer after layer)."""
        for handle in self.handles:
            handle.remove()
        return torch.stack([torch.cat(self.seen[i::layers]) for i in range(layers)], 1)


def as_multiset(routing: torch.Tensor) -> list[tuple[int, ...]]:
    """Rows ``[layers, top_k]`` (each layer's picks as a set), in sorted order: micro-batches
    may take samples in any order."""
    picks = routing.sort(-1).values.flatten(1)
    return sorted(tuple(row) for row in picks.tolist())


@pytest.mark.parametrize("family", FAMILIES)
def test_fsdp2_runs_exactly_the_replayed_experts(models, family):
    completions = hf(models[family], return_routed_experts=True).generate(PROMPTS, SAMPLED)
    batch = completions_batch(completions, pad_token_id=0)
    assert batch[ROLLOUT_ROUTED_EXPERTS].dtype == torch.int16
    engine = fsdp2(models[family])
    # without prefix sharing, the experts see one row per token
    plain = batch.drop(ROLLOUT_ROUTED_EXPERTS, SHARED_PREFIX_LEN)
    with engine.eval_mode():
        own = engine.infer(plain, OutputSpec(routed_experts=True))
        base = engine.infer(plain, OutputSpec())[LOG_PROBS]
        # the engine's own routing replayed: the same numbers
        same = engine.infer(plain.with_columns(routed_experts=own[ROUTED_EXPERTS]), OutputSpec())
        assert torch.equal(same[LOG_PROBS], base)
        # a planted wrong expert: the experts run it, and the log-probs after it move
        planted = own[ROUTED_EXPERTS].clone()
        row, pos = 1, 4
        picks = planted[row, pos, 0].tolist()
        planted[row, pos, 0, 0] = next(e for e in range(4) if e not in picks)  # a new one
        seen = ExpertInputs(engine.model)
        moved = engine.infer(
            plain.with_columns(routed_experts=planted), OutputSpec(routed_experts=True)
        )
        ran = seen.close(layers=2)
    # the engine reports the experts it used: the planted ones
    assert torch.equal(moved[ROUTED_EXPERTS], planted)
    real = torch.cat([planted[i, :n] for i, n in enumerate(batch.seq_lens)])
    assert as_multiset(ran) == as_multiset(real)
    delta = (moved[LOG_PROBS] - base).abs()
    assert float(delta[row, pos + 1 :].max()) > 1e-4 and float(delta[row, : pos + 1].max()) == 0
    assert float(delta[[0, 2, 3]].max()) == 0


def test_fsdp2_replays_through_shared_prompts(models):
    """GRPO's samples of a prompt share it in the packed row (one copy, the first sample's
    routing): every token still uses the rollout's experts, and replaying them gives the
    log-probs of the rows without sharing."""
    completions = hf(models["qwen3_moe"], return_routed_experts=True).generate(PROMPTS, SAMPLED)
    batch = completions_batch(completions, pad_token_id=0)
    rollout = batch[ROLLOUT_ROUTED_EXPERTS]
    shared = batch.drop(ROLLOUT_ROUTED_EXPERTS).with_columns(routed_experts=rollout)
    engine = fsdp2(models["qwen3_moe"])
    with engine.eval_mode():
        out = engine.infer(shared, OutputSpec(routed_experts=True))
        alone = engine.infer(shared.drop(SHARED_PREFIX_LEN), OutputSpec())
    recorded = (rollout >= 0).all(-1).all(-1)
    assert int(recorded.sum()) > 200
    assert torch.equal(out[ROUTED_EXPERTS][recorded], rollout[recorded])
    assert torch.allclose(out[LOG_PROBS], alone[LOG_PROBS], atol=1e-5)


def test_fsdp2_replays_through_activation_checkpointing(models):
    """The backward recomputes the routers under activation checkpointing: they pick the
    replayed experts again, so loss and gradients are those of a run without it."""
    completions = hf(models["qwen3_moe"], return_routed_experts=True).generate(PROMPTS, SAMPLED)
    batch = completions_batch(completions, pad_token_id=0)
    rollout = batch[ROLLOUT_ROUTED_EXPERTS]
    far = torch.where(rollout >= 0, (rollout + 1) % 4, rollout)  # far from its own choice
    replayed = batch.drop(ROLLOUT_ROUTED_EXPERTS).with_columns(routed_experts=far)
    results = []
    for checkpointing in (False, True):
        engine = fsdp2(models["qwen3_moe"], gradient_checkpointing=checkpointing)
        with engine.train_mode():
            engine.optimizer_zero_grad()
            loss = engine.forward_backward(replayed, token_mean_nll).loss
            results.append((loss, engine.optimizer_step()))
        engine.close()
    (loss, norm), (again, again_norm) = results
    assert again == pytest.approx(loss, rel=1e-6) and again_norm == pytest.approx(norm, rel=1e-5)


def test_a_finishing_event_may_carry_the_routing_alone():
    """vLLM and SGLang give a request's routing with its end, which may come without tokens."""
    routed = RoutedExperts.from_indices(0, 2, 2, [1, 2, 3, 0] * 3)
    events = iter([
        [TokenEvent("r", [7], [-0.1])],
        [TokenEvent("r", [8], [-0.2])],
        [TokenEvent("r", [], [], FinishReason.LENGTH, routed)],
    ])  # fmt: skip
    queue = RequestQueue(lambda joining, aborted: next(events), lambda: 0, capacity=1)
    queue.submit([Request("r", (1, 2), SamplingParams(max_new_tokens=2))], lambda r: None)
    collector = Collector()
    collector.track(Request("r", (1, 2), SamplingParams(max_new_tokens=2)))
    for _ in range(3):  # one event a poll
        collector.add(queue.poll())
    assert collector.done and collector.completion("r").routed_experts == routed


def test_routing_crosses_the_wire_and_a_resumed_request_joins_its_positions():
    first = RoutedExperts.from_indices(0, 2, 2, list(range(12)))  # positions 0-2
    chunk = Chunk("r", (7, 8), (-0.1, -0.2), 0, None, first)
    assert decode(encode(chunk)) == chunk
    collector = Collector()
    collector.track(Request("r", (1, 2), SamplingParams(max_new_tokens=6)))
    collector.add([Chunk("r", (7, 8), (-0.1, -0.2), 0, FinishReason.ABORT, first)])
    again = collector.resume("r", "r2")
    assert again.prompt_ids == (1, 2, 7, 8)
    # the continuation prefills positions 0-3 again, under new weights: the first three
    # positions keep the routing their tokens were sampled under
    later = RoutedExperts.from_indices(0, 2, 2, [9] * 16)
    collector.add([Chunk("r2", (5,), (-0.3,), 1, FinishReason.STOP, later)])
    routed = collector.completion("r").routed_experts
    assert routed is not None and routed.positions == 4
    assert list(routed.indices()) == [*range(12), 9, 9, 9, 9]


def grpo(model_dir: Path, data: Path, out: Path, *options: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "drivetrain.trainer", "grpo", f"actor.model.path={model_dir}",
           f"data.train_path={data}", f"run.output_dir={out}", "run.steps=2",
           "run.prompts_per_step=4", "run.save_every=0", "sampling.max_new_tokens=6",
           *options]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env, cwd=ROOT)


@pytest.fixture(scope="module")
def rl_data(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "rl.jsonl"
    rows = [
        {"messages": [{"role": "user", "content": f"What is {a:02d}+{b:02d}?"},
                      {"role": "assistant", "content": str(a + b)}]}
        for a in range(4) for b in range(4)
    ]  # fmt: skip
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.parametrize(
    ("mode", "options"),
    [
        ("rollout", (f"rollout.python={sys.executable}",)),  # over the server's wire
        # the rollout's routing is not needed, only asked for the metrics
        ("old_policy", ("algorithm.ppo_epochs=2", "rollout.return_routed_experts=true")),
        # a bf16 rollout of the fp32 trainer routes some tokens elsewhere (provenance compares
        # fingerprints in the trainer's dtype)
        (
            "off",
            (
                "rollout.return_routed_experts=true",
                "rollout.dtype=bfloat16",
                "weight_sync.provenance=false",
            ),
        ),
    ],
)
def test_grpo_with_routing_replay_reports_router_metrics(models, rl_data, tmp_path, mode, options):
    done = grpo(models["qwen3_moe"], rl_data, tmp_path / "run",
                f"algorithm.routing_replay={mode}", *options)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    steps = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    assert len(steps) == 2
    shares = [step["routing/mismatch_share"] for step in steps]
    for step in steps:
        assert {"routing/mismatch_share_layer_00", "routing/mismatch_share_layer_01"} <= set(step)
        assert step["routing/expert_load_max_over_mean"] >= 1
    if mode == "rollout":  # the update's experts are the rollout's
        assert shares == [0.0, 0.0]
    if mode == "off":  # nothing replayed: the trainer's routers disagree on some tokens
        assert sum(shares) > 0 and max(shares) < 0.2, shares  # (0.5% and 2.1% here)


@pytest.mark.parametrize(
    ("options", "said"),
    [
        (("algorithm.routing_replay=rollout", "--engine", "fsdp"),
         ("routing_replay", "fsdp")),
        (("algorithm.routing_replay=old_policy",), ("one update per step",)),
    ],
)  # fmt: skip
def test_routing_replay_is_refused_where_it_cannot_work(models, rl_data, tmp_path, options, said):
    done = grpo(models["qwen3_moe"], rl_data, tmp_path / "run", *options)
    assert done.returncode != 0
    last = done.stderr.strip().splitlines()[-1]
    assert all(word in last for word in said), done.stderr[-2000:]


class RoutingHarness(TransformersRolloutHarness):
    """Opts the hf rollout of a MoE model in to the kit's ``routed_experts`` check."""

    def __init__(self, model_dir: Path, wrap=lambda rollout: rollout) -> None:
        super().__init__(model_dir, lambda: hf(model_dir))
        self.model_dir, self.wrap = model_dir, wrap

    def changed_weights(self):
        # by the model's own names: transformers 5 fuses the experts the file holds one by one
        return [(n, p.detach().clone()) for n, p in self.models[True].named_parameters()]

    def routing_rollout(self):
        return self.wrap(hf(self.model_dir, return_routed_experts=True))

    def forward_routing(self, ids, changed):
        return forward_routing(self.models[changed], list(ids)).tolist()


class ShiftedRouting(Rollout):
    """A rollout recording the wrong experts: one expert index off at one position."""

    def __init__(self, inner: Rollout) -> None:
        self.inner = inner

    def submit(self, requests):
        self.inner.submit(requests)

    def poll(self, timeout_s=0.0):
        return [self._shift(chunk) for chunk in self.inner.poll(timeout_s)]

    def _shift(self, chunk: Chunk) -> Chunk:
        routed = chunk.routed_experts
        if routed is None or routed.start != 0:  # the prompt's positions: shift the first
            return chunk
        values = routed.indices()
        values[0] = (values[0] + 1) % 4
        shifted = RoutedExperts.from_indices(0, routed.layers, routed.top_k, values)
        return dataclasses.replace(chunk, routed_experts=shifted)

    def abort(self, request_ids=None):
        return self.inner.abort(request_ids)

    def generate(self, prompts, params):
        raise NotImplementedError

    def update_weights(self, weights, *, version):
        self.inner.update_weights(weights, version=version)

    @property
    def weight_version(self):
        return self.inner.weight_version

    def shutdown(self):
        self.inner.shutdown()


def test_the_rollout_kit_check_passes_hf_and_fails_wrong_experts(models):
    assert run_checks({"routed_experts": check_routed_experts}, RoutingHarness(models["mixtral"]))[
        0
    ] == KitCheckResult("routed_experts", None)
    failed = run_checks(
        {"routed_experts": check_routed_experts}, RoutingHarness(models["mixtral"], ShiftedRouting)
    )[0]
    assert "the rollout recorded experts" in failed.error and "position 0, layer 0" in failed.error


@pytest.mark.slow
@pytest.mark.serial  # Ray: two megatron ranks and a rollout replica
@pytest.mark.timeout(600)
def test_grpo_on_megatron_at_ep2_replays_the_rollouts_routing(models, rl_data, tmp_path):
    done = grpo(models["qwen3_moe"], rl_data, tmp_path / "run", "--engine", "megatron",
                "algorithm.routing_replay=rollout", "actor.expert_parallel=2",
                "workers.num=2")  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "roles actor=megatron" in done.stderr
    steps = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    assert [step["routing/mismatch_share"] for step in steps] == [0.0, 0.0]
    assert all(step["actor/rollout_log_prob_diff_max"] < 1e-4 for step in steps)
