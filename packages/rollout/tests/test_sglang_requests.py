"""The sglang backend's request building and streamed-answer parsing, and its refusals on a
machine without CUDA; none of it needs sglang installed."""

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest
import torch

from drivetrain.api.config import LoraConfig
from drivetrain.api.requests import Request
from drivetrain.api.rollout import FinishReason, SamplingParams
from drivetrain.rollout.config import SGLangRolloutConfig
from drivetrain.rollout.errors import BackendNotInstalledError
from drivetrain.rollout.factories import load_backend_class
from drivetrain.rollout.sglang import requests
from drivetrain.rollout.sglang.requests import (
    TopKTopPFilter,
    check_result,
    check_stops,
    context_limits,
    filter_logits,
    finish_reason,
    memory_tags,
    request_kwargs,
    sampling_params_dict,
    stream_event,
)
from drivetrain.rollout.sglang.rollout import (
    NO_CUDA,
    SGLangRollout,
    engine_arguments,
    require_sglang_version,
)
from drivetrain.testing.fake_rollout import processed_log_probs


# ---- sampling params ----------------------------------------------------------------------
def test_greedy_request_uses_sglangs_greedy_and_no_filter():
    request = sampling_params_dict(SamplingParams(temperature=0.0, top_k=5, top_p=0.5), 7)
    assert request["temperature"] == 0.0  # SGLang: top_k=1 at temperature 1
    assert request["top_k"] == -1 and request["top_p"] == 1.0
    assert "custom_params" not in request
    assert request["max_new_tokens"] == 7 and request["n"] == 1
    assert request["no_stop_trim"] is True  # matched stops stay in the output


def test_unfiltered_sampling_leaves_top_k_and_top_p_disabled():
    request = sampling_params_dict(SamplingParams(temperature=0.8), 3)
    assert (request["temperature"], request["top_k"], request["top_p"]) == (0.8, -1, 1.0)
    assert "custom_params" not in request


def test_top_k_and_top_p_go_to_the_logit_processor_not_to_sglang():
    request = sampling_params_dict(SamplingParams(temperature=0.7, top_k=4, top_p=0.9), 3)
    assert request["top_k"] == -1 and request["top_p"] == 1.0  # not applied twice
    assert request["custom_params"] == {"temperature": 0.7, "top_k": 4, "top_p": 0.9}
    only_top_p = sampling_params_dict(SamplingParams(top_p=0.5), 3)
    assert only_top_p["custom_params"]["top_k"] == 0


def test_stops_and_seed():
    params = SamplingParams(stop=("\n\n", "END"), stop_token_ids=(2, 9), ignore_eos=True)
    request = sampling_params_dict(params, 5, seed=11)
    assert request["stop"] == ["\n\n", "END"] and request["stop_token_ids"] == [2, 9]
    assert request["ignore_eos"] is True and request["sampling_seed"] == 11
    plain = sampling_params_dict(SamplingParams(), 5)
    assert plain["stop"] is None and plain["stop_token_ids"] is None
    assert "sampling_seed" not in plain


# ---- requests -----------------------------------------------------------------------------
def test_a_request_streams_under_the_given_id_with_its_budget_and_seed():
    request = Request("r-1", (1, 2), SamplingParams(temperature=1.0, max_new_tokens=4))
    kwargs = request_kwargs(request, "0f" * 16, seed=11)
    assert kwargs["input_ids"] == [1, 2] and kwargs["rid"] == "0f" * 16
    assert kwargs["stream"] is True and kwargs["return_logprob"] is True
    assert kwargs["sampling_params"]["max_new_tokens"] == 4
    assert kwargs["sampling_params"]["sampling_seed"] == 11
    assert "custom_logit_processor" not in kwargs and "lora_path" not in kwargs


