"""What the head-dim GPU tests share (tests/gpu/test_head_dims_gpu.py, padded head dims;
test_head_dim_v_gpu.py, V narrower than Q and K; test_variants_gpu.py's fp8 cases): the GPU at hand, four
shapes with odd lengths, inputs, the check of one call's O and LSE against float64 with FlashAttention-3's
criterion, and an e4m3 call checked by the fuzz's fp8 criterion."""

from __future__ import annotations

import pytest

from facodegen.verify import fuzz, reference
from facodegen.verify.flash_rounding import forward_floor

torch = pytest.importorskip("torch")
HAVE_GPU = torch.cuda.is_available()
CC = torch.cuda.get_device_capability() if HAVE_GPU else (0, 0)

# (seqlen_q, seqlen_k, heads_q, heads_kv): one query row, 17 rows over 1000 keys (MQA), 1000 x 1000
# (GQA), 1000 rows over 17 keys (causal: most rows see no key, O = 0 and LSE = -inf there)
SHAPES = ((1, 17, 4, 2), (17, 1000, 4, 1), (1000, 1000, 4, 2), (1000, 17, 2, 2))


def skip_unless_runs(arch: str) -> None:
    if arch == "sm90" and CC != (9, 0) or CC < (8, 0):
        pytest.skip(f"{arch} does not run on compute capability {CC}")


def dt(dtype: str):
    return torch.bfloat16 if dtype == "bf16" else torch.float16


def inputs(shape, d, dtype, seed, dv=None, batch=1):
    """q, k (batch, seqlen, heads, d) and v (batch, seqlen_k, heads_kv, dv or d), randn on the GPU."""
    sq, sk, hq, hkv = shape
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return tuple(torch.randn((batch, n, h, w), generator=gen, device="cuda").to(dt(dtype))
                 for n, h, w in ((sq, hq, d), (sk, hkv, d), (sk, hkv, dv or d)))


def check(out, lse, q, k, v, causal, dtype, **variants):
    """O and LSE of one call against float64 (reference.attention_reference) and the same-precision
    computation (FlashAttention-3's criterion, as `facodegen check --fuzz` applies it: FlashAttention's
    rounding of P before the normalisation taken off each element first); raises naming what is off."""
    scale = q.shape[-1] ** -0.5
    assert out.shape == (*q.shape[:3], v.shape[-1]), out.shape
    assert torch.isfinite(out).all(), "O has NaN/inf (unwritten or bad)"
    ref, ref_lse = reference.attention_reference(q, k, v, causal=causal, **variants)   # float64, 1/sqrt(d)
    ok, msg = reference.check(out, ref, dtype)
    assert ok, msg
    if lse is not None:
        ok, msg = reference.check_lse(lse, ref_lse)
        assert ok, msg
    if not variants:
        why = fuzz.fa3_failure(out, torch.from_numpy(ref).to(out.device),
                               fuzz._standard_low(q, k, v, causal, scale), forward_floor(q, k, v, causal, scale))
        assert why is None, f"O: {why}"


def check_every_shape(arch, d, dtype, causal, seed, dv=None, spec_is=lambda spec: True):
    """Each of SHAPES through facodegen.prepare into NaN-poisoned O and LSE, its spec held to
    ``spec_is``, then checked (check); an error names the shape."""
    import facodegen
    for i, shape in enumerate(SHAPES):
        q, k, v = inputs(shape, d, dtype, seed=seed + i, dv=dv)
        out = torch.full((*q.shape[:3], v.shape[-1]), float("nan"), device="cuda", dtype=q.dtype)
        lse = torch.full((1, shape[2], shape[0]), float("nan"), device="cuda")
        call = facodegen.prepare(q, k, v, causal=causal, out=out, lse_out=lse, arch=arch)
        assert spec_is(call.spec), call.spec.variant
        call()
        torch.cuda.synchronize()
        try:
            check(out, lse, q, k, v, causal, dtype)
        except AssertionError as err:
            raise AssertionError(f"shape (seqlen_q, seqlen_k, heads_q, heads_kv) = {shape}: {err}") from None


