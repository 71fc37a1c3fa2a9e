"""attention_varlen on a GPU, against the float64 varlen reference (facodegen.verify.reference.varlen_reference),
with and without the attention variants (window, softcap, sinks),
on the sm80 kernel and, on an H100/H200, the sm90 one (TMA over the packed tokens; O stored by TMA where a
warpgroup's 64 rows lie inside the sequence, else row by row, and with varlen_tma_store=False row by row).

Packed sequences with odd lengths (1, 17, 1000), empty ones (no queries, or queries with no key),
GQA/MQA, causal or not, fp16 and bf16, head dims 64/128/256, a strided token axis; O and the LSE
are poisoned with NaN first (an element the kernel never writes fails). O per sequence by
FlashAttention-3's criterion (facodegen.verify.fuzz.fa3_bound: twice a same-precision computation's error
plus twice the dtype's rounding of the reference); the LSE (heads_q, total_q) within 1e-3 + 1e-4
|lse|, -inf exactly where the reference has it. Then the fuzz family's representative cases, a
second call with other boundaries or totals (a plan-cache hit; sm90: its TMA maps encoded anew)
against the reference again, and calls whose sequences cover only part of the packed buffer: the
rows of O outside them (another sequence's) keep their poison bit for bit.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

import facodegen
from facodegen.verify import fuzz
from facodegen.ops import varlen
from facodegen.verify.reference import varlen_reference

torch = pytest.importorskip("torch")
HAVE_GPU = torch.cuda.is_available()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not HAVE_GPU, reason="needs a CUDA GPU (torch.cuda)")]
HAVE_SM90 = HAVE_GPU and torch.cuda.get_device_capability() == (9, 0)
# the sm80 kernel runs on every GPU here; sm90's on compute capability 9.0 only, persistent (its
# default: the tiles numbered densely over the sequences by the kernel's warp scan) and "sm90-np"
# (persistent=False: one CTA per tile, the grid sized by max_seqlen_q)
NEEDS_SM90 = pytest.mark.skipif(not HAVE_SM90, reason="the sm90 kernel needs an H100/H200")
ARCHS = pytest.mark.parametrize("arch", ["sm80", pytest.param("sm90", marks=NEEDS_SM90),
                                         pytest.param("sm90-np", marks=NEEDS_SM90)])


def _kw(arch: str) -> dict:
    """attention_varlen's arch (and spec fields) for an ARCHS id."""
    return dict(arch="sm90", persistent=False) if arch == "sm90-np" else dict(arch=arch)

# query lengths, key lengths, heads_q, heads_kv, head_dim
CASES = [
    ((1, 17, 1000, 0), (1, 17, 1000, 5), 4, 2, 128),       # odd lengths, an empty query sequence
    ((17, 1000, 1), (300, 17, 0), 8, 1, 64),                 # MQA; q > k (causal: rows see none); no keys
    ((1000, 0, 333, 1), (999, 0, 1000, 1000), 2, 2, 256),    # all empty; q < k; one query against 1000 keys
    ((129, 64, 1), (128, 65, 3), 6, 3, 128),                 # tile edges
    ((1, 65, 130, 0, 2), (2, 0, 131, 1, 64), 6, 2, 96),     # 65 queries with no key (O = 0, LSE = -inf); d 96
    ((193, 7, 385), (191, 1, 500), 4, 1, 192),               # MQA, 3 query blocks of 128 (+1), d 192
]


