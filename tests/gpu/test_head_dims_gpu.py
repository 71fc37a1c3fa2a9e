"""Head dims outside 64/96/128/192/256 (issue 40, slice 1) on a GPU, against float64.

A head_dim d that is a multiple of 8 runs the kernel of the next tile D (80 on 96, 8 on 64) with the
columns d..D-1 zero-filled inside the kernel: cp.async zero-fills on sm80, the TMA maps' innermost
dimension d on sm90. Each kernel (d in 8, 40, 80, 112, 160, 200, 248 x causal x fp16/bf16 x sm80/sm90)
runs four shapes with odd lengths (1, 17, 1000; rows that see no key under causal), GQA and MQA, O
and LSE poisoned with NaN (an element the kernel never writes fails); O is checked with
FlashAttention-3's criterion (its error against the float64 reference of facodegen.verify.reference
at most twice a same-precision computation's plus twice the dtype's rounding of the reference) and in
relative Frobenius norm (reference.check), the LSE with reference.check_lse. A second test gives the
kernels views of wider buffers: inputs whose columns past d hold NaN (a read past d would reach O) and
an O whose memory past d holds a sentinel (a write past d would change it). fp8 (sm90): head dims of
whole 16-byte e4m3 rows (16, 48, ..., 240) x causal x both V layouts over the same shapes, and the
wide-buffer test, by the fuzz's fp8 criterion.

Run alone: ``python -m pytest -q tests/gpu/test_head_dims_gpu.py`` (-n 4 helps: 56 kernels to compile).
"""

from __future__ import annotations

import math

import pytest

from facodegen.verify import reference

torch = pytest.importorskip("torch")

from odd_shapes import (HAVE_GPU, SHAPES, check, check_every_shape, check_fp8_call, inputs,  # noqa: E402
                        skip_unless_runs)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not HAVE_GPU, reason="needs a CUDA GPU (torch.cuda)")]

HEAD_DIMS = (8, 40, 80, 112, 160, 200, 248)


def _runs():
    for arch in ("sm80", "sm90"):
        for dtype in ("bf16", "fp16"):
            for d in HEAD_DIMS:
                for causal in (False, True):
                    yield pytest.param(arch, dtype, d, causal, id=f"{arch}-{dtype}-d{d}-{'causal' if causal else 'full'}")


@pytest.mark.parametrize("arch, dtype, d, causal", list(_runs()))
def test_padded_head_dim_matches_float64(arch, dtype, d, causal):
    skip_unless_runs(arch)
    check_every_shape(arch, d, dtype, causal, seed=1000 * d, spec_is=lambda spec: (
        (spec.head_dim_real, spec.arch) == (d, arch) and spec.head_dim == min(t for t in (64, 96, 128, 192, 256) if t >= d)))


@pytest.mark.parametrize("arch", ("sm80", "sm90"))
@pytest.mark.parametrize("d", (8, 80, 200))
@pytest.mark.parametrize("causal", (False, True))
def test_nothing_past_d_is_read_or_written(arch, d, causal):
    """q, k, v and out as views of buffers 128 columns wider: NaN past d in the inputs (read, it would
    reach O through S or P V), a sentinel past d in O's buffer (it must survive)."""
    skip_unless_runs(arch)
    import facodegen
    sq, sk, hq, hkv = 333, 1000 if not causal else 100, 4, 2
    gen = torch.Generator(device="cuda").manual_seed(d)
    wide = d + 128

    def view(n, h):
        buf = torch.full((2, n, h, wide), float("nan"), device="cuda", dtype=torch.bfloat16)
        buf[..., :d] = torch.randn((2, n, h, d), generator=gen, device="cuda").to(torch.bfloat16)
        return buf[..., :d]

    q, k, v = view(sq, hq), view(sk, hkv), view(sk, hkv)
    o_buf = torch.full((2, sq, hq, wide), 7.0, device="cuda", dtype=torch.bfloat16)
    o_buf[..., :d] = float("nan")
    out, lse = facodegen.attention(q, k, v, causal=causal, out=o_buf[..., :d], return_lse=True, arch=arch)
    torch.cuda.synchronize()
    assert out.data_ptr() == o_buf.data_ptr()
    assert (o_buf[..., d:] == 7.0).all(), "the kernel wrote O's memory past head_dim"
    check(out, lse, q.contiguous(), k.contiguous(), v.contiguous(), causal, "bf16")


