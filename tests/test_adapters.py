"""The drop-in entry points on a CPU: facodegen.torch.scaled_dot_product_attention,
facodegen.flash_attn_func and the transformers backend (facodegen.integrations.transformers).

Their signatures, every argument they refuse (refused before anything reaches the GPU), and
their plumbing: facodegen.attention is replaced by a float64 torch implementation of its
contract (FakeAttention), so the layouts, causal alignment, scale, GQA and out= that reach it
are checked against torch SDPA, and so is that q/k/v/out are views of the caller's tensors.
The real kernels are checked in tests/gpu/test_adapters_gpu.py.
"""

from __future__ import annotations

import ast
import inspect
import math
import sys

import pytest

torch = pytest.importorskip("torch")

import facodegen  # noqa: E402
import facodegen.torch as ftorch  # noqa: E402
from facodegen.ops.adapters import flash_attn_func  # noqa: E402

F = torch.nn.functional


class FakeAttention:
    """facodegen.attention's contract in float64 on the CPU, recording each call."""

    def __init__(self):
        self.calls = []

    def __call__(self, q, k, v, *, causal=False, softmax_scale=None, return_lse=False, out=None, lse_out=None,
                 arch=None, causal_alignment="bottom_right", window_size=(-1, -1), softcap=0.0, sinks=None,
                 deterministic=False, **spec_fields):
        assert not spec_fields and arch is None and lse_out is None and isinstance(deterministic, bool)
        assert causal_alignment in ("bottom_right", "top_left")
        batch, seqlen_q, heads_q, head_dim = q.shape
        seqlen_k, heads_kv = k.shape[1], k.shape[2]
        # (v may be narrower: head_dim_v)
        assert k.shape == (batch, seqlen_k, heads_kv, head_dim) and heads_q % heads_kv == 0
        assert v.shape[:3] == k.shape[:3] and v.shape[3] <= head_dim
        assert q.stride(-1) == k.stride(-1) == v.stride(-1) == 1, "head_dim must be contiguous"
        self.calls.append(dict(q=q, k=k, v=v, causal=causal, softmax_scale=softmax_scale, out=out,
                               causal_alignment=causal_alignment, return_lse=return_lse, window_size=window_size,
                               softcap=softcap, sinks=sinks, deterministic=deterministic))
        scale = 1 / math.sqrt(head_dim) if softmax_scale is None else softmax_scale
        group = heads_q // heads_kv
        qd = q.double().transpose(1, 2)
        kd = k.double().transpose(1, 2).repeat_interleave(group, dim=1)
        vd = v.double().transpose(1, 2).repeat_interleave(group, dim=1)
        s = scale * qd @ kd.transpose(-1, -2)
        if softcap:
            s = softcap * torch.tanh(s / softcap)
        if tuple(window_size) != (-1, -1):
            from facodegen.verify.reference import window_mask
            hidden = window_mask(torch.arange(seqlen_q).numpy(), torch.arange(seqlen_k).numpy(), seqlen_q, seqlen_k,
                                 window_size, causal, causal_alignment == "top_left")
            s = s.masked_fill(torch.from_numpy(hidden), -math.inf)
        elif causal:
            shift = seqlen_k - seqlen_q if causal_alignment == "bottom_right" else 0
            rows = torch.arange(seqlen_q)[:, None]
            s = s.masked_fill(torch.arange(seqlen_k)[None, :] > rows + shift, -math.inf)
        lse = torch.logsumexp(s, dim=-1)                                     # -inf on rows with no key
        if sinks is not None:     # (heads_q,) float32 logits in each row's denominator, no value
            assert sinks.dtype == torch.float32 and sinks.shape == (heads_q,)
            lse = torch.logaddexp(lse, sinks.double()[None, :, None])
        p = torch.exp(s - lse[..., None]).nan_to_num(0.0)
        o = (p @ vd).transpose(1, 2).to(q.dtype)
        if out is not None:
            assert out.shape == (*q.shape[:3], v.shape[3]) and out.stride(-1) == 1
            out.copy_(o)
            o = out
        return (o, lse.float()) if return_lse else o


class FakeVarlen:
    """facodegen.attention_varlen's contract on the CPU: each sequence through FakeAttention (so its
    bottom-right causal, scale and GQA), recording each call (its boundaries and lengths)."""

    def __init__(self, attention):
        self.attention, self.calls = attention, []

    def __call__(self, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, causal=False,
                 softmax_scale=None, **variants):
        assert q.dim() == k.dim() == v.dim() == 3 and cu_seqlens_q.dtype == cu_seqlens_k.dtype == torch.int32
        assert isinstance(max_seqlen_q, int) and isinstance(max_seqlen_k, int)
        assert set(variants) <= {"window_size", "softcap", "sinks"}
        self.calls.append(dict(q=q, k=k, v=v, cu_q=cu_seqlens_q.tolist(), cu_k=cu_seqlens_k.tolist(),
                               max_q=max_seqlen_q, max_k=max_seqlen_k, causal=causal, softmax_scale=softmax_scale,
                               **variants))
        out = q.new_zeros(q.shape[0], q.shape[1], v.shape[2])
        for (q0, q1), (k0, k1) in zip(zip(self.calls[-1]["cu_q"], self.calls[-1]["cu_q"][1:]),
                                      zip(self.calls[-1]["cu_k"], self.calls[-1]["cu_k"][1:])):
            assert q1 - q0 <= max_seqlen_q and k1 - k0 <= max_seqlen_k
            if q1 > q0 and k1 > k0:
                out[q0:q1] = self.attention(q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], causal=causal,
                                            softmax_scale=softmax_scale, **variants)[0]
        self.attention.calls.clear()
        return out