def test_filtered_requests_carry_the_processor_and_lora_requests_the_adapter():
    request = Request("r", (1,), SamplingParams(top_k=3, max_new_tokens=4))
    kwargs = request_kwargs(request, "x", processor="P", lora_name="policy-v3")
    assert kwargs["custom_logit_processor"] == "P" and kwargs["lora_path"] == "policy-v3"
    with pytest.raises(ValueError, match="logit processor"):
        request_kwargs(request, "x")


def test_more_stop_strings_than_sglang_takes_are_refused_up_front():
    check_stops(SamplingParams(stop=tuple(f"s{i}" for i in range(32))))
    with pytest.raises(ValueError, match="at most 32 stop strings, got 33"):
        check_stops(SamplingParams(stop=tuple(f"s{i}" for i in range(33))))


# ---- streamed answers -----------------------------------------------------------------------
def _output(tokens, logprobs, reason=None):
    """What SGLang streams: the request's whole output so far."""
    entries = [(lp, tok, None) for lp, tok in zip(logprobs, tokens, strict=True)]
    return {
        "output_ids": list(tokens),
        "meta_info": {
            "finish_reason": reason,
            "output_token_logprobs": entries,
            "completion_tokens": len(tokens),
        },
    }


def test_each_streamed_output_yields_only_its_new_tokens_and_the_last_its_finish():
    first = stream_event("r", _output([5, 6], [-0.5, -1.5]), reported=0)
    assert (first.token_ids, first.log_probs, first.finish_reason) == ([5, 6], [-0.5, -1.5], None)
    last = stream_event("r", _output([5, 6, 7], [-0.5, -1.5, -0.25], {"type": "length"}), 2)
    assert (last.token_ids, last.log_probs) == ([7], [-0.25])
    assert last.finish_reason is FinishReason.LENGTH and last.request_id == "r"
    aborted = stream_event("r", _output([5], [-0.5], {"type": "abort", "message": "x"}), 1)
    assert aborted.token_ids == [] and aborted.finish_reason is FinishReason.ABORT


def test_missing_output_ids_fall_back_to_the_log_prob_tokens():
    output = _output([5, 6], [-0.5, -1.5], {"type": "length", "length": 2})
    del output["output_ids"]
    event = stream_event("r", output, 0)
    assert event.token_ids == [5, 6] and event.log_probs == [-0.5, -1.5]


def test_incremental_streaming_is_refused_not_read_as_missing_tokens():
    output = _output([7], [-0.25])
    output["meta_info"]["completion_tokens"] = 3  # SGLang sent only the newest token
    with pytest.raises(RuntimeError, match="incremental streaming"):
        stream_event("r", output, 2)


def test_length_mismatch_between_tokens_and_log_probs_is_an_error():
    output = _output([5, 6], [-0.5, -1.5], {"type": "stop", "matched": 6})
    output["output_ids"] = [5]  # e.g. a trimmed stop token
    del output["meta_info"]["completion_tokens"]
    with pytest.raises(RuntimeError, match="1 generated tokens but 2 log-probs"):
        stream_event("r", output, 0)


def test_log_probs_for_other_tokens_are_an_error():
    output = _output([5, 6], [-0.5, -1.5], {"type": "length", "length": 2})
    output["output_ids"] = [5, 7]
    with pytest.raises(RuntimeError, match="log-prob 1 is for token 6"):
        stream_event("r", output, 0)


def test_missing_log_probs_are_errors():
    output = _output([5], [-0.5], {"type": "length", "length": 1})
    del output["meta_info"]["output_token_logprobs"]
    with pytest.raises(RuntimeError, match="no log-probs"):
        stream_event("r", output, 0)
    none_logprob = _output([5], [None], {"type": "length", "length": 1})
    with pytest.raises(RuntimeError, match="None"):
        stream_event("r", none_logprob, 0)


def test_finish_reasons():
    assert finish_reason({"type": "stop", "matched": 2}) is FinishReason.STOP
    assert finish_reason({"type": "length", "length": 9}) is FinishReason.LENGTH
    assert finish_reason({"type": "abort", "message": "x"}) is FinishReason.ABORT
    assert finish_reason("length") is FinishReason.LENGTH
    with pytest.raises(RuntimeError, match="unknown finish reason"):
        finish_reason({"type": "exploded"})
    with pytest.raises(RuntimeError, match="without a finish reason"):
        finish_reason(None)


