"""Attention variants (sliding window, softcap, sinks; issue 40) on the CPU: the spec switches, the
FlashParams fields, the window's frame (api.window_params against the reference's mask), a desk
check of the kernels' block ranges and mask decisions (a Python copy of common/mask.cuh.j2's
window_blocks and of the two kernels' tests), NVRTC compiles with no spills, the argument checks
and plan keys of facodegen.attention (fake driver), the float64 reference, the fuzzer's variants
family and `facodegen emit`. The kernels themselves run in tests/gpu/test_variants_gpu.py."""

from __future__ import annotations

import itertools
import math
import struct

import numpy as np
import pytest
from fakes import FakeTensor
from test_plan_cache import HQ, SK, SQ, hits, qkv
from test_plan_cache import fake as plan_fake  # noqa: F401  (the fake torch and driver, as a fixture)

from facodegen.ops import api
from facodegen.runtime import compiler, params
from facodegen.verify import fuzz, reference
from facodegen.runtime.launch import LOG2E, Operand, Variants, pack_params
from facodegen.codegen.render import emit
from facodegen.spec import KernelSpec, SpecError, default_specs
from sampling import one_per

FEATURES = {"local": dict(local=True), "softcap": dict(softcap=True), "sinks": dict(sinks=True),
            "all": dict(local=True, softcap=True, sinks=True)}


# ------------------------------------------------------------------------------------------------
# specs and FlashParams
# ------------------------------------------------------------------------------------------------

def test_variant_switches_name_the_kernel_and_default_off():
    spec = KernelSpec(arch="sm90", head_dim=128, causal=True, local=True, softcap=True, sinks=True)
    assert spec.variant.endswith("_causal_local_softcap_sinks")
    assert KernelSpec(arch="sm80", softcap=True).variant.endswith("_softcap")
    for spec in default_specs():
        assert not (spec.local or spec.softcap or spec.sinks)
        assert not any(t in spec.variant for t in ("local", "softcap", "sinks"))
    assert spec.replace(head_dim=64).sinks is False
    assert KernelSpec(arch="sm80", sinks=True).replace(head_dim=64).sinks is True


@pytest.mark.parametrize("fields, name", [
    (dict(arch="sm90", dtype="fp8", head_dim=256, local=True, stream_k=True), "stream_k"),
    (dict(arch="sm80", schedule="fa1", sinks=True), "sinks"),
    (dict(arch="sm90", head_dim=128, local=True, cluster_m=2), "cluster_m"),
    (dict(arch="sm80", local=None), "local"),
    (dict(arch="sm80", softcap="yes"), "softcap"),
])
def test_variant_switches_refused_where_no_kernel_has_them(fields, name):
    with pytest.raises(SpecError) as err:
        KernelSpec(**fields)
    assert err.value.field == name


def test_default_flashparams_unchanged_and_variant_fields_last():
    for arch, dtype in (("sm80", "bf16"), ("sm90", "bf16"), ("sm90", "fp8")):
        plain = [f.name for f, _ in params.layout(arch, dtype)[0]]
        assert not {"window_left", "window_right", "softcap_scale", "sinks"} & set(plain)
        with_variants = [f.name for f, _ in params.layout(arch, dtype, True)[0]]
        assert with_variants == plain + ["window_left", "window_right", "softcap_scale", "sinks"]


def _operands(sq=100, sk=77, hq=8, hkv=2, d=128):
    def op(ptr, s, h):
        return Operand(ptr, (2, s, h, d), (s * h * d, h * d, d, 1))
    return op(1 << 20, sq, hq), op(2 << 20, sk, hkv), op(3 << 20, sk, hkv), op(4 << 20, sq, hq)


