"""Decode (issue #39, slice 1) on the CPU: specs and their errors, variant names, the split
heuristic, the kvcache reference, render + NVRTC compile of every shipped decode/combine/append
config for sm_80 and sm_90a with no spills, the public call's plans and argument errors (fake torch
and driver), the FlashAttention alias's refusals."""

from __future__ import annotations

import ctypes
import struct
import sys
import types
from dataclasses import replace

import numpy as np
import pytest
from fakes import FakeLauncher, FakeTensor

from facodegen.ops import api, kvcache
from facodegen.runtime import driver
from facodegen.spec import decode as dec
from facodegen.runtime import plan as plan_mod
from facodegen.verify.reference import attention_reference, kvcache_reference
from facodegen.spec import SpecError
from sampling import one_per

# ------------------------------------------------------------------ specs, names, defaults

def test_variant_names():
    spec = dec.DecodeSpec(arch="sm80", dtype="bf16", head_dim=128, block_m=16, block_n=128, num_warps=4, stages=2,
                          pack_gqa=True, split=True, paged=True)
    assert spec.variant == "flash_decode_sm80_bf16_hd128_bm16_bn128_w4_st2_pack_split_paged"
    assert dec.CombineSpec(dtype="bf16", head_dim=128).variant == "flash_combine_bf16_hd128"
    assert dec.AppendSpec(dtype="fp16", head_dim=64, paged=True).variant == "flash_append_fp16_hd64_paged"


@pytest.mark.parametrize("fields, knob", [
    ({"block_n": 32, "num_warps": 4}, "block_n"),           # 8 keys a warp: not a k16 slice
    ({"head_dim": 256, "block_m": 32}, "block_m"),          # O would take 256 floats a thread
    ({"head_dim": 256, "block_n": 256, "stages": 6}, "stages"),  # 1.5 MB of ring
    ({"head_dim": 84}, "head_dim"),
    ({"head_dim": 96, "head_dim_real": 56}, "head_dim_real"),     # (56 runs on the 64 tile)
    ({"head_dim": 80, "producer_warps": 2}, "producer_warps"),
    ({"dtype": "fp8"}, "dtype"),
    ({"block_n": 64.0}, "block_n"),
    ({"paged": "yes"}, "paged"),
    ({"arch": "sm100"}, "arch"),
])
def test_spec_errors_name_the_knob(fields, knob):
    with pytest.raises(SpecError) as err:
        dec.DecodeSpec(**fields)
    assert err.value.field == knob and knob in str(err.value)


def test_defaults_fit_and_pack():
    for head_dim in dec.DECODE_HEAD_DIMS:
        for rows in (1, 4, 8, 16, 32, 64, 128):
            spec = dec.default_decode_spec("sm90", "bf16", head_dim, seqlen_q=1, group=rows)
            assert spec.pack_gqa == (rows > 1)
            assert spec.block_m * head_dim // 32 <= dec.MAX_O_FLOATS
            assert spec.smem_bytes <= dec.SMEM_LIMIT["sm80"]      # the A100 takes them too
            assert (spec.stages - 1) * spec.stage_bytes >= 32 * 1024   # bytes in flight per CTA (Little's law)
    assert dec.default_decode_spec("sm90", "bf16", 128, group=4, block_n=128).block_n == 128   # the caller wins


def test_split_heuristic():
    h = dec.num_splits_heuristic
    assert h(264, 100, 132, 2) == 1                 # a full wave already: no split
    assert h(1000, 4096, 132, 1) == 1
    assert h(8, 4096, 132, 2) == 33                 # batch 1, 8 KV heads, 256k keys: one wave of 264 slots
    assert h(64, 4096, 132, 2) == 4                 # batch 8: 256 of 264
    assert h(8, 4096, 132, 1) == 16                 # one CTA per SM (d256): 128 of 132
    assert h(150, 4096, 132, 2) == 3                # over half the slots: FA3's wave-efficiency rule (1.70 waves)
    assert h(8, 3, 132, 2) == 3                     # never more splits than key blocks
    assert h(1, 1, 132) == 1 and h(0, 5, 132) == 1
    for work in (1, 2, 7, 8, 32, 64, 100):
        splits = h(work, 10_000, 132, 2)
        assert 1 <= splits <= dec.MAX_SPLITS
        assert work * splits >= min(0.8 * 264, work * dec.MAX_SPLITS) * 0.85 or work * splits >= 0.85 * 264
    # MQA with few blocks still splits (FA3's <= 4 blocks rule is left out)
    assert h(1, 4, 132, 2) == 4


def test_pointer_order_and_struct_sizes():
    for kernel, names in dec.CALL_POINTERS.items():
        placed, size, align = dec.layout(kernel)
        assert [f.name for f, _ in placed][:len(names)] == list(names)
        assert size % align == 0


# ------------------------------------------------------------------ render + compile

def test_render_header_and_static_asserts():
    spec = dec.default_decode_spec("sm90", "bf16", 128, group=4, paged=True, split=True)
    source = dec.render(spec)
    assert source.startswith("// ===") and spec.variant in source.splitlines()[1]
    assert "facodegen emit --kernel decode" in source and "static_assert" in source
    assert dec.render(spec) == source              # deterministic


def _targets(spec):
    if spec.kernel == "decode":
        return [None]                              # sm80 -> sm_80, sm90 -> sm_90a
    return [None, "sm_90"]                         # arch-neutral kernels: the A100's and the H200's target


def _shipped_groups():
    """The shipped configs in a few groups (per arch and dtype; combine/append), each compiled in
    parallel threads (NVRTC releases the GIL). bf16 whole; fp16 (the same code but the element type)
    one config per head_dim, paging and split, seeded (tests/sampling.py)."""
    groups = {}
    specs = dec.shipped_specs()
    fp16 = one_per([s for s in specs if s.dtype == "fp16"], 
                   lambda s: (s.kernel, s.arch, s.head_dim, getattr(s, "paged", None), getattr(s, "split", None)))
    for spec in [s for s in specs if s.dtype != "fp16"] + fp16:
        key = f"decode-{spec.arch}-{spec.dtype}" if spec.kernel == "decode" else f"{spec.kernel}-{spec.dtype}"
        groups.setdefault(key, []).append(spec)
    return groups


@pytest.mark.parametrize("group", sorted(_shipped_groups()))
def test_shipped_configs_compile_without_spills(group):
    bad = []
    for sm_index in (0, 1):     # decode: its arch's own target; combine/append: sm_80, then sm_90
        chosen = [(spec, _targets(spec)[sm_index]) for spec in _shipped_groups()[group]
                  if len(_targets(spec)) > sm_index]
        if not chosen:
            continue
        sms = {spec: sm for spec, sm in chosen}
        compiled = dec.compile_many([spec for spec, _ in chosen], sm_of=sms.get)
        for (spec, sm), kernel in zip(chosen, compiled):
            r = kernel.resources
            if (r.spill_stores, r.spill_loads, r.stack_bytes) != (0, 0, 0) or kernel.warnings or r.registers > 255:
                bad.append((spec.variant, sm, r, kernel.warnings))
    assert not bad


def test_decode_sass_has_the_pipeline():
    kernel = dec.compile_spec(dec.default_decode_spec("sm90", "bf16", 128, group=8, paged=True, split=True))
    try:
        counts = kernel.sass_counts()
    except Exception as err:  # noqa: BLE001 (no cuobjdump: nothing to read)
        pytest.skip(f"cuobjdump: {err}")
    assert counts["HMMA"] > 0 and counts["LDSM"] > 0 and counts["LDGSTS"] > 0
    assert counts["LDL"] == 0 and counts["STL"] == 0


# ------------------------------------------------------------------ fused_combine

def test_fused_combine_spec_name_and_defaults():
    spec = dec.default_decode_spec("sm90", "bf16", 128, group=4, split=True, fused_combine=True)
    assert spec.variant == "flash_decode_sm90_bf16_hd128_bm16_bn64_w4_st4_pack_split_fused"   # (contiguous: 4 stages)
    assert dec.default_decode_spec("sm90", "bf16", 128, group=4, split=True).fused_combine       # on by default
    assert not dec.default_decode_spec("sm90", "bf16", 128, group=4, split=True, fused_combine=False).fused_combine
    assert not dec.default_decode_spec("sm90", "bf16", 128, group=4).fused_combine                # no split
    with pytest.raises(SpecError) as err:
        dec.DecodeSpec(fused_combine=True)                 # nothing to combine without split
    assert err.value.field == "fused_combine" and "split" in str(err.value)
    # off: neither the header nor the emit line nor the argument struct mention it (sources as before)
    plain = dec.render(dec.default_decode_spec("sm90", "bf16", 128, group=4, split=True, fused_combine=False))
    assert "fused" not in plain and "split_counters" not in plain and "combine_row" not in plain
    fused = dec.render(spec)
    assert "--split-kv --fused-combine" in fused and "fused_combine        = True" in fused
    assert "int*             split_counters;" in fused and "combine_if_last(p, fin, rows_left" in fused
    placed = {f.name: off for f, off in dec.layout("decode_fused")[0]}
    assert placed["split_counters"] == 8 * len(dec.DECODE_CALL_POINTERS)


