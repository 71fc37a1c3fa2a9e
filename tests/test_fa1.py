"""schedule=fa1 (templates/sm80/flash_fwd_fa1.cu.j2) and its switches, CPU only.

* spec: the new fields, their defaults and every invalid value (each names its field);
* render + NVRTC compile for sm_80: no stack, no spills, the SASS of mma.sync/ldmatrix/cp.async;
* the launcher's side (grid, workspace size, FlashParams field) and the CLI round trip;
* the algorithm: reference.flash1_reference at the kernel's block sizes, and a float64 NumPy
  emulation of the kernel's own per-step update for every combination of the switches (the
  O <- (O * pre + P V) * post protocol, the cross-warp exchange of warp_split=kv, the workspace
  with its first-visit rule and causal skipping, the last pass) against the direct formula.
"""

from __future__ import annotations

import itertools
import math
import re
import shlex

import numpy as np
import pytest
from click.testing import CliRunner

import facodegen
from facodegen import KernelSpec, SpecError
from facodegen.runtime.launch import grid, needs_workspace, workspace_floats
from facodegen.runtime.params import fields
from facodegen.verify.reference import attention_reference, causal_mask, flash1_reference, random_qkv
from facodegen.codegen.render import emit_command
from facodegen.spec import FA1_CHOICES, FA1_SWITCHES, FA2_CHOICES

FA1 = dict(arch="sm80", schedule="fa1")
# fa1, each switch flipped alone, all flipped (the fa1 template with every FA2 idea).
SWITCH_SPECS = [dict()] + [{name: FA2_CHOICES[name]} for name in FA1_SWITCHES] + [dict(FA2_CHOICES)]


def fa1(**kw) -> KernelSpec:
    return KernelSpec(**FA1, **kw)


# ---- spec ------------------------------------------------------------------------------------

def test_fa1_defaults_are_fa1s_choices():
    spec = fa1()
    assert {name: getattr(spec, name) for name in FA1_SWITCHES} == FA1_CHOICES
    assert (spec.block_m, spec.block_n, spec.num_warps, spec.stages) == (16, 128, 4, 1)
    assert spec.variant == "flash_fwd_sm80_bf16_hd128_bm16_bn128_w4_st1_fa1"
    # warps split the rows: 16 rows per warp
    assert fa1(warp_split="q").block_m == 64


def test_fa2_and_sm90_report_fa2s_choices():
    for spec in (KernelSpec(arch="sm80"), KernelSpec(arch="sm90")):
        assert {name: getattr(spec, name) for name in FA1_SWITCHES} == FA2_CHOICES
        assert "fa1" not in spec.variant
    # a resolved spec rebuilds itself (emit --all, the CLI round trip)
    for spec in (KernelSpec(arch="sm80"), fa1(rescale="once"), KernelSpec(arch="sm90")):
        assert KernelSpec(**spec.as_dict()) == spec


def test_each_switch_changes_the_variant():
    names = {fa1(**kw).variant for kw in SWITCH_SPECS}
    assert len(names) == len(SWITCH_SPECS)
    assert fa1(loop_order="q_outer").variant.endswith("_fa1_qouter")
    assert fa1(warp_split="q").variant.endswith("_fa1_splitq")
    assert fa1(rescale="once", causal=True).variant.endswith("_fa1_once_causal")


def test_replace_keeps_the_switches():
    spec = fa1(warp_split="q", rescale="once")
    other = spec.replace(head_dim=64)
    assert (other.schedule, other.warp_split, other.rescale, other.head_dim) == ("fa1", "q", "once", 64)
    assert spec.replace(schedule="fa2").warp_split == "q" and spec.replace(schedule="fa2").schedule == "fa2"


@pytest.mark.parametrize("fields_, knob, words", [
    (dict(schedule="fa3"), "schedule", "fa2"),
    (dict(arch="sm90", schedule="fa1"), "schedule", "sm80 schedule"),
    (dict(schedule="fa1", loop_order="inner"), "loop_order", "kv_outer"),
    (dict(schedule="fa1", warp_split="rows"), "warp_split", "kv"),
    (dict(schedule="fa1", rescale="never"), "rescale", "every_step"),
    (dict(schedule="fa1", rescale=True), "rescale", "every_step"),
    (dict(loop_order="kv_outer"), "loop_order", "schedule=fa2"),
    (dict(warp_split="kv"), "warp_split", "schedule=fa2"),
    (dict(rescale="every_step"), "rescale", "schedule=fa2"),
    (dict(arch="sm90", loop_order="kv_outer"), "loop_order", "arch=sm90"),
    (dict(arch="sm90", warp_split="kv"), "warp_split", "arch=sm90"),
    (dict(arch="sm90", rescale="every_step"), "rescale", "arch=sm90"),
    (dict(schedule="fa1", stages=2), "stages", "stages=1"),
    (dict(schedule="fa1", q_in_regs=True), "q_in_regs", "shared memory"),
    (dict(schedule="fa1", block_n=32), "block_n", "16*num_warps=64"),
    (dict(schedule="fa1", block_m=24), "block_m", "multiple of 16"),
    (dict(schedule="fa1", warp_split="q", block_m=16), "block_m", "16*num_warps=64"),
    (dict(schedule="fa1", block_m=64, head_dim=256), "block_m", "registers"),
])
def test_each_invalid_value_names_its_field(fields_, knob, words):
    with pytest.raises(SpecError) as err:
        KernelSpec(**fields_)
    assert err.value.field == knob
    assert words in str(err.value)