def test_pack_params_softcap_moves_the_scale_inside_the_tanh():
    spec = KernelSpec(arch="sm80", head_dim=128, softcap=True, sinks=True, local=True)
    data = pack_params(spec, *_operands(), 0, 0, 0.125, variants=Variants(-3, 7, 50.0, 0xABC0))
    at = {f.name: (f, off) for f, off in params.layout("sm80", "bf16", True)[0]}
    read = {name: struct.unpack_from({"i32": "<i", "f32": "<f", "ptr": "<Q"}[f.kind], data, off)[0]
            for name, (f, off) in at.items() if f.kind in ("i32", "f32", "ptr")}
    assert (read["window_left"], read["window_right"], read["sinks"]) == (-3, 7, 0xABC0)
    assert read["softmax_scale"] == pytest.approx(50.0) and read["scale_log2"] == pytest.approx(50.0 * LOG2E)
    assert read["softcap_scale"] == pytest.approx(0.125 / 50.0)
    with pytest.raises(ValueError, match="softcap"):
        pack_params(spec, *_operands(), 0, 0, 0.125, variants=Variants(0, 0, 0.0, 0))


# ------------------------------------------------------------------------------------------------
# the window's frame: api.window_params against the reference's mask
# ------------------------------------------------------------------------------------------------

def _kernel_hidden(local, causal, window_left, window_right, sq, sk):
    """What the kernels compute from api.window_params' result (True = hidden)."""
    rows, cols = np.arange(sq)[:, None], np.arange(sk)[None, :]
    d = sk - sq
    if not local:
        return cols > rows + d if causal else np.zeros((sq, sk), bool)
    return (cols < rows + d - window_left) | (cols > rows + d + window_right)


@pytest.mark.parametrize("top_left", [False, True])
@pytest.mark.parametrize("causal", [False, True])
def test_window_params_give_the_reference_mask(causal, top_left):
    sides = (-1, 0, 1, 2, 5, 13)
    for sq, sk in itertools.product((1, 2, 5, 8, 13), repeat=2):
        for left, right in itertools.product(sides, repeat=2):
            local, spec_causal, wl, wr = api.window_params(left, right, causal, sq, sk, top_left)
            want = reference.window_mask(np.arange(sq), np.arange(sk), sq, sk, (left, right), causal, top_left)
            got = _kernel_hidden(local, spec_causal, wl, wr, sq, sk)
            assert np.array_equal(got, want), (sq, sk, left, right, local, spec_causal, wl, wr)
            assert abs(wl) <= sq + sk + 1 and abs(wr) <= sq + sk + 1


def test_window_params_pick_the_plain_kernels_where_the_window_cuts_nothing():
    assert api.window_params(-1, -1, False, 100, 100) == (False, False, 0, 0)
    assert api.window_params(-1, -1, True, 100, 100) == (False, True, 0, 0)
    assert api.window_params(-1, 0, False, 100, 300) == (False, True, 0, 0)       # exactly causal
    assert api.window_params(500, 500, False, 100, 300) == (False, False, 0, 0)   # wider than both sequences
    assert api.window_params(4096, 0, True, 16384, 16384) == (True, True, 4096, 0)
    assert api.window_params(0, 0, False, 64, 64)[0] is True


# ------------------------------------------------------------------------------------------------
# desk check of the kernels' block ranges and mask decisions (Python copies of the CUDA)
# ------------------------------------------------------------------------------------------------

