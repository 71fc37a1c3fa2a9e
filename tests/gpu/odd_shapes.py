"""What the head-dim GPU tests share (tests/gpu/test_head_dims_gpu.py, padded head dims;
test_head_dim_v_gpu.py, V narrower than Q and K): the GPU at hand, four shapes with odd lengths,
inputs, and the check of one call's O and LSE against float64 with FlashAttention-3's criterion."""

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
