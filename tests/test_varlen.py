"""Variable-length attention (facodegen.attention_varlen) on the CPU: the varlen kernels (sm80, and
sm90: wgmma/TMA, O stored by TMA where a warpgroup's 64 rows lie inside the sequence and row by row
elsewhere, or row by row everywhere with varlen_tma_store=False) render and compile without spills, the float64 varlen
reference agrees with the padded one sequence by sequence, every argument error names its argument, a call whose cu_seqlens values change is a
plan-cache hit (sm90: its TMA maps encoded anew over the packed tokens when the totals change), and
the FlashParams bytes hold the sequence boundaries where the struct says.
The kernels' numbers on a GPU: tests/gpu/test_varlen_gpu.py."""

from __future__ import annotations

import re
import struct

import numpy as np
import pytest

import facodegen
from facodegen import KernelSpec, SpecError
from facodegen.ops import adapters, varlen
from facodegen.runtime import params, plan as plan_mod, tma as tma_mod
from facodegen.verify.reference import attention_reference, varlen_reference
from fakes import FakeTensor
from sampling import one_per
from test_plan_cache import fake  # noqa: F401 (the fake torch and driver fixture)

compiler = pytest.importorskip("facodegen.runtime.compiler")

SM80_DEFAULTS = [s for s in facodegen.default_specs() if s.arch == "sm80"]
VARLEN_SPECS = [s.replace(varlen=True) for s in SM80_DEFAULTS]
# sm90: the default 16-bit kernels of every head dim with varlen (persistent: the tiles numbered densely
# over the sequences by the kernel's warp scan), and with persistent=False (one CTA per tile)
SM90_VARLEN_SPECS = [KernelSpec(arch="sm90", head_dim=d, dtype=t, causal=c, varlen=True)
                     for d in facodegen.spec.HEAD_DIMS for t in ("bf16", "fp16") for c in (False, True)]
SM90_VARLEN_NP_SPECS = [s.replace(persistent=False) for s in SM90_VARLEN_SPECS]
# the persistent varlen kernel with the other scheduler than its default (causal: static, else dynamic)
SM90_VARLEN_OTHER_SCHEDULER = [s.replace(dynamic_scheduler=not s.dynamic_scheduler) for s in SM90_VARLEN_SPECS]
# and the structural knobs whose code the O store and the loads meet: L2 prefetch (packed rows), no
# intra-warpgroup overlap, O over Q (its release after the row stores), O over the V ring (o_free)
SM90_VARLEN_KNOBS = [KernelSpec(arch="sm90", head_dim=128, dtype="bf16", causal=True, varlen=True, **f)
                     for f in (dict(l2_prefetch=2), dict(intra_wg_overlap=False), dict(separate_o=False),
                               dict(o_in_v=True, separate_o=False))]
# varlen_lpt: causal tiles longest first over L2-sized groups of a sequence's heads (both schedulers)
SM90_VARLEN_LPT = [KernelSpec(arch="sm90", head_dim=d, dtype="bf16", causal=True, varlen=True, varlen_lpt=True, **f)
                   for d, f in ((64, {}), (128, {}), (256, {}), (128, dict(dynamic_scheduler=False)))]
# fp8 (e4m3, V as the packed tokens, O in bf16 from registers): every head_dim the fp8 forward ships, both
# masks, persistent, and one CTA per tile once
SM90_VARLEN_FP8 = [KernelSpec(arch="sm90", head_dim=d, dtype="fp8", causal=c, varlen=True, v_layout="row")
                   for d in (64, 128, 256) for c in (False, True)]
SM90_VARLEN_FP8_NP = [SM90_VARLEN_FP8[3].replace(persistent=False)]
# varlen_tma_store=False: every row of O row by row (the store before issue 39's TMA store of whole blocks)
SM90_VARLEN_ROW_STORE = [s.replace(varlen_tma_store=False) for s in SM90_VARLEN_SPECS]


# ------------------------------------------------------------------ spec, render, compile

def test_varlen_spec_is_the_default_kernel_with_varlen():
    for plain, packed in zip(SM80_DEFAULTS, VARLEN_SPECS):
        assert packed.varlen and packed.variant == plain.variant + "_varlen"
        assert (packed.block_m, packed.block_n, packed.num_warps, packed.stages) == \
            (plain.block_m, plain.block_n, plain.num_warps, plain.stages)
    assert {s.head_dim for s in VARLEN_SPECS} == set(facodegen.spec.HEAD_DIMS)


def test_sm90_varlen_spec_is_the_persistent_default_kernel_with_varlen():
    """sm90 varlen is persistent by default, with every knob of the padded default kernel (its
    scheduler, two Q buffers where they fit); persistent=False keeps one CTA per tile."""
    for packed in SM90_VARLEN_SPECS:
        plain = KernelSpec(arch="sm90", head_dim=packed.head_dim, dtype=packed.dtype, causal=packed.causal)
        assert packed.varlen and packed.variant == plain.variant + "_varlen"
        assert packed.persistent and not packed.stream_k and packed.cluster_m == 1
        assert (packed.block_m, packed.block_n, packed.stages, packed.consumer_warpgroups, packed.q_stages,
                packed.dynamic_scheduler) == (plain.block_m, plain.block_n, plain.stages, plain.consumer_warpgroups,
                                              plain.q_stages, plain.dynamic_scheduler)


def test_sm90_varlen_without_persistent_is_one_cta_per_tile():
    for packed in SM90_VARLEN_NP_SPECS:
        plain = KernelSpec(arch="sm90", head_dim=packed.head_dim, dtype=packed.dtype, causal=packed.causal)
        assert packed.varlen and packed.variant.endswith("_varlen") and "_np_" in packed.variant
        assert not (packed.persistent or packed.dynamic_scheduler or packed.stream_k) and packed.cluster_m == 1
        assert packed.q_stages == 1     # one tile per CTA: no next tile's Q to load early
        assert (packed.block_m, packed.block_n, packed.stages, packed.consumer_warpgroups) == \
            (plain.block_m, plain.block_n, plain.stages, plain.consumer_warpgroups)


@pytest.mark.parametrize("fields, knob", [
    (dict(arch="sm90", dtype="fp8", v_layout="transposed"), "v_layout"),
    (dict(arch="sm90", dtype="fp8", v_layout="row", vt_in_place=True), "v_layout"),
    (dict(arch="sm90", dtype="fp8", v_layout="row", defer_o_store=True), "defer_o_store"),
    (dict(arch="sm90", dtype="fp8", v_layout="row", l2_prefetch=1), "l2_prefetch"),
    (dict(arch="sm90", stream_k=True), "stream_k"),
    (dict(arch="sm90", persistent=True, dynamic_scheduler=False, stream_k=True), "stream_k"),
    (dict(arch="sm90", cluster_m=2), "cluster_m"),
    (dict(arch="sm90", persistent=True, cluster_m=2), "cluster_m"),
    (dict(arch="sm90", persistent=False, cluster_m=2), "cluster_m"),
    (dict(arch="sm80", schedule="fa1"), "varlen"),
    (dict(arch="sm80", schedule="fa1", local=True), "local"),
])
def test_varlen_refuses_what_it_does_not_have(fields, knob):
    with pytest.raises(SpecError) as err:
        KernelSpec(varlen=True, **fields)
    assert err.value.field == knob


# the attention variants with varlen: each feature alone and all three, both archs (issue 40: the window
# combines with varlen), compiled once per arch and feature set below
# padded head dims (issue 40: any multiple of 8) with varlen, both archs: d80 on the d96 tile, d40 on d64's
SM90_VARLEN_PADDED, SM80_VARLEN_PADDED = ([KernelSpec(arch=arch, head_dim=d, dtype="bf16", causal=c, varlen=True)
                                           for d, c in ((80, True), (40, False))] for arch in ("sm90", "sm80"))
# V narrower than Q and K with varlen, both archs: 192 / 128 (DeepSeek MLA prefill) and 128 / 64
SM90_VARLEN_SPLIT_V, SM80_VARLEN_SPLIT_V = ([KernelSpec(arch=arch, head_dim=d, head_dim_v=dv, dtype="bf16", causal=c,
                                                        varlen=True) for d, dv, c in ((192, 128, True), (128, 64, False))]
                                            for arch in ("sm90", "sm80"))
VARLEN_VARIANT_CASES = ((128, True, dict(local=True)), (64, False, dict(softcap=True)), (256, True, dict(sinks=True)),
                        (128, False, dict(local=True, softcap=True, sinks=True)))
SM90_VARLEN_VARIANTS, SM80_VARLEN_VARIANTS = ([KernelSpec(arch=arch, head_dim=d, dtype="bf16", causal=c, varlen=True, **f)
                                               for d, c, f in VARLEN_VARIANT_CASES] for arch in ("sm90", "sm80"))


def test_the_fp8_varlen_kernel_loads_the_packed_tokens_and_stores_each_sequences_rows():
    """fp8 varlen: the default fp8 kernel's knobs but stream-K and the deferred O store (varlen tiles differ
    in length; O leaves at each tile's end); V's loads at the sequence's first key token, as K's; O from
    registers at the sequence's first query token, rows below its seqlen_q inside the packed tensor;
    the descales per (sequence, kv head); no _rowo token (fp8 stores no O by TMA anyway)."""
    for spec in SM90_VARLEN_FP8:
        plain = KernelSpec(arch="sm90", head_dim=spec.head_dim, dtype="fp8", causal=spec.causal, v_layout="row")
        assert not spec.stream_k and not spec.defer_o_store and not spec.varlen_tma_store
        assert spec.variant.endswith("_varlen") and (spec.block_m, spec.block_n) == (plain.block_m, plain.block_n)
    source = facodegen.emit(SM90_VARLEN_FP8[3])
    lines = [line.strip() for line in source.splitlines()]
    for line in ("const int q_start = q_start_again(p, t);",
                 "const int rows = q_start < 0 ? 0 : min(t.seqlen_q, p.total_q - q_start);",
                 "store_o(o_reg, o_head, row0, rows, p.o_row_stride, lane % 4);", "init_varlen_tiles(p);"):
        assert line in lines, line
    assert source.count("t.k_start + n * BLOCK_N") == 3        # K (roles.cuh.j2's loop), V and the caller's V^T