@pytest.fixture
def fake(monkeypatch):
    f = FakeAttention()
    monkeypatch.setattr(facodegen, "attention", f)
    f.varlen = FakeVarlen(FakeAttention())
    monkeypatch.setattr(facodegen, "attention_varlen", f.varlen)
    return f


def _same_storage(a, b) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def _bottom_right(seqlen_q, seqlen_k):
    return torch.ones(seqlen_q, seqlen_k, dtype=torch.bool).tril(seqlen_k - seqlen_q)


def _close(x, ref):
    assert x.shape == ref.shape and x.dtype == ref.dtype
    torch.testing.assert_close(x, ref, rtol=2e-5, atol=2e-5)


# ------------------------------------------------------------------------------------------------
# signatures
# ------------------------------------------------------------------------------------------------

SDPA_PARAMS = [("query", None, "P"), ("key", None, "P"), ("value", None, "P"), ("attn_mask", None, "P"),
               ("dropout_p", 0.0, "P"), ("is_causal", False, "P"), ("scale", None, "K"), ("enable_gqa", False, "K")]

FA2_PARAMS = [("q", None), ("k", None), ("v", None), ("dropout_p", 0.0), ("softmax_scale", None),
              ("causal", False), ("window_size", (-1, -1)), ("softcap", 0.0), ("alibi_slopes", None),
              ("deterministic", False), ("return_attn_probs", False)]


def _params(fn):
    kinds = {inspect.Parameter.POSITIONAL_OR_KEYWORD: "P", inspect.Parameter.KEYWORD_ONLY: "K"}
    return [(p.name, None if p.default is inspect.Parameter.empty else p.default, kinds[p.kind])
            for p in inspect.signature(fn).parameters.values()]


def _torch_sdpa_documented():
    """Names and defaults of torch's SDPA from its docstring (the builtin has no inspect signature)."""
    doc = F.scaled_dot_product_attention.__doc__
    head = doc[:doc.index("->")].strip()
    fn = ast.parse(f"def {head}: pass").body[0]
    args = fn.args.args + fn.args.kwonlyargs
    defaults = [None] * (len(fn.args.args) - len(fn.args.defaults)) + fn.args.defaults + fn.args.kw_defaults
    return [(a.arg, None if d is None else ast.literal_eval(d)) for a, d in zip(args, defaults)]


def test_sdpa_signature_matches_torch():
    ours = _params(ftorch.scaled_dot_product_attention)
    assert ours == SDPA_PARAMS
    try:
        theirs = _params(F.scaled_dot_product_attention)
    except (TypeError, ValueError):   # a builtin without __text_signature__ (torch 2.13): its documented form
        assert [(n, d) for n, d, _ in ours] == _torch_sdpa_documented()
    else:
        assert ours == theirs


def test_sdpa_takes_as_many_positional_arguments_as_torch():
    """torch's SDPA takes scale and enable_gqa by keyword only (its native schema has a '*')."""
    q = torch.randn(1, 1, 2, 64)
    with pytest.raises(TypeError):
        F.scaled_dot_product_attention(q, q, q, None, 0.0, False, 0.5)
    with pytest.raises(TypeError):
        ftorch.scaled_dot_product_attention(q, q, q, None, 0.0, False, 0.5)


def test_flash_attn_func_signature_is_flash_attention_2s():
    assert [(n, d) for n, d, _ in _params(flash_attn_func)] == FA2_PARAMS
    assert all(kind == "P" for _, _, kind in _params(flash_attn_func)), "FA2's parameters are all positional"
    assert facodegen.flash_attn_func is flash_attn_func and "flash_attn_func" in facodegen.__all__


# ------------------------------------------------------------------------------------------------
# refused arguments: checked before anything reaches facodegen.attention (CPU tensors are fine)
# ------------------------------------------------------------------------------------------------

def _bhsd(batch=2, heads=4, seqlen=8, head_dim=64, dtype=torch.float32):
    return torch.randn(batch, heads, seqlen, head_dim, dtype=dtype)


@pytest.mark.parametrize("kwargs, error, name", [
    (dict(attn_mask=torch.ones(8, 8, dtype=torch.bool)), NotImplementedError, "attn_mask"),
    (dict(dropout_p=0.1), NotImplementedError, "dropout_p"),
])
def test_sdpa_refuses(fake, kwargs, error, name):
    q = _bhsd()
    with pytest.raises(error, match=name):
        ftorch.scaled_dot_product_attention(q, q, q, **kwargs)
    assert not fake.calls


def test_sdpa_attn_mask_message(fake):
    q = _bhsd()
    with pytest.raises(NotImplementedError) as err:
        ftorch.scaled_dot_product_attention(q, q, q, attn_mask=torch.zeros(8, 8))
    assert str(err.value) == ("attn_mask is not supported yet (facodegen runs causal or no mask; "
                              "use is_causal=True)")