def _packed(lengths_q, lengths_k, heads_q, heads_kv, head_dim, dtype, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    cu_q, cu_k = ([0, *itertools.accumulate(lengths)] for lengths in (lengths_q, lengths_k))
    q = torch.randn(cu_q[-1], heads_q, head_dim, generator=gen, device="cuda").to(dtype)
    # K and V on a strided token axis: every other row of a wider buffer
    k, v = (torch.randn(2 * cu_k[-1], heads_kv, head_dim, generator=gen, device="cuda").to(dtype)[::2]
            for _ in range(2))
    return q, k, v, torch.tensor(cu_q, dtype=torch.int32, device="cuda"), \
        torch.tensor(cu_k, dtype=torch.int32, device="cuda")


def _check(q, k, v, cu_q, cu_k, out, lse, causal, dtype, **variants):
    """O per sequence by FlashAttention-3's criterion and the LSE against the float64 varlen reference
    (``variants``: window_size, softcap, sinks as attention_varlen took them)."""
    o_ref, lse_ref = varlen_reference(q, k, v, cu_q, cu_k, causal=causal, **variants)
    o, lse = out.double().cpu().numpy(), lse.double().cpu().numpy()
    assert lse.shape == lse_ref.shape
    assert np.array_equal(np.isneginf(lse), np.isneginf(lse_ref)), "LSE -inf rows differ"
    seen = np.isfinite(lse_ref)
    assert np.all(np.abs(lse[seen] - lse_ref[seen]) <= 1e-3 + 1e-4 * np.abs(lse_ref[seen]))   # -inf - -inf is NaN
    assert np.isfinite(o).all(), "O has NaN (a row never written?)"
    bounds = cu_q.tolist(), cu_k.tolist()
    for seq, (q0, q1, k0, k1) in enumerate(zip(bounds[0], bounds[0][1:], bounds[1], bounds[1][1:])):
        if q0 == q1:
            continue
        one = [x[None, a:b] for x, a, b in ((q, q0, q1), (k, k0, k1), (v, k0, k1))]
        low, _ = fuzz.attention_torch(*one, causal, q.shape[-1] ** -0.5, upcast=False, **variants)
        ref = torch.from_numpy(o_ref[None, q0:q1]).cuda()
        why = fuzz.fa3_failure(out[None, q0:q1], ref, low.double().nan_to_num(0.0))
        assert why is None, f"sequence {seq}: {why}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"q{'-'.join(map(str, c[0]))}_h{c[2]}x{c[3]}_d{c[4]}")
@ARCHS
def test_varlen_matches_the_float64_reference(arch, case, causal, dtype):
    lengths_q, lengths_k, heads_q, heads_kv, head_dim = case
    q, k, v, cu_q, cu_k = _packed(lengths_q, lengths_k, heads_q, heads_kv, head_dim, dtype)
    out = torch.full_like(q, float("nan"))
    out, lse = facodegen.attention_varlen(q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k), causal=causal,
                                          return_lse=True, out=out, **_kw(arch))
    torch.cuda.synchronize()
    _check(q, k, v, cu_q, cu_k, out, lse, causal, dtype)


# window_size, softcap, sinks (issue 40: the window combines with varlen), each alone and together
VARIANTS = [dict(window_size=(32, 8)), dict(window_size=(0, 0)), dict(window_size=(-1, 16)), dict(softcap=5.0),
            dict(sinks=True), dict(window_size=(100, 0), softcap=8.0, sinks=True)]


def _variant_params():
    """Each variant on one of three CASES in turn (head dims 128, 64, 96), on both archs; the one-CTA-per-tile
    sm90 kernel with all three variants (a kernel compile per arch x head_dim x causal x feature set)."""
    sm90 = dict(marks=NEEDS_SM90)
    params = [pytest.param(arch, CASES[(0, 1, 4)[i % 3]], v, **(sm90 if arch != "sm80" else {}),
                           id=f"{arch}-" + "-".join(f"{k}{v[k]}" for k in v).replace(" ", ""))
              for i, v in enumerate(VARIANTS) for arch in ("sm80", "sm90")]
    return params + [pytest.param("sm90-np", CASES[4], VARIANTS[-1], **sm90, id="sm90-np-all")]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("arch, case, variant", _variant_params())
def test_varlen_variants_match_the_float64_reference(arch, case, causal, variant):
    """Each sequence's window on its own bottom-right diagonal (a window of 0 keys each side, one cut at the
    causal diagonal, one open on the left), softcap, sinks (a sequence with no key: O = 0, LSE = the sink),
    with empty, length-1 and q > k sequences, GQA and MQA, O and the LSE poisoned first."""
    lengths_q, lengths_k, heads_q, heads_kv, head_dim = case
    q, k, v, cu_q, cu_k = _packed(lengths_q, lengths_k, heads_q, heads_kv, head_dim, torch.bfloat16, seed=3)
    variant = dict(variant)
    if variant.get("sinks"):
        variant["sinks"] = torch.randn(heads_q, device="cuda", dtype=torch.float32)
    out = torch.full_like(q, float("nan"))
    out, lse = facodegen.attention_varlen(q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k), causal=causal,
                                          return_lse=True, out=out, **variant, **_kw(arch))
    torch.cuda.synchronize()
    _check(q, k, v, cu_q, cu_k, out, lse, causal, torch.bfloat16, **variant)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", [40, 80, 112])