def test_fp8_varlen_calls(varlen_plans):
    """attention_varlen on e4m3 tensors: the fp8 varlen kernel on sm90, O in bf16 (out_dtype), each
    descale's address written per call (a left-out one: the plan's unit descale), a new descale of the
    same layout a hit; the attention variants too; what it refuses is named."""
    from facodegen.ops import api
    descale_at = {f.name: off for f, off in params.layout("sm90", "fp8", varlen=True)[0]}["q_descale"]
    a = _args(dtype="float8_e4m3fn")
    scalar = lambda: FakeTensor((), "float32")      # noqa: E731
    d1 = (scalar(), scalar(), scalar())
    out, lse = _call(a, causal=True, return_lse=True, q_descale=d1[0], k_descale=d1[1], v_descale=d1[2])
    spec = _plan_spec()
    assert spec.dtype == "fp8" and spec.varlen and spec.out_dtype == "bf16" and spec.arch == "sm90"
    assert str(out.dtype).endswith("bfloat16") and out.shape == a["q"].shape
    d2 = (scalar(), scalar())
    _call(a, causal=True, return_lse=True, q_descale=d2[0], k_descale=d2[1])     # v_descale left out: the unit one
    _call(a, causal=True, return_lse=True, q_descale=scalar(), k_descale=scalar())
    assert varlen._PLANS.misses == 2
    records = varlen_plans.launches.records
    unit = api._unit_descale(0, "torch").data_ptr()
    assert struct.unpack_from("<3Q", records[0]["params"], descale_at) == tuple(d.data_ptr() for d in d1)
    assert struct.unpack_from("<3Q", records[1]["params"], descale_at) == (d2[0].data_ptr(), d2[1].data_ptr(), unit)
    _call(a, causal=False, window_size=(8, 3), softcap=20.0, q_descale=scalar(), k_descale=scalar())
    spec = list(varlen._PLANS._plans.values())[-1].spec
    assert spec.dtype == "fp8" and spec.varlen and spec.local and spec.softcap and not spec.sinks
    for kw, error, words in [(dict(arch="sm80"), ValueError, "fp8 (e4m3) varlen runs on sm90"),
                             (dict(v_layout="transposed"), SpecError, "v_layout")]:
        with pytest.raises(error, match=re.escape(words)):
            _call(a, causal=True, **kw)


def test_varlen_takes_v_narrower_than_q_and_k(varlen_plans):
    """head_dim 192 / head_dim_v 128 (DeepSeek MLA prefill) through attention_varlen: the split-V kernel with
    varlen, O (total, heads, 128) allocated so on a hit too; sm90's O stores (the TMA store's slabs, the
    partial blocks' row store) are head_dim_v wide."""
    a = _args()
    a.update(q=FakeTensor((118, HQ, 192)), k=FakeTensor((118, HKV, 192)), v=FakeTensor((118, HKV, 128)))
    out = _call(a, causal=True, arch="sm90")
    out2 = _call(a, causal=True, arch="sm90")                 # a hit: O shaped by the plan
    spec = _plan_spec()
    assert (spec.head_dim, spec.head_dim_v, spec.varlen) == (192, 128, True) and varlen._PLANS.misses == 1
    assert out.shape == out2.shape == (118, HQ, 128)
    lines = [line.strip() for line in facodegen.emit(spec).splitlines()]
    assert any(x.startswith("constexpr int O_ROW_CHUNKS = HEAD_DIM_V * ELEM_BYTES / 16;") for x in lines)
    assert "for (int slab = 0; slab < V_SLABS; ++slab) {" in lines


def test_varlen_takes_a_head_dim_between_the_tiles(varlen_plans):
    """head_dim 80 through attention_varlen: the d96 tile with head_dim_real 80 (its TMA maps' rows 80
    columns wide: loads fill the rest with zeros, the TMA store of O clips there), and the row store of a
    sequence's last partial block stops at the problem's columns too (sm90's store_o_rows)."""
    a = _args()
    a.update(q=FakeTensor((118, HQ, 80)), k=FakeTensor((118, HKV, 80)), v=FakeTensor((118, HKV, 80)))
    _call(a, causal=True, arch="sm90")
    spec = _plan_spec()
    assert (spec.head_dim, spec.head_dim_real, spec.varlen) == (96, 80, True)
    lines = [line.strip() for line in facodegen.emit(spec).splitlines()]
    assert "if (row < rows && c < O_REAL_CHUNKS) {" in lines
    assert any(x.startswith("constexpr int O_REAL_CHUNKS = HEAD_DIM_REAL * ELEM_BYTES / 16;") for x in lines)
    assert "if (row < rows) {" in [x.strip() for x in facodegen.emit(SM90_VARLEN_SPECS[0]).splitlines()]


def test_varlen_kernels_take_the_window_on_each_sequences_diagonal():
    """A varlen kernel with a window: the window's key offsets from the tile's own lengths (sm90: t.seqlen_q,
    t.seqlen_k from cu_seqlens; sm80: the sequence's seqlen_q, seqlen_k), its skipped blocks from the same
    (the scheduler's window_blocks over t's lengths); the padded kernel keeps the call's."""
    sm90 = [line.strip() for line in facodegen.emit(SM90_VARLEN_VARIANTS[0]).splitlines()]
    assert "const int key_lo_off = t.seqlen_k - t.seqlen_q - p.window_left;    // row i sees keys i + key_lo_off .." \
        in sm90
    assert any(x.startswith("apply_window_mask(s_reg, row0, n * BLOCK_N + col_in_block, t.seqlen_k, key_lo_off,")
               for x in sm90)
    assert any(x.startswith("const WindowBlocks w = window_blocks<BLOCK_N>(first_row, last_row, t.seqlen_k,")
               for x in sm90)
    assert not any("p.seqlen_k - p.seqlen_q - p.window_left" in x for x in sm90)
    padded = facodegen.emit(SM90_VARLEN_VARIANTS[0].replace(varlen=False))
    assert "const int key_lo_off = p.seqlen_k - p.seqlen_q - p.window_left;" in padded
    sm80 = [line.strip() for line in facodegen.emit(SM80_VARLEN_VARIANTS[0]).splitlines()]
    assert "const SeqSpan keys = seq_span(p.cu_seqlens_k, sequence, p.total_k);" in sm80
    assert any(x.startswith("const int key_lo_off = seqlen_k - seqlen_q - p.window_left;") for x in sm80)


def test_plain_kernels_do_not_mention_varlen():
    source = facodegen.emit(SM80_DEFAULTS[0])
    assert "varlen" not in source and "cu_seqlens" not in source


def test_the_varlen_kernel_reads_cu_seqlens_and_says_so():
    source = facodegen.emit(VARLEN_SPECS[0])
    lines = [line.strip() for line in source.splitlines()]
    assert "//   varlen               = True" in source and lines[4].endswith("--varlen")
    for line in ("const int sequence = blockIdx.z;", "const int seqlen_q = seq_span(p.cu_seqlens_q, sequence, p.total_q).len;",
                 "const int k_start = keys.start;", "if (rows_valid <= 0 || static_cast<unsigned>(q_start()) > "):
        assert any(x.startswith(line) for x in lines), line
    assert "cu_seqlens_q;" in source and "total_q;" in source     # the FlashParams fields


def test_the_sm90_varlen_kernel_stores_o_row_by_row():
    """sm90 varlen with varlen_tma_store=False: the sequence's boundaries in the scheduler, TMA
    coordinates in the packed tokens, the sequence's own lengths in the mask, no TMA store of O (per-row
    guarded stores instead), the LSE at (head, total_q); the plain sm90 kernel has none of it."""
    spec = SM90_VARLEN_NP_SPECS[3].replace(persistent=False, varlen_tma_store=False)   # head_dim 64, fp16, causal
    assert spec.variant.endswith("_causal_varlen_rowo") and not spec.persistent
    source = facodegen.emit(spec)
    lines = [line.strip() for line in source.splitlines()]
    assert lines[4].endswith("--varlen --varlen-row-store") and "--no-persistent" in lines[4]
    for line in ("t.q_start = queries.start;", "const SeqSpan keys = seq_span(p.cu_seqlens_k, sequence, p.total_k);",
                 "const int sequence = static_cast<unsigned>(batch) < static_cast<unsigned>(p.batch) ? batch",
                 "if (first.m_block * BLOCK_M >= first.seqlen_q) {", "store_o_rows(p, t, o_rows, wg, tid);",
                 "t.q_start + t.m_block * BLOCK_M, t.head, 0, L2_EVICT_FIRST);",
                 "apply_mask(s_reg, row0, n * BLOCK_N + col_in_block, t.seqlen_q, t.seqlen_k, CAUSAL);",
                 "p.lse[static_cast<int64_t>(t.head) * p.total_q + token] = lse[r];",
                 "const int rows = first_token < 0 ? 0 : min(min(WG_ROWS, t.seqlen_q - first_row), p.total_q - first_token);",
                 "constexpr bool VARLEN_SCAN = false;"):
        assert any(x.startswith(line) for x in lines), line
    assert "tma_store_4d(p.tma_o" not in source and "tma_prefetch_desc(p.tma_o)" not in source
    assert "o_box_token" not in source
    plain = facodegen.emit(KernelSpec(arch="sm90", head_dim=64, dtype="fp16", causal=True))
    assert "cu_seqlens" not in plain and "tma_store_4d(p.tma_o" in plain
    assert "varlen_tma_store" not in plain and "o_box_token" not in plain


