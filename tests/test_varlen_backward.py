"""attention_varlen's backward on the CPU: the varlen switch of the backward spec, the rendered and
compiled kernels (NVRTC, no spills), attention_varlen_backward's launches and BwdParams bytes on a
fake H200 (facodegen.ops.varlen_backward), its argument errors, the turn counters' layout, the float64
reference against finite differences, and the autograd that attention_varlen records on meta
tensors. What runs the kernels is tests/gpu/test_varlen_backward_gpu.py."""

from __future__ import annotations

import itertools
import re
import struct
import sys

import numpy as np
import pytest
from click.testing import CliRunner

import facodegen
from facodegen import cli
from facodegen.ops import backward, varlen_backward
from facodegen.spec import HEAD_DIMS, SpecError
from facodegen.spec.backward import BACKWARD_DTYPES, BackwardSpec, varlen_padded_blocks
from facodegen.verify.reference import varlen_backward_reference, varlen_reference
from fakes import FakeTensor
from sampling import one_per
from test_backward import bwd  # noqa: F401 (the fake H200's backward launches fixture)
from test_plan_cache import fake  # noqa: F401 (the fake torch and driver fixture)

VARLEN_SPECS = [BackwardSpec(head_dim=d, dtype=t, causal=c, varlen=True) for d in HEAD_DIMS for t in BACKWARD_DTYPES
                for c in (False, True)]
SM90_VARLEN_SPECS = [BackwardSpec(arch="sm90", head_dim=d, dtype=t, causal=c, varlen=True) for d in HEAD_DIMS
                     for t in BACKWARD_DTYPES for c in (False, True)]


# ------------------------------------------------------------------ spec, render, CLI

def test_varlen_is_a_problem_switch_of_both_backwards():
    """The varlen kernels are the default tiles with varlen; sm90's run one CTA per tile (no persistent
    token: its default there) and refuse, naming the knob, what they do not have."""
    for spec in VARLEN_SPECS + SM90_VARLEN_SPECS:
        plain = spec.replace(varlen=False, persistent=False, lpt=False, dq_lag=False)   # (sm90 defaults off varlen)
        assert spec.variant == plain.variant.replace("_np", "") + "_varlen"
        assert (spec.block_m, spec.block_n, spec.num_warps, spec.dq_tma_reduce) == \
            (plain.block_m, plain.block_n, plain.num_warps, plain.dq_tma_reduce)
        assert not spec.persistent
    for knobs, field in ((dict(persistent=True), "persistent"),
                         (dict(lpt=True, causal=True), "lpt")):
        with pytest.raises(SpecError) as err:
            BackwardSpec(arch="sm90", head_dim=128, varlen=True, **knobs)
        assert err.value.field == field
    assert BackwardSpec(arch="sm90", head_dim=128, varlen=True, deterministic=True).deterministic


def test_the_varlen_kernels_read_cu_seqlens_and_the_plain_ones_do_not():
    spec = BackwardSpec(head_dim=128, causal=True, varlen=True)
    source = backward.emit(spec)
    assert "seq_span(p.cu_seqlens_q, sequence, p.seqlen_q)" in source and "seq_span(p.cu_seqlens_k, sequence" in source
    assert re.search(r"const int\*\s+cu_seqlens_q;", source) and "VARLEN: Q/K/V/O/dO/dQ/dK/dV are packed" in source
    assert "cu_seqlens" not in backward.emit(spec.replace(varlen=False))
    assert "varlen_first_block(q_start, sequence)" in backward.emit(spec.replace(deterministic=True))


def test_params_layout_appends_the_boundaries():
    plain, packed = backward.layout("sm80"), backward.layout("sm80", varlen=True)
    assert packed[0][:len(plain[0])] == plain[0]
    assert [(f.name, off) for f, off in packed[0][len(plain[0]):]] == [("cu_seqlens_q", plain[1]),
                                                                      ("cu_seqlens_k", plain[1] + 8),
                                                                      ("zero_outside", plain[1] + 16)]


@pytest.mark.parametrize("argv", [["--head-dim", "64", "--causal", "--varlen"],
                                  ["--head-dim", "256", "--varlen", "--deterministic", "--dtype", "fp16"]])
def test_cli_emits_the_varlen_backward_and_its_line_rebuilds_it(argv):
    runner = CliRunner()
    result = runner.invoke(cli.main, ["emit", "--kernel", "backward", *argv])
    assert result.exit_code == 0, result.output
    spec = BackwardSpec(head_dim=int(argv[1]), causal="--causal" in argv, varlen=True,
                        deterministic="--deterministic" in argv, dtype="fp16" if "fp16" in argv else "bf16")
    assert result.output == backward.emit(spec)
    line = backward.emit_command(spec)
    assert "--varlen" in line
    assert runner.invoke(cli.main, line.split()[1:]).output == result.output
    refused = runner.invoke(cli.main, ["emit", "--kernel", "backward", "--arch", "sm90", "--varlen", "--persistent"])
    assert refused.exit_code == 2 and "persistent" in refused.output


# ------------------------------------------------------------------ compile (NVRTC)

compiler = pytest.importorskip("facodegen.runtime.compiler")