@ARCHS
def test_varlen_head_dims_between_the_tiles(arch, head_dim, causal):
    """Issue 40's any head_dim with varlen: d40 / d80 / d112 on the d64 / d96 / d128 tiles, the packed
    (total, heads, d) tensors exactly d wide (an O row store past d would write the next head's columns),
    against the float64 reference; 45 mixed sequences with empty and length-1 ones, GQA 8 x 2."""
    lengths_q = _mixed_lengths(45, 300, seed=head_dim)
    lengths_k = _mixed_lengths(45, 300, seed=head_dim + 1)
    q, k, v, cu_q, cu_k = _packed(lengths_q, lengths_k, 8, 2, head_dim, torch.bfloat16, seed=head_dim)
    out = torch.full_like(q, float("nan"))
    out, lse = facodegen.attention_varlen(q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k), causal=causal,
                                          return_lse=True, out=out, **_kw(arch))
    torch.cuda.synchronize()
    _check(q, k, v, cu_q, cu_k, out, lse, causal, torch.bfloat16)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dims", [(192, 128), (128, 64)], ids=["192-128", "128-64"])
@ARCHS
def test_varlen_v_narrower_than_q_and_k(arch, dims, causal):
    """head_dim_v < head_dim with varlen (DeepSeek MLA prefill's 192 / 128): O (total, heads, d_v) against
    the float64 reference, twice (the second call a plan-cache hit that makes O itself); 45 mixed
    sequences with empty and length-1 ones, GQA 8 x 2."""
    head_dim, head_dim_v = dims
    lengths_q = _mixed_lengths(45, 300, seed=head_dim_v)
    lengths_k = _mixed_lengths(45, 300, seed=head_dim_v + 1)
    q, k, _, cu_q, cu_k = _packed(lengths_q, lengths_k, 8, 2, head_dim, torch.bfloat16, seed=head_dim_v)
    v = torch.randn(cu_k[-1].item(), 2, head_dim_v, device="cuda").to(torch.bfloat16)
    for _ in range(2):
        out, lse = facodegen.attention_varlen(q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k), causal=causal,
                                              return_lse=True, **_kw(arch))
        torch.cuda.synchronize()
        assert out.shape == (q.shape[0], 8, head_dim_v)
        _check(q, k, v, cu_q, cu_k, out, lse, causal, torch.bfloat16)


@ARCHS
def test_new_boundaries_hit_the_plan_and_are_right(arch):
    """The same packed tensors with other boundaries (same total tokens): a plan-cache hit whose
    cu_seqlens addresses are patched in; the result follows the new boundaries."""
    q, k, v, cu_q, cu_k = _packed((17, 1000, 1), (300, 17, 200), 4, 2, 128, torch.bfloat16)
    facodegen.attention_varlen(q, k, v, cu_q, cu_k, 1000, 300, causal=True, return_lse=True, **_kw(arch))
    misses = varlen._PLANS.misses
    cu_q2 = torch.tensor([0, 500, 1000, 1018], dtype=torch.int32, device="cuda")
    cu_k2 = torch.tensor([0, 1, 300, 517], dtype=torch.int32, device="cuda")
    out, lse = facodegen.attention_varlen(q, k, v, cu_q2, cu_k2, 1000, 300, causal=True, return_lse=True, **_kw(arch))
    assert varlen._PLANS.misses == misses
    torch.cuda.synchronize()
    _check(q, k, v, cu_q2, cu_k2, out, lse, True, torch.bfloat16)


@pytest.mark.parametrize("return_lse", [True, False])
@ARCHS
def test_other_totals_hit_the_plan_and_are_right(arch, return_lse):
    """A training step's next batch: the same number of sequences and max_seqlen, other lengths and
    total tokens (more than the first's: without the LSE asked, it goes to a temporary; sm90: the
    TMA maps over the packed tokens are encoded anew for the new totals)."""
    first = _packed((17, 1000, 1), (300, 17, 200), 4, 2, 128, torch.bfloat16)
    facodegen.attention_varlen(*first, 1000, 300, causal=True, return_lse=return_lse, **_kw(arch))
    misses = varlen._PLANS.misses
    q, k, v, cu_q, cu_k = _packed((500, 900, 33), (300, 5, 250), 4, 2, 128, torch.bfloat16)
    got = facodegen.attention_varlen(q, k, v, cu_q, cu_k, 1000, 300, causal=True, return_lse=return_lse, **_kw(arch))
    assert varlen._PLANS.misses == misses
    torch.cuda.synchronize()
    out, lse = got if return_lse else (got, None)
    if lse is None:     # the LSE the call wrote to its temporary is not returned: check O against a fresh call's
        out_ref, lse = facodegen.attention_varlen(q, k, v, cu_q, cu_k, 1000, 300, causal=True, return_lse=True,
                                                  **_kw(arch))
        assert torch.equal(out, out_ref)
    _check(q, k, v, cu_q, cu_k, out, lse, True, torch.bfloat16)


