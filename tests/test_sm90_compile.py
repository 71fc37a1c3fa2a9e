"""The sm90 FlashAttention-3 kernel compiles for sm_90a cleanly (CPU: NVRTC + cuobjdump, no GPU).

Clean means: no ptxas C75xx warning (C7508 setmaxnreg ignored, C7509/C7510/C7511/C7515 wgmma
serialised), no stack frame, no spills, and the SASS has the Hopper instructions the design
relies on: HGMMA (wgmma), UTMALDG/UTMASTG (TMA load/store), USETMAXREG (register split),
and no local-memory traffic (LDL/STL)."""

import re

import pytest

import facodegen
from facodegen import KernelSpec
from facodegen.spec import default_fp8_specs

compile_mod = pytest.importorskip("facodegen.runtime.compiler")

K = lambda **kw: KernelSpec(arch="sm90", **kw)  # noqa: E731

SPECS = [
    # defaults (bf16: fp16 differs only in the cvt/wgmma type suffix)
    K(head_dim=64), K(head_dim=64, causal=True), K(head_dim=96), K(head_dim=128),
    K(head_dim=128, causal=True), K(head_dim=192), K(head_dim=256, causal=True),
    # the overlap / pingpong / scheduler switches, ring depth, warpgroup counts
    K(head_dim=128, intra_wg_overlap=False, pingpong=False),
    K(head_dim=128, causal=True, intra_wg_overlap=False, persistent=False),
    K(head_dim=128, block_n=128, stages=3, dtype="fp16"),
    K(head_dim=96, consumer_warpgroups=1, block_n=176, stages=1, dtype="fp16"),
    K(head_dim=64, consumer_warpgroups=3, block_n=64, intra_wg_overlap=False),
    # O aliasing Q vs its own buffer, L2 hints off, pingpong on the dynamic (causal) scheduler
    K(head_dim=128, block_n=176), K(head_dim=128, separate_o=False, l2_hints=False),
    K(head_dim=128, causal=True, pingpong=True, separate_o=False),
    K(head_dim=64, causal=True, intra_wg_overlap=False, l2_hints=False),
    # clusters of two CTAs sharing K/V loads (TMA multicast), persistent and not
    K(head_dim=256, cluster_m=2), K(head_dim=128, cluster_m=2, persistent=False, l2_hints=False),
    # O staging tile over the V ring (FlashAttention-3's head_dim-256 layout)
    K(head_dim=256, o_in_v=True), K(head_dim=256, causal=True, o_in_v=True),
    # two Q buffers (the next tile's Q loads during this one), O in its own buffer or over V
    K(head_dim=64, causal=True, consumer_warpgroups=2, q_stages=2),
    K(head_dim=128, causal=True, pingpong=True, o_in_v=True, q_stages=2),
]


def rule_specs() -> list[KernelSpec]:
    """Every distinct spec spec.seqlen_rule_fields can pick (bf16 stands for fp16: the same kernel but
    for the type suffixes), over the FA3-paper lengths and head dims: what the API runs for real
    shapes beside the defaults."""
    from facodegen.spec import HEAD_DIMS, seqlen_rule_fields
    found = {}
    for d in HEAD_DIMS:
        for dtype in ("bf16", "fp8"):
            for causal in (False, True):
                for s in (512, 1024, 2048, 4096, 8192, 16384):
                    fields = seqlen_rule_fields("sm90", d, dtype, causal, s, s)
                    if fields:
                        spec = K(head_dim=d, dtype=dtype, causal=causal, **fields)
                        found[spec.variant] = spec
    return [found[v] for v in sorted(found)]


@pytest.mark.parametrize("spec", rule_specs(), ids=lambda s: s.variant)
def test_every_seqlen_rule_spec_compiles_clean(spec):
    """A rule's kernel runs for every call of its shape: no stack, no spills, no C75xx warning (the
    pingpong that measured faster at head_dim 256 spills 32+92 bytes and is no rule for that)."""
    kernel = compile_mod.compile(spec)
    r = kernel.resources
    assert (r.stack_bytes, r.spill_stores, r.spill_loads) == (0, 0, 0), kernel.log
    assert not re.findall(r"C75\d\d", kernel.log), kernel.log


def test_default_sm90_specs_are_covered():
    covered = {(s.head_dim, s.causal) for s in SPECS}
    assert {s.head_dim for s in facodegen.default_specs() if s.arch == "sm90"} <= {d for d, _ in covered}