def _compile_targets():
    """Every head_dim x dtype x mask of the sm80 varlen backward for sm_80, one per head_dim for sm_90 (an
    H100/H200 runs it for deterministic varlen calls), the deterministic turns at 64 and 128; the sm90 varlen
    backward once per head_dim (seeded: dtype and mask), and with the vector dQ adds, dq_lag, block_m 64 at
    head_dim 64 and the deterministic turns (the knobs whose code reads the sequence's rows)."""
    deterministic = [BackwardSpec(head_dim=d, causal=True, varlen=True, deterministic=True) for d in (64, 128)]
    sm90_knobs = [BackwardSpec(arch="sm90", head_dim=128, causal=True, varlen=True, dq_tma_reduce=False),
                  BackwardSpec(arch="sm90", head_dim=128, causal=True, varlen=True, dq_lag=True),
                  BackwardSpec(arch="sm90", head_dim=64, varlen=True, block_m=64, dtype="fp16"),
                  BackwardSpec(arch="sm90", head_dim=256, causal=True, varlen=True, dq_tma_reduce=False),
                  BackwardSpec(arch="sm90", head_dim=64, causal=True, varlen=True, deterministic=True),
                  BackwardSpec(arch="sm90", head_dim=128, varlen=True, deterministic=True, dq_tma_reduce=True)]
    return ([(s, None) for s in VARLEN_SPECS + deterministic]
            + [(s, "sm_90") for s in one_per(VARLEN_SPECS, lambda s: s.head_dim)]
            + [(s, None) for s in one_per(SM90_VARLEN_SPECS, lambda s: s.head_dim) + sm90_knobs]
            + [(BackwardSpec(arch=a, head_dim=d, causal=True, varlen=True), None)     # padded head dims
               for a in ("sm80", "sm90") for d in (40, 200)])


@pytest.mark.parametrize("spec, sm", _compile_targets(), ids=lambda x: getattr(x, "variant", None) or str(x or "sm_80"))
def test_varlen_backward_compiles_without_spills(spec, sm):
    """No local memory in any of the three kernels (the sm90 producer's 24 registers included: a
    persistent producer skipping the tiles past a sequence's keys spilled at head_dim 64 and 256)."""
    kernel = backward.compile(spec, sm=sm)
    resources = backward.resources_of(kernel)
    for name in spec.kernel_names:
        r = resources[name]
        assert (r.stack_bytes, r.spill_stores, r.spill_loads) == (0, 0, 0), (name, r)
    assert "warning" not in kernel.log, kernel.log      # (an unused name in generated code is a bug in its template)
    counts = kernel.sass_counts()
    assert counts["LDL"] == 0 and counts["STL"] == 0
    if spec.arch == "sm80":
        assert counts["HMMA"] >= 5 and counts["LDGSTS"] > 0
    else:       # TMA loads, wgmma, and the bulk copies of the LSE, D rows (and dQ's bulk reduce-adds)
        sass = kernel.sass()
        assert "UTMALDG.4D" in sass and "HGMMA" in sass and "UBLKCP" in sass
        assert ("UBLKRED" in sass) == spec.dq_tma_reduce


# ------------------------------------------------------------------ launches on a fake H200

HQ, HKV, D = 8, 2, 128
LENGTHS_Q, LENGTHS_K = (1, 17, 0, 100), (5, 17, 3, 300)


@pytest.fixture
def vbwd(bwd, monkeypatch):  # noqa: F811
    """test_backward's fake H200 and launch records (bwd), with a plan cache of varlen_backward's own and
    the arrays torch.zeros_like made (none: the preprocess zeroes what the call needs zeroed)."""
    monkeypatch.setattr(varlen_backward, "_PLANS", backward.PlanCache())
    zeroed = []
    torch = sys.modules["torch"]
    monkeypatch.setattr(torch, "zeros_like", lambda x, memory_format=None: zeroed.append(x) or torch.empty_like(x),
                        raising=False)
    bwd.zeroed = zeroed
    return bwd


def _problem(lengths_q=LENGTHS_Q, lengths_k=LENGTHS_K, d=D, dtype="bfloat16"):
    total_q, total_k = sum(lengths_q), sum(lengths_k)
    q, do, o = (FakeTensor((total_q, HQ, d), dtype) for _ in range(3))
    k, v = FakeTensor((total_k, HKV, d), dtype), FakeTensor((total_k, HKV, d), dtype)
    lse = FakeTensor((HQ, total_q), "float32")
    cu_q, cu_k = FakeTensor((len(lengths_q) + 1,), "int32"), FakeTensor((len(lengths_k) + 1,), "int32")
    return dict(do=do, q=q, k=k, v=v, out=o, lse=lse, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                max_seqlen_q=max(lengths_q), max_seqlen_k=max(lengths_k))


def _call(args, **kw):
    a = dict(args)
    positional = [a.pop(n) for n in ("do", "q", "k", "v", "out", "lse", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q",
                                     "max_seqlen_k")]
    return varlen_backward.attention_varlen_backward(*positional, **a, **kw)


def _fields(record, arch="sm80", local=False, softcap=False) -> dict:
    formats = {"ptr": "<Q", "i32": "<i", "i64": "<q", "f32": "<f"}
    return {f.name: struct.unpack_from(formats[f.kind], record["params"], off)[0]
            for f, off in backward.layout(arch, varlen=True, local=local, softcap=softcap)[0] if f.kind in formats}