def test_sdpa_refuses_bad_shapes(fake):
    q = _bhsd(heads=8)
    kv = _bhsd(heads=2)
    with pytest.raises(ValueError, match="enable_gqa"):
        ftorch.scaled_dot_product_attention(q, kv, kv)
    with pytest.raises(ValueError, match="divide"):
        ftorch.scaled_dot_product_attention(q, _bhsd(heads=3), _bhsd(heads=3), enable_gqa=True)
    with pytest.raises(ValueError, match="query"):
        ftorch.scaled_dot_product_attention(q[0], q[0], q[0])                    # 3-D: no batch dim
    with pytest.raises(ValueError, match="batch dims"):
        ftorch.scaled_dot_product_attention(q, q[:1], q[:1])                     # broadcasting batch
    with pytest.raises(ValueError, match="head_dim"):
        ftorch.scaled_dot_product_attention(q, _bhsd(heads=8, head_dim=128), q)
    with pytest.raises(ValueError, match="value"):
        ftorch.scaled_dot_product_attention(q, q, _bhsd(heads=8, seqlen=9))
    with pytest.raises(TypeError, match="key"):
        ftorch.scaled_dot_product_attention(q, q.numpy(), q)
    # batch dims that no view merges into one: the adapter never copies
    q5 = torch.randn(3, 2, 4, 8, 64).transpose(0, 1)
    with pytest.raises(ValueError, match="query.*without a copy"):
        ftorch.scaled_dot_product_attention(q5, q5, q5)
    assert not fake.calls


@pytest.mark.parametrize("kwargs, name", [
    (dict(dropout_p=0.1), "dropout_p"),
    (dict(alibi_slopes=torch.ones(4)), "alibi_slopes"),
])
def test_flash_attn_func_refuses(fake, kwargs, name):
    q = _bhsd().transpose(1, 2)
    with pytest.raises(NotImplementedError, match=name):
        flash_attn_func(q, q, q, **kwargs)
    assert not fake.calls


def test_flash_attn_func_accepts_what_flash_attention_treats_as_off(fake):
    q = _bhsd().transpose(1, 2)
    flash_attn_func(q, q, q, window_size=[-1, -1], softcap=0.0, deterministic=True)
    flash_attn_func(q, q, q, softcap=-1.0)   # FA2: softcap <= 0 is off
    flash_attn_func(q, q, q, window_size=(-5, -2))   # FA2: any negative side is unbounded
    assert len(fake.calls) == 3
    assert all(c["window_size"] == (-1, -1) and c["softcap"] == 0.0 for c in fake.calls)


@pytest.mark.parametrize("kwargs", [dict(window_size=(3, 0)), dict(window_size=(-1, 2)), dict(softcap=30.0),
                                    dict(window_size=(2, 1), softcap=5.0, causal=True)])
def test_flash_attn_func_passes_window_and_softcap(fake, kwargs):
    """window_size and softcap reach facodegen.attention as given (FlashAttention's meaning), and the
    result is the float64 reference's."""
    from facodegen.verify.reference import attention_reference
    q = _bhsd().transpose(1, 2)
    k = torch.randn(q.shape[0], 9, q.shape[2], q.shape[3])
    out, lse, _ = flash_attn_func(q, k, k, return_attn_probs=True, **kwargs)
    call = fake.calls[-1]
    assert call["window_size"] == kwargs.get("window_size", (-1, -1)) and call["softcap"] == kwargs.get("softcap", 0.0)
    ref, ref_lse = attention_reference(q, k, k, causal=kwargs.get("causal", False),
                                       window_size=kwargs.get("window_size", (-1, -1)), softcap=kwargs.get("softcap", 0.0))
    _close(out, torch.from_numpy(ref).to(out.dtype))
    torch.testing.assert_close(lse.double(), torch.from_numpy(ref_lse), rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------------------------
# plumbing, against torch SDPA (float32 CPU)
# ------------------------------------------------------------------------------------------------

SHAPES = [   # batch, heads_q, heads_kv, seqlen_q, seqlen_k, head_dim
    (2, 4, 4, 16, 16, 64),
    (2, 4, 4, 5, 12, 64),
    (2, 4, 4, 12, 5, 64),
    (1, 8, 2, 7, 19, 128),
    (3, 6, 1, 1, 9, 64),
]


def _qkv_bhsd(shape, seed=0):
    batch, hq, hkv, sq, sk, d = shape
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(batch, hq, sq, d, generator=g), torch.randn(batch, hkv, sk, d, generator=g),
            torch.randn(batch, hkv, sk, d, generator=g))


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("scale", [None, 0.3])
def test_sdpa_matches_torch(fake, shape, causal, scale):
    q, k, v = _qkv_bhsd(shape)
    gqa = shape[1] != shape[2]
    out = ftorch.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, enable_gqa=gqa)
    _close(out, F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, enable_gqa=gqa))
    assert out.is_contiguous()

    (call,) = fake.calls
    assert call["causal"] is causal and call["causal_alignment"] == "top_left" and call["softmax_scale"] == scale
    for name, x in (("q", q), ("k", k), ("v", v)):
        assert call[name].data_ptr() == x.data_ptr() and _same_storage(call[name], x), f"{name} was copied"
        assert call[name].shape == x.transpose(1, 2).shape
    assert _same_storage(call["out"], out) and call["out"].data_ptr() == out.data_ptr(), "out= must alias the result"