def test_fa2_values_accepted_where_fa1_knobs_do_not_apply():
    assert KernelSpec(arch="sm80", loop_order="q_outer", warp_split="q", rescale="once") == KernelSpec(arch="sm80")
    assert KernelSpec(arch="sm90", rescale="once") == KernelSpec(arch="sm90")


def test_budget_counts_the_exchange_area():
    kv = fa1()
    # Q 16x128 + K + V 128x128 in bf16, then fp32: 4 warps' O partials, their row max / sum, 2 factors
    assert kv.smem_bytes == 16 * 128 * 2 + 2 * 128 * 128 * 2 + 4 * (4 * 16 * 128 + 2 * 4 * 16 + 2 * 16)
    q = fa1(warp_split="q")
    assert q.smem_bytes == 64 * 128 * 2 + 2 * 128 * 128 * 2
    for d in (64, 96, 128, 192, 256):            # every default fits the A100
        for kw in SWITCH_SPECS:
            assert fa1(head_dim=d, **kw).smem_bytes <= 166912


# ---- launcher side ---------------------------------------------------------------------------

def test_grid_and_workspace():
    spec = fa1()
    assert grid(spec, 3, 16, 1000, 132) == (1, 16, 3)          # one CTA per (batch, head)
    assert needs_workspace(spec) and workspace_floats(spec, 3, 16, 1000, 128) == 3 * 16 * 1000 * 130
    outer_q = fa1(loop_order="q_outer")
    assert grid(outer_q, 3, 16, 1000, 132) == (63, 16, 3)      # ceil(1000 / 16) Q blocks
    assert not needs_workspace(outer_q) and workspace_floats(outer_q, 3, 16, 1000, 128) == 0
    assert workspace_floats(KernelSpec(arch="sm80"), 3, 16, 1000, 128) == 0
    assert "workspace" in [f.name for f in fields("sm80")] and "workspace" in [f.name for f in fields("sm90")]


# ---- render, CLI, compile ----------------------------------------------------------------------

COMPILE_SPECS = [fa1(**kw) for kw in SWITCH_SPECS] + [
    fa1(head_dim=64, causal=True),
    fa1(head_dim=96, dtype="fp16", loop_order="q_outer"),
    fa1(head_dim=192, warp_split="q", causal=True),
    fa1(head_dim=256, rescale="once"),
    fa1(head_dim=256, warp_split="q", loop_order="q_outer", causal=True),
    fa1(head_dim=192, **FA2_CHOICES),
    fa1(head_dim=64, dtype="fp16", block_m=32, block_n=64, num_warps=2),
]


@pytest.mark.parametrize("spec", COMPILE_SPECS, ids=lambda s: s.variant)
def test_render(spec):
    src = facodegen.emit(spec)
    assert "#include" not in src and f"{spec.variant}(" in src
    assert src == facodegen.emit(KernelSpec(**spec.as_dict()))
    assert f"constexpr bool LOOP_KV_OUTER      = {'true' if spec.loop_order == 'kv_outer' else 'false'};" in src
    assert f"constexpr bool WARP_SPLIT_KV      = {'true' if spec.warp_split == 'kv' else 'false'};" in src
    assert f"constexpr bool RESCALE_EVERY_STEP = {'true' if spec.rescale == 'every_step' else 'false'};" in src
    assert f"constexpr int  SMEM_BYTES = {spec.smem_bytes};" in src


