"""dtype=fp8 (e4m3, sm90): spec, compile/SASS, the P/V^T permutation desk-check, quantisation, API checks (no GPU)."""

from __future__ import annotations

import re

import numpy as np
import pytest

from facodegen.runtime import driver, params, tma
from facodegen.codegen import render
from facodegen.ops.api import _View, check_descale, check_fp8_inputs
from facodegen.ops.quantize import E4M3_MAX, e4m3_decode, e4m3_encode, quantize_e4m3_numpy
from facodegen.verify.reference import attention_reference, attention_reference_fp8
from facodegen.spec import KernelSpec, SpecError, default_fp8_specs, default_specs, register_estimate, V_LAYOUTS


# ---------------------------------------------------------------- spec
def test_fp8_spec_defaults_and_errors():
    s = KernelSpec(arch="sm90", dtype="fp8", head_dim=128)
    assert (s.out_dtype, s.v_layout, s.separate_o) == ("bf16", "row", False)
    assert "_obf16" in s.variant and "fp8" in s.variant
    assert "_vt" in KernelSpec(arch="sm90", dtype="fp8", v_layout="transposed").variant
    with pytest.raises(SpecError, match="dtype"):
        KernelSpec(arch="sm80", dtype="fp8")
    with pytest.raises(SpecError, match="out_dtype"):
        KernelSpec(arch="sm90", dtype="bf16", out_dtype="fp16")
    with pytest.raises(SpecError, match="v_layout"):
        KernelSpec(arch="sm90", dtype="fp8", v_layout="col")
    with pytest.raises(SpecError, match="block_n"):
        KernelSpec(arch="sm90", dtype="fp8", block_n=48)
    with pytest.raises(SpecError, match="separate_o"):
        KernelSpec(arch="sm90", dtype="fp8", separate_o=True)
    assert all(s.dtype != "fp8" for s in default_specs())
    assert s.replace(dtype="bf16").out_dtype == "bf16"
    assert KernelSpec(arch="sm80", dtype="fp16").v_layout == "row"
    # 384 threads launch with 168 registers each: 40 + 2 x 232 (row V: the transposers keep four
    # loads in flight with more than 24) and 24 + 2 x 240 fill the CTA's setmaxnreg pool; 32 + 2 x
    # 240 (the first row-V split) would leave a consumer warpgroup in setmaxnreg.inc forever.
    assert (s.producer_regs, s.consumer_regs) == (40, 232)
    assert KernelSpec(arch="sm90", dtype="fp8", head_dim=128, v_layout="transposed").producer_regs == 24
    # consumers that need more than 232 keep 24/240: head_dim 256 x 128 keys in both layouts, with
    # uniform_wg where it lets the consumers fit 240: the in-kernel V^T's always, the caller's V^T's
    # causal one since the mask-free loop
    for layout in V_LAYOUTS:
        wide = KernelSpec(arch="sm90", dtype="fp8", head_dim=256, v_layout=layout)
        assert (wide.block_n, wide.producer_regs, wide.consumer_regs, wide.persistent) == (128, 24, 240, True)
        assert wide.uniform_wg == (layout == "row")
        assert KernelSpec(arch="sm90", dtype="fp8", head_dim=256, v_layout=layout, causal=True).uniform_wg
    assert not KernelSpec(arch="sm90", dtype="fp8", head_dim=128).uniform_wg
    # the caller's V^T at head_dim 64 and 256: a three-stage K/V ring (at 256 x 128 keys in the room the
    # row-major V ring takes otherwise; fp8_stages_default); two at 128, for the row layout, where three
    # do not fit, and a caller's choice wins
    for causal in (False, True):
        vt = KernelSpec(arch="sm90", dtype="fp8", head_dim=256, v_layout="transposed", causal=causal)
        row = KernelSpec(arch="sm90", dtype="fp8", head_dim=256, causal=causal)
        assert (vt.stages, row.stages) == (3, 2) and vt.smem_bytes == row.smem_bytes <= 232448
        assert KernelSpec(arch="sm90", dtype="fp8", head_dim=64, v_layout="transposed", causal=causal).stages == 3
        assert KernelSpec(arch="sm90", dtype="fp8", head_dim=128, v_layout="transposed", causal=causal).stages == 2
    assert KernelSpec(arch="sm90", dtype="fp8", head_dim=256, v_layout="transposed", block_n=96).stages == 3
    two_q = KernelSpec(arch="sm90", dtype="fp8", head_dim=256, v_layout="transposed", q_stages=2)
    assert two_q.stages == 2 and two_q.smem_bytes <= 232448      # a third K/V stage beside two Q tiles would not fit
    assert KernelSpec(arch="sm90", dtype="fp8", head_dim=256, v_layout="transposed", stages=2).stages == 2
    with pytest.raises(SpecError, match="setmaxnreg"):
        KernelSpec(arch="sm90", dtype="fp8", head_dim=128, producer_regs=32, consumer_regs=240)