@pytest.mark.parametrize("shape", [(2, 4, 2, 10, 17, 64), (2, 4, 4, 17, 10, 64)], ids=str)
def test_sdpa_records_a_gradient_without_out(fake, shape):
    """Inputs that require grad: facodegen.attention without out= (out= records none), its result seen in
    SDPA's layout; the gradients are torch SDPA's (top-left causal, GQA)."""
    q, k, v = (x.requires_grad_(True) for x in _qkv_bhsd(shape))
    gqa = shape[1] != shape[2]
    out = ftorch.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    (call,) = fake.calls
    assert call["out"] is None and call["causal_alignment"] == "top_left" and out.grad_fn is not None
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    got = torch.autograd.grad(out, (q, k, v), g)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    _close(out, ref)
    for x, r in zip(got, torch.autograd.grad(ref, (q, k, v), g)):
        _close(x, r)


@pytest.mark.parametrize("causal", [False, True])
def test_sdpa_takes_a_narrower_value_head_dim(fake, causal):
    """SDPA's Ev != E: value (..., head_dim_v) reaches facodegen.attention as it is; the result is
    (..., seqlen_q, head_dim_v) and the default scale 1/sqrt(E)."""
    g = torch.Generator().manual_seed(3)
    q, k = torch.randn(2, 4, 9, 192, generator=g), torch.randn(2, 2, 11, 192, generator=g)
    v = torch.randn(2, 2, 11, 128, generator=g)
    out = ftorch.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
    assert out.shape == (2, 4, 9, 128) and out.is_contiguous()
    _close(out, F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True))
    (call,) = fake.calls
    assert call["v"].shape == (2, 11, 2, 128) and call["out"].data_ptr() == out.data_ptr()


def test_sdpa_positional_arguments(fake):
    q, k, v = _qkv_bhsd((2, 4, 4, 6, 10, 64))
    _close(ftorch.scaled_dot_product_attention(q, k, v, None, 0.0, True),
           F.scaled_dot_product_attention(q, k, v, None, 0.0, True))


def test_sdpa_more_batch_dims_and_strided_inputs(fake):
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 3, 4, 9, 64, generator=g)
    # K and V as views of one packed (batch..., seqlen, 2, heads, d) buffer: strided, never copied
    kv = torch.randn(2, 3, 11, 2, 4, 64, generator=g)
    k, v = kv[..., 0, :, :].transpose(-2, -3), kv[..., 1, :, :].transpose(-2, -3)
    out = ftorch.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert out.shape == (2, 3, 4, 9, 64) and out.is_contiguous()
    _close(out, F.scaled_dot_product_attention(q, k, v, is_causal=True))
    (call,) = fake.calls
    assert call["k"].data_ptr() == k.data_ptr() and _same_storage(call["k"], kv)
    assert call["v"].data_ptr() == v.data_ptr() and _same_storage(call["v"], kv)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("causal", [False, True])