@pytest.mark.parametrize("spec", COMPILE_SPECS[:5], ids=lambda s: s.variant)
def test_emit_command_round_trips(spec):
    from facodegen import cli
    command = shlex.split(emit_command(spec))
    result = CliRunner().invoke(cli.main, command[1:], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert result.stdout == facodegen.emit(spec)


def test_cli_rejects_fa1_knobs_for_fa2():
    from facodegen import cli
    result = CliRunner().invoke(cli.main, ["emit", "--arch", "sm80", "--warp-split", "kv"])
    assert result.exit_code == 2 and "warp_split" in result.output


compiler = pytest.importorskip("facodegen.runtime.compiler")


@pytest.fixture(scope="module", params=COMPILE_SPECS, ids=lambda s: s.variant)
def kernel(request):
    return request.param, compiler.compile(request.param, sm="sm_80")


def test_no_stack_and_no_spills(kernel):
    spec, k = kernel
    r = k.resources
    assert (r.stack_bytes, r.spill_stores, r.spill_loads) == (0, 0, 0), k.log
    assert 0 < r.registers <= 255


def test_sass(kernel):
    spec, k = kernel
    sass = k.sass()
    hmma = re.findall(r"\bHMMA\.16816\.F32(\.BF16)?\b", sass)
    assert hmma and all((m == ".BF16") == (spec.dtype == "bf16") for m in hmma)
    assert re.search(r"\bLDSM\.16\.M88\.4\b", sass)        # ldmatrix.x4 (Q, K)
    assert re.search(r"\bLDSM\.16\.MT88\.4\b", sass)       # ldmatrix.x4.trans (V)
    assert re.search(r"\bLDGSTS\.E\.BYPASS\.128\b", sass)  # cp.async.cg 16 bytes
    assert not re.search(r"\b(LDL|STL)\b", sass)
    if spec.loop_order == "kv_outer":                       # O_i, m_i, l_i round trips through global memory
        assert re.search(r"\bSTG\.E\.64\b|\bSTG\.E\.128\b", sass)


# ---- the algorithm (float64 NumPy) -------------------------------------------------------------

SHAPES = [  # batch, seqlen_q, seqlen_k, heads_q, heads_kv
    (1, 1, 1, 1, 1), (2, 37, 37, 2, 1), (1, 100, 300, 2, 2), (1, 300, 100, 2, 2), (1, 160, 160, 1, 1),
]


@pytest.mark.parametrize("block_m, block_n", [(16, 128), (64, 128), (16, 64), (64, 64), (32, 64)])
@pytest.mark.parametrize("causal", [False, True])
def test_flash1_reference_at_the_kernels_blocks(block_m, block_n, causal):
    for shape in SHAPES:
        q, k, v = random_qkv(*shape, 64, "fp32", seed=sum(shape))
        o, lse = flash1_reference(q, k, v, causal, block_m=block_m, block_n=block_n)
        ref_o, ref_lse = attention_reference(q, k, v, causal)
        np.testing.assert_allclose(o, ref_o, atol=1e-12, rtol=1e-10)
        np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref_lse))
        fin = np.isfinite(ref_lse)
        np.testing.assert_allclose(lse[fin], ref_lse[fin], atol=1e-12)