# A few fused configs per arch (the defaults of GQA 4 and 8 rows x d, contiguous and paged, both
# dtypes at d128): enough to cover each head dim's finish without compiling every shipped config twice.
def _fused_specs():
    specs = []
    for arch in dec.DECODE_ARCHS:
        for dtype, head_dim in (("bf16", 64), ("bf16", 128), ("fp16", 128), ("bf16", 256)):
            for paged in (False, True):
                specs.append(dec.default_decode_spec(arch, dtype, head_dim, group=4 if paged else 8, paged=paged,
                                                     split=True, fused_combine=True))
    return specs


def test_fused_configs_compile_without_spills():
    bad = []
    specs = _fused_specs()
    for spec, kernel in zip(specs, dec.compile_many(specs, threads=2)):
        r = kernel.resources
        if (r.spill_stores, r.spill_loads, r.stack_bytes) != (0, 0, 0) or kernel.warnings or r.registers > 255:
            bad.append((spec.variant, r, kernel.warnings))
    assert not bad


@pytest.mark.parametrize("arch", dec.DECODE_ARCHS)
def test_fused_sass_has_the_arrival_and_coherent_loads(arch):
    """The counter's atomic add, the two GPU-scope fences around it, the partials read from L2
    (ld.global.cg: LDG .STRONG.GPU), and still no local memory; the unfused kernel has none of them."""
    spec = dec.default_decode_spec(arch, "bf16", 128, group=4, paged=True, split=True, fused_combine=True)
    try:
        sass = dec.compile_spec(spec).sass()
        plain = dec.compile_spec(dec.default_decode_spec(arch, "bf16", 128, group=4, paged=True, split=True,
                                                         fused_combine=False)).sass()
    except Exception as err:  # noqa: BLE001 (no cuobjdump: nothing to read)
        pytest.skip(f"cuobjdump: {err}")
    assert sass.count("ATOMG.E.ADD") == 1 and sass.count("MEMBAR.SC.GPU") == 2
    assert "LDG.E.64.STRONG.GPU" in sass and "LDG.E.STRONG.GPU" in sass
    assert "LDL" not in sass and "STL" not in sass
    assert "ATOMG" not in plain and "MEMBAR" not in plain and "STRONG.GPU" not in plain


# ------------------------------------------------------------------ the reference

