"""V narrower than Q and K (head_dim_v != head_dim; issue 40, part 2) on a GPU, against float64.

q and k are (batch, seqlen, heads, d), v is (batch, seqlen_k, heads_kv, d_v) and O (batch, seqlen_q,
heads_q, d_v), the default scale 1/sqrt(d). Each kernel ((d, d_v) in (192, 128) (DeepSeek MLA
prefill) and (128, 64) x causal x fp16/bf16 x sm80/sm90) runs four shapes with odd lengths (1, 17,
1000; rows that see no key under causal), GQA and MQA, O and LSE poisoned with NaN (an element the
kernel never writes fails); O is checked with FlashAttention-3's criterion (its error against the
float64 reference of facodegen.verify.reference at most twice a same-precision computation's plus
twice the dtype's rounding of the reference) and in relative Frobenius norm (reference.check), the
LSE with reference.check_lse. Further tests: views of wider buffers (NaN past d_v in v, a sentinel past
d_v in O's memory), the default output and scale (and a plan-cache hit), the sm90 knobs around O's
place and the V loads, the variants (window, softcap, sinks), SDPA's Ev, and the refusals (autograd,
fp8, the backward).

Run alone: ``python -m pytest -q tests/gpu/test_head_dim_v_gpu.py`` (-n 4 helps: ~20 kernels to compile).
"""

from __future__ import annotations

import pytest

from facodegen.verify import reference

torch = pytest.importorskip("torch")

from odd_shapes import CC, HAVE_GPU, check, check_every_shape, inputs, skip_unless_runs  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not HAVE_GPU, reason="needs a CUDA GPU (torch.cuda)")]

PAIRS = ((192, 128), (128, 64))


def _runs():
    for arch in ("sm80", "sm90"):
        for dtype in ("bf16", "fp16"):
            for d, dv in PAIRS:
                for causal in (False, True):
                    yield pytest.param(arch, dtype, d, dv, causal,
                                       id=f"{arch}-{dtype}-d{d}-dv{dv}-{'causal' if causal else 'full'}")


@pytest.mark.parametrize("arch, dtype, d, dv, causal", list(_runs()))
def test_head_dim_v_matches_float64(arch, dtype, d, dv, causal):
    skip_unless_runs(arch)
    check_every_shape(arch, d, dtype, causal, seed=1000 * d + dv, dv=dv,
                      spec_is=lambda spec: (spec.head_dim, spec.head_dim_v, spec.arch) == (d, dv, arch))


@pytest.mark.parametrize("arch", ("sm80", "sm90"))
@pytest.mark.parametrize("d, dv", PAIRS)
@pytest.mark.parametrize("causal", (False, True))
def test_nothing_past_head_dim_v_is_read_or_written(arch, d, dv, causal):
    """v and out as views of buffers as wide as q (and 64 columns more): NaN past d_v in v's buffer
    (read, it would reach O through P V), a sentinel past d_v in O's (it must survive)."""
    skip_unless_runs(arch)
    import facodegen
    sq, sk, hq, hkv = 333, 1000 if not causal else 100, 4, 2
    gen = torch.Generator(device="cuda").manual_seed(d + dv)
    q = torch.randn((2, sq, hq, d), generator=gen, device="cuda").to(torch.bfloat16)
    k = torch.randn((2, sk, hkv, d), generator=gen, device="cuda").to(torch.bfloat16)
    v_buf = torch.full((2, sk, hkv, d + 64), float("nan"), device="cuda", dtype=torch.bfloat16)
    v_buf[..., :dv] = torch.randn((2, sk, hkv, dv), generator=gen, device="cuda").to(torch.bfloat16)
    v = v_buf[..., :dv]
    o_buf = torch.full((2, sq, hq, d + 64), 7.0, device="cuda", dtype=torch.bfloat16)
    o_buf[..., :dv] = float("nan")
    out, lse = facodegen.attention(q, k, v, causal=causal, out=o_buf[..., :dv], return_lse=True, arch=arch)
    torch.cuda.synchronize()
    assert out.data_ptr() == o_buf.data_ptr()
    assert (o_buf[..., dv:] == 7.0).all(), "the kernel wrote O's memory past head_dim_v"
    check(out, lse, q, k, v.contiguous(), causal, "bf16")


