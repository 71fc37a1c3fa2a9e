"""The attention variants (sliding window, softcap, sinks) on a GPU, against float64.

Each case runs facodegen.attention on torch tensors with O and LSE poisoned with NaN (an element
the kernel never writes fails), on both archs where the GPU runs them, and checks O with
FlashAttention-3's criterion (the error against float64 at most twice a same-precision
computation's plus twice the dtype's rounding of the reference, as facodegen.verify.fuzz does) and the
LSE within 1e-3 + 1e-4 |lse|, -inf exactly where the reference has it (fp8, on sm90: every case in e4m3 with
per-tensor descales by the fuzz's fp8 criterion, V as given and, where a window bounds the keys, as V^T). The cases cover windows of 0,
1 and past the sequence, seqlen_q != seqlen_k both ways (rows that see no key: O = 0, LSE = -inf,
or the sink with sinks), GQA/MQA, odd lengths, a single query row, top-left alignment, and head
dims 64/128/256. Budget: well under two minutes on an H200 (most of it NVRTC compiles; -n 4 helps).
"""

from __future__ import annotations

import pytest

from facodegen.verify import fuzz

torch = pytest.importorskip("torch")

from odd_shapes import check_fp8_call  # noqa: E402
HAVE_GPU = torch.cuda.is_available()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not HAVE_GPU, reason="needs a CUDA GPU (torch.cuda)")]
CC = torch.cuda.get_device_capability() if HAVE_GPU else (0, 0)

# head_dim, seqlen_q, seqlen_k, heads_q, heads_kv, causal, window_size, softcap, sinks, top_left
CASES = [
    (128, 1000, 1000, 8, 2, True, (256, 0), 0.0, False, False),     # the local causal kernel
    (128, 333, 1000, 4, 4, False, (0, 0), 0.0, False, False),       # window 0: one key per row
    (64, 1000, 333, 8, 1, False, (1, 1), 0.0, False, False),        # MQA; rows before the diagonal see none
    (64, 1000, 333, 4, 2, False, (1, 1), 0.0, True, False),         # ... with sinks: O = 0, LSE = sink there
    (256, 77, 77, 4, 2, True, (1, 0), 0.0, True, False),            # window 1, sinks
    (128, 517, 1999, 4, 2, False, (2500, 7), 0.0, False, False),    # left side past the sequence
    (64, 2048, 2048, 4, 4, False, (-1, -1), 50.0, False, False),    # softcap alone (Gemma-2's 50)
    (128, 1000, 777, 8, 2, True, (-1, -1), 30.0, True, False),      # softcap + sinks, causal kernel
    (128, 300, 900, 4, 2, True, (64, 0), 0.0, False, True),         # top-left window
    (256, 1, 555, 2, 1, False, (100, 0), 5.0, True, False),         # one query row, everything on
    (128, 999, 999, 4, 2, False, (129, 127), 50.0, True, False),    # all three, two-sided window
    (64, 1000, 200, 4, 2, True, (-1, -1), 0.0, True, True),         # top-left causal + sinks, one launch
    (128, 4096, 4096, 2, 1, True, (1024, 0), 0.0, False, False),    # many skipped tiles, persistent order
]


def _runs():
    for i, case in enumerate(CASES):
        for arch in ("sm80", "sm90"):
            for dtype in ("bf16", "fp16") if i % 2 == 0 else ("bf16",):
                yield pytest.param(arch, dtype, case, id=f"{arch}-{dtype}-{i}")


