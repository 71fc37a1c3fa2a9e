"""attention_with_kvcache on a GPU against the float64 reference (facodegen.verify.reference.kvcache_reference)
with FlashAttention-3's criterion: the largest error of O is at most twice that of a same-precision
computation plus twice the dtype's rounding of the reference; the LSE within 1e-3 + 1e-4 |lse|; rows
with no visible key exactly O = 0 and LSE = -inf. Outputs are NaN-poisoned before each call.

Covers: contiguous and paged caches (page 16/64/256, pages shuffled), cache_seqlens 0, 1, at page
boundaries and at the capacity, GQA 1/4/8, num_splits 0 (heuristic), 1 and > 1, seqlen_q 1 and > 1
(causal and not), append (incl. tokens past the capacity, dropped), hostile lengths and page tables
(clamped, same as the reference), LSE, CuPy and torch, CUDA-graph replay with lengths changed on the
device, and the host cost of a warm call; sliding windows and softcap (issue 40). The correctness cases run twice, the splits merged by the
combine kernel and by the decode kernel itself (fused_combine: the last split CTA of each work item;
its counters must be back at zero after every call: calls in a row, graph replays). The kernels are
compiled up front in parallel (~20 specs, and their fused twins).
"""

from __future__ import annotations


import numpy as np
import pytest

import facodegen
from facodegen.spec import decode as dec
from facodegen.verify.fuzz import attention_torch, fa3_bound
from facodegen.verify.reference import kvcache_reference

torch = pytest.importorskip("torch")
HAVE_GPU = torch.cuda.is_available()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not HAVE_GPU, reason="needs a CUDA GPU (torch.cuda)")]

DT = {"bf16": torch.bfloat16, "fp16": torch.float16}
# The split merge: the combine kernel (default) or the decode kernel's last split CTA (fused_combine).
FUSED = pytest.mark.parametrize("fused", [False, True], ids=["combine", "fused"])


def _arch():
    return "sm90" if torch.cuda.get_device_capability() == (9, 0) else "sm80"


@pytest.fixture(scope="module", autouse=True)
def precompiled():
    """Compile the kernels these tests run, in parallel (decode.compile_many)."""
    if not HAVE_GPU:
        return
    arch = _arch()
    cc = torch.cuda.get_device_capability()
    sm = f"sm_{cc[0]}{cc[1]}"
    specs = set()
    for dtype in ("bf16", "fp16"):
        for d in (64, 128, 256):
            for group, sq in ((1, 1), (4, 1), (8, 1), (4, 4), (1, 4)):
                for paged in (False, True):
                    for split, fused in ((False, False), (True, False), (True, True)):
                        specs.add(dec.default_decode_spec(arch, dtype, d, seqlen_q=sq, group=group, paged=paged,
                                                          split=split, fused_combine=fused))
            if dtype == "bf16" and d == 128:       # test_window_and_softcap's
                for paged in (False, True):
                    for split, fused in ((False, False), (True, False), (True, True)):
                        for variant in (dict(local=True), dict(softcap=True), dict(local=True, softcap=True)):
                            specs.add(dec.default_decode_spec(arch, dtype, d, seqlen_q=4, group=4, paged=paged,
                                                              split=split, fused_combine=fused, **variant))
            if arch == "sm90" and dtype == "bf16":     # test_producer_warps'
                for paged in (False, True):
                    for split, fused in ((False, False), (True, True)):
                        for sq, group in ((1, 8), (4, 2)):
                            for warps in (1, 2):
                                specs.add(dec.default_decode_spec(arch, dtype, d, seqlen_q=sq, group=group,
                                                                  paged=paged, split=split, fused_combine=fused,
                                                                  producer_warps=warps))
            specs.add(dec.CombineSpec(dtype=dtype, head_dim=d))
        if dtype == "bf16":     # test_padded_head_dims'
            for d, paged, sq in ((80, False, 1), (80, True, 4), (8, True, 1), (112, False, 2), (200, True, 1),
                                 (40, False, 16)):
                for split, fused in ((False, False), (True, False), (True, True)):
                    specs.add(dec.default_decode_spec(arch, dtype, d, seqlen_q=sq, group=4, paged=paged, split=split,
                                                      fused_combine=fused))
                specs.add(dec.CombineSpec(dtype=dtype, head_dim=d))
                specs.add(dec.AppendSpec(dtype=dtype, head_dim=d, paged=paged))
            specs.add(dec.AppendSpec(dtype=dtype, head_dim=d, paged=False))
            specs.add(dec.AppendSpec(dtype=dtype, head_dim=d, paged=True))

    dec.compile_many(sorted(specs, key=lambda s: s.variant), sm_of=lambda s: None if s.kernel == "decode" else sm,
                     threads=16)


