"""Any head_dim that is a multiple of 8 in [8, 256] (issue 40, slice 1), on the CPU: the spec (head_dim
on the tile of tile_head_dim(d), head_dim_real = d), its name and emitted header, the sm80 column
predicates and the unchanged sm90 code, a compiled sample with no spills, the TMA maps and
FlashParams a padded call builds, the argument checks, and the padding's exactness on the NumPy
reference. The GPU side: tests/gpu/test_head_dims_gpu.py."""

from __future__ import annotations

import math

import numpy as np
import pytest

from facodegen import KernelSpec
from facodegen.codegen.render import emit
from facodegen.ops import api
from facodegen.runtime import tma
from facodegen.spec import HEAD_DIMS, SpecError
from facodegen.spec.knobs import head_dim_problem, tile_head_dim
from facodegen.verify.reference import attention_reference, flash2_reference
from forward_checks import compiled_clean
from sampling import one_per

# The sample of padded head dims the compile tests take (the CPU suite's time is budgeted: a sample)
SAMPLE = (8, 40, 80, 112, 160, 248)


# ------------------------------------------------------------------ the spec

def test_every_multiple_of_8_has_the_smallest_tile_above_it():
    for d in range(8, 257, 8):
        tile = tile_head_dim(d)
        assert tile in HEAD_DIMS and tile >= d and not any(d <= t < tile for t in HEAD_DIMS)
        for arch in ("sm80", "sm90"):
            spec = KernelSpec(arch=arch, head_dim=d)
            assert (spec.head_dim, spec.head_dim_real, spec.padded) == (tile, d, d != tile)
            # the tile's defaults: the same kernel but for the columns it loads and stores
            whole = KernelSpec(arch=arch, head_dim=tile)
            assert spec.replace(head_dim=tile) == whole
            assert {k: v for k, v in spec.as_dict().items() if k != "head_dim_real"} == \
                {k: v for k, v in whole.as_dict().items() if k != "head_dim_real"}


def test_a_padded_spec_equals_its_tile_with_head_dim_real_and_names_it():
    spec = KernelSpec(arch="sm90", head_dim=80)
    assert spec == KernelSpec(arch="sm90", head_dim=96, head_dim_real=80)
    assert "_hd96_d80_" in spec.variant and "_d" not in KernelSpec(arch="sm90", head_dim=96).variant.replace("_dyn", "")
    assert KernelSpec(arch="sm80", head_dim=8, causal=True).variant.startswith("flash_fwd_sm80_bf16_hd64_d8_")
    # a change of head_dim is a new problem (its own d); other changes keep d
    assert spec.replace(head_dim=128).head_dim_real == 128
    assert spec.replace(causal=True).head_dim_real == 80
    assert "head_dim_real" not in spec.launch_fields() and "head_dim" not in spec.launch_fields()
    # a non-minimal tile is a spec too (d = 80 on the 128 tile)
    assert KernelSpec(arch="sm80", head_dim=128, head_dim_real=80).variant.startswith("flash_fwd_sm80_bf16_hd128_d80_")


@pytest.mark.parametrize("fields, knob, words", [
    (dict(head_dim=84), "head_dim", "multiple of 8 in [8, 256]"),
    (dict(head_dim=4), "head_dim", "multiple of 8 in [8, 256]"),
    (dict(head_dim=0), "head_dim", "multiple of 8 in [8, 256]"),
    (dict(head_dim=264), "head_dim", "multiple of 8 in [8, 256]"),
    (dict(head_dim=96, head_dim_real=100), "head_dim_real", "multiple of 8"),
    (dict(head_dim=96, head_dim_real=112), "head_dim_real", "use head_dim=128"),
    (dict(head_dim=80, head_dim_real=40), "head_dim", "choose one of 64, 96, 128, 192, 256"),
    (dict(arch="sm90", dtype="fp8", head_dim=80, vt_in_place=True), "vt_in_place", "whole 32-column blocks"),
    (dict(arch="sm90", dtype="fp8", head_dim=88), "head_dim", "fp8 takes a multiple of 16"),
    (dict(arch="sm80", schedule="fa1", head_dim=80), "head_dim", "schedule=fa1"),
])
def test_bad_head_dims_name_the_field(fields, knob, words):
    with pytest.raises(SpecError) as err:
        KernelSpec(**fields)
    assert err.value.field == knob and words in str(err.value), str(err.value)