@pytest.mark.parametrize("spec", [SM90_VARLEN_NP_SPECS[3], SM90_VARLEN_SPECS[3], SM90_VARLEN_SPECS[19]] + SM90_VARLEN_KNOBS,
                         ids=lambda s: s.variant)
def test_the_sm90_varlen_kernel_stores_whole_blocks_of_o_by_tma(spec):
    """varlen_tma_store (the default): a consumer warpgroup whose 64 rows lie inside the sequence and the
    packed tensor stores them with the padded kernel's TMA store, at the first row's packed token (batch
    coordinate 0: tma_o spans the packed tokens); the others copy their rows as before. One barrier
    and fence after either, then the issuing thread's store, and (O over Q or V) its read wait before
    the release, as the padded epilogue; the loader prefetches tma_o's descriptor."""
    assert spec.varlen_tma_store and "rowo" not in spec.variant
    source = facodegen.emit(spec)
    lines = [line.strip() for line in source.splitlines()]
    assert "--varlen-row-store" not in lines[4]
    for line in ("__device__ __forceinline__ int o_box_token(const FlashParams& p, const TileInfo& t, int wg) {",
                 "const int first_row = t.m_block * BLOCK_M + wg * WG_ROWS;          // in the sequence",
                 "const int first_token = q_start_again(p, t) + first_row;           // in the packed O",
                 "return first_row + WG_ROWS <= t.seqlen_q && first_token >= 0 && first_token <= p.total_q - WG_ROWS",
                 "? first_token : -1;", "tma_prefetch_desc(p.tma_o);"):
        assert line in lines, line
    epilogue = "\n".join(lines[lines.index("const int o_token = o_box_token(p, t, wg);"):])
    expected = "\n".join([
        "const int o_token = o_box_token(p, t, wg);",
        "if (o_token < 0) {",
        "named_bar_sync(EPILOGUE_BAR + wg, WG_THREADS);",
        "store_o_rows(p, t, o_rows, wg, tid);",
        "}",
        "fence_proxy_async_smem();",
        "named_bar_sync(EPILOGUE_BAR + wg, WG_THREADS);",
        "if (tid == 0) {",
        "if (o_token >= 0) {",
        "for (int slab = 0; slab < NUM_SLABS; ++slab) {",
        "tma_store_4d(p.tma_o, o_rows + slab * O_SLAB_BYTES, slab * SLAB_COLS, o_token, t.head, 0);",
        "}",
        "tma_store_commit();",
        "}",
        "if (!SEPARATE_O) {",
        "tma_store_wait_read();                      // smem read: the producer may reload Q (V)",
        "mbar_arrive(O_IN_V ? smem_u32(&state.o_free) : q_empty);",
        "}"])
    assert epilogue.startswith(expected)
    # SEPARATE_O: this warpgroup's last TMA store has read the staging tile before the tile is rewritten,
    # and every O store is complete before the CTA exits (the padded kernel's lines)
    st_shared = lines.index("st_shared_32(o_smem + (col / SLAB_COLS) * O_SLAB_BYTES + offset, packed);")
    wait = lines.index("if (SEPARATE_O) {", lines.index("const uint32_t o_rows = o_smem + wg * WG_ROWS * SWIZZLE_BYTES;"))
    assert lines[wait:wait + 5] == ["if (SEPARATE_O) {", "if (tid == 0) {", "tma_store_wait_read();", "}",
                                    "named_bar_sync(EPILOGUE_BAR + wg, WG_THREADS);"] and wait < st_shared
    assert "tma_store_wait_all();                               // O stores complete before the CTA exits" in lines


def test_varlen_tma_store_is_an_sm90_varlen_knob():
    """On by default for sm90 varlen; off (and unsaid in names, headers and emit lines) elsewhere; True
    without varlen, or on sm80, is refused naming it; off is the variant's _rowo."""
    for spec in SM90_VARLEN_SPECS + SM90_VARLEN_NP_SPECS:
        assert spec.varlen_tma_store is True
    for spec in SM90_VARLEN_ROW_STORE:
        assert spec.varlen_tma_store is False and spec.variant.endswith("_varlen_rowo")
    assert not KernelSpec(arch="sm90", head_dim=128).varlen_tma_store
    assert not KernelSpec(arch="sm90", head_dim=128, dtype="fp8").varlen_tma_store
    assert not any(s.varlen_tma_store for s in VARLEN_SPECS)     # sm80
    plain = KernelSpec(arch="sm90", head_dim=128, varlen_tma_store=False)
    assert plain == KernelSpec(arch="sm90", head_dim=128) and "rowo" not in plain.variant
    for fields in (dict(arch="sm90"), dict(arch="sm80"), dict(arch="sm80", varlen=True)):
        with pytest.raises(SpecError) as err:
            KernelSpec(head_dim=128, varlen_tma_store=True, **fields)
        assert err.value.field == "varlen_tma_store"
    source = facodegen.emit(KernelSpec(arch="sm90", head_dim=128))
    assert "varlen_tma_store" not in source and "varlen-row-store" not in source
    on = facodegen.emit(SM90_VARLEN_SPECS[0])
    assert "//   varlen_tma_store     = True" in on


def test_the_cli_takes_the_varlen_store_knob():
    from click.testing import CliRunner

    from facodegen.cli import main
    result = CliRunner().invoke(main, ["emit", "--arch", "sm90", "--varlen", "--head-dim", "128", "--varlen-row-store"])
    assert result.exit_code == 0, result.output
    assert "flash_fwd_sm90_bf16_hd128_bm128_bn160_w12_st2_r24x240_ov_so_rsq_opt_varlen_rowo(" in result.output
    assert "o_box_token" not in result.output and "store_o_rows(p, t, o_rows, wg, tid);" in result.output
    result = CliRunner().invoke(main, ["emit", "--arch", "sm90", "--head-dim", "128", "--varlen-tma-store"])
    assert result.exit_code != 0 and "varlen_tma_store" in result.output


def test_varlen_lpt_is_an_sm90_persistent_causal_varlen_knob():
    """Off by default everywhere; on, the variant ends _lpt, the header says so, the CLI's --varlen-lpt
    emits it, and the scan's decode takes the sections from the sequence's cu_seqlens_k; anywhere it
    cannot order anything (sm80, the padded kernel, one CTA per tile, non-causal) it is refused naming it."""
    assert not any(s.varlen_lpt for s in SM90_VARLEN_SPECS + VARLEN_SPECS)
    spec = SM90_VARLEN_LPT[1]
    plain = spec.replace(varlen_lpt=False)
    assert plain in SM90_VARLEN_SPECS and spec.variant == plain.variant + "_lpt"
    source = facodegen.emit(spec)
    lines = [line.strip() for line in source.splitlines()]
    assert "//   varlen_lpt           = True" in source and lines[4].endswith("--varlen --varlen-lpt")
    for line in ("const int keys = seq_span(p.cu_seqlens_k, clamped, p.total_k).len;",
                 "int section = L2_SECTION_KEYS / (keys > 0 ? keys : 1);", "const int m_index = r / width;",
                 "return tile_at(p, m_count - 1 - m_index, head, sequence);"):
        assert any(x.startswith(line) for x in lines), line
    assert "cu_seqlens_k, clamped" not in facodegen.emit(plain)
    for fields in (dict(arch="sm80", varlen=True, causal=True), dict(arch="sm90", causal=True),
                   dict(arch="sm90", varlen=True, causal=True, persistent=False), dict(arch="sm90", varlen=True)):
        with pytest.raises(SpecError) as err:
            KernelSpec(head_dim=128, varlen_lpt=True, **fields)
        assert err.value.field == "varlen_lpt"
    from click.testing import CliRunner

    from facodegen.cli import main
    result = CliRunner().invoke(main, ["emit", "--arch", "sm90", "--varlen", "--head-dim", "128", "--causal",
                                       "--varlen-lpt"])
    assert result.exit_code == 0, result.output
    assert f"{spec.variant}(" in result.output