def test_flash_attn_func_matches_torch(fake, shape, causal):
    qh, kh, vh = _qkv_bhsd(shape, seed=2)
    q, k, v = qh.transpose(1, 2), kh.transpose(1, 2), vh.transpose(1, 2)   # (batch, seqlen, heads, d) views
    sq, sk = shape[3], shape[4]
    mask = _bottom_right(sq, sk) if causal else None
    ref = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, enable_gqa=True).transpose(1, 2)
    ref = ref.nan_to_num(0.0)   # rows with no visible key are zeros in FlashAttention

    out = flash_attn_func(q, k, v, causal=causal)
    _close(out, ref)
    out2, lse, probs = flash_attn_func(q, k, v, 0.0, None, causal, return_attn_probs=True)
    _close(out2, ref)
    assert probs is None and lse.shape == (shape[0], shape[1], sq) and lse.dtype == torch.float32
    scores = (qh @ kh.repeat_interleave(shape[1] // shape[2], dim=1).transpose(-1, -2)) / math.sqrt(shape[5])
    if mask is not None:
        scores = scores.masked_fill(~mask, -math.inf)
    _close(lse, torch.logsumexp(scores, dim=-1))

    for call in fake.calls:
        assert call["causal"] is causal and call["causal_alignment"] == "bottom_right"
        assert call["q"] is q and call["k"] is k and call["v"] is v


def test_flash_attn_func_positional_scale(fake):
    q, k, v = (x.transpose(1, 2) for x in _qkv_bhsd((1, 2, 2, 4, 4, 64)))
    flash_attn_func(q, k, v, 0.0, 0.25, True)
    assert fake.calls[0]["softmax_scale"] == 0.25 and fake.calls[0]["causal"] is True


@pytest.mark.parametrize("deterministic", [False, True])
def test_flash_attn_func_passes_deterministic_to_the_backward(fake, deterministic):
    """FlashAttention's deterministic is the backward's: it reaches facodegen.attention, which hands it to
    the backward it records (tests/test_backward.py checks that hand-over)."""
    q, k, v = (x.transpose(1, 2) for x in _qkv_bhsd((1, 2, 2, 4, 4, 64)))
    flash_attn_func(q, k, v, causal=True, deterministic=deterministic)
    assert fake.calls[0]["deterministic"] is deterministic


# ------------------------------------------------------------------------------------------------
# transformers backend
# ------------------------------------------------------------------------------------------------

def test_register_without_transformers(monkeypatch):
    from facodegen.integrations import transformers as fa_tf
    monkeypatch.setitem(sys.modules, "transformers", None)   # import transformers -> ImportError
    with pytest.raises(ImportError, match="pip install transformers"):
        fa_tf.register()


class _Module:
    is_causal = True


def _hf_qkv(batch=2, hq=8, hkv=2, sq=6, sk=6, d=64, seed=3):
    """(batch, heads, seqlen, d) views of (batch, seqlen, heads, d) projections, as transformers makes them."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(batch, sq, hq, d, generator=g).transpose(1, 2),
            torch.randn(batch, sk, hkv, d, generator=g).transpose(1, 2),
            torch.randn(batch, sk, hkv, d, generator=g).transpose(1, 2))


@pytest.mark.parametrize("sq, sk", [(6, 6), (1, 9), (4, 9)])
def test_transformers_attention_forward(fake, sq, sk):
    from facodegen.integrations.transformers import attention_forward
    q, k, v = _hf_qkv(sq=sq, sk=sk)
    out, weights = attention_forward(_Module(), q, k, v, None, scaling=0.2)
    assert weights is None and out.shape == (2, sq, 8, 64)
    mask = _bottom_right(sq, sk)
    _close(out, F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.2, enable_gqa=True).transpose(1, 2))
    (call,) = fake.calls
    assert call["causal"] is (sq > 1) and call["causal_alignment"] == "bottom_right" and call["softmax_scale"] == 0.2
    assert call["k"].shape[2] == 2, "K/V heads must reach the kernel unrepeated"
    for name, x in (("q", q), ("k", k), ("v", v)):
        assert call[name].data_ptr() == x.data_ptr() and _same_storage(call[name], x), f"{name} was copied"


def test_transformers_masks(fake):
    from facodegen.integrations.transformers import _causal_from_mask, attention_forward
    q, k, v = _hf_qkv(sq=4, sk=7)
    causal_bool = _bottom_right(4, 7)[None, None].expand(2, 1, 4, 7)
    additive = torch.zeros(2, 1, 4, 7).masked_fill(~causal_bool, torch.finfo(torch.float32).min)
    assert _causal_from_mask(None, 4, 7, True) is True
    assert _causal_from_mask(torch.ones(2, 7, dtype=torch.bool), 4, 7, True) is True
    assert _causal_from_mask(torch.ones(2, 7, dtype=torch.long), 4, 7, False) is False
    assert _causal_from_mask(causal_bool, 4, 7, False) is True
    assert _causal_from_mask(additive, 4, 7, False) is True
    assert _causal_from_mask(torch.ones(2, 1, 4, 7, dtype=torch.bool), 4, 7, True) is False
    padded_4d = causal_bool.clone()
    padded_4d[1, :, :, :2] = False
    top_left = torch.ones(4, 7, dtype=torch.bool).tril()[None, None].expand(2, 1, 4, 7)
    for mask in (padded_4d, top_left):
        with pytest.raises(NotImplementedError, match="a 4-D attention mask that hides more than the causal pattern"):
            attention_forward(_Module(), q, k, v, mask)
    with pytest.raises(ValueError, match="a 2-D padding mask has one entry per key"):
        attention_forward(_Module(), q, k, v, torch.ones(2, 9, dtype=torch.bool))
    assert not fake.calls and not fake.varlen.calls


@pytest.mark.parametrize("kwargs, name", [
    (dict(dropout=0.1), "dropout"),
    (dict(position_bias=torch.zeros(1, 8, 6, 6)), "position_bias"),
])
def test_transformers_refuses(fake, kwargs, name):
    from facodegen.integrations.transformers import attention_forward
    q, k, v = _hf_qkv()
    with pytest.raises(NotImplementedError, match=name):
        attention_forward(_Module(), q, k, v, None, **kwargs)
    assert not fake.calls


def test_transformers_accepts_what_flash_attention_2_accepts(fake):
    from facodegen.integrations.transformers import attention_forward
    q, k, v = _hf_qkv(batch=1)
    attention_forward(_Module(), q, k, v, None, sliding_window=6, softcap=None, s_aux=None, output_attentions=True,
                      position_ids=torch.arange(3, 9)[None])
    assert len(fake.calls) == 1 and not fake.varlen.calls
    with pytest.raises(NotImplementedError, match="not packed sequences this backend can split"):
        attention_forward(_Module(), q, k, v, None, position_ids=torch.tensor([[3, 4, 5, 0, 1, 2]]))
    out, _ = attention_forward(_Module(), q, k, v, None, is_causal=False)
    assert fake.calls[-1]["causal"] is False


def _eager_variants_reference(q, k, v, scale, window, softcap, sinks):
    """transformers' eager attention of a causal layer with a sliding window, softcap and sinks, written out
    ((batch, heads, seqlen, d) in, (batch, seqlen, heads, d) out): query i (the keys' last rows) sees key j
    where j <= i' and j > i' - window (masking_utils' sliding_window_overlay), logits softcap * tanh(s /
    softcap), each head's sink logit a column of the softmax whose probability is dropped (gpt-oss)."""
    batch, heads_q, seqlen_q, _ = q.shape
    seqlen_k, group = k.shape[2], heads_q // k.shape[1]
    keys, values = (x.double().repeat_interleave(group, dim=1) for x in (k, v))
    s = scale * q.double() @ keys.transpose(-1, -2)
    s = softcap * torch.tanh(s / softcap)
    row = torch.arange(seqlen_q)[:, None] + seqlen_k - seqlen_q
    col = torch.arange(seqlen_k)[None]
    s = s.masked_fill(~((col <= row) & (col > row - window)), -math.inf)
    logits = torch.cat([s, sinks.double()[None, :, None, None].expand(batch, heads_q, seqlen_q, 1)], dim=-1)
    return (logits.softmax(-1)[..., :-1] @ values).transpose(1, 2).to(q.dtype)


@pytest.mark.parametrize("sq, sk", [(6, 9), (9, 9), (1, 9)])
def test_transformers_passes_the_variants_as_flash_attention_2_takes_them(fake, sq, sk):
    """sliding_window (narrower than the keys), softcap and s_aux reach facodegen.attention as window_size
    (sliding_window - 1 both sides: a causal row sees itself and sliding_window - 1 keys before), softcap and
    float32 sinks, and give transformers' eager attention; a window as wide as the keys, softcap None or 0 and
    s_aux None are no variant (the plain call, whose fast path a variant argument would leave)."""
    from facodegen.integrations.transformers import attention_forward
    q, k, v = _hf_qkv(sq=sq, sk=sk)
    sinks = torch.randn(8, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    out, _ = attention_forward(_Module(), q, k, v, None, scaling=0.2, sliding_window=4, softcap=2.0, s_aux=sinks)
    (call,) = fake.calls
    assert call["window_size"] == (3, 3) and call["softcap"] == 2.0 and call["causal"] is (sq > 1)
    assert call["sinks"].dtype == torch.float32 and torch.equal(call["sinks"], sinks.float())
    _close(out, _eager_variants_reference(q, k, v, 0.2, 4, 2.0, sinks.float()))
    fake.calls.clear()
    attention_forward(_Module(), q, k, v, None, sliding_window=sk, softcap=0.0, s_aux=None)
    attention_forward(_Module(), q, k, v, None, softcap=None)
    assert [(c["window_size"], c["softcap"], c["sinks"]) for c in fake.calls] == [((-1, -1), 0.0, None)] * 2
    with pytest.raises(ValueError, match="sliding_window must be a positive integer"):
        attention_forward(_Module(), q, k, v, None, sliding_window=0)


def test_transformers_padded_batch_passes_the_variants(fake):
    """A padded batch's packed call (attention_varlen) takes the same variants, per sequence."""
    from facodegen.integrations.transformers import attention_forward
    q, k, v = _hf_qkv(batch=2, sq=7, sk=7)
    keys = torch.ones(2, 7, dtype=torch.long)
    keys[0, :2] = 0
    sinks = torch.randn(8, generator=torch.Generator().manual_seed(5))
    out, _ = attention_forward(_Module(), q, k, v, keys, scaling=0.3, sliding_window=3, softcap=1.5, s_aux=sinks)
    (call,) = fake.varlen.calls
    assert call["window_size"] == (2, 2) and call["softcap"] == 1.5 and torch.equal(call["sinks"], sinks)
    assert not out[0, :2].any()
    for b, first in ((0, 2), (1, 0)):
        _close(out[b:b + 1, first:], _eager_variants_reference(q[b:b + 1, :, first:], k[b:b + 1, :, first:],
                                                               v[b:b + 1, :, first:], 0.3, 3, 1.5, sinks))


def _per_row_reference(q, k, v, queries, keys, causal, scale):
    """(batch, seqlen_q, heads_q, d) of each row on its own tokens (torch SDPA, bottom-right causal), zeros at
    the padded query positions: what flash_attention_2 returns for a padded batch."""
    out = torch.zeros(q.shape, dtype=q.dtype)      # (batch, heads_q, seqlen_q, d), as transformers passes q
    for b in range(q.shape[0]):
        rows, cols = queries[b].nonzero().flatten(), keys[b].nonzero().flatten()
        mask = _bottom_right(len(rows), len(cols)) if causal else None
        out[b][:, rows] = F.scaled_dot_product_attention(q[b:b + 1, :, rows], k[b:b + 1, :, cols], v[b:b + 1, :, cols],
                                                         attn_mask=mask, scale=scale, enable_gqa=True)[0]
    return out.transpose(1, 2)


@pytest.mark.parametrize("sq, sk, side", [(6, 6, "right"), (6, 6, "left"), (1, 9, "left"), (3, 9, "left")],
                         ids=["prefill-right", "prefill-left", "decode", "chunk"])
def test_transformers_padded_batch_runs_on_packed_sequences(fake, sq, sk, side):
    """A 2-D padding mask that hides keys: the tokens gathered into packed sequences (attention_varlen, the
    K/V heads unrepeated), each row's attention on its own tokens, zeros at padded query positions (as
    flash_attention_2); the queries are the keys' tokens, one per row in a decode step, else the keys' last
    seqlen_q (left padding)."""
    from facodegen.integrations.transformers import attention_forward
    q, k, v = _hf_qkv(batch=3, sq=sq, sk=sk)
    keys = torch.ones(3, sk, dtype=torch.long)
    if side == "right":
        keys[0, 4:], keys[2, 1:] = 0, 0
    else:
        keys[0, :2], keys[2, :sk - 1] = 0, 0
    queries = (keys if sq == sk else keys[:, -sq:]).bool() if sq > 1 else torch.ones(3, 1, dtype=torch.bool)
    out, _ = attention_forward(_Module(), q, k, v, keys, scaling=0.3)
    _close(out, _per_row_reference(q, k, v, queries, keys.bool(), sq > 1, 0.3))
    (call,) = fake.varlen.calls
    lengths_q, lengths_k = queries.sum(-1).tolist(), keys.sum(-1).tolist()
    assert call["cu_k"] == [0, *torch.tensor(lengths_k).cumsum(0).tolist()] and call["max_k"] == max(lengths_k)
    assert call["cu_q"] == [0, *torch.tensor(lengths_q).cumsum(0).tolist()] and call["max_q"] == max(lengths_q)
    assert call["k"].shape == (sum(lengths_k), 2, 64) and call["causal"] is (sq > 1) and not fake.calls


def test_transformers_reads_a_padding_mask_once_for_every_layer(fake, monkeypatch):
    """The model hands every layer the same mask tensor: its gather (two nonzero calls, a host sync each, and
    the lengths' max) is worked out at the first layer only; an in-place change of the mask is read again."""
    from facodegen.integrations.transformers import attention_forward
    calls = []
    real = torch.Tensor.nonzero
    monkeypatch.setattr(torch.Tensor, "nonzero", lambda self, *a, **k: calls.append(1) or real(self, *a, **k))
    q, k, v = _hf_qkv(batch=2, sq=6, sk=6)
    mask = torch.ones(2, 6, dtype=torch.long)
    mask[0, :2] = 0
    first = [attention_forward(_Module(), q, k, v, mask)[0] for _ in range(3)]     # three layers
    assert len(calls) == 2 and all(torch.equal(x, first[0]) for x in first)
    assert [c["cu_q"] for c in fake.varlen.calls] == [[0, 4, 10]] * 3
    mask[1, :1] = 0                                                                # (a new version)
    attention_forward(_Module(), q, k, v, mask)
    assert len(calls) == 4 and fake.varlen.calls[-1]["cu_q"] == [0, 4, 9]
    attention_forward(_Module(), q[:, :, -1:], k, v, mask)                         # another seqlen_q: a decode step
    assert len(calls) == 6 and fake.varlen.calls[-1]["cu_q"] == [0, 1, 2]


def test_transformers_padded_batch_takes_gradients_through_the_gather():
    """autograd through the gather and scatter (the varlen call faked by differentiable torch ops): no
    gradient reaches a padded position."""
    from facodegen.integrations import transformers as fa_tf
    fake_attention = FakeAttention()
    varlen = FakeVarlen(fake_attention)
    q, k, v = (x.detach().requires_grad_(True) for x in _hf_qkv(batch=2, sq=5, sk=5))
    keys = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    original = facodegen.attention_varlen
    facodegen.attention_varlen = varlen
    try:
        out, _ = fa_tf.attention_forward(_Module(), q, k, v, keys)
    finally:
        facodegen.attention_varlen = original
    out.float().square().sum().backward()
    assert not q.grad[0, :, 3:].any() and not k.grad[0, :, 3:].any() and not v.grad[0, :, 3:].any()
    assert q.grad[0, :, :3].abs().sum() > 0 and k.grad[1].abs().sum() > 0


def test_transformers_packed_sequences(fake):
    """A batch of one holding several sequences: the cu_seq_lens kwargs (transformers' padding-free
    collator, max_length given or not) or position_ids restarting at 0 give the same packed call."""
    from facodegen.integrations.transformers import attention_forward
    q, k, v = _hf_qkv(batch=1, sq=9, sk=9)
    cu = torch.tensor([0, 4, 5, 9], dtype=torch.int64)
    positions = torch.tensor([[0, 1, 2, 3, 0, 0, 1, 2, 3]])
    outs = [attention_forward(_Module(), q, k, v, None, cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=4,
                              max_length_k=4)[0],
            attention_forward(_Module(), q, k, v, None, cu_seq_lens_q=cu, cu_seq_lens_k=cu)[0],
            attention_forward(_Module(), q, k, v, None, position_ids=positions)[0]]
    ones = torch.ones(1, 9, dtype=torch.bool)
    for out in outs:
        for a, b in ((0, 4), (4, 5), (5, 9)):
            _close(out[:, a:b], _per_row_reference(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], ones[:, a:b],
                                                   ones[:, a:b], True, 0.125))
    assert [(c["cu_q"], c["cu_k"], c["max_q"], c["causal"]) for c in fake.varlen.calls] == [([0, 4, 5, 9],) * 2
                                                                                          + (4, True)] * 3
    assert not fake.calls
    with pytest.raises(ValueError, match="cu_seq_lens_q and cu_seq_lens_k come together"):
        attention_forward(_Module(), q, k, v, None, cu_seq_lens_q=cu)


# a tiny random Llama, float32 on the CPU, facodegen.attention faked: the whole model path

def _tiny_llama(attn_implementation, state_dict=None):
    transformers = pytest.importorskip("transformers")
    from facodegen.integrations.transformers import register
    register()
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                                      max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation)
    assert model.config._attn_implementation == attn_implementation
    if state_dict is not None:
        model.load_state_dict(state_dict)
    return model.eval()


def test_transformers_register():
    transformers = pytest.importorskip("transformers")
    from facodegen.integrations.transformers import attention_forward, register
    register()
    assert transformers.AttentionInterface()["facodegen"] is attention_forward
    masking = pytest.importorskip("transformers.masking_utils")
    if hasattr(masking, "AttentionMaskInterface"):
        assert masking.AttentionMaskInterface()["facodegen"] is masking.AttentionMaskInterface()["flash_attention_2"]


@torch.no_grad()
def test_transformers_llama_matches_sdpa(fake):
    sdpa = _tiny_llama("sdpa")
    ours = _tiny_llama("facodegen", sdpa.state_dict())
    ids = torch.randint(3, 128, (2, 12), generator=torch.Generator().manual_seed(0))
    _close(ours(ids).logits, sdpa(ids).logits)
    assert len(fake.calls) == 2 and all(c["causal"] for c in fake.calls)
    assert fake.calls[0]["q"].shape == (2, 12, 4, 64) and fake.calls[0]["k"].shape == (2, 12, 2, 64)

    fake.calls.clear()
    mask = torch.ones_like(ids)
    want = sdpa.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False, use_cache=True)
    got = ours.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False, use_cache=True)
    assert torch.equal(got, want)
    decode = [c for c in fake.calls if c["q"].shape[1] == 1]
    assert decode and all(c["causal"] is False and c["k"].shape[1] > 12 for c in decode)


