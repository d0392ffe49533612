"""The ``hf`` rollout against plain transformers and engine-fsdp, in this process and in a
server process; new weights streamed from an engine; the rollout conformance kit (in-process,
with 4 rows, behind a server process) and 64 streaming requests, half of them aborted."""

import os
import signal

import pytest
import torch

from drivetrain.api import FinishReason, Prompt, SamplingParams
from drivetrain.api.registry import rollouts
from drivetrain.rollout.config import HFRolloutConfig
from drivetrain.rollout.errors import RolloutProcessError
from drivetrain.testing.rollout_kit import (
    RolloutConformance,
    run_rollout_conformance,
)
from rollout_support import (
    CHAT_PROMPTS,
    KeptRollout,
    TransformersRolloutHarness,
    build_model,
    check_64_streams_half_aborted,
    fsdp_engine,
    log_prob_gap,
    save_engine_weights,
    this_python,
    train_step,
    transformers_greedy,
)

pytestmark = pytest.mark.timeout(300)

GREEDY = SamplingParams(temperature=0, max_new_tokens=16, ignore_eos=True)
SAMPLED = SamplingParams(temperature=0.8, max_new_tokens=24, n=4, seed=5)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_model(tmp_path_factory.mktemp("hf-rollout") / "model")


def hf(model_dir, **overrides):
    config = HFRolloutConfig(model_path=str(model_dir), **{"max_model_len": 256, **overrides})
    return rollouts.load("hf")(config)


def test_greedy_generation_equals_transformers_generate(model_dir):
    prompts = [*CHAT_PROMPTS, Prompt(token_ids=(8, 9, 10))]  # batched, different lengths
    completions = hf(model_dir).generate(prompts, GREEDY)
    assert [c.prompt_index for c in completions] == [0, 1, 2, 3]
    for c in completions:
        assert len(c.token_ids) == 16 and c.finish_reason is FinishReason.LENGTH
        assert list(c.token_ids) == transformers_greedy(model_dir, c)


def test_sampled_log_probs_match_engine_fsdp(model_dir):
    completions = hf(model_dir).generate(CHAT_PROMPTS, SAMPLED)
    assert [c.prompt_index for c in completions] == [0] * 4 + [1] * 4 + [2] * 4
    engine = fsdp_engine(model_dir)
    worst, mean = log_prob_gap(engine, completions, temperature=0.8)
    print(f"hf vs engine-fsdp log-probs (fp32, T=0.8): max {worst:.2e} mean {mean:.2e}")
    assert mean < 1e-5 and worst < 1e-4
    top = hf(model_dir).generate(CHAT_PROMPTS, SamplingParams(top_p=0.9, top_k=20, seed=1))
    assert all(lp <= 0 for c in top for lp in c.log_probs)


def test_shared_prompt_prefill_changes_nothing_but_the_work(model_dir):
    """n samples of a prompt prefill it once (the default) and sample exactly what a prefill
    per row samples; prompts of different lengths, one repeated as its own prompt."""
    prompts = [*CHAT_PROMPTS, CHAT_PROMPTS[0], Prompt(token_ids=(8, 9, 10))]
    for params in (SAMPLED, SamplingParams(temperature=0, max_new_tokens=8, n=3)):
        shared = hf(model_dir).generate(prompts, params)
        alone = hf(model_dir, share_prompt_prefill=False).generate(prompts, params)
        assert [c.token_ids for c in shared] == [c.token_ids for c in alone]
        gap = max(
            abs(a - b)
            for x, y in zip(shared, alone, strict=True)
            for a, b in zip(x.log_probs, y.log_probs, strict=True)
        )
        assert gap < 1e-4, gap