def test_fp8_params_layout_and_emit_command():
    names = [f.name for f, _ in params.layout("sm90", "fp8")[0]]
    assert names[-9:-6] == ["q_descale", "k_descale", "v_descale"]
    assert [f.name for f, _ in params.layout("sm90")[0]] == names[:-9]
    s = KernelSpec(arch="sm90", dtype="fp8", head_dim=64, v_layout="transposed", out_dtype="fp16")
    cmd = render.emit_command(s)
    assert "--dtype fp8" in cmd and "--out-dtype fp16" in cmd and "--v-layout transposed" in cmd


def test_fp8_tma_geometry():
    assert tma.slab_geometry(128, 1) == (128, 128)
    assert tma.slab_geometry(64, 1) == (64, 64)
    assert tma.slab_geometry(96, 1) == (32, 32)
    assert tma.slab_geometry(96, 2) == (64, 32) and tma.slab_geometry(128, 2) == (128, 64)
    assert tma.vt_geometry(224) == (32, 32) and tma.vt_geometry(128) == (128, 128)
    a = tma.tiled_args(1 << 20, "fp8", (2, 100, 4, 128), (100 * 4 * 128, 4 * 128, 128), 128, 128, 128)
    assert a.dtype_code == 0 and a.box == (128, 128, 1, 1)
    vt = tma.transposed_v_args(1 << 20, (2, 4, 128, 100), (4 * 128 * 112, 128 * 112, 112), 128, 32, 32)
    assert vt.dims == (100, 128, 4, 2) and vt.strides == (112, 128 * 112, 4 * 128 * 112)
    with pytest.raises(ValueError, match="multiple of 16"):
        tma.transposed_v_args(1 << 20, (2, 4, 128, 100), (4 * 128 * 100, 128 * 100, 100), 128, 32, 32)


# ---------------------------------------------------------------- compile
@pytest.mark.parametrize("spec", default_fp8_specs(), ids=lambda s: s.variant)
def test_fp8_default_compiles_clean(spec):
    from facodegen.runtime import compiler
    k = compiler.compile(spec, verbose=False)
    r = k.resources
    assert (r.spill_stores, r.spill_loads, r.stack_bytes) == (0, 0, 0), r
    assert not k.warnings, k.warnings
    assert "C75" not in k.log
    counts = k.sass_counts()
    assert counts.get("QGMMA", 0) > 0 and counts.get("UTMALDG", 0) > 0, counts
    # v_layout=row: the producer transposes V (ldmatrix.trans + stmatrix); transposed: no transposer
    transposer = counts.get("LDSM", 0) > 0 and counts.get("STSM", 0) > 0
    assert transposer == (spec.v_layout == "row"), counts