@pytest.fixture(scope="module", params=SPECS, ids=lambda s: s.variant)
def kernel(request):
    return compile_mod.compile(request.param)


def test_no_serialisation_or_setmaxnreg_warnings(kernel):
    bad = [w for w in re.findall(r"C75\d\d", kernel.log)]
    assert not bad, kernel.log


def test_no_stack_and_no_spills(kernel):
    r = kernel.resources
    assert (r.stack_bytes, r.spill_stores, r.spill_loads) == (0, 0, 0), kernel.log


def test_sass_has_hopper_instructions_and_no_local_memory(kernel):
    counts = kernel.sass_counts()
    for op in ("HGMMA", "UTMALDG", "UTMASTG", "USETMAXREG"):
        assert counts[op] > 0, (op, counts)
    assert counts["LDL"] == 0 and counts["STL"] == 0, counts
    assert counts["USETMAXREG"] == 2     # one dec (producer), one inc (consumers)


def _waits_sleep(sass: str) -> None:
    """An mbarrier wait is a try-wait, and where that fails an out-of-line retry (at most two
    try-waits per wait); with mbar_wait's suspend hint each retry sleeps in NANOSLEEP.SYNCS until the
    barrier changes (without it: none, the warp re-issues the try-wait)."""
    tries = len(re.findall(r"SYNCS\.PHASECHK\.TRANS64\.TRYWAIT", sass))
    sleeps = len(re.findall(r"NANOSLEEP\.SYNCS", sass))
    assert tries > 0 and 2 * sleeps >= tries, (tries, sleeps)


def test_mbarrier_waits_sleep_instead_of_spinning(kernel):
    _waits_sleep(kernel.sass())


@pytest.mark.parametrize("spec", default_fp8_specs(), ids=lambda s: s.variant)
def test_fp8_mbarrier_waits_sleep_instead_of_spinning(spec):
    _waits_sleep(compile_mod.compile(spec, verbose=False).sass())


@pytest.mark.parametrize("fields,dynamic", [(dict(head_dim=128, dtype="fp8"), True), (dict(head_dim=256, dtype="fp8"), False),
                                            (dict(head_dim=128), False), (dict(head_dim=128, causal=True), True),
                                            (dict(head_dim=128, causal=True, dynamic_scheduler=False), False)],
                         ids=lambda x: ",".join(f"{k}={v}" for k, v in x.items()) if isinstance(x, dict) else str(x))
def test_dynamic_scheduler_draws_tiles_with_an_atomic(fields, dynamic):
    """spec.dynamic_scheduler: the loader warp's atomicAdd on the tile counter (ATOMG) is in the
    SASS exactly when the counter hands out the tiles; the static schedule computes them."""
    spec = K(**fields)
    assert spec.dynamic_scheduler == dynamic
    sass = compile_mod.compile(spec, verbose=False).sass()
    assert ("ATOMG" in sass) == dynamic


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_stream_k_kernels_meet_through_l2_without_spills(head_dim):
    """stream_k: no spills beside the default's registers; a PARTIAL piece's O, m, l go out as
    L2 stores (STG.E.STRONG.GPU, one per accumulator register and 4 more, plus the flag) and the
    COMBINE piece reads them back the same way, its flag wait sleeping (NANOSLEEP); the static
    kernel without it has none of them."""
    spec = K(head_dim=head_dim, dtype="fp8", stream_k=True)
    kernel = compile_mod.compile(spec, verbose=False)
    res = kernel.resources
    assert res.spill_stores == 0 and res.spill_loads == 0 and res.stack_bytes == 0, res
    sass = kernel.sass()
    o_regs = head_dim // 2
    assert sass.count("STG.E.STRONG.GPU") == o_regs + 4 + 1, sass.count("STG.E.STRONG.GPU")
    assert sass.count("LDG.E.STRONG.GPU") >= o_regs + 4 + 1
    assert re.search(r"NANOSLEEP 0x", sass)
    without = compile_mod.compile(spec.replace(stream_k=False, dynamic_scheduler=False), verbose=False).sass()
    assert "STRONG.GPU" not in without