def _check(arch, dtype, case, seed=0):
    head_dim, sq, sk, hq, hkv, causal, window, softcap, sinks, top_left = case
    if arch == "sm90" and CC != (9, 0) or CC < (8, 0):
        pytest.skip(f"{arch} does not run on compute capability {CC}")
    import facodegen
    gen = torch.Generator(device="cuda").manual_seed(seed)
    dt = torch.bfloat16 if dtype == "bf16" else torch.float16
    q = torch.randn((2, sq, hq, head_dim), generator=gen, device="cuda").to(dt)
    k = torch.randn((2, sk, hkv, head_dim), generator=gen, device="cuda").to(dt)
    v = torch.randn((2, sk, hkv, head_dim), generator=gen, device="cuda").to(dt)
    sink = torch.randn(hq, generator=gen, device="cuda") * 2.0 if sinks else None
    out = torch.full_like(q, float("nan"))
    lse = torch.full((2, hq, sq), float("nan"), device="cuda")
    facodegen.attention(q, k, v, causal=causal, window_size=window, softcap=softcap, sinks=sink, out=out,
                        lse_out=lse, arch=arch, causal_alignment="top_left" if top_left else "bottom_right")
    torch.cuda.synchronize()
    scale = head_dim ** -0.5
    variants = dict(window_size=window, softcap=softcap, sinks=sink, top_left=top_left)
    ref, ref_lse = fuzz.attention_torch(q, k, v, causal, scale, True, **variants)
    low, _ = fuzz.attention_torch(q, k, v, causal, scale, False, **variants)
    assert torch.isfinite(out).all(), "O has NaN/inf (unwritten or bad)"
    err = (out.double() - ref).abs().max().item()
    bound = 2 * (low.double() - ref).abs().max().item() + 2 * ((ref.to(dt) + 0.3 - 0.3).double() - ref).abs().max().item()
    assert err <= bound, f"O max error {err:.3e} over FA3's bound {bound:.3e}"
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isneginf(lse), ~finite), "LSE -inf where the reference has a visible key or sink"
    diff = (lse.double() - ref_lse)[finite].abs()
    assert (diff <= 1e-3 + 1e-4 * ref_lse[finite].abs()).all(), f"LSE max error {diff.max().item():.3e}"
    return out, lse, ref, ref_lse


@pytest.mark.parametrize("arch, dtype, case", list(_runs()))
def test_variant_matches_float64(arch, dtype, case):
    _check(arch, dtype, case)


@pytest.mark.parametrize("arch", ["sm80", "sm90"])
def test_rows_with_no_key_give_zero_and_the_sink(arch):
    out, lse, _, _ = _check(arch, "bf16", CASES[3])
    # rows 0 .. seqlen_q - seqlen_k - 2 see no key under the window (1, 1) bottom-right
    empty = slice(0, 1000 - 333 - 1)
    assert (out[:, empty] == 0).all()
    assert torch.isfinite(lse[:, :, empty]).all()


@pytest.mark.parametrize("arch", ["sm80", "sm90"])
def test_window_values_change_per_call_without_a_new_kernel(arch):
    """The same kernel (the plan's spec) for windows 16 and 300, each call right."""
    if arch == "sm90" and CC != (9, 0):
        pytest.skip("sm90 needs compute capability 9.0")
    from facodegen.ops import api
    before = set(api._PLANS._plans)
    for window in ((16, 0), (300, 0), (16, 0)):
        _check(arch, "bf16", (128, 700, 700, 4, 2, True, window, 0.0, False, False))
    new = [p for key, p in api._PLANS._plans.items() if key not in before]
    assert len(new) == 2 and new[0].spec == new[1].spec and new[0].spec.local    # the third call hit


def _check_fp8(case, v_layout, seed=0):
    """``case`` in e4m3 (odd_shapes.check_fp8_call: per-tensor descales, O in bf16, the fuzz's fp8 criterion)."""
    head_dim, sq, sk, hq, hkv, causal, window, softcap, sinks, top_left = case
    check_fp8_call(head_dim, (sq, sk, hq, hkv), causal, v_layout, seed, window_size=window, softcap=softcap,
                   sinks=sinks, top_left=top_left)


@pytest.mark.parametrize("i", range(len(CASES)))
@pytest.mark.parametrize("v_layout", ["row", "transposed"])
def test_fp8_variant_matches_float64(v_layout, i):
    """Every case in e4m3 with V as given; with the caller's V^T the cases with a bounded window (the fp8 kernel's
    loop over the window's left edge) and head_dim 256."""
    if v_layout == "transposed" and CASES[i][6] == (-1, -1) and CASES[i][0] != 256:
        pytest.skip("V^T: the window and head_dim 256 cases")
    _check_fp8(CASES[i], v_layout, seed=i)


def test_fuzz_variants_family_short_run():
    cases = [c for c in fuzz.generate(24, seed=4, family="variants") if c.arch == "sm80" or CC == (9, 0)]
    result = fuzz.run(cases)
    assert not result["failures"], fuzz.summary(result)