def _random_case(rng, batch=3, seqlen_q=2, heads_q=8, heads_kv=2, d=64, capacity=48, page=8, new=2):
    q = rng.standard_normal((batch, seqlen_q, heads_q, d))
    kc = rng.standard_normal((batch, capacity, heads_kv, d))
    vc = rng.standard_normal((batch, capacity, heads_kv, d))
    kn = rng.standard_normal((batch, new, heads_kv, d))
    vn = rng.standard_normal((batch, new, heads_kv, d))
    lengths = np.array([0, 17, capacity - new][:batch], dtype=np.int32)
    pages = batch * capacity // page
    table = rng.permutation(pages).reshape(batch, capacity // page).astype(np.int32)
    kp, vp = np.zeros((pages, page, heads_kv, d)), np.zeros((pages, page, heads_kv, d))
    for b in range(batch):
        for j in range(capacity // page):
            kp[table[b, j]] = kc[b, j * page:(j + 1) * page]
            vp[table[b, j]] = vc[b, j * page:(j + 1) * page]
    return q, kc, vc, kn, vn, lengths, table, kp, vp


def test_reference_matches_attention_on_the_prefix_and_paging():
    rng = np.random.default_rng(1)
    q, kc, vc, kn, vn, lengths, table, kp, vp = _random_case(rng)
    o, lse, kc2, vc2 = kvcache_reference(q, kc, vc, lengths, k=kn, v=vn)
    for b in range(q.shape[0]):
        keys = int(lengths[b]) + kn.shape[1]
        o_b, lse_b = attention_reference(q[b:b + 1], kc2[b:b + 1, :keys], vc2[b:b + 1, :keys], causal=True)
        np.testing.assert_allclose(o[b:b + 1], o_b, atol=1e-12)
        np.testing.assert_allclose(lse[b:b + 1], lse_b, atol=1e-12)
        np.testing.assert_array_equal(kc2[b, lengths[b]:keys], kn[b])     # appended in place
    o_p, lse_p, _, _ = kvcache_reference(q, kp, vp, lengths, page_table=table, k=kn, v=vn)
    np.testing.assert_allclose(o_p, o, atol=1e-12)
    np.testing.assert_allclose(lse_p, lse, atol=1e-12)


def test_reference_clamps_hostile_lengths_and_pages():
    rng = np.random.default_rng(2)
    q, kc, vc, kn, vn, lengths, table, kp, vp = _random_case(rng)
    o, _, _, _ = kvcache_reference(q, kc, vc, np.array([-5, 10**6, 3], np.int32), k=kn, v=vn)
    assert np.isfinite(o).all()
    bad = table.copy()
    bad[0, 0], bad[1, 1] = -7, 10**6
    o2, _, _, _ = kvcache_reference(q, kp, vp, lengths, page_table=bad)
    assert np.isfinite(o2).all()
    o3, lse3, _, _ = kvcache_reference(q, kc, vc, np.zeros(3, np.int32))   # no key at all
    assert (o3 == 0).all() and np.isneginf(lse3).all()


# ------------------------------------------------------------------ the public call on fakes

class _Nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@pytest.fixture
def fake(monkeypatch):
    state = types.SimpleNamespace(device=0, stream=1000, records=[])
    torch = types.ModuleType("torch")
    torch.Tensor = FakeTensor
    torch.float32, torch.uint8, torch.bfloat16, torch.float16, torch.int32 = (
        "float32", "uint8", "bfloat16", "float16", "int32")
    torch.empty_like = lambda x, dtype=None: FakeTensor(x.shape, (dtype or x.dtype).removeprefix("torch."),
                                                        device=x.device.index)
    torch._C = types.SimpleNamespace(_cuda_getDevice=lambda: state.device,
                                     _cuda_getCurrentRawStream=lambda device: state.stream)
    torch.cuda = types.SimpleNamespace(current_device=lambda: state.device)
    torch.compiler = types.SimpleNamespace(is_compiling=lambda: False)     # eager: the plan path, not the op
    torch.is_grad_enabled = lambda: True
    torch.empty = lambda shape, dtype, device: FakeTensor(shape if isinstance(shape, tuple) else (shape,),
                                                          str(dtype).removeprefix("torch."),
                                                          device=int(str(device).rpartition(":")[2]))
    monkeypatch.setitem(sys.modules, "torch", torch)
    monkeypatch.setattr(api, "_TORCH", None)     # api._torch() finds the fake
    info = api.DeviceInfo(0, "NVIDIA H200", (9, 0), 132, 232448)
    monkeypatch.setattr(kvcache, "device_info", lambda ordinal: info)
    monkeypatch.setattr(kvcache, "_load_on", lambda device, spec: driver.LoadedFunction(1, 1, device))

    def launcher(function, grid, threads, smem):
        def launch(stream, kernel_params):
            address = ctypes.c_void_p.from_address(kernel_params).value
            state.records.append({"grid": grid, "threads": threads, "smem": smem,
                                  "head": ctypes.string_at(address, 128)})
        return FakeLauncher(launch)
    monkeypatch.setattr(driver, "Launcher", launcher)
    monkeypatch.setattr(driver, "stream_arg", lambda stream: stream)
    monkeypatch.setattr(driver, "on_device", lambda ordinal: _Nothing())
    monkeypatch.setattr(driver, "memset_d32_async", lambda *a: None)     # fused_combine's counters (the default)
    monkeypatch.setattr(kvcache, "_PLANS", plan_mod.PlanCache())
    return state


def _call_args(batch=2, seqlen_q=1, heads_q=32, heads_kv=8, d=128, capacity=4096, paged=False, page=64, new=0,
               dtype="bfloat16"):
    q = FakeTensor((batch, seqlen_q, heads_q, d), dtype)
    if paged:
        pages = batch * capacity // page
        kc, vc = FakeTensor((pages, page, heads_kv, d), dtype), FakeTensor((pages, page, heads_kv, d), dtype)
        table = FakeTensor((batch, capacity // page), "int32")
    else:
        kc, vc = FakeTensor((batch, capacity, heads_kv, d), dtype), FakeTensor((batch, capacity, heads_kv, d), dtype)
        table = None
    lengths = FakeTensor((batch,), "int32")
    extra = {}
    if new:
        extra = {"k": FakeTensor((batch, new, heads_kv, d), dtype), "v": FakeTensor((batch, new, heads_kv, d), dtype)}
    return (q, kc, vc, lengths), dict(page_table=table, **extra)


def test_plan_split_launches_decode_then_combine(fake):
    args, kw = _call_args(batch=1, capacity=262144, paged=True, page=256, new=1)
    kvcache.attention_with_kvcache(*args, **kw, fused_combine=False)
    plan = next(iter(kvcache._PLANS._plans.values()))
    assert plan.num_splits > 1 and set(plan.kernels) == {"append", "decode", "combine"}
    assert plan.specs["decode"].split and plan.specs["decode"].paged and plan.specs["decode"].pack_gqa
    assert [r["grid"] for r in fake.records] == [plan.grids["append"], plan.grids["decode"], plan.grids["combine"]]
    assert plan.grids["decode"] == (plan.num_splits, 8, 1)        # one CTA per (split, KV head, sequence)
    # a second call with other tensors hits the plan and patches only its pointers
    args2, kw2 = _call_args(batch=1, capacity=262144, paged=True, page=256, new=1)
    out = kvcache.attention_with_kvcache(*args2, **kw2, fused_combine=False)
    assert kvcache._PLANS.misses == 1 and len(fake.records) == 6
    q, kc, vc, lengths = args2
    pointers = struct.unpack_from("<9Q", fake.records[4]["head"], 0)
    assert pointers[:4] == (q.data_ptr(), kc.data_ptr(), vc.data_ptr(), out.data_ptr())
    assert pointers[4] == 0 and pointers[5] and pointers[6]           # split: partials, no direct LSE
    assert pointers[7:] == (lengths.data_ptr(), kw2["page_table"].data_ptr())
    combine = struct.unpack_from("<4Q", fake.records[5]["head"], 0)
    assert combine[:3] == (pointers[5], pointers[6], out.data_ptr()) and combine[3]   # LSE to scratch
    append = struct.unpack_from("<6Q", fake.records[3]["head"], 0)
    assert append == (kw2["k"].data_ptr(), kw2["v"].data_ptr(), kc.data_ptr(), vc.data_ptr(), lengths.data_ptr(),
                      kw2["page_table"].data_ptr())


@pytest.mark.parametrize("d, tile", [(80, 96), (8, 64), (200, 256)])
def test_a_padded_head_dim_plans_the_next_tiles_decode_and_d_wide_combine_and_append(fake, d, tile):
    """head_dim 80: the decode kernel of the 96 tile with head_dim_real=80 (no producer warps: they copy whole
    tile rows), the combine and append kernels at d itself (the split partials are d floats a row), the split
    partials sized so, the default scale 1/sqrt(80)."""
    args, kw = _call_args(batch=1, capacity=65536, paged=True, page=64, new=1, d=d)
    kvcache.attention_with_kvcache(*args, **kw, fused_combine=False)
    plan = next(iter(kvcache._PLANS._plans.values()))
    decode = plan.specs["decode"]
    assert (decode.head_dim, decode.head_dim_real, decode.producer_warps) == (tile, d, 0)
    assert f"_hd{tile}_d{d}_" in decode.variant and decode.split and plan.num_splits > 1
    assert plan.specs["combine"].head_dim == d and plan.specs["append"].head_dim == d
    assert [r["grid"] for r in fake.records] == [plan.grids["append"], plan.grids["decode"], plan.grids["combine"]]


def test_padded_decode_kernels_compile_without_spills_and_say_so():
    """NVRTC sm_90a and sm_80: the padded decode (contiguous and paged, split with either merge, a window and
    softcap) without spills; its source names the padded loads and MMA steps, the emit line says --head-dim 80."""
    for d in (8, 80, 112, 200, 248):
        for arch in ("sm80", "sm90"):
            for knobs in (dict(), dict(paged=True, split=True), dict(split=True, fused_combine=True, local=True,
                                                                     softcap=True)):
                spec = dec.default_decode_spec(arch, "bf16", d, seqlen_q=4, group=4, **knobs)
                r = dec.compile_spec(spec).resources
                assert (r.spill_stores, r.spill_loads, r.stack_bytes) == (0, 0, 0), (spec.variant, r)
        source = dec.render(spec)
        assert f"constexpr int  HEAD_DIM_REAL = {d};" in source and "chunk < REAL_CHUNKS" in source
        assert "QK_K16_STEPS" in source and f"--head-dim {d} " in dec.emit_command(spec)
        for extra in (dec.CombineSpec(head_dim=d), dec.AppendSpec(head_dim=d, paged=True)):
            r = dec.compile_spec(extra).resources
            assert (r.spill_stores, r.spill_loads, r.stack_bytes) == (0, 0, 0), (extra.variant, r)
    assert "HEAD_DIM_REAL = HEAD_DIM;" in dec.render(dec.default_decode_spec("sm90", "bf16", 128))


def test_plan_fused_combine_launches_no_combine(fake, monkeypatch):
    """fused_combine: append and decode only; the decode kernel gets O, the LSE and the counters
    (one int32 per work item, zeroed once per stream's scratch, never per call)."""
    memsets = []
    monkeypatch.setattr(driver, "memset_d32_async", lambda *a: memsets.append(a))
    args, kw = _call_args(batch=1, capacity=262144, paged=True, page=256, new=1)
    _, lse = kvcache.attention_with_kvcache(*args, **kw, fused_combine=True, return_lse=True)
    plan = next(iter(kvcache._PLANS._plans.values()))
    assert plan.num_splits > 1 and set(plan.kernels) == {"append", "decode"}
    assert plan.specs["decode"].split and plan.specs["decode"].fused_combine
    assert [r["grid"] for r in fake.records] == [plan.grids["append"], plan.grids["decode"]]
    q, kc, vc, lengths = args
    pointers = struct.unpack_from("<10Q", fake.records[1]["head"], 0)
    assert pointers[:5] == (q.data_ptr(), kc.data_ptr(), vc.data_ptr(), pointers[3], lse.data_ptr())
    assert pointers[5] and pointers[6] and pointers[9]                 # partials and counters in scratch
    assert pointers[7:9] == (lengths.data_ptr(), kw["page_table"].data_ptr())
    work_items = plan.grids["decode"][0] // plan.num_splits * plan.grids["decode"][1] * plan.grids["decode"][2]
    assert memsets == [(pointers[9], 0, work_items, fake.stream)]
    kvcache.attention_with_kvcache(*args, **kw, fused_combine=True, return_lse=True)   # a hit: no memset
    assert kvcache._PLANS.misses == 1 and len(memsets) == 1 and len(fake.records) == 4
    fake.stream = 2000                                                  # another stream: its own counters
    kvcache.attention_with_kvcache(*args, **kw, fused_combine=True, return_lse=True)
    assert len(memsets) == 2 and memsets[1][0] != pointers[9] and memsets[1][3] == 2000
    # fused is the default; fused_combine=False launches the combine kernel; one split ignores the knob
    kvcache.attention_with_kvcache(*args, **kw, return_lse=True)
    assert list(kvcache._PLANS._plans.values())[-1].specs["decode"].fused_combine
    memsets.clear()
    kvcache.attention_with_kvcache(*args, **kw, fused_combine=False)
    assert set(list(kvcache._PLANS._plans.values())[-1].kernels) == {"append", "decode", "combine"}
    kvcache.attention_with_kvcache(*args, **kw, fused_combine=True, num_splits=1)
    one = list(kvcache._PLANS._plans.values())[-1]
    assert set(one.kernels) == {"append", "decode"} and not one.specs["decode"].split
    assert not one.specs["decode"].fused_combine and not memsets     # (neither has counters)


def test_plan_no_split_for_a_full_batch(fake):
    args, kw = _call_args(batch=64, capacity=4096)
    _, lse = kvcache.attention_with_kvcache(*args, **kw, return_lse=True)
    plan = next(iter(kvcache._PLANS._plans.values()))
    assert plan.num_splits == 1 and set(plan.kernels) == {"decode"} and not plan.specs["decode"].split
    pointers = struct.unpack_from("<9Q", fake.records[0]["head"], 0)
    assert pointers[4] == lse.data_ptr() and pointers[5] == pointers[6] == 0
    kvcache.attention_with_kvcache(*args, **kw, num_splits=3)
    plan = list(kvcache._PLANS._plans.values())[-1]
    assert plan.num_splits == 3 and plan.grids["decode"] == (3, 8, 64)


def test_mha_without_packing_and_seqlen_q(fake):
    args, kw = _call_args(batch=2, seqlen_q=4, heads_q=16, heads_kv=16)
    kvcache.attention_with_kvcache(*args, **kw, num_splits=1)
    plan = next(iter(kvcache._PLANS._plans.values()))
    assert plan.grids["decode"] == (1, 16, 2)
    args, kw = _call_args(batch=2, seqlen_q=16, heads_q=32, heads_kv=4)      # 16 x 8 = 128 packed rows
    kvcache.attention_with_kvcache(*args, **kw, num_splits=1)
    plan = list(kvcache._PLANS._plans.values())[-1]
    spec = plan.specs["decode"]
    assert plan.grids["decode"] == (-(-128 // spec.block_m), 4, 2)


@pytest.mark.parametrize("change, match", [
    (lambda a, kw: ((a[0], a[1], a[2], FakeTensor((2,), "int64")), kw), "cache_seqlens has dtype int64"),
    (lambda a, kw: ((a[0], a[1], a[2], FakeTensor((3,), "int32")), kw), r"cache_seqlens has shape \(3,\)"),
    (lambda a, kw: ((FakeTensor((2, 17, 32, 128)),) + a[1:], kw), "seqlen_q=17"),
    (lambda a, kw: ((FakeTensor((2, 1, 32, 128), "float32"),) + a[1:], kw), "q has dtype float32"),
    (lambda a, kw: ((a[0], FakeTensor((2, 4096, 8, 128), "float16"), a[2], a[3]), kw), "k_cache has dtype float16"),
    (lambda a, kw: ((a[0], FakeTensor((2, 4096, 5, 128)), FakeTensor((2, 4096, 5, 128)), a[3]), kw), "heads_kv=5"),
    (lambda a, kw: ((FakeTensor((2, 1, 32, 84)),) + a[1:], kw), r"head_dim \(q.shape\[3\]\) 84 is not supported"),
    (lambda a, kw: (a, dict(kw, page_table=FakeTensor((2,), "int32"))), "page_table must be 2-D"),
    (lambda a, kw: (a, dict(kw, k=FakeTensor((2, 1, 8, 128)))), "k and v"),
    (lambda a, kw: (a, dict(kw, k=FakeTensor((2, 1, 8, 128)), v=FakeTensor((2, 1, 4, 128)))), "v has shape"),
    (lambda a, kw: (a, dict(kw, k=FakeTensor((2, 5000, 8, 128)), v=FakeTensor((2, 5000, 8, 128)))),
     "cache holds 4096"),
    (lambda a, kw: (a, dict(kw, num_splits=-1)), "num_splits"),
    (lambda a, kw: (a, dict(kw, block_z=3)), "block_z"),
    (lambda a, kw: (a, dict(kw, out=FakeTensor((2, 1, 32, 64)))), "out has shape"),
    (lambda a, kw: ((a[0].offset(2),) + a[1:], kw), "q's data pointer"),
])
def test_argument_errors_name_the_argument(fake, change, match):
    args, kw = _call_args()
    args, kw = change(args, kw)
    with pytest.raises((TypeError, ValueError)) as err:
        kvcache.attention_with_kvcache(*args, **kw)
    assert err.match(match)
    assert fake.records == []


def test_paged_errors(fake):
    args, _ = _call_args(paged=True, page=64)
    q, _, _, lengths = args
    with pytest.raises(ValueError, match="page_table has 3 rows"):
        kvcache.attention_with_kvcache(*args, page_table=FakeTensor((3, 64), "int32"))
    with pytest.raises(TypeError, match="page_table has dtype int64"):
        kvcache.attention_with_kvcache(*args, page_table=FakeTensor((2, 64), "int64"))
    odd = FakeTensor((128, 48, 8, 128))
    with pytest.raises(ValueError, match="power of two"):
        kvcache.attention_with_kvcache(q, odd, odd, lengths, page_table=FakeTensor((2, 64), "int32"))


@pytest.mark.parametrize("name, value", [
    ("rotary_cos", object()), ("cache_batch_idx", object()), ("cache_leftpad", object()),
    ("alibi_slopes", object()), ("attention_chunk", 128),
])
def test_flash_attn_alias_refuses_what_it_lacks(fake, name, value):
    args, _ = _call_args()
    q, kc, vc, lengths = args
    with pytest.raises(NotImplementedError, match=name):
        kvcache.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lengths, **{name: value})
    with pytest.raises(TypeError, match="frobnicate"):
        kvcache.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lengths, frobnicate=1)


def test_flash_attn_alias_runs(fake):
    args, kw = _call_args(paged=True)
    q, kc, vc, lengths = args
    out, lse = kvcache.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lengths, block_table=kw["page_table"],
                                               causal=True, return_softmax_lse=True, pack_gqa=False)
    plan = next(iter(kvcache._PLANS._plans.values()))
    assert plan.specs["decode"].paged and not plan.specs["decode"].pack_gqa
    assert lse.shape == (2, 32, 1) and out.shape == q.shape


def test_decode_params_values(fake):
    args, kw = _call_args(batch=3, seqlen_q=2, heads_q=8, heads_kv=2, d=64, capacity=1024, paged=True, page=16, new=2)
    kvcache.attention_with_kvcache(*args, **kw, softmax_scale=0.5, causal=False, num_splits=1)
    plan = next(iter(kvcache._PLANS._plans.values()))
    raw = plan.param_bytes("decode")
    offsets = {f.name: (f, off) for f, off in dec.layout("decode")[0]}

    def get(name):
        f, off = offsets[name]
        return struct.unpack_from({"i32": "<i", "i64": "<q", "f32": "<f", "ptr": "<Q"}[f.kind], raw, off)[0]
    assert (get("batch"), get("seqlen_q"), get("heads_q"), get("heads_kv"), get("group")) == (3, 2, 8, 2, 4)
    assert (get("rows_per_item"), get("num_splits"), get("seqlen_new"), get("capacity")) == (8, 1, 2, 1024)
    assert (get("num_pages"), get("page_shift"), get("causal")) == (3 * 1024 // 16, 4, 0)
    assert get("softmax_scale") == 0.5 and abs(get("scale_log2") - 0.5 * 1.4426950408889634) < 1e-6
    assert get("k_page_stride") == 16 * 2 * 64 and get("k_row_stride") == 2 * 64 and get("page_table_stride") == 64


# ------------------------------------------------------------------ CLI

def test_cli_kernels_tuple():
    from facodegen import cli
    assert cli.KERNELS[0] == "forward" and {"decode", "combine", "append"} <= set(cli.KERNELS)


@pytest.mark.parametrize("argv", [
    ["--arch", "sm90", "--kernel", "decode", "--page-size", "64", "--split-kv", "--pack-gqa"],
    ["--arch", "sm90", "--kernel", "decode", "--page-size", "64", "--split-kv", "--fused-combine"],
    ["--arch", "sm90", "--kernel", "decode", "--page-size", "16", "--split-kv", "--local", "--softcap"],
    ["--arch", "sm90", "--kernel", "decode", "--head-dim", "256", "--page-size", "16", "--producer-warps", "2"],
    ["--arch", "sm80", "--kernel", "decode", "--head-dim", "64", "--block-n", "128", "--stages", "4"],
    ["--kernel", "combine", "--head-dim", "96", "--dtype", "fp16"],
    ["--kernel", "append", "--paged"],
])
def test_cli_emit_reproduces_itself(argv):
    import shlex

    from click.testing import CliRunner

    from facodegen import cli
    runner = CliRunner()
    first = runner.invoke(cli.main, ["emit", *argv])
    assert first.exit_code == 0, first.output
    line = first.output.splitlines()[4].removeprefix("//").strip()
    assert line.startswith("facodegen emit --kernel")
    again = runner.invoke(cli.main, shlex.split(line)[1:])
    assert again.exit_code == 0 and again.output == first.output


def test_cli_decode_errors_and_inspect():
    from click.testing import CliRunner

    from facodegen import cli
    runner = CliRunner()
    bad = runner.invoke(cli.main, ["emit", "--kernel", "decode", "--causal"])
    assert bad.exit_code == 2 and "--causal" in bad.output
    bad = runner.invoke(cli.main, ["emit", "--kernel", "decode", "--block-n", "32"])
    assert bad.exit_code == 2 and "block_n" in bad.output
    bad = runner.invoke(cli.main, ["emit", "--split-kv"])
    assert bad.exit_code == 2 and "--kernel decode" in bad.output
    bad = runner.invoke(cli.main, ["emit", "--kernel", "decode", "--fused-combine"])      # no --split-kv
    assert bad.exit_code == 2 and "fused_combine" in bad.output
    bad = runner.invoke(cli.main, ["emit", "--kernel", "combine", "--fused-combine"])
    assert bad.exit_code == 2 and "--fused-combine" in bad.output
    bad = runner.invoke(cli.main, ["emit", "--kernel", "append", "--producer-warps", "1"])
    assert bad.exit_code == 2 and "--producer-warps" in bad.output
    bad = runner.invoke(cli.main, ["emit", "--kernel", "decode", "--arch", "sm80", "--producer-warps", "1"])
    assert bad.exit_code == 2 and "producer_warps" in bad.output and "sm90" in bad.output
    bad = runner.invoke(cli.main, ["emit", "--producer-warps", "1"])
    assert bad.exit_code == 2 and "--kernel decode" in bad.output
    res = runner.invoke(cli.main, ["inspect", "--kernel", "decode", "--arch", "sm80", "--head-dim", "64", "--resources"])
    assert res.exit_code == 0, res.output
    assert "flash_decode_sm80_bf16_hd64" in res.output and "0 B stores, 0 B loads" in res.output


# ------------------------------------------------------------------ facodegen.bench.decode (pure parts)

def _bench_script():
    import importlib.util
    from pathlib import Path
    path = Path(__file__).resolve().parents[1] / "scripts" / "bench_decode.py"
    spec = importlib.util.spec_from_file_location("bench_decode", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_decode"] = module
    spec.loader.exec_module(module)
    return module


def test_bench_decode_grid_and_table(tmp_path):
    import csv
    import io

    from facodegen.bench import decode as bd
    from facodegen.bench import inputs
    grid = bd.cells()
    assert grid and all(c.kv_bytes <= 60e9 for c in grid)
    assert not any(c.batch == 64 and c.context == 262144 and c.d == 128 for c in grid)   # 68.7 GB and more: skipped
    assert any(c.batch == 8 and c.context == 262144 and c.heads_kv == 32 for c in grid)   # 34 GB kept
    assert {c.layout for c in grid} == set(bd.LAYOUTS) == {"contiguous", "paged16", "paged64", "paged256"}
    assert {c.d for c in grid} == {64, 128, 256}                       # issue 39's head dims
    assert not any(c.d == 256 and c.batch == 64 and c.context == 262144 for c in grid)
    cell = bd.Cell(1, 262144, 32, 8, 128, "paged64")
    assert cell.page_size == 64 and cell.kv_bytes == 2 * 262144 * 8 * 128 * 2
    assert bd.parse_int_list("1k,256k,8") == (1024, 262144, 8)
    assert bd.parse_heads("32/32,64/8") == ((32, 32), (64, 8))
    assert bd.input_sets(10 ** 10) == 1 and bd.input_sets(1 << 20) == inputs.MAX_INPUT_SETS == 8
    assert bd.input_sets(30 * 2 ** 20) == 4                 # 2 x 60 MiB of L2 over 30 MiB of K+V, as before
    assert abs(bd.tbps(4 * 10 ** 9, 1.0) - 4.0) < 1e-12 and bd.tbps(1, None) is None
    rows = [{"cell": "a", "kv_bytes": 1e9, "facodegen": 4.0, "fa3": 3.8, "sdpa": 4.1, "splits": 3},
            {"cell": "b", "kv_bytes": 1e9, "facodegen": 3.0}]
    text = bd.table(rows)
    assert "1.05x" in text and "0.98x" in text and "| b |" in text and text.count("\n") == 3
    assert abs(bd.geomean([1.0, 4.0]) - 2.0) < 1e-12
    assert len(bd.cells(**bd.QUICK)) == 10        # b64 x 256k x d128 (68.7 GB) skipped in both layouts
    assert bd.suite_cells(quick=True) == bd.cells(**bd.QUICK) and bd.suite_cells(head_dim=64) == bd.cells(d=(64,))
    assert bd.suite_cells(quick=True, head_dim=64) == []
    assert "geomean facodegen / fa3: 1.053x" in bd.summary(rows)
    records = list(csv.DictReader(io.StringIO(bd.to_csv(rows))))
    assert [(r["cell"], r["impl"]) for r in records] == [("a", "facodegen"), ("a", "fa3"), ("a", "sdpa"),
                                                         ("b", "facodegen")]
    assert float(records[1]["ratio"]) == pytest.approx(4.0 / 3.8, rel=1e-5)
    assert "graph:" not in text                       # no replay in any row: no graph columns
    # CUDA-graph replays: their own columns, ratio to the best peer's replay, geomean line, CSV records
    rows[0].update(facodegen_graph=4.4, fa3_graph=4.0, sdpa_graph=4.2)
    text = bd.table(rows)
    assert "graph: facodegen | FA3 | SDPA | vs best |" in text and "| 4.40 | 4.00 | 4.20 | 1.05x |" in text
    assert text.splitlines()[1].count("---") == 13
    assert "geomean facodegen / fa3 (CUDA-graph replays): 1.100x" in bd.summary(rows)
    records = list(csv.DictReader(io.StringIO(bd.to_csv(rows))))
    graph_fa3 = [r for r in records if r["impl"] == "fa3_graph"]
    assert len(graph_fa3) == 1 and float(graph_fa3[0]["ratio"]) == pytest.approx(4.4 / 4.0, rel=1e-5)
    paths = bd.write_decode_results(rows, tmp_path, env={"gpu": "fake"}, grid=bd.QUICK)
    assert paths["json"].name == "bench-decode.json" and paths["md"].read_text().startswith("| cell |")
    with pytest.raises(ValueError, match="layout paged7"):
        bd.cells(layout=("paged7",))


def test_bench_decode_script_lists_cells(capsys):
    bd = _bench_script()
    assert bd.main(["--quick", "--list"]) == 0
    assert "b64 ctx8192 h32/8 d128 paged64" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        bd.main(["--layout", "paged7", "--list"])


def test_bench_decode_script_hands_its_grid_to_the_package(monkeypatch, tmp_path):
    from facodegen.bench import decode as dec
    from facodegen.bench import results
    bd = _bench_script()
    seen = {}
    monkeypatch.setattr(results, "environment", lambda: {"gpu": "fake"})
    monkeypatch.setattr(dec, "run_decode", lambda todo, peers, log=print, variants=(), graphs=True:
                        seen.update(todo=todo, peers=peers, **({"variants": variants} if variants else {}),
                                    **({} if graphs else {"graphs": False})) or [])
    assert bd.main(["--batch", "1", "--context", "32k", "--heads", "32/8", "--d", "128", "--layout", "contiguous",
                    "--peers", "fa3", "--out", str(tmp_path)]) == 0
    assert seen == {"todo": [dec.Cell(1, 32768, 32, 8, 128, "contiguous")], "peers": ("fa3",)}
    assert (tmp_path / "bench-decode.json").exists()
    assert bd.main(["--batch", "1", "--context", "32k", "--heads", "32/8", "--d", "128", "--layout", "contiguous",
                    "--variant", "fused_combine=true", "--out", str(tmp_path)]) == 0
    assert seen["variants"] == [{"fused_combine": True}]
    assert bd.main(["--batch", "1", "--context", "32k", "--heads", "32/8", "--d", "128", "--layout", "contiguous",
                    "--no-graphs", "--out", str(tmp_path)]) == 0
    assert seen["graphs"] is False
    with pytest.raises(SystemExit):
        bd.main(["--variant", "fused_combine", "--list"])


def test_split_count_follows_the_gpu(fake, monkeypatch):
    """An A100 holds one ~100 KB decode CTA per SM (108 slots), an H200 one 135 KB CTA of a contiguous
    cache at d128 (132 slots): fewer splits on the A100."""
    args, kw = _call_args(batch=1, capacity=262144)
    kvcache.attention_with_kvcache(*args, **kw)
    h200 = list(kvcache._PLANS._plans.values())[-1].num_splits
    a100 = api.DeviceInfo(0, "NVIDIA A100-SXM4-80GB", (8, 0), 108, 166912)
    monkeypatch.setattr(kvcache, "device_info", lambda ordinal: a100)
    kvcache._PLANS.clear()                      # (the same call key: a process sees one GPU per ordinal)
    kvcache.attention_with_kvcache(*args, **kw)
    plan = list(kvcache._PLANS._plans.values())[-1]
    assert plan.specs["decode"].arch == "sm80"
    assert (h200, plan.num_splits) == (dec.num_splits_heuristic(8, 4096, 132, 1),
                                       dec.num_splits_heuristic(8, 4096, 108, 1))
    assert plan.num_splits < h200


@pytest.mark.parametrize("knobs", [
    {"num_splits": 1}, {"num_splits": 3}, {"num_splits": 8, "block_n": 32, "num_warps": 2},
    {"num_splits": 2, "pack_gqa": False}, {"num_splits": 2, "block_m": 16, "causal": False},
])
@pytest.mark.parametrize("paged", [False, True])
def test_kernel_algorithm_matches_the_reference(knobs, paged):
    """The decode kernel's tiling, split, warp merge and combine (reference.decode_tiled_reference)
    against the direct float64 formula, with appended tokens, lengths 0 and past the capacity,
    seqlen_q 2 x GQA 4 (8 packed rows: padding rows in a 16-row tile), shuffled pages."""
    from facodegen.verify.reference import decode_tiled_reference
    rng = np.random.default_rng(5)
    q, kc, vc, kn, vn, lengths, table, kp, vp = _random_case(rng, batch=3, seqlen_q=2, heads_q=8, heads_kv=2, d=16,
                                                              capacity=96, page=16, new=2)
    lengths = np.array([0, 40, 200], np.int32)                  # 200: past the capacity, clamped
    causal = knobs.pop("causal", True)
    if paged:
        ref_o, ref_lse, kc2, vc2 = kvcache_reference(q, kp, vp, lengths, page_table=table, k=kn, v=vn, causal=causal)
    else:
        ref_o, ref_lse, kc2, vc2 = kvcache_reference(q, kc, vc, lengths, k=kn, v=vn, causal=causal)
    o, lse = decode_tiled_reference(q, kc2, vc2, lengths, page_table=table if paged else None, seqlen_new=2,
                                    causal=causal, **knobs)
    np.testing.assert_allclose(o, ref_o, atol=1e-12)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref_lse))
    fin = np.isfinite(ref_lse)
    np.testing.assert_allclose(lse[fin], ref_lse[fin], atol=1e-12)


@pytest.mark.parametrize("window_size, softcap", [((7, -1), 0.0), ((0, 0), 0.0), ((20, 3), 0.0), ((-1, 5), 0.0),
                                                   ((-1, -1), 3.0), ((12, 0), 2.5), ((200, -1), 0.0)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_kernel_algorithm_with_a_window_and_softcap_matches_the_reference(window_size, softcap, causal, num_splits):
    """The LOCAL / SOFTCAP kernel's algorithm (decode_tiled_reference with the values decode_window gives the
    kernel: the tile's keys from its first row's first key's block on, split among the splits, each row's
    left edge masked; tanh before the mask) against the direct float64 formula with the window on each
    sequence's diagonal, on lengths 0 and past the capacity, appended tokens, 2 queries x GQA 4, pages."""
    from facodegen.verify.reference import decode_tiled_reference
    rng = np.random.default_rng(6)
    q, kc, vc, kn, vn, lengths, table, kp, vp = _random_case(rng, batch=3, seqlen_q=2, heads_q=8, heads_kv=2, d=16,
                                                              capacity=96, page=16, new=2)
    lengths = np.array([0, 40, 200], np.int32)
    ref_o, ref_lse, kc2, vc2 = kvcache_reference(q, kp, vp, lengths, page_table=table, k=kn, v=vn, causal=causal,
                                                 window_size=window_size, softcap=softcap)
    problem = kvcache._Problem(3, 2, 8, 2, 16, "bf16", True, 16, kp.shape[0], 96, 2)
    window = kvcache.decode_window(window_size, softcap, causal, problem)    # (None: the plain kernel's values)
    local = window is not None and window.local
    o, lse = decode_tiled_reference(q, kc2, vc2, lengths, page_table=table, seqlen_new=2, causal=causal,
                                    num_splits=num_splits, block_n=16, num_warps=2,
                                    window=(window.window_left, window.window_right) if local else None,
                                    softcap=window.softcap if window is not None else 0.0)
    np.testing.assert_allclose(o, ref_o, atol=1e-12)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref_lse))
    fin = np.isfinite(ref_lse)
    np.testing.assert_allclose(lse[fin], ref_lse[fin], atol=1e-12)


def test_decode_window_resolves_the_call_and_names_bad_arguments():
    """None where nothing is on; causal folds into a right side of 0; an unbounded side is more keys than
    the cache and the new tokens; a window whose left is unbounded and whose right causal already ends
    runs no LOCAL kernel (softcap alone: the plain kernel with SOFTCAP); errors name the argument."""
    problem = kvcache._Problem(2, 4, 32, 8, 128, "bf16", False, 0, 0, 4096, 0)
    big = 4096 + 4 + 1
    assert kvcache.decode_window((-1, -1), 0.0, True, problem) is None
    assert kvcache.decode_window((-1, 7), 0.0, True, problem) is None          # causal: right 0 anyway
    w = kvcache.decode_window((256, 7), 0.0, True, problem)
    assert (w.local, w.window_left, w.window_right, w.softcap) == (True, 256, 0, 0.0)
    assert w.visible_keys(problem) == 256 + 4 + 1
    w = kvcache.decode_window((-1, 3), 0.0, False, problem)
    assert (w.local, w.window_left, w.window_right) == (True, big, 3) and w.visible_keys(problem) == 4096
    w = kvcache.decode_window((10**9, -1), 30.0, False, problem)
    assert (w.local, w.window_left, w.window_right, w.softcap) == (True, big, big, 30.0)
    w = kvcache.decode_window((-1, -1), 30.0, True, problem)
    assert (w.local, w.softcap) == (False, 30.0)
    for args, error, words in [(((4, -7), 0.0), ValueError, "window_size: the right size must be >= -1"),
                               ((4, 0.0), ValueError, "window_size must be a pair"),
                               (((4, 0), -1.0), ValueError, "softcap must be a finite number >= 0"),
                               (((1.5, 0), 0.0), TypeError, "window_size: the left size must be an integer")]:
        with pytest.raises(error, match=words.replace("(", r"\(")):
            kvcache.decode_window(*args, True, problem)


def test_window_and_softcap_plans(fake):
    """The LOCAL / SOFTCAP decode kernel where a call gives window_size / softcap: the variant struct's
    fields (the window in the bottom-right frame, softcap_scale = scale / c and softmax_scale = c), a plan
    per window or softcap value (they key the fast path's plans too), the split heuristic on the keys a tile
    sees through a bounded left side, and flash_attn_with_kvcache's window_size and softcap passed on."""
    args, kw = _call_args(batch=1, capacity=262144, paged=True, page=64)
    kvcache.attention_with_kvcache(*args, **kw)
    full = list(kvcache._PLANS._plans.values())[-1]
    kvcache.attention_with_kvcache(*args, **kw, window_size=(1023, 0), softcap=30.0)
    plan = list(kvcache._PLANS._plans.values())[-1]
    spec = plan.specs["decode"]
    assert spec.local and spec.softcap and spec.paged and dec.args_of(spec).endswith("_variants")
    offsets = {f.name: (f, off) for f, off in dec.layout(dec.args_of(spec))[0]}

    def get(name):
        f, off = offsets[name]
        return struct.unpack_from({"i32": "<i", "i64": "<q", "f32": "<f", "ptr": "<Q"}[f.kind],
                                  plan.param_bytes("decode"), off)[0]
    assert (get("window_left"), get("window_right")) == (1023, 0)
    assert get("softmax_scale") == pytest.approx(30.0) and get("softcap_scale") == pytest.approx(128 ** -0.5 / 30)
    assert plan.num_splits < full.num_splits       # 1,025 keys a tile, not 262,144: fewer splits
    assert plan.num_splits == dec.num_splits_heuristic(8, -(-1025 // spec.block_n) + 1, 132,
                                                       dec.ctas_per_sm(spec, 233472))
    kvcache.attention_with_kvcache(*args, **kw, window_size=(1023, 0), softcap=30.0)    # the same: a hit
    kvcache.attention_with_kvcache(*args, **kw, window_size=(511, 0), softcap=30.0)     # another window: a plan
    assert kvcache._PLANS.misses == 3
    q, kc, vc, lengths = args
    kvcache.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lengths, block_table=kw["page_table"], causal=True,
                                    window_size=(-5, -1), softcap=-1.0)                 # FlashAttention's "off"s
    assert kvcache._PLANS.misses == 3          # (the first call's plan)
    kvcache.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lengths, block_table=kw["page_table"],
                                    window_size=(64, 0), softcap=5.0)
    spec = list(kvcache._PLANS._plans.values())[-1].specs["decode"]
    assert spec.local and spec.softcap
    with pytest.raises(ValueError, match="window_size: the right size"):
        kvcache.attention_with_kvcache(*args, **kw, window_size=(4, -3))


def test_variant_decode_kernels_compile_without_spills():
    """LOCAL and SOFTCAP, alone and together, with splits, pages and the fused combine, at head dims 64,
    128, 256 on both archs: no spills, no local memory; the default kernels render as before (the variant
    fields and code appear only where a switch is on)."""
    from facodegen.spec.decode import compile_spec
    for arch in ("sm80", "sm90"):
        for head_dim in (64, 128, 256):
            for variant in (dict(local=True), dict(softcap=True),
                            dict(local=True, softcap=True, split=True, fused_combine=True, paged=True)):
                spec = dec.default_decode_spec(arch, "bf16", head_dim, seqlen_q=4, group=4, **variant)
                kernel = compile_spec(spec, sm="sm_80" if arch == "sm80" else None)
                r = kernel.resources
                assert (r.stack_bytes, r.spill_stores, r.spill_loads) == (0, 0, 0), (spec.variant, kernel.log)
    plain = dec.render(dec.default_decode_spec("sm90", "bf16", 128, group=4))
    assert "LOCAL" not in plain and "window_left" not in plain and "softcap" not in plain
    local = dec.render(dec.default_decode_spec("sm90", "bf16", 128, group=4, local=True))
    lines = [x.strip() for x in local.splitlines()]
    for line in ("const int kv_first = row_key_first(p, row_begin, heads_per_cta, seqlen_k);",
                 "const int block_begin = first_block + split_begin;",
                 "if (key0 + BLOCK_N > kv_unmasked || key0 < kv_left_unmasked) {",
                 "mask_before_first(s[mt], first, key0 + warp_key0 + 2 * tp.t);"):
        assert line in lines, line
    assert "--local" in lines[4]


def test_check_values_names_the_argument_and_the_bad_entry():
    """check_inputs=True: negative lengths, lengths past the capacity with the new tokens, and page
    indices out of range among the pages a sequence uses are errors naming cache_seqlens/page_table;
    an out-of-range entry in pages a sequence does not reach is not."""
    table = np.array([[0, 1, 2, 3], [4, 5, 99, -1]])
    kvcache.check_values(np.array([200, 128]), table, seqlen_new=0, capacity=256, num_pages=8)   # uses 2 pages of seq 1
    with pytest.raises(ValueError, match=r"cache_seqlens\[1\] = -3 is negative"):
        kvcache.check_values(np.array([0, -3]), None, seqlen_new=0, capacity=256, num_pages=0)
    with pytest.raises(ValueError, match=r"cache_seqlens\[0\] = 250 plus 7 new token\(s\) exceeds the cache capacity 256"):
        kvcache.check_values(np.array([250, 0]), None, seqlen_new=7, capacity=256, num_pages=0)
    with pytest.raises(ValueError, match=r"page_table\[1, 2\] = 99 is not a page of the cache \(0 .. 7\)"):
        kvcache.check_values(np.array([0, 129]), table, seqlen_new=0, capacity=256, num_pages=8)
    with pytest.raises(ValueError, match=r"page_table\[1, 2\] = 99"):
        kvcache.check_values(np.array([0, 128]), table, seqlen_new=1, capacity=256, num_pages=8)   # the append's page


def test_check_inputs_runs_before_the_call():
    torch = pytest.importorskip("torch")
    q = torch.zeros(2, 1, 4, 64, dtype=torch.bfloat16)
    cache = torch.zeros(2, 128, 2, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"cache_seqlens\[1\] = 129 plus 0 new token\(s\) exceeds the cache capacity 128"):
        kvcache.attention_with_kvcache(q, cache, cache, torch.tensor([5, 129], dtype=torch.int32), check_inputs=True)


def test_bench_decode_cell_specs_are_the_calls_kernels(monkeypatch):
    """warm_cache.py --decode-grid compiles what the grid's calls launch: on an H200, batch 1 at 32k keys
    splits (decode + combine, or a fused combine), and a paged cell gets a paged decode kernel."""
    from facodegen.bench import decode as bd
    from facodegen.ops import api, kvcache
    from facodegen.spec import decode as dec
    monkeypatch.setattr(api, "device_info", lambda device=0: api.DeviceInfo(0, "NVIDIA H200", (9, 0), 132, 232448))
    specs = bd.cell_specs(bd.Cell(1, 32768, 32, 8, 128, "contiguous"))
    decode = specs[0]
    assert isinstance(decode, dec.DecodeSpec) and decode.arch == "sm90" and decode.head_dim == 128
    assert decode.split and not decode.paged
    assert len(specs) == (1 if decode.fused_combine else 2)
    paged = bd.cell_specs(bd.Cell(8, 8192, 32, 32, 256, "paged16"))[0]
    assert paged.paged and paged.head_dim == 256
    problem = kvcache._Problem(1, 1, 32, 8, 128, "bf16", False, 0, 0, 32768, 0)
    assert specs == list(kvcache.plan_specs(problem, "sm90", 132, 0, {}, kvcache._smem_per_sm(api.device_info()))[0]
                         .values())


def test_decode_step_fast_path_hits_the_plan_the_checked_path_built(fake, monkeypatch):
    """attention_with_kvcache's fast path (a step: no new tokens, out=, knobs) finds the plan _eager stored
    under the same key, patches the new addresses and launches through launch_step; anything that changes
    the launch misses (a stride, the page table's shape, the current device, num_splits' type), and a
    misaligned view or a non-tensor cache_seqlens still gets the checked path's error."""
    launched = []
    real_step = kvcache.DecodePlan.launch_step
    monkeypatch.setattr(kvcache.DecodePlan, "launch_step",
                        lambda self, *a: launched.append(a) or real_step(self, *a))
    args, kw = _call_args(batch=4, capacity=4096, paged=True, page=64)
    kvcache.attention_with_kvcache(*args, **kw)
    assert kvcache._PLANS.misses == 1 and not launched           # the first call resolved on the checked path
    plan = next(iter(kvcache._PLANS._plans.values()))
    assert plan.step_ready and [name for name, _ in plan._step_kernels] == ["decode"]
    args2, kw2 = _call_args(batch=4, capacity=4096, paged=True, page=64)     # other tensors, same layouts
    out = kvcache.attention_with_kvcache(*args2, **kw2)
    assert kvcache._PLANS.misses == 1 and len(launched) == 1
    q, kc, vc, lengths = args2
    assert launched[0][1:] == (q.data_ptr(), kc.data_ptr(), vc.data_ptr(), out.data_ptr(), 0, lengths.data_ptr(),
                               kw2["page_table"].data_ptr())
    head = struct.unpack_from("<9Q", fake.records[-1]["head"], 0)
    assert head[:4] == (q.data_ptr(), kc.data_ptr(), vc.data_ptr(), out.data_ptr()) and head[7:9] == launched[0][6:8]
    out, lse = kvcache.attention_with_kvcache(*args2, **kw2, return_lse=True)     # another key: a plan of its own
    assert kvcache._PLANS.misses == 2 and lse.shape == (4, 32, 1)
    _, lse2 = kvcache.attention_with_kvcache(*args2, **kw2, return_lse=True)
    assert kvcache._PLANS.misses == 2 and launched[-1][5] == lse2.data_ptr() != 0
    wide = FakeTensor((4, 4096 // 32), "int32")                    # the page table's shape: a miss
    kvcache.attention_with_kvcache(q, kc, vc, lengths, page_table=wide.as_strided((4, 64), (128, 1)))
    assert kvcache._PLANS.misses == 3
    q_strided = FakeTensor(q.shape, "bfloat16", strides=(32 * 128 * 2, 32 * 128, 128, 1))
    kvcache.attention_with_kvcache(q_strided, kc, vc, lengths, **kw2)
    assert kvcache._PLANS.misses == 4
    fake.device = 1                                                # another current device: a miss, not a wrong hit
    kvcache.attention_with_kvcache(*args2, **kw2)
    assert kvcache._PLANS.misses == 5
    fake.device = 0
    with pytest.raises(ValueError, match="num_splits"):
        kvcache.attention_with_kvcache(*args2, **kw2, num_splits=True)   # True == 1 must not hit num_splits=1's plan
    with pytest.raises(ValueError, match="q"):
        kvcache.attention_with_kvcache(q.offset(8), kc, vc, lengths, **kw2)      # misaligned: the checked path's error
    with pytest.raises(TypeError, match="cache_seqlens"):
        kvcache.attention_with_kvcache(q, kc, vc, 4096, **kw2)


def test_head_dim_256_takes_three_stages_on_long_splits():
    """sm90 d256: 3 ring stages (192 KB) where a split has >= 32 key blocks (contiguous, or pages of at
    least a block), 2 on short splits and pages of 16, the caller's stages/block_n kept; other head dims
    and sm80 as default_decode_spec makes them."""
    from facodegen.ops import kvcache
    from facodegen.spec import decode as dec

    def spec(d, capacity, batch=1, arch="sm90", knobs=None, splits=0, page=0):
        problem = kvcache._Problem(batch, 1, 32, 8, d, "bf16", page > 0, page, batch * capacity // max(page, 1),
                                   capacity, 0)
        return kvcache.choose(problem, arch, 132, splits, dict(knobs or {}))
    long_split, splits = spec(256, 262144)
    assert long_split.stages == 3 and 262144 // 64 // splits >= 32
    assert long_split.smem_bytes <= 227 * 1024
    assert spec(256, 8192)[0].stages == 2                       # 16 splits of 8 blocks: the default's 2
    assert spec(256, 262144, knobs={"stages": 2})[0].stages == 2
    assert spec(256, 262144, knobs={"block_n": 64})[0].stages == 2
    assert spec(128, 262144)[0].stages == dec.default_decode_spec("sm90", "bf16", 128, group=4).stages
    assert spec(256, 262144, arch="sm80")[0].stages == dec.default_decode_spec("sm80", "bf16", 256, group=4).stages
    assert spec(256, 4096, splits=1)[0].stages == 3             # one split of 64 blocks
    assert spec(256, 262144, page=64)[0].stages == spec(256, 262144, page=256)[0].stages == 3
    assert spec(256, 262144, page=16)[0].stages == 2            # pages smaller than a block keep 2


def test_producer_warps_default_follows_head_dim_and_the_split():
    """The call's decode runs 4 producer warps at head_dim 256 (split or not), 2 at 128 where the keys are
    not split and none where they are, none at 64 or on sm80; the caller's producer_warps wins."""
    from facodegen.ops import kvcache

    def spec(d, batch, arch="sm90", knobs=None, page=0):
        problem = kvcache._Problem(batch, 1, 32, 8, d, "bf16", page > 0, page, batch * 32768 // max(page, 1),
                                   32768, 0)
        return kvcache.choose(problem, arch, 132, 0, dict(knobs or {}))
    assert [spec(256, b)[0].producer_warps for b in (1, 64)] == [4, 4]
    (split128, splits), (whole128, one) = spec(128, 1, page=16), spec(128, 64, page=16)
    assert splits > 1 and one == 1 and (split128.producer_warps, whole128.producer_warps) == (0, 2)
    assert spec(64, 64)[0].producer_warps == 0 and spec(256, 64, arch="sm80")[0].producer_warps == 0
    assert spec(256, 64, knobs={"producer_warps": 0})[0].producer_warps == 0
    assert spec(128, 1, knobs={"producer_warps": 1})[0].producer_warps == 1
    assert dec.default_decode_spec("sm90", "bf16", 128, split=True).producer_warps == 0
    assert dec.default_decode_spec("sm90", "bf16", 128).producer_warps == 2


def test_decode_one_script_builds_the_bench_cell_and_its_knobs():
    """scripts/decode_one.py (one cell's call, for a profiler) takes bench_decode's cell and knob syntax."""
    import importlib.util
    from pathlib import Path
    from facodegen.bench import decode as bd
    path = Path(__file__).resolve().parents[1] / "scripts" / "decode_one.py"
    spec = importlib.util.spec_from_file_location("decode_one", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    args = module.parse_args(["--batch", "8", "--context", "32k", "--heads", "32/8", "--d", "256", "--layout",
                              "paged16", "--knob", "stages=3", "--knob", "fused_combine=0"])
    assert args.cell == bd.Cell(8, 32768, 32, 8, 256, "paged16") and args.cell.page_size == 16
    assert args.knobs == {"stages": 3, "fused_combine": False} and not args.fa3
    with pytest.raises(SystemExit):
        module.parse_args(["--batch", "1", "--context", "1k", "--heads", "8/8", "--d", "64", "--knob", "nope=1"])


def test_bench_decode_bar_lines_count_the_cells_that_miss_issue_39s_bars():
    from facodegen.bench import decode as bd

    def row(batch, layout, ours, fa3=None, sdpa=None, graph=None, context=32768):
        cell = bd.Cell(batch, context, 32, 8, 128, layout)
        r = {"cell": cell.name, **cell.__dict__, "kv_bytes": cell.kv_bytes, "facodegen": ours}
        r.update({k: v for k, v in (("fa3", fa3), ("sdpa", sdpa), ("facodegen_graph", graph)) if v})
        return r
    rows = [row(1, "contiguous", 3.5, fa3=3.0, sdpa=3.2, graph=3.7),      # 134 MB: every bar met
            row(1, "paged64", 3.2, fa3=3.4, graph=3.3),                   # below 3.4, 0.94x FA3, 0.91x contiguous
            row(1, "paged16", 3.45, fa3=3.5),                             # pages of 16: not in the paged bar
            row(1, "contiguous", 1.0, fa3=0.5, context=1024)]             # 4 MB: only the peer bar applies
    lines = bd.bar_lines(rows)
    assert lines[0] == ("bar >= 3.4 TB/s where K+V >= 64 MB (public call): 2 of 3 cells; lowest "
                        "b1 ctx32768 h32/8 d128 paged64 3.20")
    assert lines[1].startswith("bar >= 3.4 TB/s where K+V >= 64 MB (CUDA-graph replays): 1 of 2 cells")
    assert lines[2] == "bar >= 0.97x the best peer: 3 of 4 cells; lowest b1 ctx32768 h32/8 d128 paged64 0.94x"
    assert lines[3] == ("bar paged 64/256 >= 0.95x contiguous where K+V >= 64 MB: 0 of 1 cells; lowest "
                        "b1 ctx32768 h32/8 d128 paged64 0.91x")
    assert "bar >= 0.97x the best peer: 3 of 4 cells" in bd.summary(rows)
    assert bd.bar_lines([row(1, "contiguous", 3.5)]) == ["bar >= 3.4 TB/s where K+V >= 64 MB (public call): "
                                                         "1 of 1 cells"]


def test_serving_host_cost_script_documents_itself_without_torch():
    """scripts/serving_host_cost.py (issue 39's host-cost rows) imports torch only when it runs: --help works
    on a machine without it and says what it times."""
    import subprocess
    from pathlib import Path
    script = Path(__file__).resolve().parents[1] / "scripts" / "serving_host_cost.py"
    result = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "flash_attn_with_kvcache" in result.stdout and "--calls" in result.stdout


# ------------------------------------------------------------------ producer warps

@pytest.mark.parametrize("fields, knob", [
    ({"arch": "sm80", "producer_warps": 1}, "producer_warps"),     # mbarrier.try_wait is sm90's
    ({"head_dim": 192, "producer_warps": 1}, "producer_warps"),    # 24 chunks a row: a lane would idle
    ({"producer_warps": 3}, "producer_warps"),
])
def test_producer_warps_spec_errors_name_the_knob(fields, knob):
    with pytest.raises(SpecError) as err:
        dec.DecodeSpec(**fields)
    assert err.value.field == knob and knob in str(err.value)


def test_producer_warps_name_threads_and_shared_memory():
    spec = dec.default_decode_spec("sm90", "bf16", 256, group=8, paged=True, producer_warps=1)
    assert spec.variant.endswith("_paged_pw1") and spec.threads == 32 * 5
    assert spec.static_smem_bytes == 16 * spec.stages
    assert dec.default_decode_spec("sm90", "bf16", 256, producer_warps=0).static_smem_bytes == 0
    source = dec.render(spec)
    assert "--producer-warps 1" in source and "producer_warps" not in dec.render(replace(spec, producer_warps=0))


@pytest.mark.parametrize("d, paged, warps", [(256, True, 1), (256, True, 2), (256, False, 1), (128, True, 1),
                                             (64, True, 2)])
def test_producer_warps_compile_without_spills_and_wait_on_mbarriers(d, paged, warps):
    """The producers' copies arrive on the stage's mbarrier (ARRIVES.LDGSTSBAR) and the math warps wait on
    it (SYNCS), where the plain kernel waits on its own cp.async groups (LDGDEPBAR, DEPBAR); no local
    memory, at most 255 registers."""
    spec = dec.default_decode_spec("sm90", "bf16", d, group=8, paged=paged, split=True, fused_combine=True,
                                   producer_warps=warps)
    kernel = dec.compile_spec(spec)
    r = kernel.resources
    assert (r.spill_stores, r.spill_loads, r.stack_bytes) == (0, 0, 0) and r.registers <= 255 and not kernel.warnings
    try:
        sass = kernel.sass()
        plain = dec.compile_spec(replace(spec, producer_warps=0)).sass()
    except Exception as err:  # noqa: BLE001 (no cuobjdump: nothing to read)
        pytest.skip(f"cuobjdump: {err}")
    assert "ARRIVES.LDGSTSBAR" in sass and "SYNCS" in sass and "LDGSTS" in sass
    assert "ARRIVES" not in plain and "LDGDEPBAR" in plain


def test_producer_warps_plan_launches_their_threads(fake):
    args, kw = _call_args(batch=2, capacity=4096, paged=True, page=16, d=256)
    kvcache.attention_with_kvcache(*args, **kw, producer_warps=1)
    plan = next(iter(kvcache._PLANS._plans.values()))
    assert plan.specs["decode"].producer_warps == 1
    decode = [r for r in fake.records if r["smem"] == plan.specs["decode"].smem_bytes]
    assert decode and all(r["threads"] == 160 for r in decode)
