"""LoRA (adapters only train; merged and adapter-only exports; reference via disable_adapter),
value heads, packed-vs-plain-HF outputs and clear errors. In-process, world size 1."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from drivetrain.api import ConfigError, EngineStateError, MicroBatchConfig, OutputSpec
from drivetrain.testing import token_mean_nll
from drivetrain.testing.torch_engines.kit_harness import padded_batch
from fsdp_harness import FSDPHarness, build_tiny_model, single_thread
from test_parity import make_data


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    single_thread()
    return build_tiny_model(str(tmp_path_factory.mktemp("tiny") / "model"))


@pytest.fixture(scope="module")
def batch():
    data = make_data()
    return padded_batch(data["sequences"], data["masks"])


def train_steps(engine, batch, steps=2):
    for _ in range(steps):
        with engine.train_mode():
            engine.optimizer_zero_grad()
            engine.forward_backward(batch, token_mean_nll)
            engine.optimizer_step()
            engine.lr_scheduler_step()


def log_probs(engine, batch):
    with engine.eval_mode():
        return engine.infer(batch, OutputSpec(log_probs=True))["log_probs"]


LORA = {"model": {"lora": {"rank": 4, "alpha": 8, "target_modules": ("q_proj", "v_proj")}}}


def test_lora_trains_only_adapters_and_exports(model_dir, batch):
    engine = FSDPHarness(model_dir, overrides=LORA).make_engine(
        MicroBatchConfig(micro_batch_size=4)
    )
    trainable = {n for n, p in engine._inner.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    before = {n: p.detach().clone() for n, p in engine._inner.named_parameters()}
    train_steps(engine, batch)
    after = dict(engine._inner.named_parameters())
    changed = {n for n in before if not torch.equal(before[n], after[n].detach())}
    assert changed and changed <= trainable, f"non-adapter weights changed: {changed - trainable}"

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    merged = dict(engine.export_weights())
    assert set(merged) == {n for n, _ in base.named_parameters()}
    assert torch.equal(
        merged["model.layers.0.mlp.up_proj.weight"], base.model.layers[0].mlp.up_proj.weight
    )
    assert not torch.equal(
        merged["model.layers.0.self_attn.q_proj.weight"],
        base.model.layers[0].self_attn.q_proj.weight,
    )

    adapters = dict(engine.export_weights(adapter_only=True))
    assert adapters and all(n.startswith("base_model.model.") and ".lora_" in n for n in adapters)
    assert len(adapters) == 2 * 2 * 2  # 2 layers x (q, v) x (A, B)
    assert engine.adapter_config()["r"] == 4

    # merged weights in a plain HF model reproduce the LoRA model's outputs
    base.load_state_dict(merged, strict=False)
    seq = torch.tensor(make_data()["sequences"][0])[None]
    with torch.no_grad():
        ref = (
            torch.log_softmax(base(input_ids=seq).logits[0, :-1], -1)
            .gather(-1, seq[0, 1:, None])
            .squeeze(-1)
        )
    got = log_probs(engine, batch)[0, 1 : seq.shape[1]]
    assert (got - ref).abs().max().item() < 1e-5


def test_disable_adapter_gives_the_reference_model(model_dir, batch):
    lora_engine = FSDPHarness(model_dir, overrides=LORA).make_engine(
        MicroBatchConfig(micro_batch_size=4)
    )
    reference = FSDPHarness(model_dir).make_engine(MicroBatchConfig(micro_batch_size=4))
    train_steps(lora_engine, batch)
    with lora_engine.disable_adapter():
        ref_from_lora = log_probs(lora_engine, batch)
    assert torch.allclose(ref_from_lora, log_probs(reference, batch), atol=1e-6)
    assert not torch.allclose(log_probs(lora_engine, batch), ref_from_lora, atol=1e-4)
    with pytest.raises(EngineStateError, match="no LoRA adapter"):
        reference.disable_adapter()


def test_packed_outputs_equal_plain_hf_per_sequence(model_dir, batch):
    engine = FSDPHarness(model_dir).make_engine(MicroBatchConfig(max_tokens=40))
    got = log_probs(engine, batch.to_packed())
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    offsets = batch.offsets
    for i, n in enumerate(batch.seq_lens):
        ids = batch["input_ids"][i, :n][None]
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, :-1]
        ref = torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None]).squeeze(-1)
        assert got[offsets[i]] == 0
        assert (got[offsets[i] + 1 : offsets[i + 1]] - ref).abs().max().item() < 1e-5


def test_entropy_matches_full_softmax_and_chunking(model_dir, batch):
    small = FSDPHarness(model_dir, overrides={"logits_chunk": 3}).make_engine(
        MicroBatchConfig(micro_batch_size=8)
    )
    big = FSDPHarness(model_dir).make_engine(MicroBatchConfig(micro_batch_size=8))
    spec = OutputSpec(log_probs=True, entropy=True, temperature=0.7)
    with small.eval_mode(), big.eval_mode():
        a, b = small.infer(batch, spec), big.infer(batch, spec)
    assert torch.allclose(a["entropy"], b["entropy"], atol=1e-6)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ids = batch["input_ids"][0, : batch.seq_lens[0]][None]
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=ids).logits[0, :-1] / 0.7, -1)
    entropy = -(logp.exp() * logp).sum(-1)
    assert torch.allclose(a["entropy"][0, 1 : batch.seq_lens[0]], entropy, atol=1e-5)


def test_value_head_engine_outputs_and_trains(model_dir, batch):
    harness = FSDPHarness(model_dir, overrides={"model": {"value_head": True}})
    critic = harness.make_engine(MicroBatchConfig(micro_batch_size=4))
    with critic.eval_mode():
        values = critic.infer(batch, OutputSpec(log_probs=False, values=True))["values"]
    assert values.shape == batch["input_ids"].shape
    assert torch.all(values[:, 0] == 0)

    def mse(outputs, micro, ctx):
        err = (outputs["values"] - 1.0) ** 2 * micro["loss_mask"]
        return err.sum() / ctx.global_tokens, {}

    spec = OutputSpec(log_probs=False, values=True)
    losses = []
    for _ in range(5):
        with critic.train_mode():
            critic.optimizer_zero_grad()
            losses.append(critic.forward_backward(batch, mse, outputs=spec).loss)
            critic.optimizer_step()
    assert losses[-1] < losses[0] * 0.5
    assert "score.weight" in dict(critic.export_weights())
    with pytest.raises(EngineStateError, match="cannot compute"), critic.eval_mode():
        critic.infer(batch, OutputSpec(log_probs=True))


def test_clear_errors(model_dir, batch, tmp_path):
    with pytest.raises(ConfigError, match="model.path is empty"):
        FSDPHarness("").make_engine(MicroBatchConfig(micro_batch_size=1))
    with pytest.raises(ConfigError, match="not a loadable model"):
        FSDPHarness(str(tmp_path / "missing")).make_engine(MicroBatchConfig(micro_batch_size=1))
    with pytest.raises(ConfigError, match="strategy='zero3' is not one of"):
        FSDPHarness(model_dir, overrides={"strategy": "zero3"}).make_engine(
            MicroBatchConfig(micro_batch_size=1)
        )
    engine = FSDPHarness(model_dir).make_engine(MicroBatchConfig(max_tokens=8))
    with pytest.raises(Exception, match="more than max_tokens=8"), engine.train_mode():
        engine.forward_backward(batch, token_mean_nll)
    with pytest.raises(FileNotFoundError, match="not a complete drivetrain checkpoint"):
        engine.load_checkpoint(str(tmp_path))