def test_control_call_results():
    class Output:
        success = False
        error_message = "adapter not found"

    check_result((True, "ok"), "update")
    check_result(None, "release")
    with pytest.raises(RuntimeError, match="SGLang update failed: bad shape"):
        check_result((False, "bad shape"), "update")
    with pytest.raises(RuntimeError, match="adapter not found"):
        check_result(Output(), "load_lora_adapter")
    with pytest.raises(RuntimeError, match="nope"):
        check_result({"success": False, "message": "nope"}, "x")


# ---- limits, memory and weights -----------------------------------------------------------
def test_context_limits_leave_sglang_one_spare_position():
    assert context_limits(128, 256) == (129, 128)
    assert context_limits(128, None) == (129, 128)
    assert context_limits(256, 256) == (256, 255)


def test_memory_tags_per_sleep_level():
    assert memory_tags(1, weights_backup=True) is None  # weights go to host and come back
    assert memory_tags(1, weights_backup=False) == ["kv_cache"]  # weights stay on the GPU
    assert memory_tags(2, weights_backup=False) is None
    assert memory_tags(2, weights_backup=True) is None


# ---- the top-k/top-p logit processor ------------------------------------------------------
@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.7, top_k=4),
        SamplingParams(temperature=1.3, top_p=0.6),
        SamplingParams(temperature=0.5, top_k=6, top_p=0.8),
        SamplingParams(temperature=1.0, top_k=1),
        SamplingParams(temperature=2.0, top_p=0.05),
    ],
)
def test_filtered_logits_give_the_processed_distribution(params):
    # SGLang divides the processor's logits by the temperature and softmaxes: that must be
    # the contract's processed distribution (the reference in drivetrain.testing)
    torch.manual_seed(0)
    logits = torch.randn(3, 16) * 3
    rows = [dict(sampling_params_dict(params, 1)["custom_params"], __req__=object())] * 3
    filtered = TopKTopPFilter()(logits.clone(), rows)
    sglang_log_probs = torch.log_softmax(filtered / params.temperature, dim=-1)
    for row in range(3):
        reference = processed_log_probs(logits[row].tolist(), params)
        for got, want in zip(sglang_log_probs[row].tolist(), reference, strict=True):
            assert (math.isinf(got) and math.isinf(want)) or got == pytest.approx(want, abs=1e-5)


def test_filter_leaves_unfiltered_rows_and_kept_logits_unchanged():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0], [1.0, 3.0, 2.0, 0.0]])
    out = filter_logits(
        logits,
        temperatures=torch.tensor([1.0, 1.0]),
        top_ks=torch.tensor([2, 0]),
        top_ps=torch.tensor([1.0, 1.0]),
    )
    assert out[0].tolist() == [float("-inf"), 3.0, 2.0, float("-inf")]
    assert torch.equal(out[1], logits[1])


def test_processor_refuses_params_that_do_not_match_the_rows():
    with pytest.raises(ValueError, match="1 custom_params for 2 rows"):
        TopKTopPFilter()(torch.zeros(2, 4), [{"temperature": 1.0, "top_k": 1, "top_p": 1.0}])


def test_processor_string_is_sglangs_wire_format_and_loads_back():
    dill = pytest.importorskip("dill")
    payload = json.loads(requests.processor_string())
    loaded = dill.loads(bytes.fromhex(payload["callable"]))
    assert loaded is TopKTopPFilter  # by reference: SGLang's scheduler imports this module


# ---- the engine without a GPU -------------------------------------------------------------
@pytest.fixture
def model_dir(tmp_path) -> Path:
    (tmp_path / "config.json").write_text("{}")
    return tmp_path


