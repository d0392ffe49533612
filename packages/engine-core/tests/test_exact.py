"""``numerics=exact``'s kernels: a row's (a query's) bits follow from that row alone.

Each test compares bits, not tolerances: the same rows computed in calls of other sizes,
layouts and company must be equal to the last bit, and close to the ordinary kernels."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F

from drivetrain.engine_core.exact_attention import attend_blocks, blocks_of_mask, blocks_of_spans
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


def attend(q, k, v, blocks, scale):
    """Rows ``[N, heads, dim]`` as one batch row."""
    return attend_blocks(q[None], k[None], v[None], blocks, scale)


def _packed(lengths: list[int], heads: int = 4, dim: int = 16, dtype=torch.float32):
    total = sum(lengths)
    q, k, v = (torch.randn(total, heads, dim, dtype=dtype) for _ in range(3))
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    return q, k, v, [Span(s, n) for s, n in zip(starts, lengths, strict=True)]


@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_matches_causal_sdpa_per_document(dtype):
    torch.manual_seed(0)
    q, k, v, spans = _packed([5, 17, 40, 1], dtype=dtype)
    exact = attend(q, k, v, blocks_of_spans(spans, q.device), 16**-0.5)
    as_rows = (t.transpose(0, 1)[None] for t in (q, k, v))
    expected = attend_spans(*as_rows, spans, 0.0, None)[0].transpose(0, 1)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    assert exact.dtype == dtype
    assert torch.allclose(exact.float(), expected.float(), atol=tolerance)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_query_gets_the_same_bits_whatever_else_is_attended(dtype, threads):
    """One document alone, in a packed row with others, and as the rollout meets it: its
    prefill in a left-padded batch, and a decode step of one query over a left-padded cache
    row beside another row (boolean masks)."""
    torch.manual_seed(1)
    q, k, v, spans = _packed([7, 23, 12], dtype=dtype)
    with _threads(threads):
        packed = attend(q, k, v, blocks_of_spans(spans, q.device), 0.25)
        doc = slice(7, 30)  # the second document alone
        alone = attend(q[doc], k[doc], v[doc], blocks_of_spans([Span(0, 23)], q.device), 0.25)
        assert torch.equal(alone, packed[doc])
        # prefill: the document left-padded by 9 in a batch with a full row of 32
        width = 9 + 23
        cache_q, cache_k, cache_v = (
            torch.randn(2, width, *k.shape[1:], dtype=dtype) for _ in range(3)
        )
        cache_q[0, 9:], cache_k[0, 9:], cache_v[0, 9:] = q[doc], k[doc], v[doc]
        visible = torch.ones(2, width, width, dtype=torch.bool).tril()
        visible[0, :, :9] = False
        visible[0, :9] = False
        blocks = blocks_of_mask(visible)
        prefill = attend_blocks(cache_q, cache_k, cache_v, blocks, 0.25)
        assert torch.equal(prefill[9:width], packed[doc])
        assert torch.equal(prefill[:9], torch.zeros_like(prefill[:9]))  # padding queries
        # decode: the last query over its cache row (the other row sees its last 20 keys)
        step = visible[:, -1:].clone()
        step[1, 0, :12] = False
        queries = torch.stack([q[29], cache_q[1, -1]])[:, None]  # [2, 1, h, d]
        decoded = attend_blocks(queries, cache_k, cache_v, blocks_of_mask(step), 0.25)
        assert torch.equal(decoded[0], packed[29])


def test_a_shared_prefix_is_attended_as_the_same_keys_in_place():
    """A span that sees a shared prompt elsewhere in the row equals the prompt and the span
    packed as one document."""
    torch.manual_seed(2)
    q, k, v, _ = _packed([10 + 6])
    whole = attend(q, k, v, blocks_of_spans([Span(0, 16)], q.device), 0.25)
    prefixed = blocks_of_spans([Span(0, 10), Span(10, 6, prefix_start=0, prefix_len=10)], q.device)
    assert torch.equal(attend(q, k, v, prefixed, 0.25)[10:], whole[10:])


def test_a_mask_that_is_not_a_padded_causal_one_is_refused():
    gaps = torch.tensor([[[True, False, True]]])
    with pytest.raises(RuntimeError, match="contiguous"):
        blocks_of_mask(gaps)
    not_causal = torch.ones(1, 2, 3, dtype=torch.bool)
    with pytest.raises(RuntimeError, match="one more key"):
        blocks_of_mask(not_causal)


def test_gradients_flow_and_stay_finite():
    torch.manual_seed(3)
    q, k, v, spans = _packed([3, 18])
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    attend(q, k, v, blocks_of_spans(spans, q.device), 0.25).sum().backward()
    assert all(bool(t.grad.isfinite().all()) and t.grad.abs().sum() > 0 for t in (q, k, v))


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


@pytest.mark.parametrize("dtype", DTYPES)
def test_grouped_query_heads_use_their_own_kv_head(dtype):
    """4 query heads over 2 KV heads: query head ``h`` attends with KV head ``h // 2``, as
    transformers' ``repeat_kv`` pairs them."""
    torch.manual_seed(4)
    spans = [Span(0, 9), Span(9, 21)]
    q = torch.randn(30, 4, 16, dtype=dtype)
    k, v = (torch.randn(30, 2, 16, dtype=dtype) for _ in range(2))
    exact = attend(q, k, v, blocks_of_spans(spans, q.device), 0.25)
    rows = (
        t.transpose(0, 1)[None] for t in (q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1))
    )
    expected = attend_spans(*rows, spans, 0.0, 0.25)[0].transpose(0, 1)
    assert torch.allclose(
        exact.float(), expected.float(), atol=1e-5 if dtype == torch.float32 else 2e-2
    )


def test_a_decode_step_over_a_narrower_block_gets_the_same_bits():
    """A query that sees 13 keys decodes over a block 16 keys wide; in the packed row it sat in
    a block 32 wide (its document's): the same bits."""
    torch.manual_seed(5)
    q, k, v, spans = _packed([30])
    packed = attend(q, k, v, blocks_of_spans(spans, q.device), 0.25)
    step = torch.zeros(1, 1, 30, dtype=torch.bool)
    step[0, 0, :13] = True
    decoded = attend_blocks(q[12][None, None], k[None], v[None], blocks_of_mask(step), 0.25)
    assert torch.equal(decoded[0], packed[12])


def test_modules_without_a_batch_invariant_form_are_refused():
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50))
    with pytest.raises(ValueError, match="no batch-invariant form of LayerNorm"):
        make_exact(model)
    mlp = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.GELU())
    with pytest.raises(ValueError, match="activation GELU"):
        make_exact(mlp)