@pytest.mark.parametrize("arch", ("sm80", "sm90"))
def test_default_output_scale_and_plan_hit(arch):
    """No out=: O is (batch, seqlen_q, heads_q, d_v) in q's dtype, from the checked path and from the
    plan cache's hit alike; the default scale is 1/sqrt(d), an explicit one is taken as given."""
    skip_unless_runs(arch)
    import facodegen
    q, k, v = inputs((129, 257, 6, 3), 192, "fp16", seed=7, dv=128, batch=2)
    for _ in range(2):
        out = facodegen.attention(q, k, v, arch=arch)
        assert out.shape == (2, 129, 6, 128) and out.dtype == q.dtype and out.is_contiguous()
        check(out, None, q, k, v, False, "fp16")
    out, lse = facodegen.attention(q, k, v, arch=arch, softmax_scale=0.3, return_lse=True)
    ref, ref_lse = reference.attention_reference(q, k, v, softmax_scale=0.3)
    ok, msg = reference.check(out, ref, "fp16")
    assert ok, msg
    ok, msg = reference.check_lse(lse, ref_lse)
    assert ok, msg


# sm90 knobs around O's place and the V loads: its own O buffer (112 keys), O over Q, two Q buffers with
# O over V, a cluster of two CTAs multicasting V's halves, an L2 prefetch of V
SM90_KNOBS = [
    pytest.param(192, 128, False, dict(block_n=112, o_in_v=False), id="192-own-o"),
    pytest.param(192, 128, True, dict(o_in_v=False, separate_o=False), id="192-o-over-q-causal"),
    pytest.param(128, 64, True, dict(pingpong=True, o_in_v=True, q_stages=2), id="128-q2-o-in-v-causal"),
    pytest.param(256, 128, False, dict(cluster_m=2), id="256-cluster"),
    pytest.param(192, 128, False, dict(l2_prefetch=2), id="192-l2-prefetch"),
]


@pytest.mark.parametrize("d, dv, causal, knobs", SM90_KNOBS)
def test_sm90_knobs_with_head_dim_v(d, dv, causal, knobs):
    skip_unless_runs("sm90")
    import facodegen
    for i, shape in enumerate(((77, 1000, 4, 2), (1000, 1000, 4, 1))):
        q, k, v = inputs(shape, d, "bf16", seed=i, dv=dv, batch=2)
        out = torch.full((*q.shape[:3], dv), float("nan"), device="cuda", dtype=q.dtype)
        call = facodegen.prepare(q, k, v, causal=causal, out=out, arch="sm90", **knobs)
        assert all(getattr(call.spec, n) == x for n, x in knobs.items()) and call.spec.head_dim_v == dv
        call()
        torch.cuda.synchronize()
        check(out, None, q, k, v, causal, "bf16")


@pytest.mark.parametrize("arch", ("sm80", "sm90"))
def test_head_dim_v_takes_the_variants(arch):
    """A window, softcap and sinks with V narrower than Q and K."""
    skip_unless_runs(arch)
    import facodegen
    q, k, v = inputs((300, 700, 4, 2), 192, "bf16", seed=5, dv=128)
    gen = torch.Generator(device="cuda").manual_seed(5)
    sinks = torch.randn(4, generator=gen, device="cuda")
    variants = dict(window_size=(129, 17), softcap=30.0, sinks=sinks)
    out = torch.full((1, 300, 4, 128), float("nan"), device="cuda", dtype=q.dtype)
    lse = torch.full((1, 4, 300), float("nan"), device="cuda")
    call = facodegen.prepare(q, k, v, out=out, lse_out=lse, arch=arch, **variants)
    assert call.spec.head_dim_v == 128 and call.spec.local and call.spec.softcap and call.spec.sinks
    call()
    torch.cuda.synchronize()
    check(out, lse, q, k, v, False, "bf16", **variants)


def test_sdpa_takes_a_narrower_value():
    import facodegen.torch as ftorch
    gen = torch.Generator(device="cuda").manual_seed(11)
    q = torch.randn(2, 8, 100, 192, generator=gen, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(2, 2, 130, 192, generator=gen, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(2, 2, 130, 128, generator=gen, device="cuda", dtype=torch.bfloat16)
    for causal in (False, True):
        out = ftorch.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
        want = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double(),
                                                                is_causal=causal, enable_gqa=True)
        assert out.shape == (2, 8, 100, 128)
        assert ((out.double() - want).norm() / want.norm()).item() < 1e-2


def test_head_dim_v_has_no_backward_or_fp8_yet():
    import facodegen
    q, k, v = inputs((64, 64, 2, 2), 192, "bf16", seed=3, dv=128)
    with pytest.raises(NotImplementedError, match="head_dim_v=128, head_dim=192.* no backward yet"):
        facodegen.attention(q.requires_grad_(), k, v)
    q = q.detach()
    out, lse = facodegen.attention(q, k, v, return_lse=True)
    with pytest.raises(ValueError, match="head_dim_v of its own"):
        facodegen.attention_backward(torch.randn_like(out), q, k, v, out, lse)
    if CC == (9, 0):
        f8 = [x.to(torch.float8_e4m3fn) for x in (q, k, v)]
        with pytest.raises(ValueError, match="fp8 takes no head_dim_v"):
            facodegen.attention(*f8)