@pytest.mark.parametrize("fields", [dict(head_dim=256, dtype="fp8"), dict(head_dim=128, dtype="fp8", v_layout="transposed"),
                                    dict(head_dim=128), dict(head_dim=128, cluster_m=2)],
                         ids=lambda f: "-".join(f"{k}={v}" for k, v in f.items()))
def test_l2_prefetch_adds_tensor_prefetches_and_nothing_else(fields):
    """l2_prefetch=2: the loader's K and V prefetches into L2 (UTMAPF, one per tile's slab loop, a
    tensor map operand like the loads), no spills; l2_prefetch=0 has none and the same loads."""
    on = compile_mod.compile(K(l2_prefetch=2, **fields), verbose=False)
    off = compile_mod.compile(K(l2_prefetch=0, **fields), verbose=False)
    res = on.resources
    assert res.spill_stores == 0 and res.spill_loads == 0 and res.stack_bytes == 0, res
    on_sass, off_sass = on.sass(), off.sass()
    assert len(re.findall(r"UTMAPF\.L2\.4D", on_sass)) == 2
    assert "UTMAPF" not in off_sass
    assert on_sass.count("UTMALDG") == off_sass.count("UTMALDG")


@pytest.mark.parametrize("fields", [dict(head_dim=256), dict(head_dim=256, causal=True), dict(head_dim=128),
                                    dict(head_dim=64, causal=True)],
                         ids=lambda f: "-".join(f"{k}={v}" for k, v in f.items()))
def test_fp8_vt_in_place_loads_v_in_5d_boxes_and_transposes_whole_blocks(fields):
    """vt_in_place: no spills; V comes in rank-5 boxes (one UTMALDG.5D in the loader's slab loop, K and
    Q stay 4-D), and the transposer loop runs two ldmatrix.trans before its two stmatrix (a block's
    stores overwrite its own V bytes)."""
    on = compile_mod.compile(K(dtype="fp8", vt_in_place=True, **fields), verbose=False)
    res = on.resources
    assert res.spill_stores == 0 and res.spill_loads == 0 and res.stack_bytes == 0, res
    sass = on.sass()
    assert sass.count("UTMALDG.5D") == 1 and sass.count("UTMALDG.4D") >= 2
    ops = [x for x in sass.splitlines() if "LDSM.16.MT88.4" in x or "STSM.16.M88.4" in x]
    assert [("LD" if "LDSM" in x else "ST") for x in ops] == ["LD", "LD", "ST", "ST"], ops


@pytest.mark.parametrize("fields", [dict(head_dim=256), dict(head_dim=256, causal=True), dict(head_dim=128),
                                    dict(head_dim=64, causal=True)],
                         ids=lambda f: "-".join(f"{k}={v}" for k, v in f.items()))
def test_fp8_defer_o_store_stores_the_last_tile_under_the_next_q_k(fields):
    """defer_o_store: no spills and no ptxas wgmma note (C7518's serialisation came with a branch
    around the deferred stores, C7517's extra wait with stores that read o_reg); in the prologue the
    tile before's stores (O, 8 bytes each, and LSE) sit between the K wait and the S wait with the
    Q K^T wgmmas and no wgmma wait among them; and the O stores are there three times (under the next
    Q K^T, for a tile with no key block, after the last tile)."""
    on = compile_mod.compile(K(dtype="fp8", defer_o_store=True, **fields), verbose=False)
    off = compile_mod.compile(K(dtype="fp8", defer_o_store=False, **fields), verbose=False)
    res = on.resources
    assert res.spill_stores == 0 and res.spill_loads == 0 and res.stack_bytes == 0, res
    assert "C75" not in on.log, [x for x in on.log.splitlines() if "C75" in x]
    sass = [x for x in on.sass().splitlines() if re.search(r"QGMMA|STG|WARPGROUP\.DEPBAR|TRYWAIT", x)]
    first_qk = next(i for i, x in enumerate(sass) if "QGMMA" in x and "RZ, !UPT" in x)   # S = Q K^T, zero-init
    begin = max(i for i in range(first_qk) if "TRYWAIT" in sass[i])
    end = next(i for i in range(first_qk, len(sass)) if "DEPBAR" in sass[i])
    prologue = sass[begin:end]
    o_stores = 2 * fields["head_dim"] // 16        # STG.E.64 per thread and tile
    assert sum("STG.E.64" in x for x in prologue) == o_stores and sum("QGMMA" in x for x in prologue) >= 2
    assert not any("DEPBAR" in x for x in prologue)
    assert sum("STG.E.64" in x for x in sass) == 3 * o_stores
    assert sum("STG.E.64" in x for x in off.sass().splitlines()) == o_stores


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_fp8_lazy_rescale_keeps_two_exp2_paths(causal):
    """fp8 lazy_rescale (head_dim 256's default): no spills or ptxas wgmma notes; a warp vote picks
    the steady step's path, and the exp2s are there once more per steady loop than in the exact
    kernel (one path with O's rescale, one without). The compiler merging the two paths' exp2s ahead
    of the vote ran the rescale after them, slower than rescaling every step."""
    fields = dict(dtype="fp8", head_dim=256, causal=causal)
    lazy = compile_mod.compile(K(lazy_rescale=True, **fields), verbose=False)
    exact = compile_mod.compile(K(lazy_rescale=False, **fields), verbose=False)
    res = lazy.resources
    assert res.spill_stores == 0 and res.spill_loads == 0 and res.stack_bytes == 0, res
    assert "C75" not in lazy.log, [x for x in lazy.log.splitlines() if "C75" in x]
    assert "VOTE.ANY" in lazy.sass() and "VOTE.ANY" not in exact.sass()
    per_step = K(**fields).block_n // 2                       # MUFU.EX2 per thread and step
    extra = lazy.sass().count("MUFU.EX2") - exact.sass().count("MUFU.EX2")
    assert extra >= per_step and extra % per_step == 0, (extra, per_step)