def check_fp8_call(head_dim, shape, causal, v_layout="row", seed=0, *, window_size=(-1, -1), softcap=0.0,
                   sinks=False, top_left=False, wide=0):
    """One e4m3 call of facodegen.attention (per-tensor descales, O in bf16, batch 2; ``shape`` = (seqlen_q,
    seqlen_k, heads_q, heads_kv)) into a NaN-poisoned O and LSE, against float64 on the dequantised inputs by
    the fuzz's fp8 criterion (fuzz.fp8_failure: O's relative Frobenius error within 3e-2 or twice a bf16
    computation's; the LSE within 1e-2 + 1e-3 |lse| + fuzz.fp8_lse_slack, -inf exactly where the reference
    has it). ``v_layout="transposed"``: V^T (batch, heads_kv, head_dim, seqlen_k) from a buffer whose key axis
    is padded to a multiple of 16. ``wide`` > 0: q, k, v (row V) and O are views of buffers ``wide`` columns
    wider, the inputs NaN past head_dim (a read past it would reach O), O's buffer a sentinel there (it must
    survive). sm90 only (skips elsewhere)."""
    if CC != (9, 0):
        pytest.skip(f"fp8 runs on sm90 (compute capability 9.0), not {CC}")
    import facodegen
    sq, sk, hq, hkv = shape
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v = (torch.randn((2, s, h, head_dim), generator=gen, device="cuda").to(torch.bfloat16)
               for s, h in ((sq, hq), (sk, hkv), (sk, hkv)))
    (q8, qd), (k8, kd), (v8, vd) = (facodegen.quantize_e4m3(x) for x in (q, k, v))
    q, k, v = (x8.to(torch.float32) * d for x8, d in ((q8, qd), (k8, kd), (v8, vd)))    # what the kernel sees

    def widened(x, fill):
        buf = torch.full((*x.shape[:3], head_dim + wide), fill, device="cuda").to(x.dtype)
        buf[..., :head_dim] = x
        return buf[..., :head_dim]
    if wide:
        q8, k8, v8 = (widened(x, float("nan")) for x in (q8, k8, v8))
    if v_layout == "transposed":
        padded = torch.zeros((2, hkv, head_dim, (sk + 15) // 16 * 16), dtype=v8.dtype, device="cuda")
        padded[..., :sk] = v8.permute(0, 2, 3, 1)
        v8 = padded[..., :sk]
    sink = torch.randn(hq, generator=gen, device="cuda") * 2.0 if sinks else None
    out = torch.full((2, sq, hq, head_dim), float("nan"), dtype=torch.bfloat16, device="cuda")
    if wide:
        out = widened(out, 7.0)
    lse = torch.full((2, hq, sq), float("nan"), device="cuda")
    facodegen.attention(q8, k8, v8, causal=causal, window_size=window_size, softcap=softcap, sinks=sink, out=out,
                        lse_out=lse, q_descale=qd, k_descale=kd, v_descale=vd, v_layout=v_layout,
                        causal_alignment="top_left" if top_left else "bottom_right")
    torch.cuda.synchronize()
    if wide:
        past = torch.as_strided(out, (*out.shape[:3], wide), out.stride(), out.storage_offset() + head_dim)
        assert (past == 7.0).all(), "the kernel wrote O's memory past head_dim"
    scale = head_dim ** -0.5
    variants = dict(window_size=window_size, softcap=softcap, sinks=sink, top_left=top_left)
    ref, ref_lse = fuzz.attention_torch(q, k, v, causal, scale, True, **variants)
    why = fuzz.fp8_failure(out, ref, q, k, v, causal, scale, **variants)
    assert why is None, f"O: {why}"
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isneginf(lse), ~finite), "LSE -inf where the reference has a visible key or sink"
    lse_bound = 1e-2 + 1e-3 * ref_lse.abs() + fuzz.fp8_lse_slack(q, k, scale)
    diff = (lse.double() - ref_lse).abs()
    assert (diff <= lse_bound)[finite].all(), f"LSE max error {diff[finite].max().item():.3e}"