def test_seeds_samples_and_stops(model_dir):
    rollout = hf(model_dir)
    assert rollout.generate(CHAT_PROMPTS, SAMPLED) == rollout.generate(CHAT_PROMPTS, SAMPLED)
    other = rollout.generate(CHAT_PROMPTS, SamplingParams(temperature=0.8, n=4, seed=6))
    assert other != rollout.generate(CHAT_PROMPTS, SAMPLED)
    first = rollout.generate(CHAT_PROMPTS[:1], GREEDY)[0]
    stop_id = first.token_ids[3]
    stopped = rollout.generate(
        CHAT_PROMPTS[:1],
        SamplingParams(
            temperature=0, max_new_tokens=16, ignore_eos=True, stop_token_ids=(stop_id,)
        ),
    )[0]
    cut = first.token_ids.index(stop_id) + 1
    assert stopped.token_ids == first.token_ids[:cut]
    assert stopped.finish_reason is FinishReason.STOP
    text = rollout.tokenizer.decode(first.token_ids[:6])
    by_string = rollout.generate(
        CHAT_PROMPTS[:1],
        SamplingParams(temperature=0, max_new_tokens=16, ignore_eos=True, stop=(text[3:6],)),
    )[0]
    assert by_string.finish_reason is FinishReason.STOP
    assert rollout.tokenizer.decode(by_string.token_ids).endswith(text[3:6])
    assert len(by_string.token_ids) <= 6
    short = hf(model_dir, max_model_len=len(first.prompt_ids) + 5)
    capped = short.generate(CHAT_PROMPTS[:1], GREEDY)[0]
    assert len(capped.token_ids) == 5 and capped.finish_reason is FinishReason.LENGTH
    with pytest.raises(ValueError, match="leaves no room"):
        hf(model_dir, max_model_len=8).generate(CHAT_PROMPTS[:1], GREEDY)


def test_new_weights_from_an_engine_equal_a_fresh_rollout(model_dir, tmp_path):
    rollout = hf(model_dir)
    before = rollout.generate(CHAT_PROMPTS, GREEDY)
    engine = fsdp_engine(model_dir)
    train_step(engine, rollout.generate(CHAT_PROMPTS, SAMPLED))
    rollout.update_weights(engine.export_weights(), version=1)
    assert rollout.weight_version == 1
    after = rollout.generate(CHAT_PROMPTS, GREEDY)
    assert after != before and all(c.weight_version == 1 for c in after)
    fresh = hf(save_engine_weights(engine, model_dir, tmp_path / "step1"))
    assert [c.token_ids for c in after] == [
        c.token_ids for c in fresh.generate(CHAT_PROMPTS, GREEDY)
    ]
    sampled = rollout.generate(CHAT_PROMPTS, SAMPLED)
    assert [c.log_probs for c in sampled] == [
        c.log_probs for c in fresh.generate(CHAT_PROMPTS, SAMPLED)
    ]
    worst, _ = log_prob_gap(engine, sampled, temperature=0.8)
    assert worst < 1e-4
    # a bad first name changes nothing; a bad name after a good tensor leaves a mix of
    # weights (applied as they arrive), refused until whole weights arrive
    with pytest.raises(KeyError, match="unknown weight 'model.nope'"):
        rollout.update_weights([("model.nope", torch.zeros(1))], version=2)
    assert rollout.weight_version == 1
    assert rollout.generate(CHAT_PROMPTS, GREEDY) == after
    good = next(iter(engine.export_weights()))
    with pytest.raises(KeyError, match="unknown weight 'model.nope'"):
        rollout.update_weights([good, ("model.nope", torch.zeros(1))], version=2)
    assert rollout.weight_version == 1
    with pytest.raises(RuntimeError, match="failed part-way"):
        rollout.generate(CHAT_PROMPTS, GREEDY)
    rollout.update_weights(engine.export_weights(), version=3)
    again = rollout.generate(CHAT_PROMPTS, GREEDY)
    assert [(c.token_ids, c.weight_version) for c in again] == [(c.token_ids, 3) for c in after]


def test_a_server_process_equals_in_process_and_takes_weights_over_the_wire(model_dir):
    local = hf(model_dir)
    remote = hf(model_dir, python=this_python(), env=("OMP_NUM_THREADS=1",))
    try:
        assert remote.generate(CHAT_PROMPTS, SAMPLED) == local.generate(CHAT_PROMPTS, SAMPLED)
        engine = fsdp_engine(model_dir)
        train_step(engine, local.generate(CHAT_PROMPTS, SAMPLED))
        weights = list(engine.export_weights())
        remote.update_weights(iter(weights), version=3)
        local.update_weights(iter(weights), version=3)
        assert remote.generate(CHAT_PROMPTS, SAMPLED) == local.generate(CHAT_PROMPTS, SAMPLED)
        bf16 = [(name, t.to(torch.bfloat16)) for name, t in weights]
        remote.update_weights(iter(bf16), version=4)  # cast into the fp32 model on arrival
        local.update_weights(iter(bf16), version=4)
        assert remote.generate(CHAT_PROMPTS, GREEDY) == local.generate(CHAT_PROMPTS, GREEDY)

        def dying_stream():
            yield weights[0]
            os.killpg(remote.channel.process.pid, signal.SIGKILL)
            yield from weights[1:]

        with pytest.raises(RolloutProcessError, match="hf rollout process"):
            remote.update_weights(dying_stream(), version=5)
    finally:
        remote.shutdown()