def test_cluster_kernels_multicast_kv_and_arrive_remotely_without_gpu_fences(kernel):
    """cluster_m=2: the K and V loads are multicast (one UTMALDG.MULTICAST each, Q stays a plain load),
    the consumers' releases reach both CTAs' barriers (remote SYNCS.ARRIVE...RED), and no per-step
    MEMBAR.ALL.GPU (a .release.cluster arrival would put one before each): only the barrier-init
    fence and the final cluster barrier have one."""
    spec = next(s for s in SPECS if s.variant == kernel.name)
    sass = kernel.sass().splitlines()
    multicast = [x for x in sass if "UTMALDG" in x and "MULTICAST" in x]
    remote = [x for x in sass if "SYNCS.ARRIVE" in x and ".RED" in x]
    gpu_fences = [x for x in sass if "MEMBAR.ALL.GPU" in x]
    if spec.cluster_m == 1:
        assert not multicast and not remote and not any("UCGABAR" in x for x in sass)
        return
    plain = [x for x in sass if "UTMALDG" in x and "MULTICAST" not in x]
    assert len(multicast) == 2 and plain, multicast          # K and V; Q (two call sites) per CTA
    assert len(remote) >= 2 * 3, remote            # K and V releases of the loop, to both CTAs
    assert len(gpu_fences) <= 2, gpu_fences
    assert any("UCGABAR_WAIT" in x for x in sass)


def test_wgmma_shapes_match_the_spec(kernel):
    sass = kernel.sass()
    spec = next(s for s in SPECS if s.variant == kernel.name)
    assert f"HGMMA.64x{spec.block_n}x16.F32" in sass          # S = Q K^T, N = block_n
    assert f"HGMMA.64x{spec.head_dim}x16.F32" in sass         # O += P V, N = head_dim
    assert "tnspB" in sass                                      # V read MN-major


def ops_under_pv(sass: str, op: str = "MUFU.EX2") -> list[int]:
    """For each steady-state step of the overlapped loop (a WARPGROUP.DEPBAR that lets one wgmma
    group run on: S ready, P V still in flight), how many `op` come before the wait for P V."""
    counts, open_step = [], None
    for line in sass.splitlines():
        if "WARPGROUP.DEPBAR.LE gsb0, 0x1" in line:
            open_step = 0
        elif "WARPGROUP.DEPBAR.LE gsb0, 0x0" in line and open_step is not None:
            counts.append(open_step)
            open_step = None
        elif op in line and open_step is not None:
            open_step += 1
    return counts


def softmax_exps_under_pv(sass: str) -> list[int]:
    return ops_under_pv(sass, "MUFU.EX2")