def test_head_dim_problem_says_why():
    assert head_dim_problem(80) is None and head_dim_problem(8) is None and head_dim_problem(256) is None
    for bad in (0, 4, 12, 81, 264, True, 80.0):
        assert head_dim_problem(bad)


# ------------------------------------------------------------------ rendering

def test_emit_names_d_and_d_tile_and_reproduces_the_spec():
    from click.testing import CliRunner

    from facodegen.cli import main
    result = CliRunner().invoke(main, ["emit", "--arch", "sm90", "--head-dim", "80"])
    assert result.exit_code == 0, result.output
    src = result.output
    assert "flash_fwd_sm90_bf16_hd96_d80_" in src
    assert "head dim: d = 80 on a D = 96 tile" in src and "TMA maps' innermost dimension is d" in src
    line = next(x for x in src.splitlines() if "facodegen emit" in x)
    assert "--head-dim 80 " in line and "--head-dim-real" not in line
    spec = KernelSpec(arch="sm90", head_dim=80)
    assert emit(spec) == src
    # --head-dim-real for a tile that is not the smallest
    wide = KernelSpec(arch="sm80", head_dim=128, head_dim_real=80)
    wide_line = next(x for x in emit(wide).splitlines() if "facodegen emit" in x)
    assert "--head-dim 128 --head-dim-real 80" in wide_line
    result = CliRunner().invoke(main, ["emit", "--arch", "sm80", "--head-dim", "81"])
    assert result.exit_code != 0 and "head_dim" in result.output and "multiple of 8" in result.output


def test_whole_tile_kernels_do_not_mention_padding():
    for arch in ("sm80", "sm90"):
        src = emit(KernelSpec(arch=arch, head_dim=96))
        assert "head_dim_real" not in src and "REAL_CHUNKS" not in src and "head dim: d =" not in src


def _body(src: str, name: str) -> str:
    """The source after the header comment, the kernel's name blanked."""
    return src[src.index("// ---- fixed-width types"):].replace(name, "KERNEL")


@pytest.mark.parametrize("d", SAMPLE)
def test_sm90_code_is_the_tile_kernel_the_tma_maps_do_the_padding(d):
    """sm90 loads and stores Q/K/V/O through TMA only: a padded kernel is its tile's kernel (the maps
    carry d) but for the k16 steps of Q K^T, which stop at the one that holds column d - 1."""
    import difflib
    for causal in (False, True):
        spec = KernelSpec(arch="sm90", head_dim=d, causal=causal)
        whole = KernelSpec(arch="sm90", head_dim=spec.head_dim, causal=causal)
        mine, theirs = (_body(emit(s), s.variant).splitlines() for s in (spec, whole))
        diff = [line for line in difflib.unified_diff(theirs, mine, lineterm="", n=0)
                if line[:1] in "+-" and not line.startswith(("+++", "---"))]
        assert [x for x in diff if x.startswith("-")] == \
            ["-constexpr int QK_K_STEPS = HEAD_DIM / 16;                   // k16 steps of S = Q K^T"]
        added = [x[1:] for x in diff if x.startswith("+")]
        assert f"constexpr int HEAD_DIM_REAL = {d};" in added
        assert any(x.startswith("constexpr int QK_K_STEPS = (HEAD_DIM_REAL + 15) / 16;") for x in added)
        assert all(x.startswith(("//", "constexpr int HEAD_DIM_REAL", "constexpr int QK_K_STEPS", "static_assert"))
                   for x in added), added


