"""Routing replay in the megatron engine (issue 62) on 2 CPU ranks (gloo), a tiny Qwen3-MoE (4
experts, top-2, renormalised, weights far from init so tokens route apart), at EP=2, TP=2 with
sequence parallel, and EP=2 and PP=2 with full activation recompute:

- the experts the engine reports are HF's own routing of the same tokens;
- replaying them changes no log-prob and neither the loss nor the gradient norm;
- a planted wrong expert is used, and moves only its own sample's later log-probs; replaying
  just that token (-1 everywhere else) gives the same numbers;
- replaying a routing far from the model's own (every expert index plus one) gives HF's
  log-probs, loss and gradient norm under the same replay, in every layout: recompute replays
  the same experts in the backward, each pipeline stage replays its own layers;
- the routed experts output under pipeline parallel, an expert index past the last expert, and
  a dense model asked for or given routing, are refused in one line.

One launch serves every check (importing megatron-core costs ~6 s a process).
"""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen3MoeConfig

from drivetrain.engine_core.moe_routing import RoutingRecorder, routing_hooks
from megatron_harness import VOCAB, build_tiny_model
from megatron_launch import launch
from parity_data import training_batch
from test_moe import CASES, SHAPE, _randomise

pytestmark = [pytest.mark.distributed, pytest.mark.slow, pytest.mark.timeout(900)]

EXPERTS, LAYERS, TOP_K = 4, SHAPE["num_hidden_layers"], SHAPE["num_experts_per_tok"]
ROW, POS = 1, 4  # the worker's planted token
LAYOUTS = [
    {"name": "ep2", "overrides": {"expert_parallel": 2}},
    {"name": "tp2", "overrides": {"tensor_parallel": 2, "sequence_parallel": True}},
    {"name": "ep2-recompute", "overrides": {"expert_parallel": 2}, "recompute": True},
    # recompute under 1F1B: a micro-batch's backward comes after the next one's forward
    {"name": "pp2-recompute", "overrides": {"pipeline_parallel": 2}, "recompute": True},
]
REPORTING = ["ep2", "tp2", "ep2-recompute"]  # the layouts that report routed experts
SEQUENCES, MASKS = training_batch()


def _nll_and_log_probs(model, replay=None):
    """HF, one sequence at a time, optionally replaying ``replay`` (the padded column): the
    token-mean NLL over the loss mask (backward run) and each sequence's log-probs aligned
    with its tokens (0 at the first)."""
    nll, log_probs = 0.0, []
    for i, (seq, mask) in enumerate(zip(SEQUENCES, MASKS, strict=True)):
        rows = None if replay is None else replay[i, : len(seq)]
        with routing_hooks(model, replay=rows):
            logits = model(torch.tensor([seq])).logits[0, :-1]
        logp = torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(seq[1:])[:, None])[
            :, 0
        ]
        nll = nll - (logp * torch.tensor(mask[1:], dtype=torch.float32)).sum()
        log_probs.append(torch.cat([torch.zeros(1), logp.detach()]))
    return nll / sum(map(sum, MASKS)), log_probs


def _hf_reference(model_dir):
    """HF's own routing of the training batch (the padded column) and, without and with the
    shifted routing replayed, its loss, gradient norm and log-probs."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    width = max(map(len, SEQUENCES))
    own = torch.full((len(SEQUENCES), width, LAYERS, TOP_K), -1, dtype=torch.int16)
    for i, seq in enumerate(SEQUENCES):
        recorder = RoutingRecorder()
        with torch.no_grad(), routing_hooks(model, record=recorder):
            model(torch.tensor([seq]))
        own[i, : len(seq)] = recorder.take()
    shifted = torch.where(own >= 0, (own + 1) % EXPERTS, own)
    out = {"own": own}
    for name, replay in (("plain", None), ("shifted", shifted)):
        model.zero_grad()
        loss, log_probs = _nll_and_log_probs(model, replay)
        loss.backward()
        norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()]))
        out[name] = {"loss": float(loss), "norm": float(norm), "log_probs": log_probs}
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(each rank's report, HF's reference)."""
    root = tmp_path_factory.mktemp("moe-routing")
    torch.manual_seed(2)
    config = Qwen3MoeConfig(**{**SHAPE, "vocab_size": VOCAB}, **CASES["qwen3_moe"][1])
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _randomise(model)
    model.save_pretrained(root / "moe")
    reference = _hf_reference(root / "moe")
    torch.save(reference["own"], root / "routing.pt")
    build_tiny_model(str(root / "dense"), layers=2)
    ranks = launch("worker_routing.py", root, str(root / "moe"), str(root / "dense"),
                   str(root / "routing.pt"), json.dumps(LAYOUTS), timeout=600)  # fmt: skip
    return ranks, reference


def _reports(ranks, layout):
    """The output ranks' reports of ``layout``; together they cover every sample once."""
    reports = [r[layout] for r in ranks if r[layout] is not None]
    assert sorted(s for r in reports for s in r["samples"]) == list(range(len(SEQUENCES)))
    return reports