@torch.no_grad()
def test_transformers_llama_padded_batch_matches_sdpa(fake):
    """A left-padded batch through the model and generate(): facodegen's packed call matches SDPA's masked
    one at every real token, and greedy generation gives the same tokens."""
    sdpa = _tiny_llama("sdpa")
    ours = _tiny_llama("facodegen", sdpa.state_dict())
    ids = torch.randint(3, 128, (2, 8), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    real = mask.bool()
    _close(ours(ids, attention_mask=mask).logits[real], sdpa(ids, attention_mask=mask).logits[real])
    assert fake.varlen.calls and not fake.calls
    want = sdpa.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, use_cache=True)
    assert torch.equal(ours.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, use_cache=True), want)


@torch.no_grad()
def test_transformers_llama_packed_sequences_match_each_sequence_alone(fake):
    """Padding-free packing (transformers' DataCollatorWithFlattening: one row, position_ids restarting at
    0): each sequence's logits are those of the sequence run alone through SDPA."""
    sdpa = _tiny_llama("sdpa")
    ours = _tiny_llama("facodegen", sdpa.state_dict())
    g = torch.Generator().manual_seed(2)
    seqs = [torch.randint(3, 128, (1, n), generator=g) for n in (5, 1, 9)]
    ids = torch.cat(seqs, dim=1)
    positions = torch.cat([torch.arange(s.shape[1]) for s in seqs])[None]
    got = ours(ids, position_ids=positions).logits
    start = 0
    for s in seqs:
        _close(got[:, start:start + s.shape[1]], sdpa(s).logits)
        start += s.shape[1]
    assert fake.varlen.calls and all(c["cu_q"] == [0, 5, 6, 15] for c in fake.varlen.calls) and not fake.calls