def emulate_fa1_kernel(q, k, v, causal, block_m, block_n, num_warps, loop_order, warp_split, rescale,
                       softmax_scale=None):
    """The fa1 template's arithmetic in float64, step by step: one (Q block, K/V block) step is

        S = Q_i K_j^T (masked); per warp: block max over its keys; warp_split=kv: max over warps
        m_new = max(m, block max); P = 2^(S*c - m_new*c); block sum (over warps for kv)
        l_new = e^{m - m_new} l + block sum
        O <- (O * pre + P V) * post, pre/post from rescale (every_step: l e^{m - m_new}, 1/l_new;
        once: e^{m - m_new}, 1); warp_split=kv: P V summed over the warps' key slices
    with O, m, l in a workspace visited K/V-block-outer (first visit j = 0 starts from 0, -inf, 0;
    Q blocks past the causal diagonal skipped; a last pass divides by l for rescale=once) or in
    "registers" Q-block-outer."""
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    b, sq, hq, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    scale = 1 / math.sqrt(d) if softmax_scale is None else softmax_scale
    c = scale * math.log2(math.e)
    n_q, n_kv = -(-sq // block_m), -(-sk // block_n)
    keys_per_warp = block_n // num_warps if warp_split == "kv" else block_n
    warps = num_warps if warp_split == "kv" else 1

    def kv_blocks_of(i):
        if not causal:
            return n_kv
        key_end = min(sq, (i + 1) * block_m) + sk - sq
        return 0 if key_end <= 0 else min(n_kv, -(-key_end // block_n))

    def step(qi, kj, vj, i0, j0, o, m, l):
        s = qi @ kj.T
        rows, cols = np.arange(i0, i0 + len(qi)), np.arange(j0, j0 + len(kj))
        hidden = cols[None, :] >= sk
        if causal:
            hidden = hidden | causal_mask(rows, cols, sq, sk)
        s = np.where(hidden, -np.inf, s)
        parts = [slice(w * keys_per_warp, (w + 1) * keys_per_warp) for w in range(warps)]
        block_max = np.max([s[:, p].max(axis=1, initial=-np.inf) for p in parts], axis=0)
        m_new = np.maximum(m, block_max)
        ms = np.where(np.isneginf(m_new), 0.0, m_new * c)
        alpha = np.exp2(m * c - ms)
        pm = np.exp2(s * c - ms[:, None])
        block_sum = np.sum([pm[:, p].sum(axis=1) for p in parts], axis=0)
        l_new = alpha * l + block_sum
        if rescale == "every_step":
            pre, post = alpha * l, np.where(l_new > 0, 1 / np.where(l_new > 0, l_new, 1), 0.0)
        else:
            pre, post = alpha, np.ones_like(l)
        pv = np.sum([pm[:, p] @ vj[p] for p in parts], axis=0)
        return (o * pre[:, None] + pv) * post[:, None], m_new, l_new

    out = np.zeros((b, sq, hq, d))
    lse = np.full((b, hq, sq), -np.inf)
    for bi, h in itertools.product(range(b), range(hq)):
        qh, kh, vh = q[bi, :, h], k[bi, :, h // (hq // hkv)], v[bi, :, h // (hq // hkv)]
        kpad = np.zeros((n_kv * block_n, d)); kpad[:sk] = kh                  # cp.async zero-fill
        vpad = np.zeros((n_kv * block_n, d)); vpad[:sk] = vh
        qpad = np.zeros((n_q * block_m, d)); qpad[:sq] = qh
        if loop_order == "kv_outer":
            ws_o = np.full((sq, d), np.nan)                                   # never initialised
            ws_m = np.full(sq, np.nan)
            ws_l = np.full(sq, np.nan)
            for j in range(n_kv):
                j0 = j * block_n
                for i in range(n_q):
                    if j >= kv_blocks_of(i):
                        continue
                    i0, i1 = i * block_m, min(sq, (i + 1) * block_m)
                    first = j == 0
                    o = np.zeros((block_m, d)) if first else np.vstack([ws_o[i0:i1], np.zeros((block_m - (i1 - i0), d))])
                    m = np.full(block_m, -np.inf)
                    l = np.zeros(block_m)
                    if not first:
                        m[:i1 - i0], l[:i1 - i0] = ws_m[i0:i1], ws_l[i0:i1]
                    o, m, l = step(qpad[i0:i0 + block_m], kpad[j0:j0 + block_n], vpad[j0:j0 + block_n], i0, j0, o, m, l)
                    ws_o[i0:i1], ws_m[i0:i1], ws_l[i0:i1] = o[:i1 - i0], m[:i1 - i0], l[:i1 - i0]
            for r in range(sq):
                if kv_blocks_of(r // block_m) == 0:
                    continue                                                  # O = 0, LSE = -inf
                lr = ws_l[r]
                f = 1.0 if rescale == "every_step" else (1 / lr if lr > 0 else 0.0)
                out[bi, r, h] = ws_o[r] * f
                lse[bi, h, r] = ws_m[r] * scale + math.log(lr) if lr > 0 else -np.inf
        else:
            for i in range(n_q):
                i0, i1 = i * block_m, min(sq, (i + 1) * block_m)
                o, m, l = np.zeros((block_m, d)), np.full(block_m, -np.inf), np.zeros(block_m)
                for j in range(kv_blocks_of(i)):
                    j0 = j * block_n
                    o, m, l = step(qpad[i0:i0 + block_m], kpad[j0:j0 + block_n], vpad[j0:j0 + block_n], i0, j0, o, m, l)
                f = np.ones(block_m) if rescale == "every_step" else np.where(l > 0, 1 / np.where(l > 0, l, 1), 0.0)
                out[bi, i0:i1, h] = (o * f[:, None])[:i1 - i0]
                with np.errstate(divide="ignore"):
                    lse[bi, h, i0:i1] = np.where(l > 0, m * scale + np.log(np.where(l > 0, l, 1)), -np.inf)[:i1 - i0]
    return out, lse


@pytest.mark.parametrize("switches", SWITCH_SPECS, ids=lambda kw: "-".join(f"{k}={v}" for k, v in kw.items()) or "fa1")
@pytest.mark.parametrize("causal", [False, True])
def test_kernel_schedule_matches_the_formula(switches, causal):
    spec = fa1(head_dim=64, causal=causal, **switches)
    for shape in SHAPES:
        q, k, v = random_qkv(*shape, 64, "fp32", seed=7 + sum(shape))
        o, lse = emulate_fa1_kernel(q, k, v, causal, spec.block_m, spec.block_n, spec.num_warps, spec.loop_order,
                                    spec.warp_split, spec.rescale, softmax_scale=0.3)
        ref_o, ref_lse = attention_reference(q, k, v, causal, 0.3)
        assert np.isfinite(o).all()
        np.testing.assert_allclose(o, ref_o, atol=1e-12, rtol=1e-10)
        np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref_lse))
        fin = np.isfinite(ref_lse)
        np.testing.assert_allclose(lse[fin], ref_lse[fin], atol=1e-12)