@pytest.mark.parametrize("causal", [False, True])
def test_fp8_p_shuffles_only_for_a_caller_transposed_v(causal):
    """pack_p_slice keeps P's keys in its registers for the in-kernel V^T (FA3's key order);
    p_to_natural_order moves them by quad shuffles for the caller's V^T: same tiles, more SHFL (the
    softmax's row reductions are shuffles in both)."""
    from facodegen.runtime import compiler
    shfl = {}
    for layout in ("row", "transposed"):
        spec = KernelSpec(arch="sm90", dtype="fp8", head_dim=128, causal=causal, v_layout=layout,
                          producer_regs=24, consumer_regs=240)
        shfl[layout] = compiler.compile(spec, verbose=False).sass_counts()["SHFL"]
    assert shfl["transposed"] >= shfl["row"] + 2 * (spec.block_n // 8), shfl


# ---------------------------------------------------------------- permutation desk-check
def byte_perm(x: int, y: int, sel: int) -> int:
    pool = [(x >> (8 * i)) & 0xFF for i in range(4)] + [(y >> (8 * i)) & 0xFF for i in range(4)]
    return sum(pool[(sel >> (4 * n)) & 7] << (8 * n) for n in range(4))


def swizzled(slab_bytes: int, swizzle: int, row: int, col: int) -> int:
    off = row * swizzle + col % swizzle
    off ^= ((off >> 7) & (swizzle // 16 - 1)) << 4
    return (col // swizzle) * slab_bytes + off


def key_of_slot(s: int) -> int:         # the template's key_of_slot
    r = s % 32
    t, i = (r % 16) // 4, r % 4
    return (s - r) + (r // 16) * 16 + 2 * t + (i & 1) + 8 * (i >> 1)


def smem_layout(block_n: int, head_dim: int) -> tuple[int, int, int, int]:
    """The fp8 kernel's SWIZZLE_BYTES, KV_SLAB_BYTES, VT_SWIZZLE_BYTES, VT_SLAB_BYTES: the widest
    swizzle dividing a row of V (head_dim bytes) and of V^T (block_n bytes), one slab per swizzle width."""
    sw = 128 if head_dim % 128 == 0 else 64 if head_dim % 64 == 0 else 32
    vt_sw = 128 if block_n % 128 == 0 else 64 if block_n % 64 == 0 else 32
    return sw, block_n * sw, vt_sw, head_dim * vt_sw


def simulate_pv(block_n: int, head_dim: int, v_layout: str, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """One consumer warpgroup's O = P V through the kernel's index maps: S accumulator registers ->
    pack_p_slice (+ p_to_natural_order's quad shuffles for V^T from the caller) -> wgmma e4m3
    A-operand layout, and V -> shared memory (TMA swizzle) -> transpose_v -> V^T (K-major, swizzled) as the wgmma B operand."""
    rng = np.random.default_rng(seed)
    P = rng.integers(0, 256, size=(64, block_n))             # e4m3 bytes stand-ins: exact integer math
    V = rng.integers(0, 256, size=(block_n, head_dim))
    sw, kv_slab, vt_sw, vt_slab = smem_layout(block_n, head_dim)
    # accumulator registers of thread T: reg i -> (row, col)
    s_reg = np.zeros((128, block_n // 2), dtype=np.int64)
    for T in range(128):
        w, lane = divmod(T, 32)
        g, t = divmod(lane, 4)
        for i in range(block_n // 2):
            s_reg[T, i] = P[16 * w + g + 8 * ((i >> 1) & 1), 8 * (i >> 2) + 2 * t + (i & 1)]
    # pack_p_slice
    order = [(0, 1, 4, 5), (2, 3, 6, 7), (8, 9, 12, 13), (10, 11, 14, 15)]
    p_reg = np.zeros((128, block_n // 8), dtype=np.int64)
    for T in range(128):
        for kk in range(block_n // 32):
            for r, idx in enumerate(order):
                p_reg[T, 4 * kk + r] = sum(int(s_reg[T, 16 * kk + j]) << (8 * b) for b, j in enumerate(idx))
    if v_layout == "transposed":
        shuffled = np.zeros_like(p_reg)
        for T in range(128):
            lane = T % 32
            src = (T & ~3) | (2 * (lane & 1))
            sel = 0x7632 if lane & 2 else 0x5410
            for j in range(p_reg.shape[1]):
                shuffled[T, j] = byte_perm(int(p_reg[src, j]), int(p_reg[src + 1, j]), sel)
        p_reg = shuffled
    # wgmma e4m3 A operand: reg r byte b of thread T -> (row 16w + g + 8(r&1), slot 4t + b + 16(r>>1))
    A = np.full((64, block_n), -1, dtype=np.int64)
    for T in range(128):
        w, lane = divmod(T, 32)
        g, t = divmod(lane, 4)
        for kk in range(block_n // 32):
            for r in range(4):
                for b in range(4):
                    A[16 * w + g + 8 * (r & 1), 32 * kk + 4 * t + b + 16 * (r >> 1)] = (int(p_reg[T, 4 * kk + r]) >> (8 * b)) & 0xFF
    assert (A >= 0).all()
    # V^T in shared memory
    vt = np.zeros(head_dim * block_n, dtype=np.int64)
    if v_layout == "row":
        v_smem = np.zeros(block_n * head_dim, dtype=np.int64)
        for key in range(block_n):
            for col in range(head_dim):
                v_smem[swizzled(kv_slab, sw, key, col)] = V[key, col]
        col_words = head_dim // 4
        for item in range((block_n // 4) * col_words):          # every transposer item, any thread
            col, slot = 4 * (item % col_words), 4 * (item // col_words)
            key = key_of_slot(slot)
            w = [sum(int(v_smem[swizzled(kv_slab, sw, kk_, col) + j]) << (8 * j) for j in range(4))
                 for kk_ in (key, key + 1, key + 8, key + 9)]
            x0, x1 = byte_perm(w[0], w[1], 0x5140), byte_perm(w[0], w[1], 0x7362)
            y0, y1 = byte_perm(w[2], w[3], 0x5140), byte_perm(w[2], w[3], 0x7362)
            outs = [byte_perm(x0, y0, 0x5410), byte_perm(x0, y0, 0x7632), byte_perm(x1, y1, 0x5410),
                    byte_perm(x1, y1, 0x7632)]
            for j, word in enumerate(outs):
                base = swizzled(vt_slab, vt_sw, vt_row_of(col + j), slot)
                for b in range(4):
                    vt[base + b] = (word >> (8 * b)) & 0xFF
    else:                                                       # TMA of the caller's V^T: natural key order
        for n in range(head_dim):
            for key in range(block_n):
                vt[swizzled(vt_slab, vt_sw, n, key)] = V[key, n]
    # wgmma K-major B: element (k = slot, n) at slab k // vt_sw, swizzled row n
    B = np.array([[vt[swizzled(vt_slab, vt_sw, n, k)] for n in range(head_dim)] for k in range(block_n)])
    acc = A @ B                                                 # the accumulator's columns
    if v_layout == "transposed":
        return acc, P @ V
    # store_o (o_word): accumulator registers 8a + 2r + (0, 4, 1, 5) of thread (g, t) -> row g + 8r, columns
    # 16a + 4t + (0, 1, 2, 3); register i of n8 tile j holds accumulator column 8j + 2t + (i & 1)
    out = np.full_like(acc, -1)
    for t in range(4):
        for a in range(head_dim // 16):
            for q, i in enumerate((0, 4, 1, 5)):
                j, odd = divmod(i, 4)[0] + 2 * a, i & 1
                out[:, 16 * a + 4 * t + q] = acc[:, 8 * j + 2 * t + odd]
    return out, P @ V


def vt_row_of(col: int) -> int:
    """transpose_v's V^T row of head_dim column col: 2i + c of a 16-column group at row 8c + i."""
    return 16 * (col // 16) + 8 * (col % 2) + (col % 16) // 2


@pytest.mark.parametrize("block_n,head_dim", [(128, 128), (224, 128), (160, 64), (128, 96), (64, 256), (96, 192)])
@pytest.mark.parametrize("v_layout", ["row", "transposed"])
def test_pv_permutation_desk_check(block_n, head_dim, v_layout):
    got, want = simulate_pv(block_n, head_dim, v_layout)
    np.testing.assert_array_equal(got, want)


# ---------------------------------------------------------------- quantisation (NumPy core)
def test_e4m3_codes_round_trip():
    codes = np.array([c for c in range(256) if c & 0x7F != 0x7F], dtype=np.uint8)
    values = e4m3_decode(codes)
    assert values.max() == E4M3_MAX and values.min() == -E4M3_MAX
    back = e4m3_encode(values)
    zero = values == 0
    np.testing.assert_array_equal(back[~zero], codes[~zero])
    assert e4m3_decode(np.uint8(0x08)) == 2.0 ** -6 and e4m3_decode(np.uint8(0x01)) == 2.0 ** -9
    assert e4m3_encode(1e6) == 0x7E and e4m3_encode(-1e6) == 0xFE           # satfinite
    assert e4m3_encode(1.0 + 1 / 16) == e4m3_encode(1.0)                     # tie -> even mantissa
    assert e4m3_encode(1.0 + 3 / 16) == e4m3_encode(1.25)


def test_quantize_numpy_error_bound():
    x = np.random.default_rng(1).standard_normal((4, 256, 8)) * 3.0
    codes, descale = quantize_e4m3_numpy(x)
    y = e4m3_decode(codes) * descale
    assert np.max(np.abs(y)) == pytest.approx(np.max(np.abs(x)))
    normal = np.abs(x) / descale >= 2.0 ** -6
    rel = np.abs(y - x)[normal] / np.abs(x)[normal]
    assert rel.max() <= 2.0 ** -4 + 1e-12
    with pytest.raises(ValueError, match="scale"):
        quantize_e4m3_numpy(x, scale=-1.0)


def test_reference_fp8_dequantises():
    rng = np.random.default_rng(2)
    q, k, v = (e4m3_encode(rng.standard_normal(s) * 8) for s in [(1, 9, 4, 64), (1, 13, 2, 64), (1, 13, 2, 64)])
    kd = np.array([[0.5, 0.25]])
    o, lse = attention_reference_fp8(q, k, v, 0.1, kd, 2.0, causal=True)
    qf = e4m3_decode(q) * 0.1
    kf = e4m3_decode(k) * np.array([0.5, 0.25])[None, None, :, None]
    vf = e4m3_decode(v) * 2.0
    o2, lse2 = attention_reference(qf, kf, vf, causal=True)
    np.testing.assert_allclose(o, o2)
    vt = np.ascontiguousarray(v.transpose(0, 2, 3, 1))
    o3, _ = attention_reference_fp8(q, k, vt, 0.1, kd, 2.0, causal=True, v_layout="transposed")
    np.testing.assert_allclose(o3, o2)


# ---------------------------------------------------------------- API argument checks (fake device views)
def _v(name, shape, dtype="float8_e4m3fn", strides=None, device=0, kind="torch"):
    if strides is None:
        strides, acc = [], 1
        for n in reversed(shape):
            strides.insert(0, acc)
            acc *= n
    return _View(name, kind, 1 << 20, tuple(shape), tuple(strides), dtype, device)


def test_api_fp8_argument_errors():
    q, k, v = _v("q", (2, 64, 8, 128)), _v("k", (2, 80, 2, 128)), _v("v", (2, 80, 2, 128))
    check_fp8_inputs(q, k, v, "row")
    with pytest.raises(TypeError, match="k has dtype bfloat16"):
        check_fp8_inputs(q, _v("k", (2, 80, 2, 128), "bfloat16"), v, "row")
    with pytest.raises(TypeError, match="float8_e5m2"):
        check_fp8_inputs(_v("q", (2, 64, 8, 128), "float8_e5m2"), k, v, "row")
    with pytest.raises(ValueError, match="V\\^T"):
        check_fp8_inputs(q, k, v, "transposed")
    check_fp8_inputs(q, k, _v("v", (2, 2, 128, 80), strides=(2 * 128 * 80, 128 * 80, 80, 1)), "transposed")
    with pytest.raises(ValueError, match="multiple of 16"):
        check_fp8_inputs(q, k, _v("v", (2, 2, 128, 81)).__class__("v", "torch", 1 << 20, (2, 2, 128, 80),
                                                                   (2 * 128 * 81, 128 * 81, 81, 1), "float8_e4m3fn", 0),
                         "transposed")
    assert check_descale(_v("q_descale", (), "float32"), "q_descale", q, 2, 2) == (0, 0)
    assert check_descale(_v("k_descale", (2, 2), "float32"), "k_descale", q, 2, 2) == (2, 1)
    with pytest.raises(TypeError, match="v_descale has dtype float16"):
        check_descale(_v("v_descale", (), "float16"), "v_descale", q, 2, 2)
    with pytest.raises(ValueError, match="k_descale has shape"):
        check_descale(_v("k_descale", (2, 8), "float32"), "k_descale", q, 2, 2)
    with pytest.raises(ValueError, match="q_descale is on cuda:1"):
        check_descale(_v("q_descale", (), "float32", device=1), "q_descale", q, 2, 2)


# ---------------------------------------------------------------- the Python path of an fp8 call, GPU faked
@pytest.mark.parametrize("v_layout", ["row", "transposed"])
def test_fp8_prepare_packs_params(monkeypatch, v_layout):
    import struct
    import sys
    import types

    from fakes import FakeTensor
    from facodegen.ops import api

    fake_torch = types.SimpleNamespace(Tensor=FakeTensor, bfloat16="torch.bfloat16")
    monkeypatch.setitem(sys.modules, "torch", fake_torch)
    monkeypatch.setattr(api, "_TORCH", None)     # api._torch() finds the fake
    info = api.DeviceInfo(0, "NVIDIA H200", (9, 0), 132, 232448)
    monkeypatch.setattr(api, "device_info", lambda ordinal: info)
    monkeypatch.setattr(api, "_prepare", lambda spec, device: api._Prepared(None, spec.smem_bytes, 132))
    monkeypatch.setattr(api, "_current_device", lambda kind: 0)
    monkeypatch.setattr(api, "_tuned_fields", lambda *a, **k: None)
    monkeypatch.setattr(driver, "ensure_context", lambda ordinal: None)
    encoded = {}
    monkeypatch.setattr(tma, "encode", lambda a: encoded.setdefault(len(encoded), a) and bytes(128))

    b, sq, sk, hq, hkv, d = 2, 100, 77, 4, 2, 128
    q = FakeTensor((b, sq, hq, d), "float8_e4m3fn")
    k = FakeTensor((b, sk, hkv, d), "float8_e4m3fn")
    v_t = FakeTensor((b, hkv, d, sk), "float8_e4m3fn", strides=(hkv * d * 80, d * 80, 80, 1))
    v = FakeTensor((b, sk, hkv, d), "float8_e4m3fn") if v_layout == "row" else v_t
    out = FakeTensor((b, sq, hq, d), "bfloat16")
    lse = FakeTensor((b, hq, sq), "float32")
    qd = FakeTensor((), "float32")
    kd = FakeTensor((b, hkv), "float32")
    vd = FakeTensor((1,), "float32")
    prepared = api.prepare(q, k, v, causal=True, out=out, lse_out=lse, q_descale=qd, k_descale=kd, v_descale=vd,
                           v_layout=v_layout)
    spec = prepared.spec
    assert spec.dtype == "fp8" and spec.v_layout == v_layout and spec.out_dtype == "bf16" and spec.causal
    placed, size, _ = params.layout("sm90", "fp8")
    raw = prepared._param_bytes
    assert len(raw) == size
    at = {f.name: off for f, off in placed}
    ptr = lambda name: struct.unpack_from("<Q", raw, at[name])[0]      # noqa: E731
    i64 = lambda name: struct.unpack_from("<q", raw, at[name])[0]      # noqa: E731
    assert (ptr("q_descale"), ptr("k_descale"), ptr("v_descale")) == (qd._ptr, kd._ptr, vd._ptr)
    assert (i64("q_descale_batch_stride"), i64("q_descale_head_stride")) == (0, 0)
    assert (i64("k_descale_batch_stride"), i64("k_descale_head_stride")) == (hkv, 1)
    assert (i64("v_descale_batch_stride"), i64("v_descale_head_stride")) == (0, 0)
    assert ptr("o") == out._ptr and i64("o_row_stride") == hq * d
    maps = list(encoded.values())
    assert all(m.dtype_code == 0 for m in maps)                          # UINT8
    assert maps[0].dims == (d, sq, hq, b) and maps[0].box == (128, spec.block_m, 1, 1)
    if v_layout == "row":       # V as given, read like K; the kernel transposes it in shared memory
        assert maps[2].dims == maps[1].dims == (d, sk, hkv, b) and maps[2].box == maps[1].box
        assert maps[2].strides == maps[1].strides
    else:
        vt_swizzle = tma.vt_geometry(spec.block_n)[0]
        assert maps[2].dims == (sk, d, hkv, b) and maps[2].box == (vt_swizzle, d, 1, 1)
        assert maps[2].strides == (80, d * 80, hkv * d * 80)
    # bad arguments name themselves
    with pytest.raises(TypeError, match="q_descale has dtype float16"):
        api.prepare(q, k, v, q_descale=FakeTensor((), "float16"), v_layout=v_layout, out=out, lse_out=lse)
    with pytest.raises(ValueError, match="sm90"):
        api.prepare(q, k, v, arch="sm80", v_layout=v_layout)
    with pytest.raises(TypeError, match="out must be a torch bfloat16"):
        api.prepare(q, k, v, q_descale=qd, k_descale=kd, v_descale=vd, v_layout=v_layout,
                    out=FakeTensor((b, sq, hq, d), "float16"), lse_out=lse)


# ---------------------------------------------------------------- Q in registers
@pytest.mark.parametrize("head_dim,block_n,causal", [(128, 192, False), (128, 128, True), (256, 64, False)])
def test_fp8_q_in_regs_reads_q_from_registers(head_dim, block_n, causal):
    """q_in_regs: every Q K^T QGMMA takes A from registers (none from a shared-memory descriptor),
    Q comes in by ldmatrix (non-transposed, beside the transposer's .trans ones), and the consumer
    still fits its registers without spills; the register estimate counts Q's head_dim / 8."""
    from facodegen.runtime import compiler
    spec = KernelSpec(arch="sm90", dtype="fp8", head_dim=head_dim, block_n=block_n, causal=causal, q_in_regs=True)
    assert "qreg" in spec.variant
    assert register_estimate(spec) == register_estimate(spec.replace(block_n=block_n, q_in_regs=False)) + head_dim // 8
    k = compiler.compile(spec, verbose=False)
    assert (k.resources.spill_stores, k.resources.spill_loads) == (0, 0), k.resources
    qk = [line for line in k.sass().splitlines() if f"QGMMA.64x{block_n}x32" in line]
    assert qk and all(re.search(r"QGMMA\S+ R\d+, R\d+, gdesc", line) for line in qk), qk[:2]
    counts = k.sass_counts()
    plain_ldsm = len(re.findall(r"LDSM\.16\.M88\.4", k.sass()))
    assert plain_ldsm == head_dim // 32, plain_ldsm        # one per k32 slice, once per tile
    assert counts.get("STSM", 0) > 0                       # the V transposer is still there


# ---------------------------------------------------------------- transposer bank conflicts
def _swizzle_xor(swizzle: int, row: int) -> int:            # the template's swizzle_xor<SWIZZLE>(row * SWIZZLE)
    return ((row * swizzle // 128) & (swizzle // 16 - 1)) << 4


def transposer_lane_addresses(block_n: int, head_dim: int, key0: int, col0: int, vt_row_of_lane) -> tuple:
    """transpose_v's ldmatrix (V) and stmatrix (V^T) addresses of one item (keys key0..key0+15,
    columns col0..col0+31) for the 32 lanes, offsets from the stage's V and V^T tiles."""
    sw, kv_slab, vt_sw, vt_slab = smem_layout(block_n, head_dim)
    loads, stores = [], []
    for lane in range(32):
        matrix, row = divmod(lane, 8)
        v_key = (matrix % 2) * 8 + row
        v_xor = ((matrix // 2) * 16) ^ _swizzle_xor(sw, v_key)
        loads.append(v_key * sw + key0 * sw + (col0 // sw) * kv_slab + ((col0 % sw) ^ v_xor))
        vt_row = vt_row_of_lane(matrix, row)
        vt_keys = (key0 // vt_sw) * vt_slab + ((key0 % vt_sw) ^ _swizzle_xor(vt_sw, vt_row))
        stores.append(vt_row * vt_sw + vt_keys + col0 * vt_sw)
    return loads, stores, (sw, kv_slab, vt_sw, vt_slab)


def _conflict_free(addresses) -> bool:
    """Each 8-lane matrix of ldmatrix/stmatrix moves 8 rows of 16 bytes: one wavefront when the rows
    fall in 8 different 16-byte bank groups."""
    return all(len({(a // 16) % 8 for a in addresses[8 * m: 8 * m + 8]}) == 8 for m in range(4))


@pytest.mark.parametrize("block_n,head_dim", [(192, 128), (128, 128), (96, 256), (160, 64), (128, 96), (224, 128)])
def test_transposer_is_bank_conflict_free(block_n, head_dim):
    """transpose_v's lanes (the template's formulas, mirrored): every ldmatrix and stmatrix matrix
    is one wavefront, each lane's address is where the swizzled layout keeps its row, and the V^T
    rows follow vt_row_of. The old order (V^T row 2i + c per matrix) was 2-way conflicted on the
    stores under every swizzle."""
    new = lambda matrix, row: 16 * (matrix // 2) + 8 * (matrix % 2) + row      # noqa: E731
    old = lambda matrix, row: 16 * (matrix // 2) + 2 * row + matrix % 2        # noqa: E731
    for key0 in range(0, block_n, 16):
        for col0 in range(0, head_dim, 32):
            loads, stores, (sw, kv_slab, vt_sw, vt_slab) = transposer_lane_addresses(block_n, head_dim, key0, col0, new)
            assert _conflict_free(loads) and _conflict_free(stores), (key0, col0)
            for lane in range(32):
                matrix, row = divmod(lane, 8)
                key = key0 + (matrix % 2) * 8 + row
                assert loads[lane] == swizzled(kv_slab, sw, key, col0 + 16 * (matrix // 2))
                head_col = col0 + 16 * (matrix // 2) + 2 * row + matrix % 2
                assert stores[lane] == swizzled(vt_slab, vt_sw, vt_row_of(head_col), key0)
            _, old_stores, _ = transposer_lane_addresses(block_n, head_dim, key0, col0, old)
            assert not _conflict_free(old_stores)


@pytest.mark.parametrize("causal", [False, True])
def test_fp8_transposers_at_24_registers_keep_loads_in_flight_without_spills(causal):
    """head_dim 256 x 128 keys needs the 24/240 split: the transposers follow the V ring alone (no
    tile scheduler: the loader ends their loop with a tile-less v_full phase), branch on a
    warp-uniform warp index (so ptxas keeps the loop control in uniform registers) and each lane
    keeps two swizzled row addresses: at 24 registers the item loop holds two ldmatrix in flight
    (two distinct destination quads before the first byte_perm) and nothing after the producer's
    setmaxnreg.dec spills."""
    import re
    from facodegen.runtime import compiler
    spec = KernelSpec(arch="sm90", dtype="fp8", head_dim=256, block_n=128, producer_regs=24, consumer_regs=240,
                      persistent=True, causal=causal)
    sass = compiler.compile(spec, verbose=False).sass().splitlines()
    dealloc = next(i for i, line in enumerate(sass) if "USETMAXREG.DEALLOC" in line)
    ops = [m.groups() for line in sass[dealloc:]
           for m in [re.match(r"\s*/\*([0-9a-f]{4,})\*/\s*(.*?)\s*;", line)] if m]
    last_store = max(i for i, (_, op) in enumerate(ops) if op.startswith("STSM"))
    back = next(i for i in range(last_store, len(ops)) if "BRA" in ops[i][1])
    loop_start = int(re.search(r"BRA (0x[0-9a-f]+)", ops[back][1]).group(1), 16)
    loop = [op for address, op in ops if loop_start <= int(address, 16) <= int(ops[back][0], 16)]
    assert not [op for _, op in ops if op.startswith(("STL", "LDL"))], ops
    loads = [op for op in loop if op.startswith("LDSM.16.MT88.4")]
    assert len(loads) == 4 and sum(op.startswith("STSM.16.M88.4") for op in loop) == 4
    first_perm = next(i for i, op in enumerate(loop) if op.startswith("PRMT"))
    in_flight = {op.split()[1] for op in loop[:first_perm] if op.startswith("LDSM")}
    assert len(in_flight) >= 2, loop[:first_perm]


@pytest.mark.parametrize("vt_in_place", [False, True])
def test_the_end_of_the_v_stream_is_marked_per_ring_slot(vt_in_place):
    """The loader runs up to STAGES tiles ahead of the transposers, so the end of the V stream must
    belong to the ring slot whose v_full phase carries no tile: one end-of-stream barrier for the whole
    ring (as at 4ea21e5) let the transposers stop at the slot before it, and the consumers then waited
    forever for that slot's V^T (a hang: the device fuzz of 2026-12-03 sat silent at its third case,
    an fp8 one). The loader marks the end in the slot it sends it through; the transposers test the
    slot they just waited on."""
    spec = KernelSpec(arch="sm90", head_dim=128, dtype="fp8", v_layout="row", vt_in_place=vt_in_place)
    source = render.emit(spec)
    assert "uint64_t v_stream_end[STAGES];" in source
    assert "mbar_arrive(smem_u32(&state.v_stream_end[stage]));" in source
    assert re.search(r"mbar_test\(smem_u32\(&state\.v_stream_end\[stage\]\), 0\)", source)
    # every use names a slot: no whole-ring end left anywhere
    assert not re.search(r"&state\.v_stream_end\)", source)