@pytest.mark.parametrize("d", SAMPLE)
def test_sm80_predicates_the_columns_past_d(d):
    spec = KernelSpec(arch="sm80", head_dim=d, causal=d % 16 == 0)
    src = emit(spec)
    assert f"constexpr int HEAD_DIM_REAL = {d};" in src
    assert "const bool chunk_in = chunk < REAL_CHUNKS;" in src
    assert "cp_async_16(to_k, chunk_in ? from : tile, chunk_in ? 16 : 0);" in src     # full rows
    assert "const bool valid = chunk_in && k * LOAD_ROWS_PER_PASS < rows_left;" in src  # rows cut by seqlen
    assert "i < ROWS_PER_WARP * REAL_CHUNKS" in src and "i < rows_valid * REAL_CHUNKS" in src   # O, empty O
    # the MMAs stop at the 16-column slice that holds column d - 1 (Q K^T's k16 slices, O's n16 pairs)
    assert "constexpr int QK_K16_STEPS  = (HEAD_DIM_REAL + 15) / 16;" in src
    assert "kk < QK_K16_STEPS" in src and "dp < PV_D16_STEPS" in src and "kk < HEAD_DIM / 16" not in src
    # the variant kernels load and store through the same functions
    variants = emit(KernelSpec(arch="sm80", head_dim=d, local=True, softcap=True, sinks=True))
    assert "chunk_in ? from : tile" in variants and "i < rows_valid * REAL_CHUNKS" in variants


# ------------------------------------------------------------------ compiled: no spills, the instructions

compiler = pytest.importorskip("facodegen.runtime.compiler")

# One per tile on sm80; sm90's code is its tile's but for Q K^T's k16 steps (test above): three of them.
COMPILED = [
    KernelSpec(arch="sm80", head_dim=8, causal=True),
    KernelSpec(arch="sm80", head_dim=80, dtype="fp16"),
    KernelSpec(arch="sm80", head_dim=112, causal=True),
    KernelSpec(arch="sm80", head_dim=160),
    KernelSpec(arch="sm80", head_dim=248, causal=True, dtype="fp16"),
    KernelSpec(arch="sm90", head_dim=8),
    KernelSpec(arch="sm90", head_dim=80, causal=True),
    KernelSpec(arch="sm90", head_dim=160, dtype="fp16"),
]