# the variants in whole models: Mistral (sliding window), Gemma-2 (softcap and sliding layers), gpt-oss (sinks
# and sliding layers), each a tiny random one in float32 beside transformers' eager attention

VARIANT_MODELS = ("gemma2", "gpt_oss", "mistral")


def variant_model_config(family: str, sliding_window: int, **sizes):
    """A tiny random config of ``family`` (Mistral: a sliding window; Gemma-2: softcap 5 and sliding layers; gpt-oss:
    sinks and sliding layers), facodegen registered; ``sizes``: the config's other fields (vocab, hidden, heads)."""
    transformers = pytest.importorskip("transformers")
    from facodegen.integrations.transformers import register
    register()
    name, fields = {
        "mistral": ("MistralConfig", {}),
        "gemma2": ("Gemma2Config", dict(attn_logit_softcapping=5.0, query_pre_attn_scalar=64)),
        "gpt_oss": ("GptOssConfig", dict(num_local_experts=4, num_experts_per_tok=2,
                                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
    }[family]
    return getattr(transformers, name)(num_hidden_layers=2, head_dim=64, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                                       sliding_window=sliding_window, **fields, **sizes)


def _tiny_variant_model(family, attn_implementation, state_dict=None):
    transformers = pytest.importorskip("transformers")
    config = variant_model_config(family, 4, vocab_size=128, hidden_size=128, intermediate_size=128,
                                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation)
    if state_dict is not None:
        model.load_state_dict(state_dict)
    if family == "gpt_oss":     # learned sinks of either sign, not the initial zeros
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.sinks.copy_(torch.linspace(-2.0, 2.0, layer.self_attn.sinks.numel()))
    return model.eval()


@torch.no_grad()
@pytest.mark.parametrize("family", VARIANT_MODELS)
def test_transformers_variant_models_match_eager(fake, family):
    """12 tokens through a sliding window of 4 (and softcap, sinks): the logits of an unpadded and a
    left-padded batch are eager attention's, and greedy generate() gives its tokens."""
    eager = _tiny_variant_model(family, "eager")
    ours = _tiny_variant_model(family, "facodegen", eager.state_dict())
    ids = torch.randint(3, 128, (2, 12), generator=torch.Generator().manual_seed(6))
    _close(ours(ids).logits, eager(ids).logits)
    windows = {c["window_size"] for c in fake.calls}
    assert (3, 3) in windows, "the sliding layers must reach facodegen with their window"
    if family == "gemma2":
        assert {c["softcap"] for c in fake.calls} == {5.0}
    if family == "gpt_oss":
        assert all(c["sinks"] is not None and c["sinks"].dtype == torch.float32 for c in fake.calls)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    real = mask.bool()
    _close(ours(ids, attention_mask=mask).logits[real], eager(ids, attention_mask=mask).logits[real])
    assert fake.varlen.calls
    for batch_mask in (torch.ones_like(ids), mask):
        want = eager.generate(ids, attention_mask=batch_mask, max_new_tokens=6, do_sample=False, use_cache=True)
        got = ours.generate(ids, attention_mask=batch_mask, max_new_tokens=6, do_sample=False, use_cache=True)
        assert torch.equal(got, want)