def make_case(*, dtype="bf16", batch=3, seqlen_q=1, heads_q=8, heads_kv=2, d=128, capacity=1024, page_size=0,
              lengths=None, new=0, seed=0):
    """Random q, cache (contiguous, or paged with the pages shuffled), lengths, new tokens."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    dt = DT[dtype]

    def randn(*shape):
        return torch.randn(*shape, generator=g, device="cuda", dtype=torch.float32).to(dt)
    q = randn(batch, seqlen_q, heads_q, d)
    k_full, v_full = randn(batch, capacity, heads_kv, d), randn(batch, capacity, heads_kv, d)
    table = None
    if page_size:
        per_seq = capacity // page_size
        pages = batch * per_seq
        perm = torch.randperm(pages, generator=torch.Generator().manual_seed(seed)).to("cuda")
        table = perm.view(batch, per_seq).to(torch.int32)
        k_cache = torch.empty(pages, page_size, heads_kv, d, dtype=dt, device="cuda")
        v_cache = torch.empty_like(k_cache)
        k_cache[table.view(-1).long()] = k_full.view(pages, page_size, heads_kv, d)
        v_cache[table.view(-1).long()] = v_full.view(pages, page_size, heads_kv, d)
    else:
        k_cache, v_cache = k_full, v_full
    if lengths is None:
        lengths = [int(x) for x in torch.randint(0, capacity - new + 1, (batch,), generator=torch.Generator())]
    seqlens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    kn = vn = None
    if new:
        kn, vn = randn(batch, new, heads_kv, d), randn(batch, new, heads_kv, d)
    return {"q": q, "k_cache": k_cache, "v_cache": v_cache, "cache_seqlens": seqlens, "page_table": table,
            "k": kn, "v": vn}


def _np(x):
    return None if x is None else x.detach().double().cpu().numpy() if x.is_floating_point() else x.cpu().numpy()


def check_call(case, *, causal=True, num_splits=0, softmax_scale=None, window_size=(-1, -1), softcap=0.0, **knobs):
    """Run attention_with_kvcache on ``case`` (its caches are updated in place by an append) and
    check O, LSE and the caches against the float64 reference (with the call's window and softcap)."""
    q = case["q"]
    dt = q.dtype
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    variants = dict(window_size=window_size, softcap=softcap)
    ref_o, ref_lse, ref_kc, ref_vc = kvcache_reference(
        _np(q), _np(case["k_cache"]), _np(case["v_cache"]), _np(case["cache_seqlens"]),
        page_table=_np(case["page_table"]), k=_np(case["k"]), v=_np(case["v"]), causal=causal, softmax_scale=scale,
        **variants)
    out = torch.full_like(q, float("nan"))
    got, lse = facodegen.attention_with_kvcache(
        q, case["k_cache"], case["v_cache"], case["cache_seqlens"], page_table=case["page_table"], k=case["k"],
        v=case["v"], causal=causal, softmax_scale=softmax_scale, num_splits=num_splits, return_lse=True, out=out,
        **variants, **knobs)
    torch.cuda.synchronize()
    assert got is out
    o = out.double().cpu().numpy()
    lse = lse.double().cpu().numpy()
    assert np.isfinite(o).all(), "O has NaN/inf (an element never written?)"
    # the caches after the append
    np.testing.assert_array_equal(_np(case["k_cache"]), ref_kc)
    np.testing.assert_array_equal(_np(case["v_cache"]), ref_vc)
    # rows with no visible key
    empty = np.isneginf(ref_lse)                                   # (batch, heads_q, seqlen_q)
    assert np.array_equal(np.isneginf(lse), empty), "LSE -inf rows differ"
    assert (o.transpose(0, 2, 1, 3)[empty] == 0).all(), "rows with no key must be 0"
    fin = ~empty
    assert (np.abs(lse[fin] - ref_lse[fin]) <= 1e-3 + 1e-4 * np.abs(ref_lse[fin])).all(), \
        f"LSE max err {np.abs(lse[fin] - ref_lse[fin]).max():.3e}"
    # O: FlashAttention-3's criterion, per sequence (its own number of keys)
    batch = q.shape[0]
    capacity = ref_kc.shape[1] if case["page_table"] is None else case["page_table"].shape[1] * ref_kc.shape[1]
    new = 0 if case["k"] is None else case["k"].shape[1]
    lengths = _np(case["cache_seqlens"])
    for b in range(batch):
        seqlen_k = min(int(np.clip(lengths[b], 0, capacity)) + new, capacity)
        if seqlen_k == 0:
            continue
        if case["page_table"] is None:
            keys, values = ref_kc[b, :seqlen_k], ref_vc[b, :seqlen_k]
        else:
            table = _np(case["page_table"])
            pos = np.arange(seqlen_k)
            pages = np.clip(table[b, pos // ref_kc.shape[1]], 0, ref_kc.shape[0] - 1)
            keys, values = ref_kc[pages, pos % ref_kc.shape[1]], ref_vc[pages, pos % ref_kc.shape[1]]
        kt = torch.from_numpy(keys).to("cuda", dt)[None]
        vt = torch.from_numpy(values).to("cuda", dt)[None]
        low, _ = attention_torch(q[b:b + 1], kt, vt, causal, scale, upcast=False, **variants)
        ref = torch.from_numpy(ref_o[b:b + 1]).to("cuda")
        bound = fa3_bound(ref, low.double().nan_to_num(0.0), dt)
        err = np.abs(o[b] - ref_o[b]).max()
        assert err <= bound + 1e-6, f"sequence {b} ({seqlen_k} keys): max err {err:.3e} > bound {bound:.3e}"


# ------------------------------------------------------------------ the matrix

@FUSED
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("page_size", [0, 64])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_decode_one_query(d, page_size, group, fused):
    if d != 128 and group != 4:
        pytest.skip("GQA 1/8 run at d128 only (time)")
    lengths = [0, 1, 64, 1023] if page_size else [0, 1, 513, 1024]
    case = make_case(batch=4, heads_q=8, heads_kv=8 // group, d=d, capacity=1024, page_size=page_size,
                     lengths=lengths, seed=d + group)
    check_call(case, fused_combine=fused)


@FUSED
@pytest.mark.parametrize("d, page_size, num_splits, seqlen_q, new", [(80, 0, 0, 1, 0), (80, 64, 5, 4, 3),
                                                                    (8, 16, 1, 1, 1), (112, 0, 16, 2, 0),
                                                                    (200, 64, 0, 1, 2), (40, 0, 3, 16, 0)])
def test_padded_head_dims(d, page_size, num_splits, seqlen_q, new, fused):
    """A head_dim between the tiles (the next tile's kernel, padded inside it): O and LSE against float64, the
    split partials d wide (the combine kernel's and the fused merge's rows), appends of d-wide rows; O into a
    d-column view of a NaN-filled buffer 16 columns wider, whose columns past d stay NaN."""
    case = make_case(batch=3, seqlen_q=seqlen_q, heads_q=8, heads_kv=2, d=d, capacity=1024, page_size=page_size,
                     lengths=[0, 1, 700] if page_size else [1, 513, 1000], new=new, seed=d + seqlen_q)
    check_call(case, num_splits=num_splits, fused_combine=fused)
    q = case["q"]
    wide = torch.full((*q.shape[:3], d + 16), float("nan"), device="cuda", dtype=q.dtype)
    facodegen.attention_with_kvcache(q, case["k_cache"], case["v_cache"], case["cache_seqlens"],
                                     page_table=case["page_table"], num_splits=num_splits, out=wide[..., :d],
                                     fused_combine=fused)
    torch.cuda.synchronize()
    assert torch.isnan(wide[..., d:]).all() and torch.isfinite(wide[..., :d]).all()


@FUSED
@pytest.mark.parametrize("num_splits", [1, 3, 16, 128])
def test_num_splits(num_splits, fused):
    case = make_case(batch=2, heads_q=32, heads_kv=8, capacity=4096, lengths=[4096, 777], seed=num_splits)
    check_call(case, num_splits=num_splits, fused_combine=fused)


@FUSED
@pytest.mark.parametrize("page_size", [16, 256])
def test_page_sizes_and_boundaries(page_size, fused):
    capacity = 2048
    lengths = [page_size - 1, page_size, page_size + 1, capacity]
    case = make_case(batch=4, heads_q=16, heads_kv=2, capacity=capacity, page_size=page_size, lengths=lengths)
    check_call(case, fused_combine=fused)
    check_call(case, num_splits=16, fused_combine=fused)      # (the heuristic may not split: 16 do)


@pytest.mark.skipif(HAVE_GPU and torch.cuda.get_device_capability() != (9, 0), reason="producer_warps is sm90's")
@pytest.mark.parametrize("producer_warps", [1, 2])
@pytest.mark.parametrize("d, page_size", [(256, 16), (256, 0), (128, 16), (64, 64)])
@pytest.mark.parametrize("seqlen_q, group", [(1, 8), (4, 2)])
def test_producer_warps(d, page_size, producer_warps, seqlen_q, group):
    """Warps that only copy (mbarrier ring): lengths at page and block edges, an empty sequence, pages out
    of order, one CTA per sequence and 16 splits (fused), seqlen_q 4 with its causal rows."""
    capacity = 2048
    lengths = [0, 1, 63, 65, capacity - 1, capacity] if page_size == 0 else \
        [0, 1, page_size - 1, page_size + 1, 1000, capacity]
    case = make_case(batch=len(lengths), seqlen_q=seqlen_q, heads_q=16, heads_kv=16 // group, d=d,
                     capacity=capacity, page_size=page_size, lengths=lengths, seed=d + page_size + producer_warps)
    check_call(case, num_splits=1, producer_warps=producer_warps)
    check_call(case, num_splits=16, fused_combine=True, producer_warps=producer_warps)


@FUSED
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("group", [1, 4])
def test_several_queries(causal, group, fused):
    # lengths below seqlen_q: the first rows of a causal sequence see no key
    case = make_case(batch=3, seqlen_q=4, heads_q=8, heads_kv=8 // group, capacity=512, lengths=[2, 100, 512],
                     seed=7)
    check_call(case, causal=causal, fused_combine=fused)


@FUSED
def test_sixteen_queries_gqa8_fp16(fused):
    case = make_case(dtype="fp16", batch=2, seqlen_q=16, heads_q=16, heads_kv=2, d=64, capacity=300,
                     lengths=[0, 299])
    check_call(case, num_splits=2, fused_combine=fused)


@FUSED
@pytest.mark.parametrize("page_size", [0, 64])
def test_append(page_size, fused):
    # the last sequence has room for one of its three new tokens: the others are dropped
    case = make_case(batch=3, seqlen_q=3, heads_q=8, heads_kv=2, capacity=512, page_size=page_size,
                     lengths=[0, 200, 511], new=3)
    check_call(case, fused_combine=fused)


@FUSED
def test_hostile_lengths_and_pages_are_clamped(fused):
    case = make_case(batch=4, heads_q=8, heads_kv=2, capacity=1024, page_size=64, lengths=[-5, 10 ** 9, 64, 3])
    table = case["page_table"]
    table[0, 0], table[2, 0], table[3, 0] = -100, 10 ** 6, table.numel() - 1
    check_call(case, fused_combine=fused)


@FUSED
def test_softmax_scale_and_knobs(fused):
    case = make_case(batch=2, heads_q=8, heads_kv=1, d=128, capacity=1000, lengths=[1000, 5])
    check_call(case, softmax_scale=0.3, block_n=128, stages=2, fused_combine=fused)
    check_call(case, pack_gqa=False, num_splits=4, fused_combine=fused)


@FUSED
@pytest.mark.parametrize("variant", [dict(window_size=(100, 0)), dict(window_size=(0, 0)), dict(window_size=(700, 3)),
                                     dict(softcap=5.0), dict(window_size=(257, -1), softcap=30.0)],
                         ids=["w100", "w0", "w700-3", "softcap", "w257-softcap"])
@pytest.mark.parametrize("page_size", [0, 16])
def test_window_and_softcap(variant, page_size, fused):
    """Issue 40's window with a (paged) KV cache, and softcap: against the float64 reference with the window
    on each sequence's bottom-right diagonal; lengths 0, 1, under the window, at page edges and the
    capacity; 4 queries (causal and not) x GQA 4, appended tokens; one split and several (a window's
    blocks divided among them), the heuristic's."""
    case = make_case(batch=4, seqlen_q=4, heads_q=8, heads_kv=2, capacity=2048, page_size=page_size,
                     lengths=[0, 1, 96, 2044], new=2, seed=11)
    for causal, num_splits in ((True, 0), (False, 5)):
        check_call(case, causal=causal, num_splits=num_splits, fused_combine=fused, **variant)


@pytest.mark.parametrize("page_size", [0, 64])
def test_fused_combine_calls_in_a_row_leave_the_counters_at_zero(page_size):
    """fused_combine's counters are zeroed once per stream's scratch and put back to zero by each work
    item's last split: calls in a row (other lengths, all-empty sequences, another split count's plan
    beside this one) are each right, and the counters read 0 after every call."""
    from facodegen.ops import kvcache
    case = make_case(batch=3, heads_q=32, heads_kv=8, capacity=2048, page_size=page_size, lengths=[2048, 0, 700])
    for lengths in ([2048, 0, 700], [0, 0, 0], [1, 2047, 64], [2048, 2048, 2048]):
        case["cache_seqlens"].copy_(torch.tensor(lengths, dtype=torch.int32))
        for splits in (0, 7, 0):
            check_call(case, num_splits=splits, fused_combine=True)
    plans = [p for p in kvcache._PLANS._plans.values() if p.specs["decode"].fused_combine]
    assert plans
    torch.cuda.synchronize()
    for plan in plans:
        for scratch in plan._scratch._streams.values():     # (the holder: the scratch's uint8 torch tensor)
            at = scratch.split_counters - scratch.holder.data_ptr()
            counters = scratch.holder[at:at + 4 * plan._counters].view(torch.int32)
            assert int(counters.abs().sum()) == 0, "a counter was left non-zero"


@pytest.mark.parametrize("page_size", [0, 64])
def test_a_repeated_step_takes_the_fast_path_and_matches_the_reference(page_size, monkeypatch):
    """The second call of a decode step finds its plan in attention_with_kvcache's own frame
    (DecodePlan.launch_step, the LSE from new_lse's template; both outputs allocated by the call): O and
    the LSE against float64, with other lengths in the same cache_seqlens tensor (a server's next step)."""
    from facodegen.ops import kvcache
    case = make_case(batch=3, heads_q=16, heads_kv=4, capacity=1024, page_size=page_size, lengths=[1024, 5, 600])
    args = (case["q"], case["k_cache"], case["v_cache"], case["cache_seqlens"])
    facodegen.attention_with_kvcache(*args, page_table=case["page_table"], return_lse=True)   # builds the plan
    steps = []
    real = kvcache.DecodePlan.launch_step
    monkeypatch.setattr(kvcache.DecodePlan, "launch_step", lambda self, *a: steps.append(a) or real(self, *a))
    for lengths in ([1, 1023, 0], [700, 64, 1024]):
        case["cache_seqlens"].copy_(torch.tensor(lengths, dtype=torch.int32))
        out, lse = facodegen.attention_with_kvcache(*args, page_table=case["page_table"], return_lse=True)
        ref_o, ref_lse, _, _ = kvcache_reference(_np(case["q"]), _np(case["k_cache"]), _np(case["v_cache"]),
                                                 _np(case["cache_seqlens"]), page_table=_np(case["page_table"]))
        assert np.abs(_np(out) - ref_o).max() < 2e-2
        finite = np.isfinite(ref_lse)
        assert (np.isneginf(_np(lse)) == ~finite).all() and np.abs(_np(lse)[finite] - ref_lse[finite]).max() < 1e-3
    assert len(steps) == 2


def test_cupy_fp16():
    cupy = pytest.importorskip("cupy")
    case = make_case(dtype="fp16", batch=2, heads_q=8, heads_kv=2, capacity=256, lengths=[256, 17])
    args = [cupy.asarray(case[n]) for n in ("q", "k_cache", "v_cache", "cache_seqlens")]
    out, lse = facodegen.attention_with_kvcache(*args, return_lse=True)
    ref_o, ref_lse, _, _ = kvcache_reference(*(cupy.asnumpy(a).astype(np.float64) if a.dtype != np.int32
                                               else cupy.asnumpy(a) for a in args))
    assert np.abs(cupy.asnumpy(out).astype(np.float64) - ref_o).max() < 2e-3
    assert np.abs(cupy.asnumpy(lse) - ref_lse).max() < 1e-3


@FUSED
def test_cuda_graph_replay_follows_the_lengths(fused):
    case = make_case(batch=2, heads_q=32, heads_kv=8, capacity=2048, lengths=[100, 2000])
    args = (case["q"], case["k_cache"], case["v_cache"], case["cache_seqlens"])
    kw = {"num_splits": 8, "fused_combine": fused}
    facodegen.attention_with_kvcache(*args, **kw)            # warm: plan, compile, workspace
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        facodegen.attention_with_kvcache(*args, **kw)        # the side stream's scratch (and zeroed counters)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        out = facodegen.attention_with_kvcache(*args, **kw)
    for lengths in ([1500, 7], [0, 2048], [1500, 7]):       # replays in a row: the counters are back at 0 each time
        case["cache_seqlens"].copy_(torch.tensor(lengths, dtype=torch.int32))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        ref_o, _, _, _ = kvcache_reference(_np(case["q"]), _np(case["k_cache"]), _np(case["v_cache"]),
                                           _np(case["cache_seqlens"]))
        assert np.abs(out.double().cpu().numpy() - ref_o).max() < 2e-2


def test_host_cost_of_a_warm_call():
    """A warm call takes the plan-cache hit: no timed call builds a plan, and its host time
    (bench.time_host_per_call's host_us: chunks of 100 calls after a synchronize, only the loop on
    the clock) stays far below a miss's. The figure itself is the benchmark's (scripts/
    host_cost_breakdown.py, on an idle host): this file runs beside 11 other pytest workers, and
    such a host read 59 us for a call the idle one times at 17 (H200, 2026-12-04)."""
    from facodegen import bench
    from facodegen.ops import kvcache
    case = make_case(batch=1, heads_q=32, heads_kv=8, capacity=512, page_size=64, lengths=[500])
    args = (case["q"], case["k_cache"], case["v_cache"], case["cache_seqlens"])
    for splits in (1, 2):
        kw = {"page_table": case["page_table"], "num_splits": splits}
        facodegen.attention_with_kvcache(*args, **kw)
        misses = kvcache._PLANS.misses
        t = bench.time_host_per_call(lambda: facodegen.attention_with_kvcache(*args, **kw), torch.cuda.synchronize,
                                     warmup=20, calls=500, repeats=3)
        print(f"host cost per warm call (paged, num_splits={splits}): {t['host_us']:.1f} us "
              f"(a loop's time per call: {t['loop_us']:.1f} us)")
        assert kvcache._PLANS.misses == misses, "a warm call built a plan (the key changed between calls)"
        assert t["host_us"] < 150, f"{t['host_us']:.1f} us per call (an idle H200 host: ~17)"


def _appended_rows(k_cache, lengths, table):
    """Row cache_seqlens[b] of each sequence (where a one-token append lands), (batch, heads_kv, d)."""
    batch = lengths.shape[0]
    if table is None:
        return k_cache[torch.arange(batch, device=lengths.device), lengths.long()]
    page = k_cache.shape[1]
    pages = table[torch.arange(batch, device=lengths.device), (lengths // page).long()]
    return k_cache[pages.long(), (lengths % page).long()]


@pytest.mark.parametrize("page_size", [0, 64])
@pytest.mark.parametrize("with_out", [False, True])
def test_torch_compile_decode_step_with_append_matches_eager(page_size, with_out):
    """torch.compile(fullgraph=True) of a decode step (append one token, attend, read the appended
    row back in the same graph: the op's cache mutation orders that read) is the eager call bit for bit."""
    case = make_case(batch=3, heads_q=32, heads_kv=8, capacity=1024, page_size=page_size, lengths=[0, 500, 1023],
                     new=1)
    table = case["page_table"]

    def step(q, k_cache, v_cache, lengths, k, v):
        out = torch.empty_like(q) if with_out else None
        o, lse = facodegen.attention_with_kvcache(q, k_cache, v_cache, lengths, page_table=table, k=k, v=v,
                                                  return_lse=True, out=out)
        return o, lse, _appended_rows(k_cache, lengths, table), _appended_rows(v_cache, lengths, table)

    def inputs():
        return (case["q"], case["k_cache"].clone(), case["v_cache"].clone(), case["cache_seqlens"], case["k"],
                case["v"])

    eager_in, compiled_in = inputs(), inputs()
    want = step(*eager_in)
    got = torch.compile(step, fullgraph=True)(*compiled_in)
    torch.cuda.synchronize()
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    assert torch.equal(compiled_in[1], eager_in[1]) and torch.equal(compiled_in[2], eager_in[2])
    assert torch.equal(got[2], case["k"][:, 0]) and torch.equal(got[3], case["v"][:, 0])   # the append landed
    assert not torch.equal(compiled_in[1], case["k_cache"])


@FUSED
def test_cuda_graph_replay_of_a_decode_step_with_append(fused):
    """The eager call with an append, captured once: each replay writes the new token at the
    lengths the device holds then, and attends over it."""
    case = make_case(batch=2, heads_q=32, heads_kv=8, capacity=2048, page_size=64, lengths=[100, 2000], new=1)
    args = (case["q"], case["k_cache"], case["v_cache"], case["cache_seqlens"])
    kw = {"page_table": case["page_table"], "k": case["k"], "v": case["v"], "fused_combine": fused}
    facodegen.attention_with_kvcache(*args, **kw)            # warm: plan, compile, workspace
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        facodegen.attention_with_kvcache(*args, **kw)        # the side stream's scratch
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        out = facodegen.attention_with_kvcache(*args, **kw)
    for lengths in ([1500, 7], [0, 2047]):
        case["cache_seqlens"].copy_(torch.tensor(lengths, dtype=torch.int32))
        before = (case["k_cache"].clone(), case["v_cache"].clone())
        graph.replay()
        torch.cuda.synchronize()
        ref_o, _, ref_kc, ref_vc = kvcache_reference(
            _np(case["q"]), _np(before[0]), _np(before[1]), _np(case["cache_seqlens"]),
            page_table=_np(case["page_table"]), k=_np(case["k"]), v=_np(case["v"]))
        assert np.abs(out.double().cpu().numpy() - ref_o).max() < 2e-2
        np.testing.assert_array_equal(_np(case["k_cache"]), ref_kc)
        np.testing.assert_array_equal(_np(case["v_cache"]), ref_vc)
        assert torch.equal(_appended_rows(case["k_cache"], case["cache_seqlens"], case["page_table"]),
                           case["k"][:, 0])