@pytest.mark.parametrize("spec", COMPILED, ids=lambda s: s.variant)
def test_padded_kernels_compile_clean(spec):
    kernel, counts = compiled_clean(spec)
    if spec.arch == "sm80":
        # at least the P V MMAs of one K/V step over the 16-column slices that hold d (the rest skipped)
        slabs = spec.block_m // spec.num_warps // 16
        assert counts["HMMA"] >= slabs * 2 * math.ceil(spec.head_dim_real / 16) * (spec.block_n // 16), counts
        if spec.head_dim_real <= spec.head_dim // 4:     # 8 on 64: a quarter of the tile's MMAs
            whole = compiler.compile(spec.replace(head_dim=spec.head_dim))
            assert counts["HMMA"] < whole.sass_counts()["HMMA"] // 2
    else:
        if spec.head_dim_real == 8:     # Q K^T in one k16 step of the tile's four
            whole = compiler.compile(spec.replace(head_dim=spec.head_dim))
            assert counts["HGMMA"] < whole.sass_counts()["HGMMA"]


# fp8 (sm90): the padded e4m3 kernels (multiples of 16), both V layouts and the variants seeded per head dim;
# Q K^T in ceil(d/32) k32 steps (fewer than the tile's where d leaves a whole step out: 16 on 64, 160 on 192)
_FP8_COMPILED = one_per([(d, c, layout, f) for d in (16, 48, 80, 112, 160, 208, 240) for c in (False, True)
                         for layout in ("row", "transposed") for f in (False, True)], lambda x: x[0])


@pytest.mark.parametrize("d, causal, v_layout, variants", _FP8_COMPILED)
def test_fp8_padded_kernels_compile_clean_and_stop_q_k_at_d(d, causal, v_layout, variants):
    extra = dict(local=True, softcap=True, sinks=True) if variants else {}
    spec = KernelSpec(arch="sm90", dtype="fp8", head_dim=d, causal=causal, v_layout=v_layout, **extra)
    assert (spec.head_dim, spec.head_dim_real) == (tile_head_dim(d), d)
    kernel, counts = compiled_clean(spec)
    source = kernel.source
    assert f"constexpr int HEAD_DIM_REAL = {d};" in source and "(HEAD_DIM_REAL + 31) / 32" in source
    assert "for (int a = 0; a < HEAD_DIM_REAL / 16; ++a)" in source      # O's stores stop at d
    assert f"QGMMA.64x{d}x32" in kernel.sass()      # O += P V with wgmma N = d (V^T's rows: K-major B)
    whole = compiler.compile(spec.replace(head_dim=spec.head_dim))
    steps_left_out = spec.head_dim // 32 - math.ceil(d / 32)
    assert (counts["QGMMA"] < whole.sass_counts()["QGMMA"]) == (steps_left_out > 0), (counts, steps_left_out)


# ------------------------------------------------------------------ host side: TMA maps, FlashParams

PTR = 1 << 20


@pytest.mark.parametrize("d", (8, 80, 160))
def test_tma_maps_take_d_as_their_innermost_dimension_with_the_tiles_boxes(d):
    spec = KernelSpec(arch="sm90", head_dim=d)
    b, s, h, hkv = 2, 17, 4, 2
    q_strides, kv_strides = (s * h * d, h * d, d), (s * hkv * d, hkv * d, d)
    maps = tma.tensor_map_args(spec, PTR, PTR + 4096, PTR + 8192, PTR + 12288, b, s, s, h, hkv,
                               q_strides, kv_strides, kv_strides, q_strides)
    swizzle, box_cols = tma.slab_geometry(spec.head_dim)
    for name, a in maps.items():
        assert a.dims[0] == d and a.box[0] == box_cols and a.swizzle_code == tma.SWIZZLE_CODES[swizzle], name
        assert a.strides[0] == (h if name in ("tma_q", "tma_o") else hkv) * d * 2     # row stride: the tensor's
    # the slabs a kernel loads reach past d but never start past it: no box is wholly outside the tensor
    for real in range(8, 257, 8):
        assert (tile_head_dim(real) - 1) // box_cols_of(real) * box_cols_of(real) < real


@pytest.mark.parametrize("v_layout", ("row", "transposed"))
def test_fp8_maps_take_d_with_the_tiles_boxes(v_layout):
    """e4m3 on the 96 tile with d = 80: Q, K (and row V) maps of d bytes a row in the tile's slab boxes; the
    caller's V^T (batch, heads_kv, d, seqlen_k) has d rows and boxes of the tile's 96 (zeros past d)."""
    d, b, s, h, hkv = 80, 2, 17, 4, 2
    spec = KernelSpec(arch="sm90", dtype="fp8", head_dim=d, v_layout=v_layout)
    q_strides, kv_strides = (s * h * d, h * d, d), (s * hkv * d, hkv * d, d)
    v_strides = kv_strides if v_layout == "row" else (hkv * d * 32, d * 32, 32)     # V^T: keys padded to 32
    maps = tma.tensor_map_args(spec, PTR, PTR + 4096, PTR + 8192, PTR + 12288, b, s, s, h, hkv,
                               q_strides, kv_strides, v_strides, q_strides)
    swizzle, box_cols = tma.slab_geometry(spec.head_dim, 1)
    for name in ("tma_q", "tma_k") + (("tma_v",) if v_layout == "row" else ()):
        assert maps[name].dims[0] == d and maps[name].box[0] == box_cols, name
    if v_layout == "transposed":
        assert maps["tma_v"].dims[:2] == (s, d) and maps["tma_v"].box[1] == 96


def box_cols_of(d: int) -> int:
    return tma.slab_geometry(tile_head_dim(d))[1]


def test_a_box_wider_than_the_rows_is_accepted_and_the_16_byte_rule_holds():
    a = tma.tiled_args(PTR, "bf16", (1, 5, 1, 8), (40, 8, 8), 64, 64, 128)
    assert a.dims[0] == 8 and a.box[0] == 64
    with pytest.raises(ValueError, match="multiple of 16 bytes"):
        tma.tiled_args(PTR, "bf16", (1, 5, 1, 12), (60, 12, 12), 64, 64, 128)


# The fake torch and driver of the plan-cache tests: a whole attention() call without a GPU.
from test_plan_cache import fake  # noqa: E402,F401
from fakes import FakeTensor, param_field as _field  # noqa: E402


@pytest.mark.usefixtures("fake")
@pytest.mark.parametrize("arch, dtype, v_layout", [("sm80", "bfloat16", "row"), ("sm90", "bfloat16", "row"),
                                                   ("sm90", "float8_e4m3fn", "row"),
                                                   ("sm90", "float8_e4m3fn", "transposed")])
def test_a_padded_call_runs_the_tiles_kernel_with_d_in_its_maps_and_scale(monkeypatch, arch, dtype, v_layout):
    """d = 80 runs the 96 tile's kernel with d in its maps (sm90: Q, K and row V d elements a row in the
    tile's slab boxes; fp8's caller V^T d rows in boxes of 96) and the scale 1/sqrt(80)."""
    encoded = []
    monkeypatch.setattr(tma, "encode", lambda args: encoded.append(args) or bytes(128))
    d, fp8 = 80, dtype == "float8_e4m3fn"
    v_shape, v_strides = ((2, 40, 2, d), None) if v_layout == "row" else ((2, 2, d, 40), (2 * d * 48, d * 48, 48, 1))
    q, k, v = FakeTensor((2, 33, 4, d), dtype), FakeTensor((2, 40, 2, d), dtype), FakeTensor(v_shape, dtype, v_strides)
    call = api.prepare(q, k, v, causal=True, arch=arch, **({"v_layout": v_layout} if fp8 else {}))
    assert (call.spec.head_dim, call.spec.head_dim_real) == (96, 80)
    assert call.spec.variant.startswith(f"flash_fwd_{arch}_{'fp8' if fp8 else 'bf16'}_hd96_d80_")
    assert math.isclose(_field(call._param_bytes, call.spec, "softmax_scale"), 1 / math.sqrt(80), rel_tol=1e-6)
    if arch == "sm80":
        assert not encoded
    elif not fp8:
        assert {a.dims[0] for a in encoded} == {80} and {a.box[0] for a in encoded} == {32}
    else:
        rows = [a.dims[0] for a in encoded if a.box[1] != 96]       # Q, K (and row V): d bytes a row
        assert rows and set(rows) == {80}
        if v_layout == "transposed":
            assert [a.dims[:2] for a in encoded if a.box[1] == 96] == [(40, 80)]     # V^T: d rows of 40 keys


def test_the_tile_heads_tuned_rules_apply():
    from facodegen.spec import seqlen_rule_fields
    rule = seqlen_rule_fields("sm90", 128, "bf16", False, 8192, 8192)
    assert rule      # head_dim 128's long non-causal rule
    spec = api.spec_for_shape("sm90", 112, "bf16", False, (1, 8192, 8192, 8), gpu="h200")
    assert spec == KernelSpec(arch="sm90", head_dim=112, gpu="h200", **rule)


# ------------------------------------------------------------------ argument checks

def view(name, shape, dtype="bfloat16"):
    strides = (shape[1] * shape[2] * shape[3], shape[2] * shape[3], shape[3], 1)
    return api._View(name, "torch", PTR, tuple(shape), strides, dtype, 0)


def qkv(d, dtype="bfloat16"):
    return view("q", (2, 64, 8, d), dtype), view("k", (2, 64, 2, d), dtype), view("v", (2, 64, 2, d), dtype)


def test_the_forward_takes_any_multiple_of_8_and_names_head_dim_otherwise():
    for d in (8, 40, 80, 248, 256):
        api._check_inputs(*qkv(d), any_head_dim=True)
    for d in (4, 12, 84, 264):
        with pytest.raises(ValueError, match=r"head_dim \(q.shape\[3\]\) .*multiple of 8 in \[8, 256\]"):
            api._check_inputs(*qkv(d), any_head_dim=True)


def test_the_paths_limited_to_the_five_tiles_say_so():
    with pytest.raises(ValueError, match=r"head_dim=80 is not supported by attention_varlen_backward; choose one "
                                         r"of 64, 96, 128, 192, 256 \(the 16-bit forward"):
        api._check_inputs(*qkv(80), what="attention_varlen_backward")
    api.check_fp8_inputs(*qkv(80, "float8_e4m3fn"), "row")     # fp8 pads too (whole 16-byte rows)


def test_autograd_takes_a_padded_head_dim():
    """attention() on (batch, seqlen, heads, 80) tensors and attention_varlen on packed (total, heads, 80) ones
    record the backward's padded kernels (the 96 tile, head_dim_real=80)."""
    torch = pytest.importorskip("torch")
    from facodegen.ops import torch_op
    from facodegen.spec.backward import BackwardSpec
    torch_op._refuse_without_backward(torch.zeros(1, 4, 2, 80, requires_grad=True), None, None, None)
    torch_op._refuse_without_backward(torch.zeros(4, 2, 80, requires_grad=True), None, None, None,
                                      what="facodegen.attention_varlen")
    for arch in ("sm80", "sm90"):
        spec = BackwardSpec(arch=arch, head_dim=80, varlen=True)
        assert (spec.head_dim, spec.head_dim_real, spec.varlen) == (96, 80, True)
    torch_op._refuse_without_backward(torch.zeros(1, 4, 2, 96, requires_grad=True), None, None, None)
    torch_op._refuse_without_backward(torch.zeros(1, 4, 2, 84, requires_grad=True), None, None, None)  # forward's error


# ------------------------------------------------------------------ the NumPy reference: padding is exact

@pytest.mark.parametrize("d, causal", [(8, True), (40, False), (80, True), (112, False)])
def test_zero_columns_change_nothing_but_the_scale(d, causal):
    """What the kernels compute: the tiled FlashAttention-2 algorithm over Q, K, V zero-padded to D
    columns, with the scale of the real d, gives the d-column attention in its first d columns."""
    rng = np.random.default_rng(d)
    tile = tile_head_dim(d)
    q, k, v = (rng.standard_normal((1, n, 2, d)) for n in (37, 50, 50))
    pad = lambda x: np.concatenate([x, np.zeros(x.shape[:3] + (tile - d,))], axis=3)  # noqa: E731
    want, want_lse = attention_reference(q, k, v, causal=causal)
    got, got_lse = flash2_reference(pad(q), pad(k), pad(v), causal=causal, softmax_scale=d ** -0.5,
                                    block_m=16, block_n=16)
    np.testing.assert_allclose(got[..., :d], want, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(got[..., d:], 0.0)
    np.testing.assert_allclose(got_lse, want_lse, rtol=1e-12, atol=1e-12)


# ------------------------------------------------------------------ the fuzzer and the sanitizer sweep

def test_the_head_dims_family_draws_padded_forwards(monkeypatch):
    """16-bit at PADDED_HEAD_DIMS; sm90 cases with seed 6 mod 7 (not 3 mod 4: head_dim_v's) in e4m3 at
    FP8_PADDED_HEAD_DIMS, whole 16-byte rows."""
    from facodegen.verify import fuzz
    info = api.DeviceInfo(0, "NVIDIA H200", (9, 0), 132, 232448)
    monkeypatch.setattr(api, "device_info", lambda ordinal: info)
    monkeypatch.setattr(api, "_tuned_fields", lambda *a: None)
    cases = [c for c in fuzz.generate(400, seed=3, family="head_dims") if not c.head_dim_v]   # (head_dim_v: its own test)
    wide = [c for c in cases if c.dtype != "fp8"]
    fp8 = [c for c in cases if c.dtype == "fp8"]
    assert {c.head_dim for c in wide} == set(fuzz.PADDED_HEAD_DIMS)
    assert {c.dtype for c in wide} == {"bf16", "fp16"} and {c.arch for c in wide} == {"sm80", "sm90"}
    assert fp8 and all(c.arch == "sm90" and c.seed % 7 == 6 and c.head_dim % 16 == 0 for c in fp8)
    assert {c.head_dim for c in fp8} <= set(fuzz.FP8_PADDED_HEAD_DIMS) and len({c.head_dim for c in fp8}) > 3
    for c in wide[:30] + fp8[:10]:
        spec = fuzz.case_spec(c)
        assert (spec.head_dim_real, spec.head_dim, spec.dtype) == (c.head_dim, tile_head_dim(c.head_dim), c.dtype)
    sweep = [c for c in fuzz.representative_cases() if c.family == "head_dims" and not c.head_dim_v]
    assert {(c.arch, c.dtype, c.head_dim) for c in sweep} == {
        (a, d, h) for a in ("sm80", "sm90") for d, h in (("bf16", 80), ("fp16", 8))} | {("sm90", "fp8", 80)}


def test_precompile_takes_a_padded_head_dim():
    """A model's head_dim 80 (Phi-2) precompiles the head_dim 96 tile's kernel with d = 80."""
    from click.testing import CliRunner

    from facodegen.cli import main
    result = CliRunner().invoke(main, ["precompile", "--shape", "1,128,128,8,8,80", "--arch", "sm80", "--gpu", "a100"])
    assert result.exit_code == 0, result.output
    assert "flash_fwd_sm80_bf16_hd96_d80_" in result.output and "0 bytes spilled" in result.output