# ---- the rollout kit and request-level serving --------------------------------------------
class TestHFRollout(RolloutConformance):
    @pytest.fixture(autouse=True)
    def _model(self, model_dir):
        self.model_dir = model_dir

    def harness(self):
        return TransformersRolloutHarness(self.model_dir, lambda: hf(self.model_dir))


class TestHFRolloutSmallBatch(TestHFRollout):
    """Four rows at most: requests wait for a free row and join a running batch."""

    def harness(self):
        return TransformersRolloutHarness(
            self.model_dir, lambda: hf(self.model_dir, max_batch_size=4)
        )


def test_the_kit_catches_destinations_handed_out_unmarked(model_dir):
    """A rollout that hands transports its parameters without marking the update changed
    serves a mix of two versions after a broken stream: the kit names it."""
    from drivetrain.testing.rollout_kit import ROLLOUT_CHECKS

    class Unmarked(type(hf(model_dir))):
        def weight_destination(self, name, shape, dtype):
            target = self._weights.get(name)
            live = self.weight_update is not None and target is not None
            return target if live and tuple(target.shape) == shape else None

    def make():
        return Unmarked(HFRolloutConfig(model_path=str(model_dir), max_model_len=256))

    with pytest.raises(AssertionError, match="mix of two versions without refusing: mark"):
        ROLLOUT_CHECKS["destination_update"](TransformersRolloutHarness(model_dir, make))


@pytest.mark.slow  # the whole kit over RPC: ~30 s
def test_the_kit_passes_through_a_rollout_server_process(model_dir):
    """One server process lent to every check (a start costs ~10 s; each check gets it back
    with the initial weights as version 0)."""
    kept = KeptRollout(hf(model_dir, python=this_python()), model_dir)
    try:
        harness = TransformersRolloutHarness(model_dir, lambda: kept)
        failed = [r for r in run_rollout_conformance(harness) if r.error is not None]
    finally:
        kept.close()
    assert not failed, failed


def test_64_streaming_requests_half_aborted(model_dir):
    """Aborted requests return their partial tokens and log-probs with finish reason abort;
    the others equal an undisturbed greedy run bitwise."""
    harness = TransformersRolloutHarness(model_dir, lambda: hf(model_dir))
    check_64_streams_half_aborted(lambda: hf(model_dir), lambda r: r.shutdown(), harness)


# ---- sleep (colocated placement on an accelerator) ---------------------------------------
def test_sleep_frees_nothing_on_the_cpu_and_serving_goes_on(model_dir):
    rollout = hf(model_dir)
    before = rollout.generate(CHAT_PROMPTS, GREEDY)
    assert rollout.sleep(1) is False
    rollout.wake_up(("weights",))
    rollout.wake_up(("kv_cache",))
    assert rollout.generate(CHAT_PROMPTS, GREEDY) == before


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_sleep_moves_weights_off_the_gpu_and_the_colocated_order_serves_new_weights(model_dir):
    rollout = hf(model_dir, device="cuda")
    before = rollout.generate(CHAT_PROMPTS, GREEDY)
    resident = torch.cuda.memory_allocated()
    engine = fsdp_engine(model_dir)
    train_step(engine, rollout.generate(CHAT_PROMPTS, SAMPLED))
    assert rollout.sleep(1) is True
    assert torch.cuda.memory_allocated() < resident  # the weights left the device
    rollout.wake_up(("weights",))  # the sync manager's colocated order
    rollout.update_weights(engine.export_weights(), version=1)
    rollout.wake_up(("kv_cache",))
    after = rollout.generate(CHAT_PROMPTS, GREEDY)
    assert after != before and all(c.weight_version == 1 for c in after)
    assert next(rollout.model.parameters()).device.type == "cuda"