@ARCHS
def test_a_longer_max_seqlen_under_the_same_power_of_two_hits_the_plan_and_is_right(arch):
    """A server's next step: every sequence one token longer, max_seqlen 600 -> 601 (plan_bound 1024
    both): the plan of the first call, whose grid covers 1024 rows per sequence, and exact results."""
    first = _packed((600, 3, 17), (600, 3, 17), 4, 2, 128, torch.float16)
    facodegen.attention_varlen(*first, 600, 600, causal=True, return_lse=True, **_kw(arch))
    misses = varlen._PLANS.misses
    q, k, v, cu_q, cu_k = _packed((601, 4, 18), (601, 4, 18), 4, 2, 128, torch.float16)
    out, lse = facodegen.attention_varlen(q, k, v, cu_q, cu_k, 601, 601, causal=True, return_lse=True, **_kw(arch))
    assert varlen._PLANS.misses == misses
    torch.cuda.synchronize()
    _check(q, k, v, cu_q, cu_k, out, lse, True, torch.float16)


def test_flash_attn_varlen_func_returns_flash_attentions_tuple():
    q, k, v, cu_q, cu_k = _packed((17, 33), (17, 40), 4, 4, 64, torch.float16)
    out, lse, probs = facodegen.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 33, 40, causal=True,
                                                       return_attn_probs=True)
    assert probs is None and lse.shape == (4, 50)
    torch.cuda.synchronize()
    _check(q, k, v, cu_q, cu_k, out, lse, True, torch.float16)


# sequences covering part of the packed buffer (cu_seqlens need not start at 0): query boundaries, key
# boundaries; the rows before the first and after the last query boundary belong to no sequence here
PARTIAL = [
    ((3, 20, 20, 150, 151), (0, 5, 5, 300, 301)),     # odd offsets, an empty sequence, a length-1 one at the end
    ((64, 128), (7, 200)),                             # one whole 64-row block: rows 128.. (the next tile's) stay
    ((1, 66), (250, 251)),                             # 65 queries, one key: a 64-row box would cross row 65
]


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("bounds", PARTIAL, ids=lambda b: "q" + "-".join(map(str, b[0])))
@ARCHS
def test_rows_of_other_sequences_are_untouched(arch, bounds, causal, head_dim):
    """O poisoned (NaN and a finite sentinel) before a call whose sequences cover only some of its
    rows: every row outside them (as another sequence's rows are to a tile: the kernel must not store
    past its sequence's last row, which a TMA box of O would) keeps its poison bit for bit; the rows
    inside are right."""
    bounds_q, bounds_k = bounds
    total_q, total_k = bounds_q[-1] + 37, bounds_k[-1] + 11
    q, k, v, _, _ = _packed((total_q,), (total_k,), 4, 2, head_dim, torch.bfloat16, seed=3)
    cu_q, cu_k = (torch.tensor(b, dtype=torch.int32, device="cuda") for b in (bounds_q, bounds_k))
    lengths_q = [b - a for a, b in zip(bounds_q, bounds_q[1:])]
    lengths_k = [b - a for a, b in zip(bounds_k, bounds_k[1:])]
    inside = torch.zeros(total_q, dtype=torch.bool, device="cuda")
    inside[bounds_q[0]:bounds_q[-1]] = True
    for poison in (float("nan"), -7.5):
        out = torch.full_like(q, poison)
        before = out.clone()
        out, lse = facodegen.attention_varlen(q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k), causal=causal,
                                              return_lse=True, out=out, **_kw(arch))
        torch.cuda.synchronize()
        assert torch.equal(out[~inside].view(torch.int16), before[~inside].view(torch.int16)), \
            f"rows outside the sequences were written (poison {poison})"
        rows = slice(bounds_q[0], bounds_q[-1])
        keys = slice(bounds_k[0], bounds_k[-1])
        _check(q[rows], k[keys], v[keys], cu_q - bounds_q[0], cu_k - bounds_k[0], out[rows], lse[:, rows], causal,
               torch.bfloat16)