@pytest.mark.parametrize("arch", [None, "sm80"])
def test_a_varlen_window_and_softcap_run_the_sm80_local_softcap_kernels(vbwd, arch):
    """window_size and softcap (attention_varlen's): the sm80 LOCAL and SOFTCAP varlen kernels on this fake H200
    too (arch=None), the window folded against the plan's bounds (a window past them is none), its values and
    the cap in BwdParams; an sm90 call with them is refused naming the knob."""
    a = _problem()
    _call(a, causal=True, softmax_scale=0.25, window_size=(20, -1), softcap=30.0, arch=arch)
    spec = BackwardSpec(head_dim=D, causal=True, gpu="h200", varlen=True, local=True, softcap=True)
    main = vbwd.bwd.records[1]
    assert main["name"] == spec.variant
    f = _fields(main, local=True, softcap=True)
    assert (f["window_left"], f["window_right"]) == (20, 0) and f["softcap_scale"] == pytest.approx(0.25 / 30)
    _call(a, causal=True, softmax_scale=0.25, window_size=(5000, -1), arch=arch)     # wider than any sequence
    assert "_local" not in vbwd.bwd.records[4]["name"]
    with pytest.raises(SpecError, match="local"):
        _call(a, causal=True, window_size=(20, -1), arch="sm90")
    # sinks: the sm80 SINKS kernels (the sm90 varlen backward has none), a fourth result, the addresses patched in
    sinks = FakeTensor((HQ,), "float32")
    *_, dsinks = _call(a, causal=True, window_size=(20, -1), sinks=sinks, arch=arch)
    post = vbwd.bwd.records[-1]
    assert post["name"].endswith("_varlen_local_sinks_convert_dq") and dsinks.shape == (HQ,)
    placed = {f.name: off for f, off in backward.layout("sm80", varlen=True, local=True, sinks=True)[0]}
    assert struct.unpack_from("<2Q", post["params"], placed["sinks"]) == (sinks.data_ptr(), dsinks.data_ptr())
    with pytest.raises(SpecError, match="sinks"):
        _call(a, causal=True, sinks=sinks, arch="sm90")