@pytest.mark.parametrize("arch", ("sm80", "sm90"))
def test_default_output_and_scale(arch):
    """No out=: O is allocated like q; the default scale is 1/sqrt(d), an explicit one is taken as given."""
    skip_unless_runs(arch)
    import facodegen
    q, k, v = inputs((129, 257, 6, 3), 40, "fp16", seed=7)
    out = facodegen.attention(q, k, v, arch=arch)
    ref, _ = reference.attention_reference(q, k, v)
    assert out.shape == q.shape and reference.check(out, ref, "fp16")[0]
    out = facodegen.attention(q, k, v, arch=arch, softmax_scale=0.3)
    ref, _ = reference.attention_reference(q, k, v, softmax_scale=0.3)
    ok, msg = reference.check(out, ref, "fp16")
    assert ok, msg
    assert not math.isclose(0.3, 40 ** -0.5)


# fp8 (sm90): head dims whose rows are whole 16-byte chunks of e4m3 (a contiguous tensor's head stride is
# d bytes; d = 8 mod 16 takes strided views), each on the next tile
FP8_HEAD_DIMS = (16, 48, 80, 112, 160, 208, 240)


@pytest.mark.parametrize("v_layout", ("row", "transposed"))
@pytest.mark.parametrize("causal", (False, True))
@pytest.mark.parametrize("d", FP8_HEAD_DIMS)
def test_fp8_padded_head_dim_matches_float64(d, causal, v_layout):
    """Each of SHAPES in e4m3 (odd_shapes.check_fp8_call), V as given and as the caller's V^T."""
    for i, shape in enumerate(SHAPES):
        try:
            check_fp8_call(d, shape, causal, v_layout, seed=1000 * d + i)
        except AssertionError as err:
            raise AssertionError(f"shape (seqlen_q, seqlen_k, heads_q, heads_kv) = {shape}: {err}") from None


@pytest.mark.parametrize("d", (16, 80, 208))
@pytest.mark.parametrize("causal", (False, True))
def test_fp8_nothing_past_d_is_read_or_written(d, causal):
    """e4m3 q, k, v and O as views of buffers 128 columns wider: NaN past d in the inputs, a sentinel in O's."""
    check_fp8_call(d, (333, 1000 if not causal else 100, 4, 2), causal, seed=d, wide=128)


@pytest.mark.parametrize("arch", ("sm80", "sm90"))
@pytest.mark.parametrize("d", (40, 200))
def test_padded_head_dims_take_the_variants(arch, d):
    """A window, softcap and sinks on a padded head_dim: the variant kernels load and store through the
    same padded paths."""
    skip_unless_runs(arch)
    import facodegen
    q, k, v = inputs((300, 700, 4, 2), d, "bf16", seed=d)
    gen = torch.Generator(device="cuda").manual_seed(d)
    sinks = torch.randn(4, generator=gen, device="cuda")
    variants = dict(window_size=(129, 17), softcap=30.0, sinks=sinks)
    out = torch.full_like(q, float("nan"))
    lse = torch.full((1, 4, 300), float("nan"), device="cuda")
    call = facodegen.prepare(q, k, v, out=out, lse_out=lse, arch=arch, **variants)
    assert call.spec.head_dim_real == d and call.spec.local and call.spec.softcap and call.spec.sinks
    call()
    torch.cuda.synchronize()
    ref, ref_lse = reference.attention_reference(q, k, v, **variants)
    ok, msg = reference.check(out, ref, "bf16")
    assert ok, msg
    ok, msg = reference.check_lse(lse, ref_lse)
    assert ok, msg


@pytest.mark.parametrize("d", (80, 96, 112))
@pytest.mark.parametrize("causal", (False, True))
def test_176_key_tiles_of_the_16k_rule(d, causal):
    """The sequence-length rule from 16k keys (block_n 176 on the 96 tile and for head dims padded on
    the 128 tile): its kernels on the odd shapes (block_n 176 given), and the rule itself on 16,384
    keys (17 and 1000 queries: the reference stays small), its spec held to block_n 176."""
    skip_unless_runs("sm90")
    import facodegen
    for i, (sq, sk, hq, hkv) in enumerate(((1, 17, 4, 2), (1000, 1000, 4, 2), (17, 1000, 4, 1),
                                           (17, 16384, 4, 2), (1000, 16384, 2, 1))):
        q, k, v = inputs((sq, sk, hq, hkv), d, "bf16", seed=7000 + 10 * d + i)
        fields = {} if sk == 16384 else {"block_n": 176}
        call = facodegen.prepare(q, k, v, causal=causal, return_lse=True, arch="sm90", **fields)
        assert call.spec.block_n == 176, call.spec.variant
        out, lse = call()
        torch.cuda.synchronize()
        check(out, lse, q, k, v, causal, "bf16")