def steady_loop(sass: str) -> list[str]:
    """The instructions of the shortest loop (a backward branch and its target) that issues both
    GEMMs of a step: the steady state of the overlapped consumer loop."""
    lines = [(int(m.group(1), 16), m.group(2)) for m in
             (re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?);", line) for line in sass.splitlines()) if m]
    index = {addr: i for i, (addr, _) in enumerate(lines)}
    best = None
    for i, (addr, text) in enumerate(lines):
        target = re.search(r"BRA\s+(?:`\()?(0x[0-9a-f]+)", text)
        if not target or int(target.group(1), 16) >= addr or int(target.group(1), 16) not in index:
            continue
        body = [x for _, x in lines[index[int(target.group(1), 16)]:i + 1]]
        shapes = {m.group(1) for x in body for m in [re.search(r"[HQ]GMMA\.(64x\d+x\d+)", x)] if m}
        if len(shapes) >= 2 and (best is None or len(body) < len(best)):
            best = body
    assert best, "no loop with both GEMMs"
    return best


@pytest.mark.parametrize("spec", [s for s in default_fp8_specs() if s.head_dim in (64, 128, 256) and s.v_layout == "row"],
                         ids=lambda s: s.variant)
def test_fp8_steady_step_issues_q_kt_before_it_waits_for_the_vt_tile(spec):
    """fp8 (late_pv_wait, FlashAttention-3's order): a steady step waits for K, issues Q K^T, and
    only then waits for its V^T tile (the transposers' output, which lands after K) before P V."""
    body = steady_loop(compile_mod.compile(spec).sass())
    qk = next(i for i, x in enumerate(body) if f"QGMMA.64x{spec.block_n}x32" in x)
    pv = next(i for i, x in enumerate(body) if f"QGMMA.64x{spec.head_dim}x32" in x and i > qk)
    waits = [i for i, x in enumerate(body) if "SYNCS.PHASECHK" in x]
    assert any(i < qk for i in waits) and any(qk < i < pv for i in waits), (qk, pv, waits)


ANCHORED = [s.replace(anchor_softmax=True) for s in [K(head_dim=128), K(head_dim=256, causal=True), K(head_dim=64)]]


@pytest.mark.parametrize("spec", ANCHORED, ids=lambda s: s.variant)
def test_anchor_softmax_keeps_every_exp2_under_the_pv_gemm(spec):
    """anchor_softmax=True: the exp2s of block n run while P V of block n-1 is in flight, i.e.
    between the two waits in SASS (ptxas otherwise hoists the second wait over the whole softmax)."""
    counts = softmax_exps_under_pv(compile_mod.compile(spec).sass())
    per_thread = 64 * spec.block_n // 128      # S elements of one thread: 64 rows x block_n over 128 threads
    assert counts and min(counts) >= per_thread, (counts, per_thread)


FP8_EXACT = [s for s in default_fp8_specs() if not s.optimistic_max and s.v_layout == "row"]   # V^T from the caller: P moves by shuffles + PRMT


@pytest.mark.parametrize("spec", FP8_EXACT, ids=lambda s: s.variant)
def test_fp8_exact_step_packs_p_straight_into_its_registers_after_the_pv_wait(spec):
    """fp8, exact max: the exp2 half writes each e4m3 pair into P's register (F2FP ... MERGE_C), so
    the steady loop has no PRMT (packing from s after the wait, ptxas built the pairs in
    temporaries and merged them by PRMT: 16 per step at head_dim 256) and no F2FP before the wait
    for the P V that reads P. anchor_softmax=True keeps the row max pass (its two quad shuffles per
    row) ahead of that wait, and still no packing: ptxas may start a pair there into a temporary,
    which an F2FP ... MERGE_C after the wait then takes as its C operand (head_dim 128), never a
    PRMT."""
    sass = compile_mod.compile(spec.replace(anchor_softmax=False)).sass()
    assert not [x for x in steady_loop(sass) if x.split()[0] == "PRMT"]
    assert set(ops_under_pv(sass, "F2FP")) == {0}
    anchored = compile_mod.compile(spec.replace(anchor_softmax=True)).sass()
    assert not [x for x in steady_loop(anchored) if x.split()[0] == "PRMT"]
    assert max(ops_under_pv(anchored, "F2FP")) <= 2
    assert min(ops_under_pv(anchored, "SHFL.BFLY")) >= 4
    assert max(ops_under_pv(sass, "SHFL.BFLY")) < 4


def test_without_the_anchor_ptxas_hoists_the_pv_wait():
    """The default (anchor off, measured faster): the wait for P V comes before most exp2s. If a
    ptxas update stops hoisting it, anchor_softmax's reason to exist (and its measurement) is stale."""
    spec = K(head_dim=128)
    counts = softmax_exps_under_pv(compile_mod.compile(spec).sass())
    assert counts and max(counts) < 64 * spec.block_n // 128 // 2, counts


TWO_P_BUFFERS = [K(head_dim=128, causal=True, pingpong=True, p_buffers=2), K(head_dim=128, block_n=128, p_buffers=2),
                 K(head_dim=128, dtype="fp8", producer_regs=24, consumer_regs=240, p_buffers=2),
                 K(head_dim=128, dtype="fp8", causal=True, producer_regs=24, consumer_regs=240, p_buffers=2)]


@pytest.mark.parametrize("spec", TWO_P_BUFFERS, ids=lambda s: s.variant)
def test_two_p_buffers_run_the_optimistic_softmax_under_the_pv_gemm(spec):
    """p_buffers=2: the optimistic step writes P into the buffer the running P V does not read, so
    its exp2s sit between the two waits in every steady step (with one buffer they must follow the
    wait for P V, whose P they overwrite), and the kernel still compiles clean (no spills)."""
    kernel = compile_mod.compile(spec, verbose=False)
    r = kernel.resources
    assert (r.stack_bytes, r.spill_stores, r.spill_loads) == (0, 0, 0), kernel.log
    per_thread = 64 * spec.block_n // 128
    counts = softmax_exps_under_pv(kernel.sass())
    assert counts and min(counts) >= per_thread, (counts, per_thread)
    one = softmax_exps_under_pv(compile_mod.compile(spec.replace(p_buffers=1), verbose=False).sass())
    assert one and max(one) < per_thread // 2, one


def test_rebuilt_q_descriptors_free_the_registers_of_two_p_buffers_at_head_dim_256():
    """rebuild_q_desc: ptxas derives the Q descriptors at each Q K^T from uniform registers instead
    of holding all 16 across the loop, some in vector registers moved over (R2UR) at every wgmma;
    so head_dim 256 x 80 keys with two P buffers compiles clean, all of a step's exp2s under P V
    (without it ptxas spilled there, nvrtc 13.0)."""
    spec = K(head_dim=256, o_in_v=True, uniform_wg=True, p_buffers=2, rebuild_q_desc=True)
    kernel = compile_mod.compile(spec, verbose=False)
    r = kernel.resources
    assert spec.block_n == 80 and (r.stack_bytes, r.spill_stores, r.spill_loads) == (0, 0, 0), kernel.log
    held = compile_mod.compile(spec.replace(rebuild_q_desc=False), verbose=False)
    assert kernel.sass().count("R2UR") < held.sass().count("R2UR")
    counts = softmax_exps_under_pv(kernel.sass())
    assert counts and min(counts) >= 64 * spec.block_n // 128, counts


def first_op_after_pv_wait(sass: str, ops=("MUFU.EX2", "SHFL.BFLY")) -> list[str]:
    """For each steady-state step (after the wait that leaves P V running, then the wait for P V),
    which of `ops` comes first after the wait for P V."""
    firsts, state = [], None
    for line in sass.splitlines():
        if "WARPGROUP.DEPBAR.LE gsb0, 0x1" in line:
            state = "qk"
        elif "WARPGROUP.DEPBAR.LE gsb0, 0x0" in line and state == "qk":
            state = "pv"
        elif state == "pv":
            hit = next((op for op in ops if op in line), None)
            if hit:
                firsts.append(hit)
                state = None
    return firsts


@pytest.mark.parametrize("spec", [K(head_dim=128), K(head_dim=128, causal=True), K(head_dim=64),
                                  K(head_dim=256, optimistic_max=True)], ids=lambda s: s.variant)
def test_optimistic_max_starts_the_exp2s_before_any_row_max_shuffle(spec):
    """optimistic_max: after the wait for P V the step's exp2s start at once (the quad shuffles of a
    row max come only in the exact redo); the exact step shuffles the row max first."""
    assert spec.optimistic_max
    assert set(first_op_after_pv_wait(compile_mod.compile(spec).sass())) == {"MUFU.EX2"}
    exact = compile_mod.compile(spec.replace(optimistic_max=False)).sass()
    assert set(first_op_after_pv_wait(exact)) == {"SHFL.BFLY"}