@pytest.mark.parametrize("case", [c for c in fuzz.representative_cases() if c.family == "varlen"],
                         ids=lambda c: f"{c.arch}-{c.dtype}-{'causal' if c.causal else 'full'}")
def test_fuzz_representative_varlen_cases(case):
    if case.arch == "sm90" and not HAVE_SM90:
        pytest.skip("the sm90 kernel needs an H100/H200")
    ok, message = fuzz.run_case(case)
    assert ok, f"{message}\n  {case.repro()}"


# ------------------------------------------------------------------ the persistent sm90 schedule (issue 39)

def _mixed_lengths(count, longest, seed):
    """``count`` lengths in [0, longest] (seeded), with zeros and ones among them."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(0, longest + 1, count)
    lengths[::7] = 0
    lengths[3::11] = 1
    return [int(x) for x in lengths]


# spec fields of the sm90 kernel: persistent with either scheduler, and one CTA per tile
SCHEDULES = [dict(persistent=True, dynamic_scheduler=False), dict(persistent=True, dynamic_scheduler=True),
             dict(persistent=False)]


@NEEDS_SM90
@pytest.mark.parametrize("fields", SCHEDULES, ids=["static", "dynamic", "np"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_sm90_schedules_on_many_mixed_sequences(head_dim, causal, fields):
    """45 sequences (two chunks of the persistent kernel's 32-sequence scan), lengths 0 .. 400 with
    empty and length-1 ones, other key lengths than query lengths, GQA 8 x 2: every schedule of the
    sm90 varlen kernel against the float64 reference, O and the LSE poisoned first."""
    lengths_q = _mixed_lengths(45, 400, seed=head_dim)
    other = _mixed_lengths(45, 400, seed=head_dim + 1)      # every third sequence: another key length
    lengths_k = [n if i % 3 else m for i, (n, m) in enumerate(zip(lengths_q, other))]
    q, k, v, cu_q, cu_k = _packed(lengths_q, lengths_k, 8, 2, head_dim, torch.bfloat16, seed=head_dim)
    out = torch.full_like(q, float("nan"))
    out, lse = facodegen.attention_varlen(q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k), causal=causal,
                                          return_lse=True, out=out, arch="sm90", **fields)
    torch.cuda.synchronize()
    _check(q, k, v, cu_q, cu_k, out, lse, causal, torch.bfloat16)


@NEEDS_SM90
@pytest.mark.parametrize("fields", SCHEDULES, ids=["static", "dynamic", "np"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_sm90_equal_lengths_match_the_padded_kernel(causal, fields):
    """Equal lengths (the issue's cell, smaller): the varlen kernel against the reference and, within the
    same rounding, against the padded kernel on (batch, seqlen), which does the same work."""
    batch, seqlen, heads, head_dim = 4, 1000, 8, 128
    q, k, v, cu_q, cu_k = _packed([seqlen] * batch, [seqlen] * batch, heads, heads, head_dim, torch.bfloat16)
    out, lse = facodegen.attention_varlen(q, k, v, cu_q, cu_k, seqlen, seqlen, causal=causal, return_lse=True,
                                          arch="sm90", **fields)
    padded = facodegen.attention(*(x.reshape(batch, seqlen, x.shape[1], head_dim).contiguous() for x in (q, k, v)),
                                 causal=causal, arch="sm90")
    torch.cuda.synchronize()
    _check(q, k, v, cu_q, cu_k, out, lse, causal, torch.bfloat16)
    torch.testing.assert_close(out.reshape(padded.shape), padded, atol=2e-2, rtol=2e-2)


# cu_seqlens that lie, and how many first rows (and keys) of sequence 0 are still honest: a sequence
# longer than max_seqlen_q running past total_q (200), decreasing steps, keys past total_k; negative starts
HOSTILE = [
    (([0, 40, 10**6, 200, 190], [0, 40, 5000, 50, 600]), 40),
    (([-100, 40, 40], [-50, 40, 40]), 0),
]


@NEEDS_SM90
@pytest.mark.parametrize("fields", SCHEDULES, ids=["static", "dynamic", "np"])
@pytest.mark.parametrize("hostile", HOSTILE, ids=["past-the-end", "negative"])
def test_sm90_hostile_cu_seqlens_stay_in_bounds(hostile, fields):
    """The kernel ends and writes no row of O outside the packed tokens (guard bands before and after
    `out` keep their poison bit for bit), the sequences past max_seqlen_q stop there, and an honest
    first sequence is right."""
    (bounds_q, bounds_k), honest = hostile
    total_q, total_k, heads, head_dim, band = 200, 200, 4, 128, 150
    q, k, v, _, _ = _packed((total_q,), (total_k,), heads, heads, head_dim, torch.bfloat16, seed=5)
    cu_q, cu_k = (torch.tensor(b, dtype=torch.int32, device="cuda") for b in (bounds_q, bounds_k))
    buffer = torch.full((band + total_q + band, heads, head_dim), -7.5, dtype=torch.bfloat16, device="cuda")
    before = buffer.clone()
    out, lse = facodegen.attention_varlen(q, k, v, cu_q, cu_k, 256, 256, return_lse=True,
                                          out=buffer[band:band + total_q], arch="sm90", **fields)
    torch.cuda.synchronize()
    outside = torch.ones(buffer.shape[0], dtype=torch.bool, device="cuda")
    outside[band:band + total_q] = False
    assert torch.equal(buffer[outside].view(torch.int16), before[outside].view(torch.int16)), \
        "rows outside the packed tokens were written"
    if honest:
        cu = torch.tensor([0, honest], dtype=torch.int32, device="cuda")
        _check(q[:honest], k[:honest], v[:honest], cu, cu, out[:honest], lse[:, :honest], False, torch.bfloat16)


@NEEDS_SM90
@pytest.mark.parametrize("dynamic", [True, False], ids=["dynamic", "static"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_sm90_varlen_lpt_matches_the_default_bit_for_bit(head_dim, dynamic):
    """varlen_lpt only reorders the tiles (each sequence's heads in L2-sized sections, m_blocks counting
    down with the heads fastest), so O and the LSE equal the default order's bit for bit, and the float64
    reference. 45 mixed sequences (empty, length 1, other key lengths) and one of 300 queries against
    40,000 keys, whose K/V (40,000 x 2 x head_dim x 2 bytes a head) put fewer than its 8 heads in a
    section at every head_dim; GQA 8 x 2; then hostile cu_seqlens write nothing outside O."""
    lengths_q = _mixed_lengths(45, 400, seed=head_dim) + [300]
    lengths_k = _mixed_lengths(45, 400, seed=head_dim + 1) + [40000]
    q, k, v, cu_q, cu_k = _packed(lengths_q, lengths_k, 8, 2, head_dim, torch.bfloat16, seed=head_dim)
    results = []
    for lpt in (False, True):
        out = torch.full_like(q, float("nan"))
        out, lse = facodegen.attention_varlen(q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k), causal=True,
                                              return_lse=True, out=out, arch="sm90", dynamic_scheduler=dynamic,
                                              varlen_lpt=lpt)
        torch.cuda.synchronize()
        results.append((out.clone(), lse.clone()))
    _check(q, k, v, cu_q, cu_k, *results[1], True, torch.bfloat16)
    assert torch.equal(results[0][0].view(torch.int16), results[1][0].view(torch.int16)), "O differs from the default order's"
    assert torch.equal(results[0][1].nan_to_num(), results[1][1].nan_to_num()), "the LSE differs from the default order's"
    for (bounds_q, bounds_k), _ in HOSTILE:
        total, band = 200, 150
        q, k, v, _, _ = _packed((total,), (total,), 4, 4, head_dim, torch.bfloat16, seed=5)
        buffer = torch.full((band + total + band, 4, head_dim), -7.5, dtype=torch.bfloat16, device="cuda")
        before = buffer.clone()
        facodegen.attention_varlen(q, k, v, *(torch.tensor(b, dtype=torch.int32, device="cuda") for b in (bounds_q, bounds_k)),
                                   256, 256, causal=True, out=buffer[band:band + total], arch="sm90",
                                   dynamic_scheduler=dynamic, varlen_lpt=True)
        torch.cuda.synchronize()
        assert torch.equal(buffer[:band].view(torch.int16), before[:band].view(torch.int16))
        assert torch.equal(buffer[band + total:].view(torch.int16), before[band + total:].view(torch.int16))


@NEEDS_SM90
@pytest.mark.parametrize("per_head", [False, True], ids=["tensor-descales", "sequence-head-descales"])
@pytest.mark.parametrize("persistent", [True, False], ids=["persistent", "np"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", [64, 80, 112, 128, 256])
def test_fp8_varlen_matches_the_float64_reference(head_dim, causal, persistent, per_head):
    """fp8 (e4m3) varlen on sm90 (head_dim 80 and 112: padded on the 96 and 128 tiles, since session 44):
    45 mixed sequences (empty, length 1, other key lengths), GQA 8 x 2,
    descales per tensor or per (sequence, kv head) (FlashAttention-3's (batch, heads_kv), batch = the
    sequences), O (bf16) poisoned first: per sequence within the forward fp8 cases' bound (rel_fro 3e-2 or
    twice a bf16 computation's) of the float64 reference on the dequantised inputs; the LSE within
    1e-2 + 1e-3 |lse|; rows outside every sequence untouched."""
    from facodegen.verify.fuzz import fp8_failure
    lengths_q = _mixed_lengths(45, 400, seed=head_dim)
    lengths_k = _mixed_lengths(45, 400, seed=head_dim + 1)
    q, k, v, cu_q, cu_k = _packed(lengths_q, lengths_k, 8, 2, head_dim, torch.bfloat16, seed=head_dim)
    if per_head:
        gen = torch.Generator(device="cuda").manual_seed(head_dim)

        def quantize(x, cu):        # descale per (sequence, kv head) in [1/64, 3/64]: |x / d| stays under 448
            lengths = cu[1:] - cu[:-1]
            d = (torch.rand(len(lengths), 2, generator=gen, device="cuda") + 0.5) / 32
            per = d[torch.repeat_interleave(torch.arange(len(lengths), device="cuda"), lengths.long())]
            per = per.repeat_interleave(x.shape[1] // 2, dim=1)[..., None]       # (tokens, heads, 1)
            x8 = (x.float() / per).to(torch.float8_e4m3fn)
            return x8, d, x8.float() * per
        (q8, qd, qf), (k8, kd, kf), (v8, vd, vf) = (quantize(x, cu) for x, cu in ((q, cu_q), (k, cu_k), (v, cu_k)))
    else:
        (q8, qd), (k8, kd), (v8, vd) = (facodegen.quantize_e4m3(x) for x in (q, k, v))
        qf, kf, vf = (x8.float() * d for x8, d in ((q8, qd), (k8, kd), (v8, vd)))
    out = torch.full(q.shape, float("nan"), dtype=torch.bfloat16, device="cuda")
    out, lse = facodegen.attention_varlen(q8, k8.contiguous(), v8.contiguous(), cu_q, cu_k, max(lengths_q),
                                          max(lengths_k), causal=causal, return_lse=True, out=out, arch="sm90",
                                          q_descale=qd, k_descale=kd, v_descale=vd, persistent=persistent)
    torch.cuda.synchronize()
    o_ref, lse_ref = varlen_reference(qf, kf, vf, cu_q, cu_k, causal=causal)
    got_lse = lse.double().cpu().numpy()
    assert np.array_equal(np.isneginf(got_lse), np.isneginf(lse_ref)), "LSE -inf rows differ"
    seen = np.isfinite(lse_ref)
    assert np.all(np.abs(got_lse[seen] - lse_ref[seen]) <= 1e-2 + 1e-3 * np.abs(lse_ref[seen]))
    bounds = cu_q.tolist(), cu_k.tolist()
    for seq, (q0, q1, k0, k1) in enumerate(zip(bounds[0], bounds[0][1:], bounds[1], bounds[1][1:])):
        if q0 == q1:
            continue
        ref = torch.from_numpy(o_ref[None, q0:q1]).cuda()
        one = [x[None, a:b] for x, a, b in ((qf, q0, q1), (kf, k0, k1), (vf, k0, k1))]
        why = fp8_failure(out[None, q0:q1], ref, *one, causal, head_dim ** -0.5)
        assert why is None, f"sequence {seq}: {why}"


# ------------------------------------------------------------------ O's TMA store of whole blocks (issue 39)

@NEEDS_SM90
@pytest.mark.parametrize("persistent", [True, False], ids=["persistent", "np"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", [64, 96, 128, 192, 256])
def test_varlen_tma_store_both_ways_at_the_block_edges(head_dim, causal, persistent):
    """varlen_tma_store on (the default: a consumer warpgroup whose 64 rows lie inside the sequence
    stores them by TMA over the packed tokens) and off (every row by row): query lengths at the
    kernel's block edges (block_m and 64-row multiples, one more, one less), empty and length-1
    sequences, keys of other lengths (one sequence with none), GQA 6 x 2, packed between guard rows that
    belong to no sequence. Each way: the guard rows keep their poison bit for bit (NaN, then a finite
    sentinel), the sequences match the float64 reference; and the two ways store the same bits of O
    and the LSE (the same staging tile leaves by TMA or by 16-byte stores)."""
    assert facodegen.KernelSpec(arch="sm90", head_dim=head_dim, causal=causal, varlen=True).varlen_tma_store
    # the edges of every block_m the kernels take here (64: head_dim 64 causal's rule at these lengths; 128;
    # 192: head_dim 64), each a multiple of 64 (whole warpgroup boxes), one more, one less
    lengths_q = [192, 193, 191, 0, 64, 65, 63, 384, 1, 581, 128, 127, 129, 256, 255]
    lengths_k = [192, 195, 191, 7, 0, 65, 200, 384, 1, 576, 100, 127, 129, 256, 300]
    lead, tail = 5, 7                                         # guard rows before and after the sequences
    total_q, total_k = lead + sum(lengths_q) + tail, lead + sum(lengths_k) + tail
    q, k, v, _, _ = _packed((total_q,), (total_k,), 6, 2, head_dim, torch.bfloat16, seed=head_dim + causal)
    cu_q, cu_k = ([lead, *(lead + x for x in itertools.accumulate(lengths))] for lengths in (lengths_q, lengths_k))
    cu_q_t, cu_k_t = (torch.tensor(c, dtype=torch.int32, device="cuda") for c in (cu_q, cu_k))
    inside = torch.zeros(total_q, dtype=torch.bool, device="cuda")
    inside[cu_q[0]:cu_q[-1]] = True
    results = {}
    for store in (True, False):
        for poison in (float("nan"), -7.5):
            out = torch.full_like(q, poison)
            before = out.clone()
            out, lse = facodegen.attention_varlen(q, k, v, cu_q_t, cu_k_t, max(lengths_q), max(lengths_k),
                                                  causal=causal, return_lse=True, out=out, arch="sm90",
                                                  persistent=persistent, varlen_tma_store=store)
            torch.cuda.synchronize()
            assert torch.equal(out[~inside].view(torch.int16), before[~inside].view(torch.int16)), \
                f"varlen_tma_store={store}: rows outside the sequences were written (poison {poison})"
        rows, keys = slice(cu_q[0], cu_q[-1]), slice(cu_k[0], cu_k[-1])
        _check(q[rows], k[keys], v[keys], cu_q_t - lead, cu_k_t - lead, out[rows], lse[:, rows], causal,
               torch.bfloat16)
        results[store] = (out[rows].clone(), lse[:, rows].clone())
    assert torch.equal(results[True][0].view(torch.int16), results[False][0].view(torch.int16)), \
        "O differs between the TMA store and the row store"
    assert torch.equal(results[True][1], results[False][1]), "the LSE differs between the two O stores"


@NEEDS_SM90
@pytest.mark.parametrize("store", [True, False], ids=["tma-store", "row-store"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_varlen_tma_store_on_equal_lengths_matches_the_padded_kernel(causal, store):
    """The issue's cell, smaller (4 x 1024 bf16, d128; every block whole: all of O by TMA): either
    store against the reference and, within the same rounding, the padded kernel."""
    batch, seqlen, heads, head_dim = 4, 1024, 8, 128
    q, k, v, cu_q, cu_k = _packed([seqlen] * batch, [seqlen] * batch, heads, heads, head_dim, torch.bfloat16)
    out, lse = facodegen.attention_varlen(q, k, v, cu_q, cu_k, seqlen, seqlen, causal=causal, return_lse=True,
                                          arch="sm90", varlen_tma_store=store)
    padded = facodegen.attention(*(x.reshape(batch, seqlen, x.shape[1], head_dim).contiguous() for x in (q, k, v)),
                                 causal=causal, arch="sm90")
    torch.cuda.synchronize()
    _check(q, k, v, cu_q, cu_k, out, lse, causal, torch.bfloat16)
    torch.testing.assert_close(out.reshape(padded.shape), padded, atol=2e-2, rtol=2e-2)