@pytest.mark.parametrize("layout", REPORTING)
def test_reported_experts_are_hf_routing(runs, layout):
    ranks, reference = runs
    hf = reference["own"]
    assert len(set(hf[..., 0].flatten().tolist()) - {-1}) == EXPERTS  # tokens do route apart
    for report in _reports(ranks, layout):
        own = report["own"]
        assert own.dtype == torch.int16 and own.shape[2:] == (LAYERS, TOP_K)
        for i, sample in enumerate(report["samples"]):
            n = len(SEQUENCES[sample])
            assert torch.equal(own[i, :n], hf[sample, :n]), f"sample {sample}"
            assert bool((own[i, n:] == -1).all())
        # in forward_backward too (with recompute: the forward's), and the replayed ones after
        assert {k: v["mismatched"] for k, v in report["train"].items()} == dict.fromkeys(
            ("plain", "own", "shifted"), 0
        )


@pytest.mark.parametrize("layout", REPORTING)
def test_replaying_own_routing_changes_nothing(runs, layout):
    ranks, _ = runs
    for report in _reports(ranks, layout):
        assert torch.equal(report["same"], report["base"])
        assert torch.equal(report["same_routed"], report["own"])
        plain, replayed = report["train"]["plain"], report["train"]["own"]
        assert replayed["loss"] == plain["loss"]
        assert replayed["norm"] == pytest.approx(plain["norm"], rel=1e-6)


@pytest.mark.parametrize("layout", REPORTING)
def test_a_planted_expert_moves_only_its_samples_later_log_probs(runs, layout):
    ranks, _ = runs
    for report in _reports(ranks, layout):
        assert torch.equal(report["moved_routed"], report["planted"])
        assert not torch.equal(report["planted"], report["own"])
        n = len(SEQUENCES[report["samples"][ROW]])
        delta = (report["moved"] - report["base"]).abs()
        assert float(delta[ROW, POS + 1 : n].max()) > 1e-4
        assert float(delta[ROW, : POS + 1].max()) == 0
        others = [i for i in range(len(report["samples"])) if i != ROW]
        assert float(delta[others].max()) == 0
        # the planted token alone (-1 elsewhere): the other rows keep the routers' own choice,
        # which the planted expert changes only for its sample's later tokens
        sparse = report["sparse_routed"]
        assert torch.equal(sparse[ROW, POS], report["planted"][ROW, POS])
        changed = (sparse != report["own"]).any(-1).any(-1).nonzero().tolist()
        assert [ROW, POS] in changed and all(r == ROW and p >= POS for r, p in changed)
        assert torch.equal(report["sparse_again"], report["sparse"])


@pytest.mark.parametrize("layout", [layout["name"] for layout in LAYOUTS])
def test_a_far_routing_replayed_gives_hf_numbers_under_the_same_replay(runs, layout):
    ranks, reference = runs
    hf = reference["shifted"]
    for report in _reports(ranks, layout):
        for i, sample in enumerate(report["samples"]):
            n = len(SEQUENCES[sample])
            diff = (report["shifted"][i, :n] - hf["log_probs"][sample]).abs().max()
            assert float(diff) < 1e-5, f"sample {sample}: {float(diff):.2e}"
        train = report["train"]
        print(f"{layout}: megatron {train}\n hf plain/shifted loss {reference['plain']['loss']}"
              f" {hf['loss']}, norm {reference['plain']['norm']} {hf['norm']}")  # fmt: skip
        # far indeed (the loss of this near-random model hardly depends on its experts)
        assert abs(hf["loss"] - reference["plain"]["loss"]) > 1e-3
        assert abs(hf["norm"] / reference["plain"]["norm"] - 1) > 1e-2
        assert train["shifted"]["loss"] == pytest.approx(hf["loss"], abs=1e-5)
        assert train["shifted"]["norm"] == pytest.approx(hf["norm"], rel=1e-4)
        assert train["plain"]["loss"] == pytest.approx(reference["plain"]["loss"], abs=1e-5)
        assert train["plain"]["norm"] == pytest.approx(reference["plain"]["norm"], rel=1e-4)


def test_what_cannot_be_replayed_is_refused_in_one_line(runs):
    ranks, _ = runs
    (piped,) = [r["pp2-recompute"] for r in ranks if r["pp2-recompute"] is not None]
    assert piped["refused"] == (
        "ConfigError: routed_experts output under pipeline parallel is not supported yet"
    )
    for layout in LAYOUTS:
        for report in _reports(ranks, layout["name"]):
            assert report["out_of_range"] == (
                "ConfigError: routed_experts rows must hold 2 experts in [0, 4) or start with -1 "
                "(not recorded)"
            )
    for asked, given in (rank["dense"] for rank in ranks):
        for refused in (asked, given):
            assert refused == (
                "ConfigError: routed_experts (routing replay) needs a mixture-of-experts model; "
                "this one has no router"
            )