def test_a_varlen_call_launches_the_three_kernels_over_the_packed_rows(vbwd):
    """arch="sm80": the preprocess and postprocess over the 118 packed query rows as one batch, the main
    kernel over max_seqlen_k's plan_bound keys (512: 4 blocks of 128) x kv heads x sequences; BwdParams has
    the sequences as its batch, the totals as its lengths, the packed strides (batch 0) and the call's
    boundaries."""
    a = _problem()
    dq, dk, dv = _call(a, causal=True, softmax_scale=0.25, arch="sm80")
    spec = BackwardSpec(head_dim=D, causal=True, gpu="h200", varlen=True)
    recs = vbwd.bwd.records
    assert [r["name"] for r in recs] == list(spec.kernel_names)
    assert [r["grid"] for r in recs] == [(-(-118 // 16), HQ, 1), (4, HKV, 4), (-(-118 // 8), HQ, 1)]
    f = _fields(recs[1])
    assert (f["batch"], f["seqlen_q"], f["seqlen_k"], f["heads_q"], f["heads_kv"]) == (4, 118, 325, HQ, HKV)
    assert (f["cu_seqlens_q"], f["cu_seqlens_k"]) == (a["cu_seqlens_q"].data_ptr(), a["cu_seqlens_k"].data_ptr())
    assert (f["q_batch_stride"], f["q_row_stride"], f["q_head_stride"]) == (0, HQ * D, D)
    assert (f["k_batch_stride"], f["k_row_stride"], f["dk_row_stride"]) == (0, HKV * D, HKV * D)
    assert f["dpsum"] - f["dq_accum"] == 4 * HQ * 118 * D and f["dq_semaphore"] == 0
    # the scratch is the call's (its size follows the call's totals, which one plan serves)
    plan = next(iter(varlen_backward._PLANS._plans.values()))
    assert plan.scratch(vbwd.stream) is None and not plan.plain
    assert f["softmax_scale"] == 0.25 and (f["dq"], f["dk"], f["dv"]) == tuple(t.data_ptr() for t in (dq, dk, dv))
    # no fill launch: the preprocess zeroes dK and dV where no sequence's keys are; dQ is written whole
    assert vbwd.zeroed == [] and f["zero_outside"] == 0b110
    _call(a, causal=True, softmax_scale=0.25, arch="sm80", dk=FakeTensor(a["k"].shape, "bfloat16"))
    assert _fields(recs[-2])["zero_outside"] == 0b100    # a given dK keeps what it held there


@pytest.mark.parametrize("arch", ["sm80", "sm90"])
def test_a_padded_head_dim_runs_the_varlen_kernels_of_the_next_tile(vbwd, monkeypatch, arch):
    """head_dim 80: the varlen kernels of the 96 tile with head_dim_real=80, dq_accum rows of the tile's width,
    the packed tensors' own strides, the default scale 1/sqrt(80); sm90's maps are 80 columns wide."""
    from facodegen.runtime import driver, tma
    encoded = []
    monkeypatch.setattr(tma, "encode", lambda args: encoded.append(args) or bytes(128))
    monkeypatch.setattr(driver, "replace_tensor_map_address", lambda address, ptr: None)
    _call(_problem(d=80), causal=True, arch=arch)
    spec = BackwardSpec(arch=arch, head_dim=80, causal=True, gpu="h200", varlen=True)
    recs = vbwd.bwd.records
    assert spec.head_dim == 96 and [r["name"] for r in recs] == list(spec.kernel_names)
    f = _fields(recs[1], arch)
    assert (f["q_row_stride"], f["q_head_stride"], f["k_row_stride"]) == (HQ * 80, 80, HKV * 80)
    assert f["softmax_scale"] == pytest.approx(80 ** -0.5)
    if arch == "sm80":
        assert f["dpsum"] - f["dq_accum"] == 4 * HQ * 118 * 96
    else:
        assert [a.dims[0] for a in encoded] == [80] * 4


def test_the_sm90_varlen_call_runs_one_cta_per_tile_over_the_packed_tokens(vbwd, monkeypatch):
    """arch=None on the fake H200: the sm90 varlen backward. The preprocess and postprocess per sequence
    (grid z) over max_seqlen_q's bound (128: 6 CTAs of 24 rows, 2 query blocks of 64); one CTA per tile,
    (4 key blocks of max_seqlen_k's 512) x 2 kv heads x 4 sequences; the TMA maps over the packed tokens
    as one batch, moved to each call's tensors; the stats and the tiled dq_accum in (ceil(118 / 64) + 4)
    padded blocks of 64 rows per head."""
    from facodegen.runtime import tma
    encoded = []
    monkeypatch.setattr(tma, "encode", lambda args: encoded.append(args) or bytes(128))
    a = _problem()
    _call(a, causal=True)
    spec = BackwardSpec(arch="sm90", head_dim=D, causal=True, varlen=True)
    recs = vbwd.bwd.records
    assert [r["name"] for r in recs] == list(spec.kernel_names) and spec.dq_tma_reduce and not spec.persistent
    assert [r["grid"] for r in recs] == [(6, HQ, 4), (4 * HKV * 4, 1, 1), (2, HQ, 4)]
    f = _fields(recs[1], "sm90")
    assert (f["batch"], f["seqlen_q"], f["seqlen_k"], f["varlen_max_seqlen_k"]) == (4, 118, 325, 512)
    assert (f["cu_seqlens_q"], f["cu_seqlens_k"]) == (a["cu_seqlens_q"].data_ptr(), a["cu_seqlens_k"].data_ptr())
    padded_rows = (2 + 4) * 64
    assert f["dpsum"] - f["dq_accum"] == 4 * HQ * padded_rows * D
    # (sm90's postprocess writes each sequence's dQ rows only: the preprocess zeroes the others too)
    assert vbwd.zeroed == [] and f["zero_outside"] == 0b111
    assert [(m.dims, m.box[1]) for m in encoded] == [((D, 118, HQ, 1), 64), ((D, 325, HKV, 1), 128),
                                                    ((D, 325, HKV, 1), 128), ((D, 118, HQ, 1), 64)]
    again = dict(_problem(), cu_seqlens_q=a["cu_seqlens_q"])    # new tensors of the same layouts: a hit
    _call(again, causal=True)
    assert varlen_backward._PLANS.misses == 1       # ... whose maps are encoded for its tensors (and totals)
    assert [m.ptr for m in encoded[4:]] == [again[n].data_ptr() for n in ("q", "k", "v", "do")]


@pytest.mark.parametrize("arch", ["sm80", "sm90"])
def test_new_boundaries_hit_the_plan_and_are_patched_in(vbwd, arch):
    a = _problem()
    _call(a, arch=arch)
    moved = dict(a, cu_seqlens_q=FakeTensor((5,), "int32"), cu_seqlens_k=FakeTensor((5,), "int32"), max_seqlen_k=260)
    _call(moved, arch=arch)
    assert varlen_backward._PLANS.misses == 1 and len(vbwd.bwd.records) == 6
    f = _fields(vbwd.bwd.records[4], arch)
    assert (f["cu_seqlens_q"], f["cu_seqlens_k"]) == (moved["cu_seqlens_q"].data_ptr(),
                                                      moved["cu_seqlens_k"].data_ptr())
    _call(_problem(lengths_q=(1, 17, 1, 100)), arch=arch)      # another total: a hit whose grids and totals follow it
    assert varlen_backward._PLANS.misses == 1
    f = _fields(vbwd.bwd.records[-2], arch)
    assert (f["seqlen_q"], f["seqlen_k"]) == (119, 325)
    if arch == "sm80":      # the preprocess and postprocess over the packed rows
        assert [r["grid"] for r in vbwd.bwd.records[-3:]] == [(-(-119 // 16), HQ, 1), (4, HKV, 4), (-(-119 // 8), HQ, 1)]
    _call(dict(a, max_seqlen_k=600), arch=arch)                # another plan_bound (1024): the main grid follows it
    assert varlen_backward._PLANS.misses == 2
    assert vbwd.bwd.records[-2]["grid"] == ((8, HKV, 4) if arch == "sm80" else (8 * HKV * 4, 1, 1))


# the pointers a call's arrays and scratch take (its own each call) and the scratch's sizes (the gaps between)
_PER_CALL = ("dq", "dk", "dv", "dq_accum", "dpsum", "dq_semaphore")


def _launched(record, arch) -> tuple:
    """A launch's kernel, grid, BwdParams bytes with the per-call pointers zeroed, and its scratch's sizes."""
    data = bytearray(record["params"])
    for field, off in backward.layout(arch, varlen=True)[0]:
        if field.name in _PER_CALL:
            data[off:off + 8] = bytes(8)
    f = _fields(record, arch)
    return (record["name"], record["grid"], bytes(data), f["dpsum"] - f["dq_accum"],
            f["dq_semaphore"] and f["dq_semaphore"] - f["dpsum"])


@pytest.mark.parametrize("arch", ["sm80", "sm90"])
@pytest.mark.parametrize("deterministic", [False, True])
def test_a_hit_with_other_totals_launches_what_a_new_plan_would(vbwd, monkeypatch, arch, deterministic):
    """A plan serves calls with other token totals (the same sequences count and max_seqlen bounds): each hit
    launches the kernels, grids, BwdParams (the totals, the maps of its tensors over its totals) and scratch
    sizes that a plan built for that call launches."""
    import hashlib

    from facodegen.runtime import tma
    monkeypatch.setattr(tma, "encode", lambda args: hashlib.sha512(repr(args).encode()).digest() * 2)
    recs = vbwd.bwd.records
    _call(_problem(), arch=arch, deterministic=deterministic, causal=True)
    for lengths_q, lengths_k in (((3, 40, 0, 77), (9, 1, 300, 15)), ((100, 1, 1, 16), (5, 17, 3, 290)),
                                 ((65, 65, 65, 65), (257, 257, 257, 257)), ((1, 0, 0, 70), (260, 0, 0, 1)),
                                 ((1, 0, 0, 0), (0, 0, 1, 0))):     # (one token: the maps' row stride too)
        a = dict(_problem(lengths_q, lengths_k), max_seqlen_q=100, max_seqlen_k=300)    # (the first call's bounds)
        n = len(recs)
        _call(a, arch=arch, deterministic=deterministic, causal=True)
        assert varlen_backward._PLANS.misses == 1, (lengths_q, lengths_k)
        monkeypatch.setattr(varlen_backward, "_PLANS", backward.PlanCache())     # the same call on a new plan
        _call(a, arch=arch, deterministic=deterministic, causal=True)
        assert [_launched(r, arch) for r in recs[n:n + 3]] == [_launched(r, arch) for r in recs[n + 3:]]


@pytest.mark.parametrize("arch", ["sm80", "sm90"])
def test_threads_with_other_totals_share_the_plan(vbwd, monkeypatch, arch):
    """Four threads, each calling with totals of its own (more than the plan keeps grids and images of), share
    one plan: every call's three launches come in order with its own totals in BwdParams (sm90: maps encoded
    for them), nothing raises."""
    import threading

    from facodegen.runtime import tma
    monkeypatch.setattr(tma, "encode", lambda args: repr(args.dims).encode().ljust(128, b"\0")[:128])
    problems = [dict(_problem((1, 17, 0, 100 - i), (5, 17, 3, 300 - i)), max_seqlen_q=100, max_seqlen_k=300)
                for i in range(24)]
    _call(problems[0], arch=arch)
    vbwd.bwd.yield_in_launch = True
    errors = []

    def run(first):
        try:
            for i in range(first, first + 60):
                _call(problems[i % len(problems)], arch=arch)
        except Exception as err:  # noqa: BLE001
            errors.append(err)
    threads = [threading.Thread(target=run, args=(6 * n,)) for n in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert errors == [] and varlen_backward._PLANS.misses == 1
    recs = vbwd.bwd.records[3:]
    spec = BackwardSpec(arch=arch, head_dim=D, gpu="h200", varlen=True)
    assert len(recs) == 3 * 240 and [r["name"] for r in recs] == list(spec.kernel_names) * 240
    for pre, main, post in zip(recs[0::3], recs[1::3], recs[2::3]):
        f = _fields(main, arch)
        assert _fields(pre, arch)["seqlen_q"] == f["seqlen_q"] == _fields(post, arch)["seqlen_q"]
        assert f["seqlen_k"] - f["seqlen_q"] == 325 - 118       # (each problem: total_k - total_q = 207)
        if arch == "sm90":
            off = {fl.name: o for fl, o in backward.layout("sm90", varlen=True)[0]}["tma_q"]
            assert main["params"][off:off + 128].rstrip(b"\0") == repr((D, f["seqlen_q"], HQ, 1)).encode()


def test_a_hit_refuses_arrays_that_disagree_on_the_totals(vbwd):
    """The key leaves the totals out, so a hit checks that the arrays agree on them: one that does not goes
    the checked path, whose error names it."""
    a = _problem()
    _call(a, arch="sm80")
    short = FakeTensor((117, HQ, D), "bfloat16")
    for name, words in (("do", "do"), ("out", "out"), ("dq", "dq")):
        with pytest.raises(ValueError, match=words):
            _call(dict(a, **{name: short}), arch="sm80")
    with pytest.raises(ValueError, match="lse"):
        _call(dict(a, lse=FakeTensor((HQ, 117), "float32")), arch="sm80")
    with pytest.raises(ValueError, match="v"):
        _call(dict(a, v=FakeTensor((324, HKV, D), "bfloat16")), arch="sm80")
    assert varlen_backward._PLANS.misses == 1


@pytest.mark.parametrize("arch", ["sm80", "sm90"])
def test_deterministic_varlen_call_keeps_a_turn_counter_per_query_block(vbwd, arch):
    """deterministic: ceil(total_q / block_m) + sequences counters per query head after the row stats,
    which the preprocess zeroes (sm80: its grid covers them where they outnumber the rows; sm90: each
    sequence's at its padded blocks, as its stat rows)."""
    a = _problem(lengths_q=(1, 1, 1, 1, 1, 1), lengths_k=(64,) * 6)
    _call(a, deterministic=True, arch=arch)
    spec = BackwardSpec(arch=arch, head_dim=D, gpu="h200", varlen=True, deterministic=True)
    pre, main, _ = vbwd.bwd.records
    assert main["name"] == spec.variant and not spec.dq_tma_reduce
    f = _fields(main, arch)
    turns = varlen_padded_blocks(spec, 6, 6)
    stats = HQ * 6 if arch == "sm80" else 2 * HQ * turns * 64
    assert f["dq_semaphore"] - f["dpsum"] == 4 * stats
    assert turns == 1 + 6 and backward.semaphore_ints(spec, 6, HQ, 6) == HQ * turns
    if arch == "sm80":
        assert pre["grid"] == (1, HQ, 1) and 16 >= turns    # 16 rows a preprocess CTA at head_dim 128
    else:       # per sequence: max_seqlen_q's 1 row rounded up to 64, 24 rows a CTA
        assert pre["grid"] == (3, HQ, 6)
    source = backward.emit(spec)
    assert ("stat_row0 / BLOCK_M + row / BLOCK_M] = 0;" in source) == (arch == "sm90")


@pytest.mark.parametrize("seed", range(5))
def test_varlen_turn_counters_are_distinct_and_in_range(seed):
    """varlen_turn_block: each sequence's query blocks from (first token + index x block_m) // block_m on
    never meet another sequence's and stay below varlen_padded_blocks, empty sequences among them."""
    rng = np.random.default_rng(seed)
    for block_m in (64, 128):
        spec = BackwardSpec(head_dim=64, varlen=True, deterministic=True, block_m=block_m, block_n=64)
        lengths = rng.choice([0, 1, 17, 63, 64, 65, 128, 129, 1000], size=rng.integers(1, 12))
        starts = [0, *itertools.accumulate(lengths)]
        total = starts[-1]
        taken = []
        for b, length in enumerate(lengths):
            first = (starts[b] + b * block_m) // block_m
            taken += [first + m for m in range(-(-int(length) // block_m))]
        assert len(taken) == len(set(taken)) and all(0 <= t < varlen_padded_blocks(spec, len(lengths), total)
                                                     for t in taken)


@pytest.mark.parametrize("changes, kw, error, words", [
    (dict(lse=FakeTensor((HQ, 117), "float32")), {}, ValueError, "lse must be a contiguous (heads_q, total_q)"),
    (dict(lse=FakeTensor((1, HQ, 118), "float32")), {}, ValueError, "lse must be a contiguous (heads_q, total_q)"),
    (dict(lse=FakeTensor((HQ, 118), "bfloat16")), {}, TypeError, "lse must be a float32"),
    (dict(do=FakeTensor((118, HQ, 64))), {}, ValueError, "do has shape"),
    (dict(out=FakeTensor((118, HQ, D), "float16")), {}, TypeError, "out must be a torch bfloat16"),
    (dict(q=FakeTensor((1, 118, HQ, D))), {}, ValueError, "q must be 3-D (total_tokens"),
    (dict(q=FakeTensor((118, HQ, 84)), do=FakeTensor((118, HQ, 84)), out=FakeTensor((118, HQ, 84)),
          k=FakeTensor((325, HKV, 84)), v=FakeTensor((325, HKV, 84))), {}, ValueError,
     "head_dim (q.shape[3]) 84 is not supported: it must be a multiple of 8"),
    (dict(v=FakeTensor((325, HKV, 64))), {}, ValueError, "k and v must have the same shape"),
    (dict(cu_seqlens_k=FakeTensor((5,), "int64")), {}, TypeError, "cu_seqlens_k has dtype int64"),
    (dict(cu_seqlens_k=FakeTensor((4,), "int32")), {}, ValueError, "cu_seqlens_k has shape (4,)"),
    (dict(max_seqlen_k=300.0), {}, TypeError, "max_seqlen_k must be a host int"),
    (dict(max_seqlen_q=-2), {}, ValueError, "max_seqlen_q must be >= 0"),
    ({}, dict(dk=FakeTensor((325, HQ, D))), ValueError, "dk has shape"),
    ({}, dict(causal=1), TypeError, "causal must be True or False"),
    ({}, dict(arch="sm90", persistent=True), SpecError, "the sm90 varlen backward runs one CTA per tile"),
    ({}, dict(varlen=True), ValueError, "varlen is attention_varlen_backward's own switch"),
    ({}, dict(block_n=72), SpecError, "block_n"),
])
def test_argument_errors_name_the_argument(vbwd, changes, kw, error, words):
    with pytest.raises(error) as err:
        _call({**_problem(), **changes}, **kw)
    assert words in str(err.value)


def test_fp8_has_no_varlen_backward(vbwd):
    a = _problem(dtype="float8_e4m3fn")
    with pytest.raises(TypeError, match="q has dtype float8_e4m3fn; supported: float16, bfloat16"):
        _call(dict(a, lse=FakeTensor((HQ, 118), "float32")))


# ------------------------------------------------------------------ the float64 reference

@pytest.mark.parametrize("causal", [False, True])
def test_varlen_backward_reference_is_the_gradient_of_varlen_reference(causal):
    """Central differences of sum(O * dO) through varlen_reference (an empty query sequence, a
    sequence with no keys, q longer than k, GQA) against varlen_backward_reference."""
    rng = np.random.default_rng(7 + causal)
    cu_q, cu_k = np.array([0, 3, 3, 5, 9]), np.array([0, 2, 4, 4, 7])
    q, do = rng.standard_normal((9, 2, 4)), rng.standard_normal((9, 2, 4))
    k, v = rng.standard_normal((7, 1, 4)), rng.standard_normal((7, 1, 4))
    scale = 0.7

    def loss(q, k, v):
        return float((varlen_reference(q, k, v, cu_q, cu_k, causal, scale)[0] * do).sum())

    grads = varlen_backward_reference(do, q, k, v, cu_q, cu_k, causal, scale)
    h = 1e-6
    for i, (name, x) in enumerate((("q", q), ("k", k), ("v", v))):
        numeric = np.zeros_like(x)
        for idx in np.ndindex(x.shape):
            args = [q.copy(), k.copy(), v.copy()]
            args[i][idx] += h
            up = loss(*args)
            args[i][idx] -= 2 * h
            numeric[idx] = (up - loss(*args)) / (2 * h)
        np.testing.assert_allclose(grads[i], numeric, atol=1e-6, err_msg=name)
    assert not grads[0][3:5].any()      # sequence 2's queries have no key: no gradient


# ------------------------------------------------------------------ autograd (meta tensors)

torch = pytest.importorskip("torch")


def meta(*shape, dtype=torch.bfloat16, grad=True):
    return torch.empty(*shape, dtype=dtype, device="meta").requires_grad_(grad)


class MetaVarlen:
    """Stand-ins for the varlen forward and backward launches on meta tensors, recording their arguments."""

    def __init__(self):
        self.forwards, self.backwards = [], []

    def forward(self, q, k, v, cu_q, cu_k, max_q, max_k, **kw):
        assert not torch.is_grad_enabled()
        made = torch.empty_like(q), q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)
        self.forwards.append(dict(q=q, k=k, v=v, cu_q=cu_q, cu_k=cu_k, max_q=max_q, max_k=max_k, made=made, **kw))
        return made if kw.get("return_lse") else made[0]

    def backward(self, do, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, **kw):
        self.backwards.append(dict(do=do, q=q, k=k, v=v, out=out, lse=lse, cu_q=cu_q, cu_k=cu_k, max_q=max_q,
                                   max_k=max_k, **kw))
        grads = q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)
        sinks = kw.get("sinks")
        return grads if sinks is None else (*grads, sinks.new_empty(sinks.shape))


@pytest.fixture
def meta_varlen(monkeypatch):
    from facodegen.ops import varlen
    launches = MetaVarlen()
    monkeypatch.setattr(varlen, "attention_varlen", launches.forward)        # what _VarlenAttention calls
    monkeypatch.setattr(varlen_backward, "attention_varlen_backward", launches.backward)
    return launches


def _boundaries():
    return (torch.empty(4, dtype=torch.int32, device="meta"), torch.empty(4, dtype=torch.int32, device="meta"))


def test_attention_varlen_records_its_backward(meta_varlen):
    """A call on tensors that require grad records _VarlenAttention: the no-grad forward with the LSE,
    and a backward that passes O, the LSE and the call's boundaries, lengths, mask and scale to
    attention_varlen_backward (arch None: its default, whatever the forward's); the LSE takes none."""
    q, k, v = meta(100, 8, 128), meta(77, 2, 128), meta(77, 2, 128)
    cu_q, cu_k = _boundaries()
    out, lse = facodegen.attention_varlen(q, k, v, cu_q, cu_k, 60, 50, causal=True, softmax_scale=0.1,
                                          return_lse=True, arch="sm90", block_n=64)
    assert type(out.grad_fn).__name__ == "_VarlenAttentionBackward" and not lse.requires_grad
    [fwd] = meta_varlen.forwards
    assert (fwd["causal"], fwd["softmax_scale"], fwd["return_lse"], fwd["arch"], fwd["block_n"]) == \
        (True, 0.1, True, "sm90", 64)
    out.float().sum().backward()
    [back] = meta_varlen.backwards
    assert torch._C._is_alias_of(back["out"], fwd["made"][0]) and torch._C._is_alias_of(back["lse"], fwd["made"][1])
    assert back["q"] is q and back["cu_q"] is cu_q and back["cu_k"] is cu_k and (back["max_q"], back["max_k"]) == (60, 50)
    assert {n: x for n, x in back.items() if n in ("causal", "softmax_scale", "arch")} == \
        {"causal": True, "softmax_scale": 0.1, "arch": None} and "block_n" not in back
    assert q.grad.shape == q.shape and k.grad.shape == k.shape and v.grad.shape == v.shape


def test_varlen_backward_is_deterministic_under_torch_use_deterministic_algorithms(meta_varlen):
    q = meta(16, 2, 64)
    out = facodegen.attention_varlen(q, q.detach(), q.detach(), *_boundaries(), 8, 8)
    torch.use_deterministic_algorithms(True)
    try:
        out.float().sum().backward()
    finally:
        torch.use_deterministic_algorithms(False)
    assert meta_varlen.backwards[0]["deterministic"] is True


@pytest.mark.parametrize("deterministic", [False, True])
def test_flash_attn_varlen_func_records_the_backward_too(meta_varlen, deterministic):
    """flash_attn_varlen_func's deterministic is FlashAttention's: the backward's."""
    q = meta(16, 2, 64)
    out = facodegen.flash_attn_varlen_func(q, q.detach(), q.detach(), *_boundaries(), 8, 8, causal=True,
                                           deterministic=deterministic)
    out.float().sum().backward()
    [back] = meta_varlen.backwards
    assert back["causal"] is True and back.get("deterministic", False) is deterministic


@pytest.mark.parametrize("variant", [dict(window_size=(8, 0)), dict(softcap=20.0),
                                     dict(window_size=(3, 5), softcap=50.0), dict(sinks="meta")],
                         ids=["window", "softcap", "both", "sinks"])
def test_the_variants_record_their_varlen_backward(meta_varlen, variant):
    """attention_varlen with a window, softcap or sinks on tensors that require grad: the forward takes them, and so
    does its recorded attention_varlen_backward (the sm80 LOCAL / SOFTCAP / SINKS kernels, each sequence's own
    diagonal); the sinks, an input of the recording, take the gradient it returns."""
    q = meta(16, 2, 64)
    variant = dict(variant)
    if variant.get("sinks") == "meta":
        variant["sinks"] = meta(2, dtype=torch.float32)
    facodegen.attention_varlen(q, q.detach(), q.detach(), *_boundaries(), 8, 8, causal=True,
                               **variant).float().sum().backward()
    [fwd], [back] = meta_varlen.forwards, meta_varlen.backwards
    want = {"window_size": tuple(variant.get("window_size", (-1, -1))), "softcap": variant.get("softcap", 0.0)}
    assert {n: fwd[n] for n in want} == want and {n: back[n] for n in want} == want and back["causal"] is True
    sinks = variant.get("sinks")
    assert fwd["sinks"] is sinks and back["sinks"] is sinks
    if sinks is not None:
        assert sinks.grad is not None and sinks.grad.shape == (2,)


@pytest.mark.parametrize("kw, q_shape, v_dim, dtype, words", [
    (dict(out="new"), (16, 2, 64), 64, torch.bfloat16, "out="),
    ({}, (16, 2, 128), 64, torch.bfloat16, "head_dim_v=64"),
    ({}, (16, 2, 64), 64, torch.float8_e4m3fn, "fp8"),
])
def test_what_has_no_backward_raises_at_the_forward(meta_varlen, kw, q_shape, v_dim, dtype, words):
    q = meta(*q_shape, dtype=dtype)
    v = meta(q_shape[0], q_shape[1], v_dim, dtype=dtype, grad=False)
    if kw.get("out") == "new":
        kw = dict(out=torch.empty_like(q.detach()))
    with pytest.raises(NotImplementedError) as err:
        facodegen.attention_varlen(q, q.detach(), v, *_boundaries(), 8, 8, **kw)
    assert words in str(err.value) and "facodegen.attention_varlen" in str(err.value)
    assert not meta_varlen.forwards


# ------------------------------------------------------------------ the benchmark script (its CPU parts)

def test_bench_varlen_backward_counts_real_work_and_tabulates_ratios_to_fa2():
    from facodegen.bench import varlen_backward_suite as bench
    c = bench.vs.cells(quick=True, causal=True)[0]
    assert bench.backward_tflops(c, 1.0) == pytest.approx(2.5 * c["flops"] / 1e-3 / 1e12)
    rows = [{**c, "results": {"facodegen autograd": {"ms": 2.0, "tflops": 10.0}, "FA2 varlen (NJT)": {"ms": 3.0,
                                                                                                       "tflops": 6.7},
                              "facodegen sm80": {"why": "RuntimeError: no kernel image"}}}]
    table = bench.format_table(rows)
    assert "autograd 1.50x" in table and "RuntimeError: no kernel image" in table and "| 10.0 |" in table


# ------------------------------------------------------------------ hostile boundaries

@pytest.mark.parametrize("cu_q, cu_k, words", [
    ([-1, 5, 10], [0, 5, 10], "cu_seqlens_q[0] = -1 is negative"),
    ([0, 7, 5], [0, 5, 10], "cu_seqlens_q decreases at sequence 1"),
    ([0, 5, 10], [0, 5, 12], "cu_seqlens_k[-1] = 12 is past the 10 packed tokens"),
    ([0, 1, 10], [0, 5, 10], "sequence 1 has 9 tokens (cu_seqlens_q[2] - cu_seqlens_q[1]) but max_seqlen_q is 8"),
    ([0, 5, 10], [0, 0, 10], "sequence 1 has 10 tokens (cu_seqlens_k[2] - cu_seqlens_k[1]) but max_seqlen_k is 8"),
])
def test_check_inputs_refuses_boundaries_that_are_not_the_packed_tokens(cu_q, cu_k, words):
    from facodegen.ops import varlen
    with pytest.raises(ValueError) as err:
        varlen.check_boundaries(cu_q, cu_k, 10, 10, 8, 8)
    assert words in str(err.value)
    varlen.check_boundaries([0, 5, 10], [2, 3, 10], 10, 10, 8, 8)    # (need not start at 0 nor cover every token)


def test_every_varlen_kernel_reads_cu_seqlens_through_the_clamp():
    """Hostile cu_seqlens (decreasing, negative, past the packed tokens) never reach an address: every
    varlen kernel, forward and backward on both archs, takes a sequence's start and length from seq_span
    (clamped into the packed tokens), but for the sm80 forward's raw re-read of the start, whose tile returns
    where that start lies outside them."""
    from facodegen import KernelSpec
    from facodegen.codegen.render import emit
    sources = [emit(KernelSpec(arch=a, head_dim=128, dtype=t, causal=True, varlen=True, **k))
               for a, t, k in (("sm80", "bf16", {}), ("sm90", "bf16", {}), ("sm90", "bf16", dict(persistent=False)),
                               ("sm90", "fp8", dict(v_layout="row")))]
    sources += [backward.emit(BackwardSpec(arch=a, head_dim=128, causal=True, varlen=True, **k))
                for a, k in (("sm80", {}), ("sm80", dict(deterministic=True)), ("sm90", {}), ("sm90", dict(deterministic=True)),
                             ("sm90", dict(dq_tma_reduce=False)))]
    for source in sources:
        assert "SeqSpan seq_span(" in source
        raw = re.findall(r"p\.cu_seqlens_[qk]\[[^\]]*\]", source)
        assert raw == (["p.cu_seqlens_q[opaque(sequence)]"] if "flash_fwd_sm80" in source.split("\n", 2)[1] else []), raw
    sm80 = sources[0]
    assert "static_cast<unsigned>(q_start()) > static_cast<unsigned>(p.total_q)) return;" in sm80