def test_an_sglang_older_than_the_backend_needs_is_refused_with_the_env_command(monkeypatch):
    import importlib.metadata

    monkeypatch.setattr(importlib.metadata, "version", lambda name: "0.5.2")
    with pytest.raises(RuntimeError, match=r"sglang >= 0.5.22, this environment has 0.5.2: "):
        require_sglang_version()
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "0.5.23")
    require_sglang_version()


def test_engine_refuses_a_machine_without_cuda_before_importing_sglang(model_dir, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setitem(sys.modules, "sglang", None)  # importing it would raise ImportError
    with pytest.raises(RuntimeError, match=NO_CUDA) as error:
        SGLangRollout(SGLangRolloutConfig(model_path=str(model_dir)))
    assert "SGLang needs a CUDA GPU; on CPU use the hf or vllm rollout" in str(error.value)


def test_engine_refuses_device_cpu_even_with_cuda(model_dir, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setitem(sys.modules, "sglang", None)
    with pytest.raises(RuntimeError, match=r"CUDA GPU.*rollout.device='cpu'"):
        SGLangRollout(SGLangRolloutConfig(model_path=str(model_dir), device="cpu"))


def test_engine_checks_the_model_directory_first(tmp_path):
    with pytest.raises(FileNotFoundError, match="not a Hugging Face model directory"):
        SGLangRollout(SGLangRolloutConfig(model_path=str(tmp_path / "nowhere")))


@pytest.mark.skipif(importlib.util.find_spec("sglang") is not None, reason="sglang installed")
def test_load_backend_class_names_the_install_command():
    with pytest.raises(BackendNotInstalledError, match="needs sglang") as error:
        load_backend_class("sglang")
    assert "pip install 'drivetrain-rollout[sglang]'" in str(error.value)
    assert "python -m drivetrain.rollout.env sglang" in str(error.value)


# ---- engine arguments ---------------------------------------------------------------------
ALL_ARGS = {"enable_weights_cpu_backup", "enable_deterministic_inference"}


def test_engine_arguments_map_the_config(tmp_path):
    config = SGLangRolloutConfig(
        model_path=str(tmp_path),
        dtype="bfloat16",
        tensor_parallel_size=2,
        seed=7,
        mem_fraction_static=0.3,
        attention_backend="triton",
        lora=LoraConfig(rank=8),
    )
    kwargs = engine_arguments(config, tmp_path, 129, ALL_ARGS)
    assert kwargs["model_path"] == str(tmp_path) and kwargs["dtype"] == "bfloat16"
    assert (kwargs["context_length"], kwargs["tp_size"], kwargs["random_seed"]) == (129, 2, 7)
    assert kwargs["mem_fraction_static"] == 0.3 and kwargs["attention_backend"] == "triton"
    assert kwargs["enable_memory_saver"] and kwargs["enable_weights_cpu_backup"]
    assert kwargs["enable_custom_logit_processor"] is True
    assert kwargs["max_running_requests"] == 256  # the rollout's queue holds the rest
    assert "enable_deterministic_inference" not in kwargs
    assert kwargs["enable_lora"] and kwargs["max_lora_rank"] == 8
    assert kwargs["lora_target_modules"] == ["all"]


def test_engine_arguments_follow_the_installed_version(tmp_path):
    config = SGLangRolloutConfig(model_path=str(tmp_path))
    old = engine_arguments(config, tmp_path, 129, supported=set())
    assert "enable_weights_cpu_backup" not in old and "attention_backend" not in old
    deterministic = SGLangRolloutConfig(model_path=str(tmp_path), deterministic_inference=True)
    assert engine_arguments(deterministic, tmp_path, 129, ALL_ARGS)[
        "enable_deterministic_inference"
    ]
    with pytest.raises(RuntimeError, match=r">= 0.5.3"):
        engine_arguments(deterministic, tmp_path, 129, supported=set())
    no_saver = SGLangRolloutConfig(model_path=str(tmp_path), enable_memory_saver=False)
    assert "enable_weights_cpu_backup" not in engine_arguments(no_saver, tmp_path, 9, ALL_ARGS)