@pytest.mark.parametrize("block_m", [128, 192])
def test_whole_blocks_by_tma_and_the_rest_by_rows_write_every_row_once(block_m):
    """A model of the epilogue's split (o_box_token, store_o_rows' row guard) over sequences around
    the block edges (lengths a multiple of block_m or 64, one more, one less, empty, 1) packed one after
    another, one head: each row of each sequence is written exactly once, by a TMA box only when all its
    64 rows are the sequence's, and no row outside the sequences is written (nor past total_q)."""
    lengths = [0, 1, 63, 64, 65, 127, 128, 129, 191, 192, 193, 255, 256, 257, 384, 0, 1000]
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    total_q = cu[-1]
    written = [0] * total_q
    boxes = 0
    for seq, n in enumerate(lengths):
        for m_block in range(-(-n // block_m)):
            for wg in range(block_m // 64):
                first_row = m_block * block_m + wg * 64
                first_token = cu[seq] + first_row
                o_token = first_token if (first_row + 64 <= n and 0 <= first_token <= total_q - 64) else -1
                if o_token >= 0:
                    boxes += 1
                    for token in range(o_token, o_token + 64):     # the box: 64 rows, none clipped
                        assert cu[seq] <= token < cu[seq + 1]
                        written[token] += 1
                else:
                    rows = 0 if first_token < 0 else min(min(64, n - first_row), total_q - first_token)
                    for row in range(max(rows, 0)):
                        written[first_token + row] += 1
    assert written == [1] * total_q
    assert boxes == sum(n // 64 for n in lengths)      # every whole 64 rows of a sequence by TMA


@pytest.mark.parametrize("spec", [SM90_VARLEN_SPECS[3], SM90_VARLEN_OTHER_SCHEDULER[3], SM90_VARLEN_SPECS[4]],
                         ids=["hd64-causal-dynamic", "hd64-causal-static", "hd96-full-static"])
def test_the_persistent_sm90_varlen_kernel_scans_cu_seqlens(spec):
    """Persistent varlen: no early exit, the CTA's tile count from all its threads' sum in the setup, the
    tiles decoded by a warp scan (shfl_up, a ballot of the sequences ending at or before the tile) from
    a cursor the loader keeps, each tile handed to the consumers through the slot with its sequence's
    boundaries (the consumers read no cu_seqlens after their first tile), and every loop ending at the
    CTA's own count, not at p.num_tiles (the grid's bound); the partial blocks' O row by row as before."""
    source = facodegen.emit(spec)
    lines = [line.strip() for line in source.splitlines()]
    assert lines[4].endswith("--varlen") and "--no-persistent" not in lines[4]
    for line in ("constexpr bool VARLEN_SCAN = true;", "constexpr bool TILE_HANDOFF = DYNAMIC_SCHEDULER || VARLEN_SCAN;",
                 "init_varlen_tiles(p);", "cta_varlen_tiles = total * p.heads_q;", "__shared__ int cta_varlen_tiles;",
                 "for (int sequence = threadIdx.x; sequence < p.batch; sequence += THREADS) {",
                 "const int x = __shfl_up_sync(0xffffffffu, end, d);",
                 "const int before = __popc(__ballot_sync(0xffffffffu, end <= tile));",
                 "return blocks < p.num_m_blocks ? blocks : p.num_m_blocks;",
                 "VarlenCursor cursor = {0, 0};", "TileInfo t = decode_tile(p, tile, cursor);",
                 "if (tile >= tile_count(p)) {", "if (tile < tile_count(p)) {", "return cta_varlen_tiles;",
                 "if (TILE_HANDOFF && tile_iter >= 1) {", "store_o_rows(p, t, o_rows, wg, tid);",
                 "int tile_slot[8];", "state.tile_slot[4] = t.q_start;", "t.seqlen_k = state.tile_slot[7];",
                 "tile_blocks(p, t, m_block, head, batch);"):
        assert any(x.startswith(line) for x in lines), line
    assert "if (first.m_block * BLOCK_M >= first.seqlen_q) {" not in source
    # (whole blocks by TMA, test_the_sm90_varlen_kernel_stores_whole_blocks_of_o_by_tma; rows as before)
    assert "tma_store_4d(p.tma_o, o_rows + slab * O_SLAB_BYTES, slab * SLAB_COLS, o_token, t.head, 0);" in lines
    assert ("ticket == tile_count(p) - 1" in source) and (f"DYNAMIC_SCHEDULER = {str(spec.dynamic_scheduler).lower()};"
                                                           in source)


def test_the_cli_emits_an_sm90_varlen_kernel():
    from click.testing import CliRunner

    from facodegen.cli import main
    result = CliRunner().invoke(main, ["emit", "--arch", "sm90", "--varlen", "--head-dim", "128", "--causal"])
    assert result.exit_code == 0, result.output
    assert "flash_fwd_sm90_bf16_hd128_bm128_bn128_w12_st2_r24x240_ov_so_rsq_opt_q2_causal_varlen(" in result.output
    assert "store_o_rows(p, t, o_rows, wg, tid);" in result.output and "init_varlen_tiles(p);" in result.output
    result = CliRunner().invoke(main, ["emit", "--arch", "sm90", "--varlen", "--no-persistent", "--head-dim", "128",
                                       "--causal"])
    assert result.exit_code == 0, result.output
    assert "flash_fwd_sm90_bf16_hd128_bm128_bn128_w12_st2_r24x240_ov_np_so_rsq_opt_causal_varlen(" in result.output
    assert "init_varlen_tiles" not in result.output


# every sm80 varlen config for the A100 (sm_80), one per head_dim of them for H100/H200 (sm_90: the same
# source); the sm90 varlen kernel (persistent) once per head_dim and causal, its dtype seeded (fp16 and
# bf16 differ in the element type only); with persistent=False once per causal (head_dim and dtype
# seeded: the one-CTA path compiled at every head_dim through 2026-12-04 and runs on the H200 in
# tests/gpu); with the other scheduler once (causal seeded); the knob variants and varlen_lpt's; with varlen_tma_store=False
# once (seeded: its source is the row-by-row store's of 2026-12-04, which compiled at every head_dim)
@pytest.fixture(scope="module", params=[(s, "sm_80") for s in VARLEN_SPECS]
                + [(s, "sm_90") for s in one_per(VARLEN_SPECS, lambda s: s.head_dim)]
                + [(s, None) for s in one_per(SM90_VARLEN_SPECS, lambda s: (s.head_dim, s.causal))
                   + one_per(SM90_VARLEN_NP_SPECS, lambda s: s.causal)
                   + one_per(SM90_VARLEN_OTHER_SCHEDULER, lambda s: True)
                   + SM90_VARLEN_KNOBS + SM90_VARLEN_LPT + SM90_VARLEN_VARIANTS + SM80_VARLEN_VARIANTS
                   + SM90_VARLEN_FP8 + SM90_VARLEN_FP8_NP + SM90_VARLEN_PADDED + SM80_VARLEN_PADDED
                   + SM90_VARLEN_SPLIT_V + SM80_VARLEN_SPLIT_V
                   + one_per(SM90_VARLEN_ROW_STORE, lambda s: True)],
                ids=lambda p: f"{p[0].variant}-{p[1] or 'sm_90a'}")
def varlen_kernel(request):
    spec, sm = request.param
    return spec, compiler.compile(spec, sm=sm)


def test_varlen_kernels_compile_without_spills(varlen_kernel):
    spec, kernel = varlen_kernel
    r = kernel.resources
    assert (r.stack_bytes, r.spill_stores, r.spill_loads) == (0, 0, 0), kernel.log
    assert 0 < r.registers <= 255
    if spec.arch == "sm90":     # no local memory, no serialised wgmma or ignored setmaxnreg (C75xx)
        counts = kernel.sass_counts()
        assert counts["LDL"] == 0 and counts["STL"] == 0 and "C75" not in kernel.log, kernel.log
        # Q, K, V by TMA; O by 16-byte st.global (guarded per row) and, with varlen_tma_store, by a TMA
        # store too (one per slab of head_dim, the padded kernel's; the rows of partial blocks as before)
        if spec.dtype == "fp8":     # O from registers, row by row (no staging tile, no TMA store)
            assert counts["UTMALDG"] > 0 and counts["UTMASTG"] == 0, counts
            return
        assert counts["UTMALDG"] > 0 and "STG.E.128" in kernel.sass()
        assert counts["UTMASTG"] == (0 if not spec.varlen_tma_store else     # (V narrower: O's slabs, head_dim_v)
                                     spec.head_dim_v // tma_mod.slab_geometry(spec.head_dim)[1]), counts


# ------------------------------------------------------------------ the persistent varlen schedule

def _i32(x):
    return (x + 2**31) % 2**32 - 2**31


MODEL_TOTAL_Q = 400      # the packed query tokens of the scan test's calls (cu_seqlens_k's: twice that)


def _span_len(cu, seq, total=None):
    """varlen_span.cuh.j2's seq_span(cu, seq, total).len: start clamped into [0, total], the end into
    [start, total] (``total`` None: the largest boundary, as a call whose tensors hold every sequence)."""
    total = max(max(cu), 0) if total is None else total
    start = min(max(cu[seq], 0), total)
    return min(max(cu[seq + 1], start), total) - start


def _m_blocks(cu, seq, block_m, num_m_blocks, total=None):
    """scheduler.cuh.j2's varlen_m_blocks: the clamped length's blocks (0 for none), capped."""
    length = _span_len(cu, seq, total)
    blocks = 0 if length <= 0 else (length - 1) // block_m + 1
    return min(blocks, num_m_blocks)


def _total_tiles(cu, batch, heads, block_m, num_m_blocks, threads=384, total=None):
    """init_varlen_tiles: thread i sums the blocks of sequences i, i + THREADS, ..., the warps' sums
    are added by thread 0; times heads."""
    per_thread = [sum(_m_blocks(cu, s, block_m, num_m_blocks, total) for s in range(i, batch, threads))
                  for i in range(threads)]
    warps = [sum(per_thread[w * 32:(w + 1) * 32]) for w in range(threads // 32)]
    return sum(warps) * heads


def _lpt_place(local, heads, m_count, keys, section_keys):
    """VARLEN_LPT's (head, m_index) of a sequence's tile number ``local``: its heads in sections of
    section_keys // keys (1 .. heads), each section's tiles m_index-major with the heads fastest."""
    section = min(max(section_keys // (keys if keys > 0 else 1), 1), heads)
    s, r = divmod(local, section * m_count)
    first_head = s * section
    width = min(heads - first_head, section)
    m_index, within = divmod(r, width)
    return first_head + within, m_index


def _decode(cu, batch, heads, block_m, num_m_blocks, causal, tile, cursor, cu_k=None, section_keys=0, total=None):
    """decode_tile(p, tile, cursor) lane by lane: chunks of 32 sequences from cursor's, an inclusive
    scan of their tiles, the ballot of the ends at or before the tile; -> (sequence, head, m_block).
    ``cu_k`` given: VARLEN_LPT's order, with L2_SECTION_KEYS = ``section_keys``."""
    seq_from, base = cursor
    for chunk in range(seq_from, batch, 32):
        blocks = [_m_blocks(cu, chunk + lane, block_m, num_m_blocks, total) if chunk + lane < batch else 0
                  for lane in range(32)]
        tiles = [b * heads for b in blocks]
        ends = [base + sum(tiles[:lane + 1]) for lane in range(32)]
        ballot = [end <= tile for end in ends]
        before = sum(ballot)
        assert ballot == sorted(ballot, reverse=True), "the lanes at or before the tile are a prefix"
        if before < 32:
            first = ends[before] - tiles[before]
            cursor[:] = [chunk + before, first]
            local = tile - first
            if cu_k is not None:
                seq = chunk + before
                head, m_index = _lpt_place(local, heads, blocks[before],
                                           _span_len(cu_k, seq, None if total is None else 2 * total), section_keys)
            else:
                head, m_index = divmod(local, blocks[before])
            assert blocks[before] > 0 and 0 <= head < heads
            return chunk + before, head, (blocks[before] - 1 - m_index if causal else m_index)
        base = ends[31]
    return batch, None, None


HOSTILE_CU = [
    [0, 5, 5, 300, 301],                      # a zero-length and a length-1 sequence
    [3, 20, 20, 150, 151],                    # not starting at 0
    [0] + [7 * i for i in range(1, 71)],      # 70 sequences: three chunks of the scan
    [0, 1000, 10, 2**31 - 1, -2**31, 64],     # hostile: decreasing, wrapping, past max_seqlen_q
    [0, 0, 0],                                # all empty: no tile
    [0] + [int(x) for x in np.cumsum(np.random.default_rng(7).integers(0, 300, 500))],   # 500: two rounds of the count
]


@pytest.mark.parametrize("causal, lpt", [(False, False), (True, False), (True, True)],
                         ids=["full", "causal", "causal-lpt"])
@pytest.mark.parametrize("cu", HOSTILE_CU, ids=lambda c: f"b{len(c) - 1}")
def test_the_varlen_scan_numbers_every_tile_once_and_none_empty(cu, causal, lpt):
    """A model of scheduler.cuh.j2's VARLEN_SCAN, lane by lane: whatever cu_seqlens_q holds, the tiles
    0 .. total-1 are every (sequence, head, m_block) with m_block below the sequence's blocks (at most
    p.num_m_blocks, max_seqlen_q's) exactly once, no tile is empty (its first row is in the sequence),
    the total stays within p.num_tiles, a CTA's cursor only moves forward whether its tiles come from
    the static schedule (blockIdx.x + k gridDim.x) or the dynamic one (growing tickets, 0 .. total-1 drawn
    in all, so the counter's reset at ticket total-1 holds), and every tile index past the total decodes
    to sequence p.batch (which tile_at clamps). VARLEN_LPT the same, with a cu_seqlens_k as hostile (twice
    cu_seqlens_q: wrapping too) and sections of 1 to 3 heads."""
    heads, block_m, num_m_blocks = 3, 128, 2      # max_seqlen_q 256
    lpt_args = dict(cu_k=[2 * x for x in cu], section_keys=500) if lpt else {}
    lpt_args["total"] = MODEL_TOTAL_Q          # (the packed tokens seq_span clamps into: 400 queries, 800 keys)
    batch = len(cu) - 1
    total = _total_tiles(cu, batch, heads, block_m, num_m_blocks, total=MODEL_TOTAL_Q)
    assert total <= batch * heads * num_m_blocks           # p.num_tiles, the grid's bound
    expect = {(b, h, m) for b in range(batch) for h in range(heads)
              for m in range(_m_blocks(cu, b, block_m, num_m_blocks, MODEL_TOTAL_Q))}
    assert total == len(expect)
    rng = np.random.default_rng(len(cu))
    for ctas in (1, 5, 132):
        static = [list(range(c, total + 1, ctas)) for c in range(ctas)]
        # dynamic: a CTA's tiles after its first are growing tickets + gridDim.x, drawn in any CTA order
        dynamic = [[c] for c in range(ctas)]
        live = [c for c in range(ctas) if c < total]
        next_ticket = 0
        while live:
            c = live[rng.integers(len(live))]
            tile = next_ticket + ctas
            next_ticket += 1
            dynamic[c].append(tile)
            if tile >= total:
                live.remove(c)
        # the tickets drawn are 0 .. total-1: the CTA drawing total-1 leaves the counter at zero
        assert next_ticket == total
        for order in (static, dynamic):
            seen = []
            for tiles in order:
                cursor = [0, 0]
                for tile in tiles:
                    if tile >= total:
                        assert _decode(cu, batch, heads, block_m, num_m_blocks, causal, tile, list(cursor),
                                       **lpt_args)[0] == batch
                        break
                    before = tuple(cursor)
                    b, h, m = _decode(cu, batch, heads, block_m, num_m_blocks, causal, tile, cursor, **lpt_args)
                    assert tuple(cursor) >= before
                    length = _span_len(cu, b, MODEL_TOTAL_Q)
                    assert 0 <= m < num_m_blocks and m * block_m < length        # not empty
                    seen.append((b, h, m))
            assert len(seen) == len(set(seen)) == total and set(seen) == expect


@pytest.mark.parametrize("keys, sections", [(4096, [list(range(16))]), (8192, [list(range(8)), list(range(8, 16))]),
                                            (3 * 4096, [list(range(5 * i, min(5 * i + 5, 16))) for i in range(4)])])
def test_varlen_lpt_runs_each_sequence_longest_first_over_l2_sized_groups_of_heads(keys, sections):
    """VARLEN_LPT at head_dim 128 (L2_SECTION_KEYS = 32 MB / (2 x 128 x 2 bytes) = 65536) with 16 heads:
    a sequence's tiles come section by section (the heads whose K/V fit: 16 at 4096 keys, 8 at 8192, 5
    at 12288, the last section short), inside each the m_blocks count down with the heads fastest, so
    each sequence's tiles end on its block 0s; tile for tile what the padded kernel's decode_tile gives
    one (batch, head) pair of it (sections of pairs there, of one sequence's heads here)."""
    heads, block_m, num_m_blocks, section_keys = 16, 128, 96, 65536
    cu = [0, keys, 2 * keys]                      # two equal sequences, keys as long as queries
    total = _total_tiles(cu, 2, heads, block_m, num_m_blocks)
    order = [_decode(cu, 2, heads, block_m, num_m_blocks, True, tile, [0, 0], cu_k=cu, section_keys=section_keys)
             for tile in range(total)]
    m_blocks = keys // block_m
    for sequence in (0, 1):
        mine = [(h, m) for b, h, m in order if b == sequence]
        expect = [(h, m) for section in sections for m in reversed(range(m_blocks)) for h in section]
        assert mine == expect
    assert [b for b, _, _ in order] == [0] * (total // 2) + [1] * (total // 2)


# ------------------------------------------------------------------ the float64 reference

def _packed(lengths_q, lengths_k, heads_q=4, heads_kv=2, d=16, seed=0):
    rng = np.random.default_rng(seed)
    cu_q, cu_k = np.concatenate([[0], np.cumsum(lengths_q)]), np.concatenate([[0], np.cumsum(lengths_k)])
    q = rng.standard_normal((cu_q[-1], heads_q, d))
    k, v = (rng.standard_normal((cu_k[-1], heads_kv, d)) for _ in range(2))
    return q, k, v, cu_q.astype(np.int32), cu_k.astype(np.int32)


@pytest.mark.parametrize("variant", [dict(window_size=(3, 2)), dict(window_size=(5, -1), softcap=2.0),
                                     dict(sinks=[0.5, -1.0, 0.25, 2.0]), dict(window_size=(0, 0), softcap=1.5,
                                                                             sinks=[0.5, -1.0, 0.25, 2.0])],
                         ids=["window", "window-softcap", "sinks", "all"])
@pytest.mark.parametrize("causal", [False, True])
def test_varlen_reference_with_variants_is_the_padded_reference_per_sequence(causal, variant):
    """Window (each sequence's own bottom-right diagonal), softcap and sinks: per sequence what
    attention_reference gives, including a sequence with no key (LSE = its sink where there are sinks)."""
    lengths_q, lengths_k = [1, 17, 0, 40, 5, 3], [1, 30, 9, 17, 0, 3]
    q, k, v, cu_q, cu_k = _packed(lengths_q, lengths_k)
    o, lse = varlen_reference(q, k, v, cu_q, cu_k, causal=causal, softmax_scale=0.3, **variant)
    for b in range(len(lengths_q)):
        rows, keys = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        ref_o, ref_lse = attention_reference(q[None, rows], k[None, keys], v[None, keys], causal=causal,
                                             softmax_scale=0.3, **variant)
        np.testing.assert_allclose(o[rows], ref_o[0], rtol=0, atol=1e-12)
        np.testing.assert_allclose(lse[:, rows], ref_lse[0], rtol=0, atol=1e-12)
    if "sinks" in variant:      # sequence 4 has no key: O = 0, LSE = the sink of each head
        assert not o[cu_q[4]:cu_q[5]].any()
        np.testing.assert_array_equal(lse[:, cu_q[4]:cu_q[5]], np.repeat(np.array(variant["sinks"])[:, None], 5, 1))


def test_varlen_reference_with_v_narrower_than_q_and_k():
    """V (and O) of d_v < d columns: per sequence what attention_reference gives."""
    q, k, _, cu_q, cu_k = _packed([3, 17, 0, 40], [5, 30, 9, 17])
    v = np.random.default_rng(3).standard_normal((k.shape[0], k.shape[1], 8))
    for causal in (False, True):
        o, _ = varlen_reference(q, k, v, cu_q, cu_k, causal=causal)
        assert o.shape == (q.shape[0], q.shape[1], 8)
        for b in range(4):
            rows, keys = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
            ref, _ = attention_reference(q[None, rows], k[None, keys], v[None, keys], causal=causal)
            np.testing.assert_allclose(o[rows], ref[0], rtol=0, atol=1e-12)


@pytest.mark.parametrize("causal", [False, True])
def test_varlen_reference_is_the_padded_reference_per_sequence(causal):
    lengths_q, lengths_k = [1, 17, 0, 40, 5, 3], [1, 30, 9, 17, 0, 3]     # empty queries, empty keys, q > k
    q, k, v, cu_q, cu_k = _packed(lengths_q, lengths_k)
    o, lse = varlen_reference(q, k, v, cu_q, cu_k, causal=causal, softmax_scale=0.3)
    assert o.shape == q.shape and lse.shape == (q.shape[1], q.shape[0])
    for b in range(len(lengths_q)):
        rows = slice(cu_q[b], cu_q[b + 1])
        ref_o, ref_lse = attention_reference(q[None, rows], k[None, cu_k[b]:cu_k[b + 1]], v[None, cu_k[b]:cu_k[b + 1]],
                                             causal=causal, softmax_scale=0.3)
        np.testing.assert_allclose(o[rows], ref_o[0], rtol=0, atol=1e-12)
        np.testing.assert_allclose(lse[:, rows], ref_lse[0], rtol=0, atol=1e-12)     # -inf where no key is seen
    if causal:      # sequence 3 has 40 queries and 17 keys: its first 23 rows see none
        assert np.isneginf(lse[:, cu_q[3]:cu_q[3] + 23]).all() and not o[cu_q[3]:cu_q[3] + 23].any()
    assert np.isneginf(lse[:, cu_q[4]:cu_q[5]]).all()       # no keys at all


# ------------------------------------------------------------------ argument errors (fake torch)

HQ, HKV, D = 8, 2, 128


def _args(lengths=(1, 17, 0, 100), dtype="bfloat16", **changes):
    total = sum(lengths)
    args = dict(q=FakeTensor((total, HQ, D), dtype), k=FakeTensor((total, HKV, D), dtype),
                v=FakeTensor((total, HKV, D), dtype), cu_seqlens_q=FakeTensor((len(lengths) + 1,), "int32"),
                cu_seqlens_k=FakeTensor((len(lengths) + 1,), "int32"), max_seqlen_q=max(lengths),
                max_seqlen_k=max(lengths))
    args.update(changes)
    return args


def _call(args, **kw):
    a = dict(args)
    return facodegen.attention_varlen(a.pop("q"), a.pop("k"), a.pop("v"), a.pop("cu_seqlens_q"),
                                      a.pop("cu_seqlens_k"), a.pop("max_seqlen_q"), a.pop("max_seqlen_k"), **a, **kw)


def test_a_hit_refuses_v_or_out_of_another_total(varlen_plans):
    """The plan key leaves the token totals out, so a hit checks that V has K's tokens and out= q's: a call
    whose V or O is shorter would read or write past it. The checked path's error names the array."""
    a = _args()
    _call(a, out=FakeTensor((118, HQ, D)))
    with pytest.raises(ValueError, match="k and v must have the same shape"):
        _call(dict(a, v=FakeTensor((117, HKV, D))))
    with pytest.raises(ValueError, match="out has shape"):
        _call(a, out=FakeTensor((117, HQ, D)))
    assert varlen._PLANS.misses == 1


@pytest.mark.parametrize("changes, kw, error, words", [
    (dict(q=FakeTensor((2, 118, HQ, D))), {}, ValueError, "q must be 3-D (total_tokens"),
    (dict(k=FakeTensor((0, HKV, D))), {}, ValueError, "k has no tokens"),
    (dict(v=FakeTensor((118, HKV, D), "float16")), {}, TypeError, "v has dtype float16"),
    (dict(q=FakeTensor((118, 5, D))), {}, ValueError, "heads_kv=2 (k.shape[1]) must divide heads_q=5 (q.shape[1])"),
    (dict(q=FakeTensor((118, HQ, 80))), {}, ValueError, "head_dim"),
    (dict(q=FakeTensor((118, HQ, D), strides=(HQ * D + 4, D, 1))), {}, ValueError, "q's seqlen stride"),
    (dict(cu_seqlens_q=FakeTensor((5,), "int64")), {}, TypeError, "cu_seqlens_q has dtype int64"),
    (dict(cu_seqlens_k=FakeTensor((5,), "float32")), {}, TypeError, "cu_seqlens_k has dtype float32"),
    (dict(cu_seqlens_q=FakeTensor((1,), "int32"), cu_seqlens_k=FakeTensor((1,), "int32")), {}, ValueError,
     "cu_seqlens_q must be 1-D of shape (batch + 1,) with batch >= 1"),
    (dict(cu_seqlens_q=FakeTensor((5, 1), "int32")), {}, ValueError, "cu_seqlens_q must be 1-D"),
    (dict(cu_seqlens_k=FakeTensor((4,), "int32")), {}, ValueError, "cu_seqlens_k has shape (4,) but cu_seqlens_q"),
    (dict(cu_seqlens_k=FakeTensor((5,), "int32", strides=(2,))), {}, ValueError, "cu_seqlens_k must be contiguous"),
    (dict(cu_seqlens_q=FakeTensor((5,), "int32", device=1)), {}, ValueError, "cu_seqlens_q is on cuda:1"),
    (dict(cu_seqlens_q=[0, 1, 18, 18, 118]), {}, TypeError, "cu_seqlens_q must be an int32 torch array"),
    (dict(max_seqlen_q=100.0), {}, TypeError, "max_seqlen_q must be a host int"),
    (dict(max_seqlen_k=FakeTensor((), "int32")), {}, TypeError, "max_seqlen_k must be a host int"),
    (dict(max_seqlen_k=True), {}, TypeError, "max_seqlen_k must be a host int"),
    (dict(max_seqlen_q=-1), {}, ValueError, "max_seqlen_q must be >= 0"),
    ({}, dict(causal=1), TypeError, "causal must be True or False"),
    ({}, dict(softmax_scale=float("nan")), ValueError, "softmax_scale must be a finite number"),
    ({}, dict(arch="sm100"), ValueError, "arch='sm100': attention_varlen has the sm80 and sm90 kernels"),
    ({}, dict(out=FakeTensor((118, HQ, 64))), ValueError,
     "out has shape (118, 8, 64); expected (total_q, heads_q, head_dim_v) = (118, 8, 128)"),
    (dict(v=FakeTensor((118, HKV, 64))), dict(head_dim_v=96), ValueError, "head_dim_v=96 but v has head_dim 64"),
    ({}, dict(out=FakeTensor((118, HQ, D), "float16")), TypeError, "out must be a torch bfloat16 array"),
    ({}, dict(varlen=False), ValueError, "varlen is attention_varlen's own switch"),
    ({}, dict(window_size=(4, -7)), ValueError, "window_size: the right size must be >= -1"),
    ({}, dict(window_size=4), ValueError, "window_size must be a pair"),
    ({}, dict(softcap=float("nan")), ValueError, "softcap must be a finite number >= 0"),
    ({}, dict(sinks=FakeTensor((HQ + 1,), "float32")), ValueError, "sinks has shape (9,)"),
    ({}, dict(sinks=FakeTensor((HQ,), "float16")), TypeError, "sinks has dtype float16"),
    ({}, dict(local=True), ValueError, "local is set by window_size"),
])
def test_argument_errors_name_the_argument(fake, changes, kw, error, words):  # noqa: F811
    with pytest.raises(error) as err:
        _call(_args(**changes), **kw)
    assert words in str(err.value)


@pytest.mark.parametrize("kw, words", [
    (dict(dropout_p=0.1), "dropout_p=0.1"), (dict(alibi_slopes=object()), "alibi_slopes"),
    (dict(block_table=object()), "block_table"),
])
def test_flash_attn_varlen_func_refuses_what_is_unsupported_by_name(kw, words):
    a = _args()
    with pytest.raises(NotImplementedError) as err:
        adapters.flash_attn_varlen_func(a["q"], a["k"], a["v"], a["cu_seqlens_q"], a["cu_seqlens_k"], 100, 100, **kw)
    assert words in str(err.value)


def test_flash_attn_varlen_func_runs_attention_varlen(varlen_plans):
    a = _args()
    out, lse, probs = adapters.flash_attn_varlen_func(a["q"], a["k"], a["v"], a["cu_seqlens_q"], a["cu_seqlens_k"],
                                                      100, 100, causal=True, window_size=(-5, -1),
                                                      return_attn_probs=True, deterministic=True)
    assert out.shape == a["q"].shape and lse.shape == (HQ, 118) and probs is None
    (spec,) = {p.spec for p in varlen._PLANS._plans.values()}
    assert spec.varlen and spec.causal and spec.arch == "sm90"     # the fake H200's arch, as attention()'s


# ------------------------------------------------------------------ plan cache and FlashParams bytes

@pytest.fixture
def varlen_plans(fake, monkeypatch):  # noqa: F811
    monkeypatch.setattr(varlen, "_PLANS", plan_mod.PlanCache())
    return fake


ARCHS = pytest.mark.parametrize("arch", ["sm80", "sm90"])


def _fields(record, arch="sm80") -> dict:
    placed, _, _ = params.layout(arch, "bf16", varlen=True)
    formats = {"ptr": "<Q", "i32": "<i", "i64": "<q", "f32": "<f"}
    return {f.name: struct.unpack_from(formats[f.kind], record["params"], off)[0] if f.kind in formats
            else record["params"][off:off + f.size] for f, off in placed}     # (sm90's maps: their bytes)


@ARCHS
def test_new_cu_seqlens_values_hit_the_plan_and_are_patched_in(varlen_plans, arch):
    state = varlen_plans
    args = _args()
    out, lse = _call(args, causal=True, return_lse=True, arch=arch)
    # the same layouts, other boundaries (same total tokens): new cu_seqlens arrays, new q/k/v/out
    again = _args(cu_seqlens_q=FakeTensor((5,), "int32"), cu_seqlens_k=FakeTensor((5,), "int32"))
    out2, lse2 = _call(again, causal=True, return_lse=True, arch=arch)
    assert varlen._PLANS.misses == 1 and len(state.launches.records) == 2
    assert next(iter(varlen._PLANS._plans.values())).varlen_plain     # (the hit's launch: LaunchPlan.launch_plain)
    first, second = (_fields(r, arch) for r in state.launches.records)
    assert (second["cu_seqlens_q"], second["cu_seqlens_k"]) == (again["cu_seqlens_q"].data_ptr(),
                                                                again["cu_seqlens_k"].data_ptr())
    assert (second["q"], second["o"], second["lse"]) == (again["q"].data_ptr(), out2.data_ptr(), lse2.data_ptr())
    unchanged = set(first) - {"q", "k", "v", "o", "lse", "cu_seqlens_q", "cu_seqlens_k"}
    assert {n: first[n] for n in unchanged} == {n: second[n] for n in unchanged}
    # a longer max_seqlen under the same power of two (a server's growing sequences): the same plan
    _call(_args(max_seqlen_q=128, max_seqlen_k=101), causal=True, return_lse=True, arch=arch)
    assert varlen._PLANS.misses == 1
    # past it, another grid: a new plan
    _call(_args(max_seqlen_q=129), causal=True, return_lse=True, arch=arch)
    _call(_args(max_seqlen_q=17), causal=True, return_lse=True, arch=arch)
    assert varlen._PLANS.misses == 3
    m_blocks = [-(-n // _plan_spec().block_m) for n in (128, 256, 32)]
    if arch == "sm90":      # persistent: the tiles' bound from max_seqlen_q (4 sequences x HQ heads), at most a CTA an SM
        assert [r["grid"] for r in state.launches.records[-3:]] == [(min(m * HQ * 4, 132), 1, 1) for m in m_blocks]
    else:
        assert [r["grid"][0] for r in state.launches.records[-3:]] == m_blocks


def _plan_spec():
    return next(iter(varlen._PLANS._plans.values())).spec


def _variant_fields(record, arch) -> dict:
    placed, _, _ = params.layout(arch, "bf16", variants=True, varlen=True)
    at = {f.name: (f, off) for f, off in placed}
    return {n: struct.unpack_from({"i32": "<i", "f32": "<f", "ptr": "<Q"}[at[n][0].kind], record["params"], at[n][1])[0]
            for n in ("window_left", "window_right", "softcap_scale", "sinks", "cu_seqlens_q")}


@ARCHS
def test_varlen_variants_resolve_against_the_plan_bound_and_sinks_move_per_call(varlen_plans, arch):
    """window_size, softcap and sinks through attention_varlen (and window_size, softcap through
    flash_attn_varlen_func): the variant kernel with varlen; the window in the bottom-right frame against
    max_seqlen's plan_bound (100 -> 128: an unbounded side is 128 + 128 + 1), so calls the plan serves share
    it; the window and softcap values key the plan, the sinks' address is patched per call."""
    state = varlen_plans
    a = _args()
    s1, s2 = FakeTensor((HQ,), "float32"), FakeTensor((HQ,), "float32")
    _call(a, causal=True, window_size=(16, -1), sinks=s1, arch=arch)
    _call(_args(max_seqlen_q=120), causal=True, window_size=(16, -1), sinks=s2, arch=arch)   # same bound: a hit
    assert varlen._PLANS.misses == 1 and len(state.launches.records) == 2
    spec = _plan_spec()
    assert spec.varlen and spec.local and spec.causal and spec.sinks and not spec.softcap and spec.arch == arch
    first, second = (_variant_fields(r, arch) for r in state.launches.records)
    assert (first["window_left"], first["window_right"], first["sinks"]) == (16, 0, s1.data_ptr())
    assert (second["window_left"], second["window_right"], second["sinks"]) == (16, 0, s2.data_ptr())
    assert not next(iter(varlen._PLANS._plans.values())).varlen_plain     # (sinks to patch: LaunchPlan.launch)
    _call(a, window_size=(-1, 8), arch=arch)                               # another window: another plan
    assert _variant_fields(state.launches.records[-1], arch)["window_left"] == 128 + 128 + 1
    adapters.flash_attn_varlen_func(a["q"], a["k"], a["v"], a["cu_seqlens_q"], a["cu_seqlens_k"], 100, 100,
                                    window_size=(7, 3), softcap=30.0)
    assert varlen._PLANS.misses == 3
    spec = list(varlen._PLANS._plans.values())[-1].spec
    assert spec.local and spec.softcap and not spec.causal and spec.varlen
    fields = _variant_fields(state.launches.records[-1], spec.arch)     # (the device's arch: sm90)
    assert (fields["window_left"], fields["window_right"]) == (7, 3)
    assert fields["softcap_scale"] == pytest.approx(D ** -0.5 / 30.0)
    # a window that cuts nothing at the plan's bound runs the plain varlen kernel; the causal one the causal
    _call(a, window_size=(127, 127), arch=arch)
    _call(a, window_size=(-1, 0), arch=arch)
    assert [(p.spec.local, p.spec.causal) for p in list(varlen._PLANS._plans.values())[-2:]] == [(False, False),
                                                                                               (False, True)]



def test_plan_bound_rounds_up_to_a_power_of_two():
    assert [varlen.plan_bound(n) for n in (0, 1, 2, 3, 100, 128, 129, 8192)] == [0, 1, 2, 4, 128, 128, 256, 8192]
    assert varlen.plan_bound(-3) == -3


@ARCHS
def test_other_total_tokens_hit_the_plan_and_patch_total_q(varlen_plans, arch):
    """The same sequences count and max_seqlen with other total tokens (a training step's next
    batch): a hit whose FlashParams differ from the first call's only in the pointers and total_q;
    the LSE comes out (heads_q, total_q); a larger total that did not ask for the LSE writes it to
    a temporary, not past the plan's scratch."""
    state = varlen_plans
    _call(_args((1, 17, 0, 100)), causal=True, return_lse=True, arch=arch)
    out, lse = _call(_args((100, 3, 50, 60)), causal=True, return_lse=True, arch=arch)      # 213 tokens
    assert varlen._PLANS.misses == 1 and out.shape == (213, HQ, D) and lse.shape == (HQ, 213)
    first, second = (_fields(r, arch) for r in state.launches.records)
    assert (first["total_q"], second["total_q"]) == (118, 213) and second["lse"] == lse.data_ptr()
    assert (first["total_k"], second["total_k"]) == (118, 213)
    changed = {n for n in first if first[n] != second[n]}
    assert changed <= {"q", "k", "v", "o", "lse", "cu_seqlens_q", "cu_seqlens_k", "total_q", "total_k"}
    # without the LSE (another plan): its scratch holds 118 tokens' LSE
    _call(_args((1, 17, 0, 100)), causal=True, arch=arch)
    scratch_lse = _fields(state.launches.records[-1], arch)["lse"]
    _call(_args((100, 3, 50, 60)), causal=True, arch=arch)                                    # 213 > 118: a temporary
    third = _fields(state.launches.records[-1], arch)
    assert third["total_q"] == 213 and third["lse"] not in (0, scratch_lse)
    _call(_args((1, 2, 3, 100)), causal=True, arch=arch)                                      # 106 <= 118: the scratch
    assert _fields(state.launches.records[-1], arch)["lse"] == scratch_lse and varlen._PLANS.misses == 2


@ARCHS
def test_flashparams_bytes_of_a_varlen_call(varlen_plans, arch):
    state = varlen_plans
    lengths = (1, 17, 0, 100)
    args = _args(lengths, q=FakeTensor((118, HQ, D), strides=(3 * HQ * D, D, 1)))   # a strided token axis
    out = _call(args, softmax_scale=0.25, arch=arch)
    (record,) = state.launches.records
    placed, size, _ = params.layout(arch, "bf16", varlen=True)
    offsets = {f.name: off for f, off in placed}
    plain = params.layout(arch, "bf16")
    # the varlen fields come after the plain struct's (its layout, and plan.py's pointer offsets, unchanged)
    assert [f.name for f, _ in placed[:len(plain[0])]] == [f.name for f, _ in plain[0]]
    assert offsets["cu_seqlens_q"] >= plain[1] and offsets["cu_seqlens_k"] == offsets["cu_seqlens_q"] + 8
    raw = record["params"]
    assert struct.unpack_from("<2Q", raw, offsets["cu_seqlens_q"]) == (args["cu_seqlens_q"].data_ptr(),
                                                                        args["cu_seqlens_k"].data_ptr())
    f = _fields(record, arch)
    assert f["q"] == args["q"].data_ptr() and f["o"] == out.data_ptr() and f["lse"] != 0     # scratch LSE
    # the grid's bounds: max_seqlen 100's plan_bound
    assert (f["batch"], f["seqlen_q"], f["seqlen_k"], f["heads_q"], f["heads_kv"], f["total_q"]) == \
        (4, 128, 128, HQ, HKV, 118)
    spec = next(iter(varlen._PLANS._plans.values())).spec
    assert f["num_m_blocks"] == -(-128 // spec.block_m)
    if arch == "sm90":      # persistent: num_tiles is the bound the kernel's own count stays under
        assert spec.persistent and f["num_tiles"] == f["num_m_blocks"] * HQ * 4
        assert record["grid"] == (min(f["num_tiles"], 132), 1, 1)
    else:
        assert record["grid"] == (f["num_m_blocks"], HQ, 4)
    assert (f["q_row_stride"], f["q_head_stride"], f["k_row_stride"], f["o_row_stride"]) == \
        (3 * HQ * D, D, HKV * D, HQ * D)
    assert f["softmax_scale"] == 0.25


@ARCHS
def test_all_sequences_empty_launches_nothing(varlen_plans, arch):
    out = _call(_args(max_seqlen_q=0), arch=arch)
    assert out.shape == (118, HQ, D) and varlen_plans.launches.records == []


def test_the_cli_emits_a_varlen_kernel():
    from click.testing import CliRunner

    from facodegen.cli import main
    result = CliRunner().invoke(main, ["emit", "--arch", "sm80", "--varlen", "--head-dim", "64"])
    assert result.exit_code == 0, result.output
    assert "flash_fwd_sm80_bf16_hd64_bm128_bn128_w4_st2_varlen(const __grid_constant__ FlashParams p)" in result.output


def test_sm90_maps_span_the_packed_tokens_and_follow_the_totals(varlen_plans, monkeypatch):
    """sm90: the TMA maps are over the packed tensors, {head_dim, total, heads, 1} with the token
    stride as the row stride; a hit with the same addresses and totals encodes nothing, other totals
    (or addresses) encode the three maps anew (never cuTensorMapReplaceAddress: the extents changed)."""
    from facodegen.runtime import tma
    encoded = []
    monkeypatch.setattr(tma, "encode", lambda a: encoded.append(a) or bytes(128))
    q = FakeTensor((118, HQ, D), strides=(3 * HQ * D, D, 1))
    args = _args((1, 17, 0, 100), q=q)
    out = FakeTensor((118, HQ, D))
    _call(args, arch="sm90", out=out)
    by_ptr = {a.ptr: a for a in encoded}
    assert len(encoded) == 4 and set(by_ptr) == {q.data_ptr(), args["k"].data_ptr(), args["v"].data_ptr(),
                                                  out.data_ptr()}
    assert by_ptr[q.data_ptr()].dims == (D, 118, HQ, 1) and by_ptr[q.data_ptr()].strides[:2] == (3 * HQ * D * 2, D * 2)
    assert by_ptr[args["k"].data_ptr()].dims == (D, 118, HKV, 1)
    encoded.clear()
    _call(dict(args, q=q), arch="sm90", out=out)                   # the same addresses and totals: the image
    assert encoded == [] and varlen._PLANS.misses == 1
    longer_k, longer_v = FakeTensor((300, HKV, D)), FakeTensor((300, HKV, D))
    _call(dict(args, q=q, k=longer_k, v=longer_v), arch="sm90", out=out)    # other total_k: encoded anew
    assert varlen._PLANS.misses == 1 and len(encoded) == 4         # Q, K, V and O (varlen_tma_store)
    assert {a.dims for a in encoded} == {(D, 300, HKV, 1), (D, 118, HQ, 1)}
    assert varlen_plans.launches.map_moves == []


@pytest.mark.parametrize("spec", [s for s in SM90_VARLEN_SPECS if s.dtype == "bf16" and not s.causal],
                         ids=lambda s: f"hd{s.head_dim}")
def test_store_o_rows_reads_back_what_the_epilogue_wrote(spec):
    """A model of the two halves of the sm90 varlen O store, with the template's formulas: the
    epilogue's st.shared of the accumulator pairs into the swizzled staging tile (16-byte chunk q of
    row r at q ^ (r & mask)) and store_o_rows' 16-byte reads, chunk c of row r of a warpgroup: every
    read finds exactly row r's columns 8c .. 8c+7, in order, and covers the tile once."""
    d, block_m = spec.head_dim, spec.block_m
    swizzle, slab_cols = tma_mod.slab_geometry(d)
    slab_bytes = block_m * swizzle                      # O_SLAB_BYTES (= Q's: BLOCK_M rows x SWIZZLE_BYTES)

    def swizzled(offset):                               # swizzle_xor<SWIZZLE_BYTES>
        return offset ^ (((offset >> 7) & (swizzle // 16 - 1)) << 4)
    written = {}
    for wg in range(block_m // 64):
        for tid in range(128):
            lane, warp = tid % 32, tid // 32
            row_in_tile, col_in_block = wg * 64 + warp * 16 + lane // 4, 2 * (lane % 4)
            for i in range(0, d // 2, 2):
                row, col = row_in_tile + 8 * ((i >> 1) & 1), 8 * (i >> 2) + col_in_block
                addr = (col // slab_cols) * slab_bytes + swizzled(row * swizzle + (col % slab_cols) * 2)
                written[addr], written[addr + 2] = (row, col), (row, col + 1)
    assert len(written) == block_m * d
    row_chunks, slab_chunks = d * 2 // 16, swizzle // 16
    read = set()
    for wg in range(block_m // 64):
        o_rows = wg * 64 * swizzle
        for tid in range(128):
            for round_ in range(64 * row_chunks // 128):
                chunk = round_ * 128 + tid
                row, c = chunk // row_chunks, chunk % row_chunks
                addr = o_rows + (c // slab_chunks) * slab_bytes + swizzled(row * swizzle + (c % slab_chunks) * 16)
                assert [written[addr + 2 * e] for e in range(8)] == [(wg * 64 + row, 8 * c + e) for e in range(8)]
                read.add((wg * 64 + row, c))
    assert len(read) == block_m * row_chunks


@pytest.mark.parametrize("row_store", [False, True], ids=["tma-store", "row-store"])
def test_the_o_map_spans_the_packed_output_and_follows_the_totals(varlen_plans, monkeypatch, row_store):
    """varlen_tma_store (the default): the plan's image holds O's map over the packed output, {head_dim,
    total_q, heads_q, 1} with out's token stride and 64-row boxes (one consumer warpgroup's rows), the
    padded kernel's swizzled slabs, at out's address; a call with another total_q or another out encodes it
    anew with the others, and the image's tma_o field holds those bytes. varlen_tma_store=False encodes Q,
    K and V only on such a call (its tma_o, never read, is Q's bytes)."""
    from facodegen.runtime import tma
    encoded = []

    def fake_encode(a):
        encoded.append(a)
        return (b"%016x" % a.ptr) + bytes([len(encoded)]) * 112      # bytes that tell the maps apart
    monkeypatch.setattr(tma, "encode", fake_encode)
    kw = dict(arch="sm90", varlen_tma_store=False) if row_store else dict(arch="sm90")
    out = FakeTensor((118, HQ, D), strides=(2 * HQ * D, D, 1))        # a strided token axis
    args = _args((1, 17, 0, 100))
    _call(args, out=out, **kw)
    o_maps = [a for a in encoded if a.ptr == out.data_ptr()]
    assert len(o_maps) == 1            # (pack_params: every sm90 plan's first image has all four)
    (o_map,) = o_maps
    assert o_map.dims == (D, 118, HQ, 1) and o_map.strides[:2] == (2 * HQ * D * 2, D * 2)
    assert o_map.box == (64, 64, 1, 1) and o_map.swizzle_code == tma.SWIZZLE_CODES[128]
    placed, _, _ = params.layout("sm90", "bf16", varlen=True)
    offset = {f.name: off for f, off in placed}["tma_o"]
    assert varlen_plans.launches.records[-1]["params"][offset:offset + 16] == b"%016x" % out.data_ptr()
    encoded.clear()
    out2 = FakeTensor((213, HQ, D), strides=(2 * HQ * D, D, 1))      # (the layout is part of the plan's key)
    again = _args((100, 3, 50, 60))                                    # 213 tokens: other totals
    _call(again, out=out2, **kw)
    assert varlen._PLANS.misses == 1
    by_ptr = {a.ptr: a for a in encoded}
    image = varlen_plans.launches.records[-1]["params"]
    if row_store:
        assert len(encoded) == 3 and out2.data_ptr() not in by_ptr
        assert image[offset:offset + 16] == b"%016x" % again["q"].data_ptr()
    else:
        assert len(encoded) == 4 and by_ptr[out2.data_ptr()].dims == (D, 213, HQ, 1)
        assert by_ptr[out2.data_ptr()].box == (64, 64, 1, 1)
        assert image[offset:offset + 16] == b"%016x" % out2.data_ptr()
