"""The sglang rollout against transformers on a tiny local Llama: greedy tokens and log-probs,
sampled log-probs of the processed distribution, weight updates and sleep. Needs a CUDA GPU
and sglang (and drivetrain-trainer for the tiny model)."""

import importlib.util
import math

import pytest
import torch

from drivetrain.api.rollout import FinishReason, Prompt, SamplingParams
from drivetrain.rollout.config import SGLangRolloutConfig
from drivetrain.testing.fake_rollout import processed_log_probs

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or importlib.util.find_spec("sglang") is None,
        reason="needs a CUDA GPU and sglang",
    ),
]

SHAPE = dict(
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=64,
    max_position_embeddings=256,
)
PROMPTS = ["hello there", "abc", "The quick brown fox"]


def _build(path, seed):
    tiny_model = pytest.importorskip("drivetrain.trainer.builtin.tiny_model")
    char_tokenizer = pytest.importorskip("drivetrain.trainer.builtin.char_tokenizer")
    char_tokenizer.build_char_tokenizer(path)
    return tiny_model.build_llama_model(
        path, tokenizer_dir=path, seed=seed, tie_word_embeddings=False, **SHAPE
    )


@pytest.fixture(scope="module")
def model_a(tmp_path_factory):
    return _build(tmp_path_factory.mktemp("model_a"), seed=0)


@pytest.fixture(scope="module")
def model_b(tmp_path_factory):
    return _build(tmp_path_factory.mktemp("model_b"), seed=1)


def _engine(path):
    from drivetrain.rollout.sglang.rollout import SGLangRollout

    config = SGLangRolloutConfig(
        model_path=str(path),
        dtype="float32",
        max_model_len=128,
        mem_fraction_static=0.2,
        attention_backend="torch_native",  # fp32 attention, as transformers computes it
        disable_cuda_graph=True,
    )
    return SGLangRollout(config)


@pytest.fixture
def engine_a(model_a):
    """One engine per test: shutting an SGLang engine down kills every child process of this
    process, so no two may live at once."""
    engine = _engine(model_a)
    yield engine
    engine.shutdown()


def _hf_model(path):
    from transformers import AutoModelForCausalLM, GenerationConfig

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda().eval()
    # a clean generation config: no EOS stop, no sampling defaults from the model's
    model.generation_config = GenerationConfig(pad_token_id=model.config.pad_token_id)
    return model


def _prompt_ids(path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    return [tokenizer.encode(text, add_special_tokens=False) for text in PROMPTS]


def _hf_greedy(model, prompt, steps):
    """Tokens and their log-probs (temperature 1) from transformers' greedy ``generate``."""
    ids = torch.tensor([prompt], device="cuda")
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=steps,
            return_dict_in_generate=True,
            output_logits=True,
        )
    tokens = out.sequences[0, len(prompt) :].tolist()
    log_probs = [
        torch.log_softmax(step[0].float(), dim=-1)[token].item()
        for step, token in zip(out.logits, tokens, strict=True)
    ]
    return tokens, log_probs


GREEDY = SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True)


def _token_prompts(path):
    return [Prompt(token_ids=tuple(ids)) for ids in _prompt_ids(path)]


def test_greedy_generation_equals_transformers_generate(engine_a, model_a):
    model = _hf_model(model_a)
    completions = engine_a.generate(_token_prompts(model_a), GREEDY)
    assert [c.prompt_index for c in completions] == [0, 1, 2]
    for completion, prompt in zip(completions, _prompt_ids(model_a), strict=True):
        tokens, log_probs = _hf_greedy(model, prompt, GREEDY.max_new_tokens)
        assert list(completion.token_ids) == tokens
        assert completion.log_probs == pytest.approx(log_probs, abs=2e-3)
        assert completion.finish_reason is FinishReason.LENGTH
        assert completion.weight_version == 0


def test_sampled_log_probs_are_of_the_processed_distribution(engine_a, model_a):
    params = SamplingParams(
        n=4, temperature=0.8, top_k=5, top_p=0.9, max_new_tokens=8, ignore_eos=True
    )
    model = _hf_model(model_a)
    completions = engine_a.generate(_token_prompts(model_a), params)
    assert [c.prompt_index for c in completions] == [0] * 4 + [1] * 4 + [2] * 4
    for completion in completions:
        sequence = list(completion.prompt_ids) + list(completion.token_ids)
        with torch.inference_mode():
            logits = model(torch.tensor([sequence], device="cuda")).logits[0].float()
        start = len(completion.prompt_ids) - 1
        for k, (token, got) in enumerate(
            zip(completion.token_ids, completion.log_probs, strict=True)
        ):
            want = processed_log_probs(logits[start + k].tolist(), params)[token]
            assert math.isfinite(want), "a token outside top-k/top-p was sampled"
            assert got == pytest.approx(want, abs=2e-3)


def test_update_weights_gives_the_outputs_of_a_fresh_engine(model_a, model_b):
    from safetensors.torch import load_file

    weights = {}
    for file in sorted(model_b.glob("*.safetensors")):
        weights.update(load_file(str(file)))
    prompts = _token_prompts(model_a)
    updated = _engine(model_a)
    try:
        before = updated.generate(prompts, GREEDY)
        updated.update_weights(iter(weights.items()), version=1)
        after = updated.generate(prompts, GREEDY)
    finally:
        updated.shutdown()
    fresh = _engine(model_b)
    try:
        expected = fresh.generate(prompts, GREEDY)
    finally:
        fresh.shutdown()
    assert [c.token_ids for c in after] == [c.token_ids for c in expected]
    assert [c.token_ids for c in after] != [c.token_ids for c in before]
    for got, want in zip(after, expected, strict=True):
        assert got.log_probs == pytest.approx(want.log_probs, abs=1e-4)
        assert got.weight_version == 1


def test_unknown_weight_names_change_nothing(engine_a, model_a):
    before = engine_a.generate(_token_prompts(model_a), GREEDY)
    with pytest.raises(KeyError, match="unknown weight"):
        engine_a.update_weights([("model.no_such.weight", torch.zeros(1))], version=9)
    after = engine_a.generate(_token_prompts(model_a), GREEDY)
    assert [c.token_ids for c in after] == [c.token_ids for c in before]
    assert engine_a.weight_version == 0


def test_sleep_keeps_weights_at_level_one_and_needs_new_ones_at_level_two(engine_a, model_a):
    from safetensors.torch import load_file

    prompts = _token_prompts(model_a)
    reference = [c.token_ids for c in engine_a.generate(prompts, GREEDY)]
    assert engine_a.sleep(level=1) is True
    with pytest.raises(RuntimeError, match="asleep"):
        engine_a.generate(prompts, GREEDY)
    engine_a.wake_up()
    assert [c.token_ids for c in engine_a.generate(prompts, GREEDY)] == reference

    assert engine_a.sleep(level=2) is True
    engine_a.wake_up()
    with pytest.raises(RuntimeError, match="discarded"):
        engine_a.generate(prompts, GREEDY)
    weights = {}
    for file in sorted(model_a.glob("*.safetensors")):
        weights.update(load_file(str(file)))
    engine_a.update_weights(weights.items(), version=2)
    completions = engine_a.generate(prompts, GREEDY)
    assert [c.token_ids for c in completions] == reference
    assert {c.weight_version for c in completions} == {2}