def window_blocks(row_first, row_last, seqlen_k, lo, hi, block_n):
    """common/mask.cuh.j2's window_blocks: (n_begin, n_end, n_left_mask, n_right_mask)."""
    key_begin = max(0, row_first + lo)
    key_end = min(seqlen_k, row_last + hi + 1)
    n_begin = min(key_begin, seqlen_k) // block_n
    n_end = -(-key_end // block_n) if key_end > key_begin else n_begin
    whole_end = min(seqlen_k, row_first + hi + 1)
    n_right = whole_end // block_n if whole_end > 0 else 0
    last_lo = row_last + lo
    n_left = -(-last_lo // block_n) if last_lo > 0 else 0
    return n_begin, n_end, n_left, n_right


def _check_tile(visible, rows, n_begin, n_end, masked, block_n, sk):
    """Every visible key of ``rows`` lies in the visited blocks, and a block the kernel leaves
    unmasked is visible to every row of ``rows`` wherever a key exists."""
    keys = np.nonzero(visible[rows].any(axis=0))[0]
    if len(keys):
        assert n_begin * block_n <= keys.min() and keys.max() < n_end * block_n, (rows, n_begin, n_end)
    for n in range(n_begin, n_end):
        if not masked(n):
            cols = slice(n * block_n, min((n + 1) * block_n, sk))
            assert (n + 1) * block_n <= sk and visible[rows, cols].all(), (rows, n)


@pytest.mark.parametrize("block_m, block_n, rows_per_warp", [(128, 64, 32), (64, 128, 16), (192, 128, 64)])
def test_window_blocks_skip_only_hidden_keys_and_mask_every_edge(block_m, block_n, rows_per_warp):
    rng = np.random.default_rng(block_m + block_n)
    for _ in range(400):
        sq, sk = rng.integers(1, 700, size=2)
        left, right = (int(rng.choice([-1, 0, 1, int(rng.integers(2, 300)), 2000])) for _ in range(2))
        causal, top_left = bool(rng.integers(2)), bool(rng.integers(2))
        local, _, wl, wr = api.window_params(left, right, causal, int(sq), int(sk), top_left)
        if not local:
            continue
        lo, hi = sk - sq - wl, sk - sq + wr
        visible = ~_kernel_hidden(True, False, wl, wr, sq, sk) & (np.arange(sk)[None, :] < sk)
        for m in range(-(-sq // block_m)):
            first, last = m * block_m, min(m * block_m + block_m, sq) - 1
            n_begin, n_end, n_left, n_right = window_blocks(first, last, sk, lo, hi, block_n)
            # sm90: one decision per tile (scheduler.cuh.j2's block_needs_mask)
            _check_tile(visible, np.arange(first, last + 1), n_begin, n_end,
                        lambda n, n_left=n_left, n_right=n_right: n >= n_right or n < n_left, block_n, sk)
            # sm80: one decision per warp (flash_fwd.cu.j2: the warp's first row's right edge, its
            # last row's (valid or not) left edge)
            for w0 in range(first, last + 1, rows_per_warp):
                warp_rows = np.arange(w0, min(w0 + rows_per_warp, last + 1))
                _check_tile(visible, warp_rows, n_begin, n_end,
                            lambda n, w0=w0, sk=sk, lo=lo, hi=hi: (n + 1) * block_n > sk
                            or (n + 1) * block_n - 1 > w0 + hi or n * block_n < w0 + rows_per_warp - 1 + lo,
                            block_n, sk)


# ------------------------------------------------------------------------------------------------
# NVRTC: every feature on both archs and head_dim 64/128/256, causal or not seeded per combination
# (the causal mask is the same code in every feature's kernel; tests/sampling.py): no spills
# ------------------------------------------------------------------------------------------------

_VARIANT_COMPILES = one_per([(arch, d, c, f) for arch in ("sm80", "sm90") for d in (64, 128, 256)
                             for c in (False, True) for f in FEATURES], lambda x: (x[0], x[1], x[3]))


@pytest.mark.parametrize("arch, head_dim, causal, feature", _VARIANT_COMPILES)
def test_variant_kernels_compile_without_spills(arch, head_dim, causal, feature):
    spec = KernelSpec(arch=arch, head_dim=head_dim, causal=causal, **FEATURES[feature])
    kernel = compiler.compile(spec)
    r = kernel.resources
    assert (r.spill_stores, r.spill_loads, r.stack_bytes) == (0, 0, 0), (spec.variant, r)
    source = kernel.source
    assert ("apply_window_mask" in source) == spec.local
    assert ("tanh.approx.f32" in source) == spec.softcap
    assert ("softmax_finalize_sink" in source) == spec.sinks


# fp8 (sm90): every head dim and feature, causal and the V layout seeded per group (at head_dim 256 each
# layout: the caller's V^T is where a window's third loop spilled before uniform_wg)
_FP8_VARIANT_COMPILES = one_per([(d, c, f, layout) for d in (64, 96, 128, 192, 256) for c in (False, True)
                                 for f in FEATURES for layout in ("row", "transposed")],
                                lambda x: (x[0], x[2], x[3] if x[0] == 256 else None))


@pytest.mark.parametrize("head_dim, causal, feature, v_layout", _FP8_VARIANT_COMPILES)
def test_fp8_variant_kernels_compile_without_spills(head_dim, causal, feature, v_layout):
    spec = KernelSpec(arch="sm90", dtype="fp8", head_dim=head_dim, causal=causal, v_layout=v_layout,
                      **FEATURES[feature])
    kernel = compiler.compile(spec)
    r = kernel.resources
    assert (r.spill_stores, r.spill_loads, r.stack_bytes) == (0, 0, 0), (spec.variant, r)
    assert ("MUFU.TANH" in kernel.sass()) == spec.softcap
    assert ("softmax_finalize_fp8_sink" in kernel.source) == spec.sinks
    assert not spec.stream_k or not spec.local


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_sequence_length_rule_kernels_take_the_variants_without_spills(head_dim, causal):
    """The kernels calls actually get (api.spec_for_shape: the sequence-length rules' tiles, two CTAs
    of one warpgroup, two P buffers, O in V ...) with all three variants. (All five head dims x
    6 lengths x each feature on both archs, 112 specs, compiled clean on 2026-12-03.)"""
    seen = set()
    for seqlen in (1024, 4096, 16384):
        spec = api.spec_for_shape("sm90", head_dim, "bf16", causal, (1, seqlen, seqlen, 16), **FEATURES["all"])
        if spec.variant in seen:
            continue
        seen.add(spec.variant)
        r = compiler.compile(spec).resources
        assert (r.spill_stores, r.spill_loads, r.stack_bytes) == (0, 0, 0), (spec.variant, r)


def test_softcap_runs_on_the_tanh_unit_and_plain_kernels_have_none():
    plain = compiler.compile(KernelSpec(arch="sm90", head_dim=128)).sass()
    capped = compiler.compile(KernelSpec(arch="sm90", head_dim=128, softcap=True)).sass()
    assert "MUFU.TANH" in capped and "MUFU.TANH" not in plain


def test_bf16_and_fp16_variants_render_alike():
    for arch in ("sm80", "sm90"):
        a = emit(KernelSpec(arch=arch, dtype="fp16", **FEATURES["all"]))
        assert "LOCAL" in a and "SOFTCAP" in a and "SINKS" in a


# ------------------------------------------------------------------------------------------------
# facodegen.attention: argument checks and plan keys (fake torch and driver of test_plan_cache)
# ------------------------------------------------------------------------------------------------



@pytest.fixture
def fake(request):
    """test_plan_cache's fake torch module and driver."""
    return request.getfixturevalue("plan_fake")


@pytest.mark.parametrize("kwargs, error, words", [
    (dict(window_size=(-2, 0)), ValueError, "window_size: the left size must be >= -1"),
    (dict(window_size=(4, -7)), ValueError, "window_size: the right size must be >= -1"),
    (dict(window_size=(4,)), ValueError, "window_size must be a pair"),
    (dict(window_size=(1.5, 0)), TypeError, "window_size: the left size must be an integer"),
    (dict(window_size=(True, 0)), TypeError, "window_size: the left size must be an integer"),
    (dict(softcap=-1.0), ValueError, "softcap must be a finite number >= 0"),
    (dict(softcap=float("nan")), ValueError, "softcap must be a finite number >= 0"),
    (dict(softcap=float("inf")), ValueError, "softcap must be a finite number >= 0"),
    (dict(softcap=True), ValueError, "softcap must be"),
    (dict(sinks=FakeTensor((HQ + 1,), "float32")), ValueError, "sinks has shape"),
    (dict(sinks=FakeTensor((HQ,), "bfloat16")), TypeError, "sinks has dtype bfloat16"),
    (dict(sinks=FakeTensor((HQ,), "float32", device=1)), ValueError, "sinks is on cuda:1"),
    (dict(sinks=FakeTensor((HQ,), "float32", strides=(2,))), ValueError, "contiguous"),
    (dict(sinks=np.zeros(HQ, np.float32)), TypeError, "sinks must be a float32"),
])
def test_bad_variant_arguments_name_the_argument(fake, kwargs, error, words):
    with pytest.raises(error, match=words.replace("(", r"\(")):
        api.attention(*qkv(), **kwargs)
    assert not fake.launches.records


def _plan_fields(plan):
    data = plan.param_bytes()
    at = {f.name: (f, off) for f, off in params.layout(plan.spec.arch, plan.spec.dtype, True)[0]}
    return {n: struct.unpack_from({"i32": "<i", "f32": "<f", "ptr": "<Q"}[at[n][0].kind], data, at[n][1])[0]
            for n in ("window_left", "window_right", "softcap_scale", "sinks")}


def test_window_values_key_the_plan_and_sinks_move_per_call(fake):
    q, k, v = qkv()
    s1, s2 = FakeTensor((HQ,), "float32"), FakeTensor((HQ,), "float32")
    api.attention(q, k, v, window_size=(16, 0), sinks=s1)
    api.attention(q, k, v, window_size=(16, 0), sinks=s2)
    assert (api._PLANS.misses, hits(fake)) == (1, 1)
    plan = next(iter(api._PLANS._plans.values()))
    assert plan.spec.local and plan.spec.sinks and plan.spec.causal and not plan.spec.softcap
    fields = _plan_fields(plan)
    assert (fields["window_left"], fields["window_right"], fields["sinks"]) == (16, 0, s2.data_ptr())
    api.attention(q, k, v, window_size=(32, 0), sinks=s2)          # another window: another plan image
    api.attention(q, k, v, window_size=(16, 0), softcap=30.0, sinks=s2)
    assert api._PLANS.misses == 3
    specs = [p.spec for p in api._PLANS._plans.values()]
    assert specs[0] == specs[1] and specs[2].softcap
    assert _plan_fields(list(api._PLANS._plans.values())[2])["softcap_scale"] == pytest.approx(128 ** -0.5 / 30.0)


def test_windows_that_cut_nothing_run_the_plain_kernels(fake):
    q, k, v = qkv()
    api.attention(q, k, v, window_size=(SK + 10, SQ + 10))
    api.attention(q, k, v, window_size=(-1, 0))
    api.attention(q, k, v, causal=True, window_size=(-1, 5))
    specs = [p.spec for p in api._PLANS._plans.values()]
    assert [(s.local, s.causal, s.softcap, s.sinks) for s in specs] == [(False, False, False, False),
                                                                       (False, True, False, False),
                                                                       (False, True, False, False)]


def test_top_left_causal_with_a_variant_is_one_window_launch(fake):
    q, k, v = qkv()     # seqlen_q 100 > seqlen_k 77
    api.attention(q, k, v, causal=True, causal_alignment="top_left", softcap=10.0)
    assert len(fake.launches.records) == 1
    plan = next(iter(api._PLANS._plans.values()))
    assert plan.spec.local and plan.spec.softcap
    fields = _plan_fields(plan)
    # top-left: row i sees keys <= i, i.e. the bottom-right frame's right side is -(seqlen_k - seqlen_q)
    assert fields["window_right"] == -(SK - SQ) and fields["window_left"] == SQ + SK + 1


def test_the_window_switch_comes_with_its_sizes(fake):
    with pytest.raises(ValueError, match="pass window_size"):
        api.attention(*qkv(), local=True)
    # a whole spec's fields (the tuner's and the GPU tests' spec_kwargs) carry local=False: the default
    api.attention(*qkv(), local=False)
    plan = next(iter(api._PLANS._plans.values()))
    assert not plan.spec.local and len(fake.launches.records) == 1


def test_fp8_calls_take_the_variants_with_their_descales(fake):
    """An e4m3 call with a window, softcap and sinks runs the fp8 kernel with the three switches; the
    descales and the sinks are patched per call, the window and softcap values key the plan."""
    descale_at = {f.name: off for f, off in params.layout("sm90", "fp8", True)[0]}["q_descale"]
    q, k, v = qkv(dtype="float8_e4m3fn")
    scalar = lambda: FakeTensor((), "float32")      # noqa: E731
    sinks = FakeTensor((HQ,), "float32")
    api.attention(q, k, v, window_size=(16, 3), softcap=50.0, sinks=sinks, q_descale=scalar(), k_descale=scalar(),
                  v_descale=scalar())
    qd, kd, vd, sinks2 = scalar(), scalar(), scalar(), FakeTensor((HQ,), "float32")
    api.attention(q, k, v, window_size=(16, 3), softcap=50.0, sinks=sinks2, q_descale=qd, k_descale=kd, v_descale=vd)
    assert (api._PLANS.misses, hits(fake)) == (1, 1)
    plan = next(iter(api._PLANS._plans.values()))
    spec = plan.spec
    assert spec.dtype == "fp8" and spec.local and spec.softcap and spec.sinks and not spec.stream_k
    assert struct.unpack_from("<3Q", fake.launches.records[-1]["params"], descale_at) == (
        qd.data_ptr(), kd.data_ptr(), vd.data_ptr())
    fields = _plan_fields(plan)
    assert (fields["window_left"], fields["window_right"], fields["sinks"]) == (16, 3, sinks2.data_ptr())
    assert fields["softcap_scale"] == pytest.approx(128 ** -0.5 / 50.0)
    api.attention(q, k, v, window_size=(16, 3), softcap=30.0, sinks=sinks2, q_descale=qd, k_descale=kd, v_descale=vd)
    assert api._PLANS.misses == 2


def test_fp8_variant_template_scales_inside_the_tanh():
    """With a softcap the descales multiply the tanh's factor, not the softmax's (c tanh(s * descales * scale /
    c)); sinks take the fp8 row sums' offset out; a window's left edge has a masked loop of its own."""
    capped = emit(KernelSpec(arch="sm90", dtype="fp8", head_dim=128, softcap=True, sinks=True, local=True))
    assert "const float softcap_scale = p.softcap_scale * qk_descale;" in capped
    assert "const float scale_log2 = p.scale_log2;" in capped and "p.scale_log2 * qk_descale" not in capped
    assert "softmax_finalize_fp8_sink(o_reg, row_max, row_sum, p.softmax_scale, v_descale" in capped
    assert "apply_softcap(s_reg, softcap_scale);" in capped
    assert capped.count("t.n_end - 1 - i >= t.n_left_mask") == 1
    plain = emit(KernelSpec(arch="sm90", dtype="fp8", head_dim=128))
    assert "p.scale_log2 * qk_descale" in plain and "softcap_scale" not in plain and "n_left_mask" not in plain


# ------------------------------------------------------------------------------------------------
# the float64 reference and the fuzzer
# ------------------------------------------------------------------------------------------------

def _direct(q, k, v, scale, window, softcap, sinks, causal, top_left):
    """One (row, head) at a time, straight from the definitions."""
    b, sq, hq, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    o, lse = np.zeros(q.shape), np.full((b, hq, sq), -np.inf)
    left, right = window
    right = 0 if causal else right
    for bi, h, i in itertools.product(range(b), range(hq), range(sq)):
        kv = h // (hq // hkv)
        ip = i if top_left else i + sk - sq
        logits, values = [], []
        for j in range(sk):
            if (left >= 0 and j < ip - left) or (right >= 0 and j > ip + right):
                continue
            x = scale * float(q[bi, i, h] @ k[bi, j, kv])
            logits.append(softcap * math.tanh(x / softcap) if softcap else x)
            values.append(v[bi, j, kv])
        if sinks is not None:
            logits.append(float(sinks[h]))
            values.append(np.zeros(d))
        if logits:
            m = max(logits)
            w = np.exp(np.array(logits) - m)
            o[bi, i, h] = (w[:, None] * np.array(values)).sum(0) / w.sum()
            lse[bi, h, i] = m + math.log(w.sum())
    return o, lse


@pytest.mark.parametrize("window, softcap, sinks, causal, top_left", [
    ((3, 0), 0.0, False, False, False), ((0, 0), 0.0, True, False, False), ((1, 2), 5.0, False, False, True),
    ((-1, -1), 2.0, True, True, False), ((2, -1), 0.0, True, True, True), ((50, 50), 1.0, True, False, False),
])
def test_reference_variants_match_the_definition(window, softcap, sinks, causal, top_left):
    rng = np.random.default_rng(3)
    q, k, v = rng.standard_normal((2, 7, 4, 16)), rng.standard_normal((2, 5, 2, 16)), rng.standard_normal((2, 5, 2, 16))
    s = rng.standard_normal(4) * 3 if sinks else None
    o, lse = reference.attention_reference(q, k, v, causal, 0.5, window_size=window, softcap=softcap, sinks=s,
                                           top_left=top_left)
    want_o, want_lse = _direct(q, k, v, 0.5, window, softcap, s, causal, top_left)
    np.testing.assert_allclose(o, want_o, atol=1e-12)
    np.testing.assert_allclose(lse, want_lse, atol=1e-12)
    if sinks:
        empty = ~np.isfinite(_direct(q, k, v, 0.5, window, softcap, None, causal, top_left)[1])
        assert np.allclose(lse[empty], np.broadcast_to(s[None, :, None], lse.shape)[empty])   # LSE = sink


def test_fuzz_torch_reference_agrees_with_the_numpy_one():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(5)
    q, k, v = (torch.from_numpy(rng.standard_normal(s)) for s in ((1, 9, 4, 16), (1, 6, 2, 16), (1, 6, 2, 16)))
    sinks = torch.from_numpy(rng.standard_normal(4))
    for window, softcap, causal, top_left in (((2, 1), 7.0, False, False), ((0, -1), 0.0, True, True)):
        o, lse = fuzz.attention_torch(q, k, v, causal, 0.3, True, window_size=window, softcap=softcap, sinks=sinks,
                                      top_left=top_left)
        ro, rlse = reference.attention_reference(q, k, v, causal, 0.3, window_size=window, softcap=softcap,
                                                 sinks=sinks, top_left=top_left)
        np.testing.assert_allclose(o.numpy(), ro, atol=1e-12)
        np.testing.assert_allclose(lse.numpy(), rlse, atol=1e-12)


def test_fuzz_variants_family_covers_the_edges_with_few_kernels():
    cases = fuzz.generate(3000, seed=11, family="variants")
    assert all(c.family == "variants" for c in cases)
    assert {c.dtype for c in cases} == {"bf16", "fp16", "fp8"}
    assert all(c.arch == "sm90" and c.seed % 7 == 6 for c in cases if c.dtype == "fp8")
    assert all(c.sinks or c.softcap or (c.window_left, c.window_right) != (-1, -1) for c in cases)
    sides = {c.window_left for c in cases} | {c.window_right for c in cases}
    assert {-1, 0, 1} <= sides
    assert any(c.window_left >= c.seqlen_k for c in cases) and any(c.top_left for c in cases)
    assert {c.softcap for c in cases} >= {0.0, 5.0, 50.0} and any(c.sinks for c in cases)
    assert fuzz.Case.from_json(cases[0].to_json()) == cases[0]
    mixed = fuzz.generate(200, seed=2, family="all")
    assert {c.family for c in mixed} == set(fuzz.FAMILIES)
    kernels = set()
    for c in cases:
        local, causal, _, _ = api.window_params(c.window_left, c.window_right, c.causal, c.seqlen_q, c.seqlen_k,
                                                c.top_left)
        kernels.add((c.arch, c.dtype, c.head_dim, causal, local, c.softcap > 0, c.sinks))
    assert len(kernels) <= (2 + 3) * 5 * 2 * 2 * 2 * 2     # (arch, dtype): sm80's two, sm90's three


# ------------------------------------------------------------------------------------------------
# the command line
# ------------------------------------------------------------------------------------------------

def test_emit_takes_the_run_time_values_and_its_line_reproduces_the_file():
    from click.testing import CliRunner

    from facodegen.cli import main
    runner = CliRunner()
    args = ["emit", "--arch", "sm90", "--window-left", "256", "--window-right", "0", "--softcap", "50", "--sinks",
            "--causal"]
    first = runner.invoke(main, args)
    assert first.exit_code == 0, first.output
    source = first.output
    assert "_causal_local_softcap_sinks" in source.splitlines()[1]
    assert "run-time values given: window_size = (256, 0), softcap = 50.0" in source
    line = next(ln for ln in source.splitlines() if ln.startswith("//   facodegen emit"))
    assert "--window-left 256 --window-right 0" in line and "--softcap 50.0" in line
    again = runner.invoke(main, line.removeprefix("//   facodegen ").split())
    assert again.exit_code == 0 and again.output == source
    bare = runner.invoke(main, ["emit", "--arch", "sm80", "--softcap", "--local"])
    assert bare.exit_code == 0 and "run-time values" not in bare.output and "_local_softcap" in bare.output
    for off_args in (["--softcap", "0"], ["--no-softcap"]):
        off = runner.invoke(main, ["emit", "--arch", "sm80", *off_args])
        assert off.exit_code == 0 and "softcap" not in off.output.splitlines()[1], off.output
    bad = runner.invoke(main, ["emit", "--arch", "sm80", "--window-left", "-2"])
    assert bad.exit_code == 2 and "--window-left" in bad.output
    fp8 = runner.invoke(main, ["emit", "--arch", "sm90", "--dtype", "fp8", "--head-dim", "256", "--window-left", "8",
                               "--window-right", "0", "--stream-k"])
    assert fp8.exit_code == 2 and "stream_k" in fp8.output
    fp8 = runner.invoke(main, ["emit", "--arch", "sm90", "--dtype", "fp8", "--window-left", "8", "--window-right", "0"])
    assert fp8.exit_code == 0 and "_local" in fp8.output.splitlines()[1]


@pytest.mark.parametrize("arch", ["sm80", "sm90"])
def test_a_whole_spec_runs_through_its_launch_fields(fake, arch):
    """The tuner, `facodegen check`, the bench runner and the GPU tests pass a spec to attention()
    as KernelSpec.launch_fields(): each candidate the tuner would time resolves to itself (the
    variant switches that are off are not passed: their arguments would refuse False)."""
    from facodegen.tuning import tune
    q, k, v = qkv()
    candidates = [c for c in tune.enumerate_candidates(arch, q.shape[-1], "bf16", causal=True, max_candidates=4)
                  if c.spec is not None]
    assert len(candidates) >= 2
    for cand in candidates:
        fields = cand.spec.launch_fields()
        assert not {"local", "softcap", "sinks", "head_dim", "dtype", "causal"} & set(fields)
        api.attention(q, k, v, causal=True, **fields)
        assert api._PLANS._plans[next(reversed(api._PLANS._plans))].spec == cand.spec
    on = KernelSpec(arch=arch, head_dim=q.shape[-1], dtype="bf16", causal=False, local=True)
    assert on.launch_fields()["local"] is True     # a switch that is on stays: the call says what to pass
    with pytest.raises(ValueError, match="pass window_size"):
        api.attention(q, k, v, **on.launch_fields())
