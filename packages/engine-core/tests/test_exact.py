"""``numerics=exact``'s kernels: a row's (a query's) bits follow from that row alone.

Each test compares bits, not tolerances: the same rows computed in calls of other sizes,
layouts and company must be equal to the last bit, and close to the ordinary kernels."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F

from drivetrain.engine_core.exact_attention import (
    KEY_BUCKET,
    attend_ranges,
    ranges_of_mask,
    ranges_of_spans,
)
from drivetrain.engine_core.exact_modules import ROW_MULTIPLE, ExactSiLU, exact_linear, make_exact
from drivetrain.engine_core.packed_attention import Span, attend_spans

DTYPES = [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_linear_row_has_the_same_bits_in_any_call(dtype):
    torch.manual_seed(0)
    x = torch.randn(70, 384, dtype=dtype)
    weight = torch.randn(1000, 384, dtype=dtype)
    bias = torch.randn(1000, dtype=dtype)
    every = exact_linear(x, weight, bias)
    assert torch.allclose(every.float(), F.linear(x, weight, bias).float(), rtol=0.02, atol=0.1)
    for threads in (1, 2):
        with _threads(threads):
            for rows in (1, 2, 3, ROW_MULTIPLE, 5, 7, 9, 11, 33):
                assert torch.equal(exact_linear(x[:rows], weight, bias), every[:rows]), rows
    # a strided view (each prompt's last position, as a prefill keeps it) and a 3-d call
    stacked = x[:64].reshape(8, 8, 384)
    assert torch.equal(exact_linear(stacked[:, -1:], weight, bias)[:, 0], every[7:64:8])
    assert torch.equal(exact_linear(stacked, weight, bias).reshape(64, -1), every[:64])


@contextlib.contextmanager
def _threads(count: int):
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def test_plain_f_linear_is_not_row_invariant_here():
    """Why ``exact_linear`` pads: a float32 call of one row gets other bits than the same row
    among many (MKL). If this fails, the padding may no longer be needed, not wrong."""
    torch.manual_seed(0)
    x, weight = torch.randn(64, 384), torch.randn(1000, 384)
    every = F.linear(x, weight)
    differs = sum(not torch.equal(F.linear(x[i : i + 1], weight)[0], every[i]) for i in range(64))
    assert differs > 0


def test_exact_silu_is_silu_and_position_independent():
    torch.manual_seed(0)
    x = torch.randn(4096, 100) * 4
    full = ExactSiLU()(x)
    assert torch.allclose(full, F.silu(x), atol=1e-6)
    for rows in (1, 3, 7):
        assert torch.equal(ExactSiLU()(x[:rows].contiguous()), full[:rows])
    assert ExactSiLU()(x.bfloat16()).dtype == torch.bfloat16


def _packed(lengths: list[int], heads: int = 4, dim: int = 16, dtype=torch.float32):
    total = sum(lengths)
    q, k, v = (torch.randn(total, heads, dim, dtype=dtype) for _ in range(3))
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    return q, k, v, [Span(s, n) for s, n in zip(starts, lengths, strict=True)]


@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_matches_causal_sdpa_per_document(dtype):
    torch.manual_seed(0)
    q, k, v, spans = _packed([5, 17, 40, 1], dtype=dtype)
    starts, counts = ranges_of_spans(spans, q.device)
    exact = attend_ranges(q, k, v, starts, counts, 16**-0.5)
    as_rows = (t.transpose(0, 1)[None] for t in (q, k, v))
    expected = attend_spans(*as_rows, spans, 0.0, None)[0].transpose(0, 1)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    assert exact.dtype == dtype
    assert torch.allclose(exact.float(), expected.float(), atol=tolerance)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_query_gets_the_same_bits_whatever_else_is_attended(dtype):
    """One document alone, in a packed row with others, and as the rollout meets it: a decode
    step of one query over a left-padded cache row (a boolean mask)."""
    torch.manual_seed(1)
    q, k, v, spans = _packed([7, 23, 12], dtype=dtype)
    starts, counts = ranges_of_spans(spans, q.device)
    packed = attend_ranges(q, k, v, starts, counts, 0.25)
    doc = slice(7, 30)  # the second document alone
    s, c = ranges_of_spans([Span(0, 23)], q.device)
    alone = attend_ranges(q[doc], k[doc], v[doc], s, c, 0.25)
    assert torch.equal(alone, packed[doc])
    # decode: its last query over a cache row padded on the left by 9, beside another row
    width = 9 + 23
    cache_k = torch.zeros(2, width, *k.shape[1:], dtype=dtype)
    cache_v = torch.zeros_like(cache_k)
    cache_k[0, 9:], cache_v[0, 9:] = k[doc], v[doc]
    cache_k[1], cache_v[1] = torch.randn_like(cache_k[1]), torch.randn_like(cache_v[1])
    visible = torch.zeros(2, 1, width, dtype=torch.bool)
    visible[0, 0, 9:] = True
    visible[1, 0, 3:] = True
    s, c = ranges_of_mask(visible)
    queries = torch.stack([q[29], torch.randn_like(q[29])])
    decoded = attend_ranges(queries, cache_k.flatten(0, 1), cache_v.flatten(0, 1), s, c, 0.25)
    assert torch.equal(decoded[0], packed[29])


def test_a_shared_prefix_is_attended_as_the_same_keys_in_place():
    """A span that sees a shared prompt elsewhere in the row equals the prompt and the span
    packed as one document."""
    torch.manual_seed(2)
    q, k, v, _ = _packed([10 + 6])
    one = ranges_of_spans([Span(0, 16)], q.device)
    whole = attend_ranges(q, k, v, *one, 0.25)
    prefixed = ranges_of_spans([Span(0, 10), Span(10, 6, prefix_start=0, prefix_len=10)], q.device)
    assert prefixed[0].shape == (16, 2)
    assert torch.equal(attend_ranges(q, k, v, *prefixed, 0.25)[10:], whole[10:])


def test_buckets_and_padding_queries():
    torch.manual_seed(3)
    q, k, v, spans = _packed([KEY_BUCKET + 1])
    starts, counts = ranges_of_spans(spans, q.device)
    counts[0, 1] = 0  # a query that sees nothing (a padding position): zeros
    out = attend_ranges(q, k, v, starts, counts, 0.25)
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    gaps = torch.tensor([[[True, False, True]]])
    with pytest.raises(RuntimeError, match="contiguous"):
        ranges_of_mask(gaps)


def _tiny_llama(rope_type: str = "default"):
    from transformers import LlamaConfig, LlamaForCausalLM

    rope = {"rope_type": rope_type, "rope_theta": 10000.0}
    if rope_type == "dynamic":
        rope["factor"] = 2.0
    config = LlamaConfig(
        vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
        rope_parameters=rope,
    )  # fmt: skip
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval()


def test_make_exact_keeps_the_model_and_tables_its_rotary():
    model = _tiny_llama()
    ids = torch.randint(0, 50, (2, 9))
    with torch.no_grad():
        before = model(ids).logits
        rotary = model.model.rotary_emb
        x = torch.zeros(1)
        cos_before, _ = rotary(x, torch.arange(9)[None])
        make_exact(model)
        after = model(ids).logits
        cos_after, _ = rotary(x, torch.arange(9)[None])
    assert torch.allclose(before, after, atol=1e-5)
    assert torch.equal(cos_after, cos_before)
    assert isinstance(model.model.layers[0].mlp.act_fn, ExactSiLU)
    with pytest.raises(RuntimeError, match="past the model's 64"):
        rotary(x, torch.tensor([[64]]))


def test_a_rotary_that_rescales_per_call_is_refused():
    with pytest.raises(ValueError, match="rotary type 'dynamic'"):
        make_exact(_tiny_llama("dynamic"))
