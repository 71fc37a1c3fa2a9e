"""The launch-plan cache of facodegen.attention, on the CPU: a fake torch module and a fake driver
record what each call would launch, so hits, misses and what a hit writes into FlashParams can be
checked without a GPU. The GPU tests (tests/gpu/test_host_path.py) run the same calls for real."""

from __future__ import annotations

import ctypes
import struct
import sys
import threading
import types

import pytest

from facodegen.ops import api
from facodegen.runtime import driver, params, plan as plan_mod, tma
from facodegen.tuning import tunedb
from fakes import FakeLauncher, FakeTensor

B, SQ, SK, HQ, HKV, D = 2, 100, 77, 8, 2, 128


class _Nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class Launches:
    """The fake driver: each launch's FlashParams bytes, grid and stream, as the kernel would see them."""

    def __init__(self):
        self.records = []
        self.map_moves = []
        self.memsets = []
        self.switches = []
        self.contexts = []      # driver.ensure_context's ordinals (a plan's build: its TMA maps need one)

    def launcher(self, function, grid, threads, smem):
        def launch(stream, kernel_params):
            address = ctypes.c_void_p.from_address(kernel_params).value
            size = params.layout("sm90", "fp8")[1]      # the largest FlashParams
            self.records.append({"stream": stream, "grid": grid, "params": ctypes.string_at(address, size)})
        return FakeLauncher(launch)

    def pointers(self, i=-1):
        return struct.unpack_from("<7Q", self.records[i]["params"], 0)


@pytest.fixture
def fake(monkeypatch, tmp_path):
    state = types.SimpleNamespace(device=0, stream=1000)
    torch = types.ModuleType("torch")
    torch.Tensor = FakeTensor
    torch.float32, torch.uint8, torch.bfloat16, torch.float16 = "float32", "uint8", "bfloat16", "float16"
    torch.contiguous_format = "contiguous_format"
    torch.empty_like = lambda x, dtype=None, memory_format=None: FakeTensor(
        x.shape, (dtype or x.dtype).removeprefix("torch."), device=x.device.index)     # (contiguous, as both give)
    torch.zeros_like = torch.empty_like        # (no memory to zero)
    torch.ones = lambda shape, dtype, device: FakeTensor(shape, dtype, device=int(str(device).rpartition(":")[2]))
    torch.compiler = types.SimpleNamespace(is_compiling=lambda: False)
    torch.is_grad_enabled = lambda: False
    torch._C = types.SimpleNamespace(_cuda_getDevice=lambda: state.device,
                                     _cuda_getCurrentRawStream=lambda device: state.stream)
    torch.cuda = types.SimpleNamespace(current_device=lambda: state.device)
    torch.empty = lambda shape, dtype, device: FakeTensor(shape if isinstance(shape, tuple) else (shape,), dtype,
                                                          device=int(str(device).rpartition(":")[2]))
    monkeypatch.setitem(sys.modules, "torch", torch)
    monkeypatch.setattr(api, "_TORCH", None)     # api._torch() finds the fake

    launches = Launches()
    info = api.DeviceInfo(0, "NVIDIA H200", (9, 0), 132, 232448)
    monkeypatch.setattr(api, "device_info", lambda ordinal: info)
    monkeypatch.setattr(api, "_prepare", lambda spec, device: api._Prepared(
        driver.LoadedFunction(1, 1, device), spec.smem_bytes, 132))
    monkeypatch.setattr(driver, "Launcher", launches.launcher)
    monkeypatch.setattr(driver, "stream_arg", lambda stream: stream)
    monkeypatch.setattr(driver, "memset_d32_async", lambda *a: launches.memsets.append(a))
    monkeypatch.setattr(driver, "on_device", lambda ordinal: launches.switches.append(ordinal) or _Nothing())
    monkeypatch.setattr(driver, "ensure_context", lambda ordinal: launches.contexts.append(ordinal))
    monkeypatch.setattr(driver, "replace_tensor_map_address", lambda m, p: launches.map_moves.append(p))
    monkeypatch.setattr(tma, "encode", lambda args: bytes(128))
    monkeypatch.setenv("FACODEGEN_TUNE_DB", str(tmp_path / "tuned.json"))
    monkeypatch.setattr(api, "_PLANS", plan_mod.PlanCache())
    tunedb.reload()
    api._unit_descale.cache_clear()     # the fake torch's unit descales must not outlive the test
    state.launches = launches
    yield state
    api._unit_descale.cache_clear()
    tunedb.reload()


def hits(fake) -> int:
    """Launches that found their plan: every launch but the ones that built one."""
    return len(fake.launches.records) - api._PLANS.misses


def qkv(hkv=HKV, dtype="bfloat16", q_strides=None):
    return (FakeTensor((B, SQ, HQ, D), dtype, q_strides), FakeTensor((B, SK, hkv, D), dtype),
            FakeTensor((B, SK, hkv, D), dtype))


def test_second_call_hits_and_writes_its_own_pointers(fake):
    q, k, v = qkv()
    api.attention(q, k, v, causal=True)
    q2, k2, v2 = qkv()
    out = api.attention(q2, k2, v2, causal=True)
    assert (api._PLANS.misses, hits(fake)) == (1, 1)
    qp, kp, vp, op, lse, counter, _ = fake.launches.pointers()
    assert (qp, kp, vp, op) == (q2.data_ptr(), k2.data_ptr(), v2.data_ptr(), out.data_ptr())
    assert lse != 0 and counter != 0            # the plan's scratch on this stream
    # the four TMA maps moved to the new tensors (q, k, v, o), nothing else
    assert sorted(fake.launches.map_moves) == sorted([q2.data_ptr(), k2.data_ptr(), v2.data_ptr(), op])
    # the rest of FlashParams is the first call's image: same shapes, same strides, same scale
    first, second = (r["params"] for r in fake.launches.records)
    assert first[56:192] == second[56:192]


def test_same_tensors_again_move_no_map(fake):
    q, k, v = qkv()
    out = FakeTensor(q.shape)
    api.attention(q, k, v, out=out)
    api.attention(q, k, v, out=out)
    assert fake.launches.map_moves == [] and hits(fake) == 1


@pytest.mark.parametrize("change", ["stride", "gqa", "dtype", "device", "causal", "scale", "knob", "lse", "out",
                                    "lse_out", "window", "softcap", "sinks", "k on another device",
                                    "v's stride", "causal=1", "scale=1"])
def test_anything_that_changes_the_launch_misses(fake, change):
    q, k, v = qkv()
    api.attention(q, k, v, **({"softmax_scale": 1.0} if change == "scale=1" else {}))
    args, kwargs = qkv(), {}
    if change == "stride":     # a (b, s, h, d) view of a wider buffer: other row stride, same shape
        args = (FakeTensor((B, SQ, HQ, D), strides=(SQ * HQ * 2 * D, HQ * 2 * D, D, 1)), *qkv()[1:])
    elif change == "gqa":
        args = qkv(hkv=4)
    elif change == "dtype":
        args = qkv(dtype="float16")
    elif change == "device":
        args = tuple(FakeTensor(t.shape, device=1) for t in qkv())
    elif change == "causal":
        kwargs = dict(causal=True)
    elif change == "scale":
        kwargs = dict(softmax_scale=0.5)
    elif change == "knob":
        kwargs = dict(block_n=64)
    elif change == "lse":
        kwargs = dict(return_lse=True)
    elif change == "out":
        kwargs = dict(out=FakeTensor((B, SQ, HQ, D)))
    elif change == "lse_out":
        kwargs = dict(lse_out=FakeTensor((B, HQ, SQ), "float32"))
    elif change == "window":
        kwargs = dict(window_size=(16, 0))
    elif change == "softcap":
        kwargs = dict(softcap=30.0)
    elif change == "sinks":
        kwargs = dict(sinks=FakeTensor((HQ,), "float32"))
    elif change == "k on another device":   # (refused by the checked path, never a hit)
        q, k, v = qkv()
        with pytest.raises(ValueError, match="k is on cuda:1"):
            api.attention(q, FakeTensor(k.shape, device=1), v)
        assert (api._PLANS.misses, hits(fake)) == (1, 0)
        return
    elif change == "v's stride":
        q, k, _ = qkv()
        args = (q, k, FakeTensor((B, SK, HKV, D), strides=(SK * HKV * 2 * D, HKV * 2 * D, D, 1)))
    elif change == "causal=1":  # 1 == True and hash(1) == hash(True): the key tells them apart
        api.attention(*qkv(), causal=True)
        with pytest.raises(TypeError, match="causal must be True or False"):
            api.attention(*qkv(), causal=1)
        assert (api._PLANS.misses, hits(fake)) == (2, 0)
        return
    elif change == "scale=1":   # the first call's softmax_scale=1.0; 1 and True are other keys
        kwargs = dict(softmax_scale=1)
        with pytest.raises(ValueError, match="softmax_scale must be a finite number"):
            api.attention(*args, softmax_scale=True)
    api.attention(*args, **kwargs)
    assert (api._PLANS.misses, hits(fake)) == (2, 0)
    # tensors on cuda:1 with cuda:0 current: the launch makes cuda:1's context current around it
    assert fake.launches.switches == ([1] if change == "device" else [])


def test_explicit_defaults_and_the_recording_forward_hit_the_plain_calls_plan(fake):
    """attention()'s fast path (the common call, its defaults told by identity) and _attention_torch
    (the general path: explicit default values, the recording autograd forward) key a call alike."""
    q, k, v = qkv()
    api.attention(q, k, v, causal=True)
    api.attention(q, k, v, causal=True, window_size=(-1, -1), softcap=float("0"), causal_alignment="bottom_right")
    api.attention(q, k, v, causal=True, window_size=[-1, -1], sinks=None)
    torch = sys.modules["torch"]
    api._attention_torch(torch, q, k, v, True, None, False, None, None, None, {})
    assert (api._PLANS.misses, hits(fake)) == (1, 3)
    api._attention_torch(torch, q, k, v, True, None, True, None, None, None, {})    # the recording forward's
    api.attention(q, k, v, causal=True, return_lse=True)
    assert (api._PLANS.misses, hits(fake)) == (2, 4)


def test_grad_and_tracing_leave_the_fast_path_after_a_hit(fake, monkeypatch):
    """A plan built by a plain call is not launched directly for a call that must record autograd
    or is traced by torch.compile: those go through torch_op."""
    import facodegen.ops
    torch = sys.modules["torch"]
    went = []
    torch_op = types.ModuleType("facodegen.ops.torch_op")    # (the real one needs the real torch)
    torch_op.attention_recording = lambda *a: went.append("recording")
    torch_op.attention = lambda *a, **kw: went.append("op")
    monkeypatch.setitem(sys.modules, "facodegen.ops.torch_op", torch_op)
    monkeypatch.setattr(facodegen.ops, "torch_op", torch_op, raising=False)
    q, k, v = qkv()
    api.attention(q, k, v, causal=True)
    q.requires_grad = True
    api.attention(q, k, v, causal=True)
    monkeypatch.setattr(torch, "is_grad_enabled", lambda: True)
    api.attention(q, k, v, causal=True)
    q.requires_grad = False
    v.requires_grad = True
    api.attention(q, k, v, causal=True)
    v.requires_grad = False
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    api.attention(q, k, v, causal=True)
    assert went == ["recording", "recording", "op"]
    assert (api._PLANS.misses, hits(fake)) == (1, 1)    # q requiring grad under no_grad: a plain hit


def test_a_hit_on_a_device_not_current_switches_to_it(fake):
    args = tuple(FakeTensor(t.shape, device=1) for t in qkv())
    api.attention(*args)
    out = api.attention(*args)
    assert hits(fake) == 1 and fake.launches.switches == [1, 1]
    assert fake.launches.pointers()[:4] == (*(t.data_ptr() for t in args), out.data_ptr())


def test_prepared_calls_launch_their_arrays_on_the_current_stream(fake):
    """prepare()() of a plain plan (launch_plain) and of an fp8 one (launch, its descales) write
    the bound arrays' addresses, the stream current at call time its own scratch."""
    descale_at = {f.name: off for f, off in params.layout("sm90", "fp8")[0]}["q_descale"]
    q, k, v = qkv()
    out, lse = FakeTensor(q.shape), FakeTensor((B, HQ, SQ), "float32")
    prepared = api.prepare(q, k, v, causal=True, out=out, lse_out=lse)
    q8, k8, v8 = qkv(dtype="float8_e4m3fn")
    dq = FakeTensor((), "float32")
    prepared8 = api.prepare(q8, k8, v8, q_descale=dq)
    assert prepared._call.plan.plain and not prepared8._call.plan.plain
    unit = api._unit_descale(0, "torch").data_ptr()
    for stream in (1000, 2000, 1000):
        fake.stream = stream
        prepared()
        assert fake.launches.pointers()[:5] == (q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(),
                                                lse.data_ptr())
        prepared8()
        assert fake.launches.pointers()[:3] == (q8.data_ptr(), k8.data_ptr(), v8.data_ptr())
        assert struct.unpack_from("<3Q", fake.launches.records[-1]["params"], descale_at) == (dq.data_ptr(), unit,
                                                                                              unit)
    counters = [struct.unpack_from("<7Q", r["params"])[5] for r in fake.launches.records[::2]]
    assert counters[0] == counters[2] != counters[1]
    assert [r["stream"] for r in fake.launches.records] == [1000, 1000, 2000, 2000, 1000, 1000]


def test_a_view_offset_by_8_bytes_is_refused_not_hit(fake):
    q, k, v = qkv()
    api.attention(q, k, v)
    with pytest.raises(ValueError, match="q's data pointer is not 16-byte aligned"):
        api.attention(q.offset(8), k, v)
    api.attention(q.offset(16), k, v)         # 16 bytes on is fine, and a hit
    assert hits(fake) == 1


def test_a_wrong_type_is_refused_after_a_hit_too(fake):
    q, k, v = qkv()
    api.attention(q, k, v, causal=True)
    with pytest.raises(TypeError, match="causal must be True or False"):
        api.attention(q, k, v, causal=1)
    with pytest.raises(ValueError, match="softmax_scale must be a finite number"):
        api.attention(q, k, v, causal=True, softmax_scale=True)


def test_another_stream_gets_its_own_scratch(fake):
    q, k, v = qkv()
    api.attention(q, k, v, causal=True)
    counter_a = fake.launches.pointers()[5]
    fake.stream = 2000
    api.attention(q, k, v, causal=True)
    counter_b = fake.launches.pointers()[5]
    fake.stream = 1000
    api.attention(q, k, v, causal=True)
    assert hits(fake) == 2 and counter_a != counter_b
    assert [r["stream"] for r in fake.launches.records] == [1000, 2000, 1000]
    # each stream's counter is zeroed once, when its scratch is made (the kernel leaves it at zero)
    assert [(m[0], m[3]) for m in fake.launches.memsets] == [(counter_a, 1000), (counter_b, 2000)]


def test_a_tuning_database_write_is_seen_at_once(fake):
    q, k, v = qkv()
    api.attention(q, k, v)
    api.attention(q, k, v)
    assert hits(fake) == 1
    info = api.device_info(0)
    from facodegen.runtime import compiler
    key = tunedb.make_key(info.name, info.compute_capability, compiler.nvrtc_identity(), "sm90", D, "bf16",
                          False, SQ, SK, B, HQ)
    tunedb.put(tunedb.make_entry(key, {"block_n": 96, "stages": 2}))
    api.attention(q, k, v)
    assert api._PLANS.misses == 2
    assert api._PLANS.get(next(reversed(api._PLANS._plans))).spec.block_n == 96


def test_another_process_write_is_seen_within_the_recheck_interval(fake, monkeypatch, tmp_path):
    clock = [100.0]
    monkeypatch.setattr(tunedb.time, "monotonic", lambda: clock[0])
    tunedb.reload()
    before = tunedb.generation()
    (tmp_path / "tuned.json").write_text("{}")      # another process's write
    assert tunedb.generation() == before             # not looked at within the interval
    clock[0] += tunedb.RECHECK_S
    assert tunedb.generation() != before


def test_the_cache_is_bounded_oldest_first():
    cache = plan_mod.PlanCache(max_plans=2)
    for key in "abc":
        cache.put(key, key.upper())
    assert len(cache) == 2 and cache.get("a") is None and cache.get("c") == "C"


def test_threads_launch_their_own_pointers(fake):
    q, k, v = qkv()
    api.attention(q, k, v, out=FakeTensor(q.shape))     # the plan the threads will share
    errors = []

    def worker(seed):
        for i in range(200):
            base = (seed * 1000 + i + 1) << 32
            mine = [FakeTensor(t.shape, ptr=base + j * (1 << 20)) for j, t in enumerate((q, k, v))]
            out = FakeTensor(q.shape, ptr=base + 3 * (1 << 20))
            api.attention(*mine, out=out)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for r in fake.launches.records[1:]:
        qp, kp, vp, op = struct.unpack_from("<4Q", r["params"], 0)
        if not (kp - qp == 1 << 20 and vp - qp == 2 << 20 and op - qp == 3 << 20):
            errors.append((qp, kp, vp, op))
    assert not errors and hits(fake) == 800


def test_fp8_descales_are_written_per_call(fake):
    descale_at = {f.name: off for f, off in params.layout("sm90", "fp8")[0]}["q_descale"]
    q, k, v = qkv(dtype="float8_e4m3fn")
    scalar = lambda: FakeTensor((), "float32")      # noqa: E731
    api.attention(q, k, v, q_descale=scalar(), k_descale=scalar())          # v_descale left out: 1
    qd, kd = scalar(), scalar()
    api.attention(q, k, v, q_descale=qd, k_descale=kd)
    assert hits(fake) == 1
    got = struct.unpack_from("<3Q", fake.launches.records[-1]["params"], descale_at)
    unit = api._unit_descale(0, "torch").data_ptr()
    assert got == (qd.data_ptr(), kd.data_ptr(), unit)


class SliceableTensor(FakeTensor):
    """A FakeTensor that slices along dims 1 (and the LSE's last) like a torch view, for the
    top-left causal split; assignments are recorded, not computed."""
    writes: list = []

    def __getitem__(self, index):
        index = index if isinstance(index, tuple) else (index,)
        shape = list(self.shape)
        offset = 0
        for axis, item in enumerate(index):
            if item is Ellipsis:
                axis, item = len(shape) - 1, index[-1]
                start, stop, _ = item.indices(shape[axis])
                offset += start * self._strides[axis]
                shape[axis] = stop - start
                break
            if isinstance(item, slice):
                start, stop, _ = item.indices(shape[axis])
                offset += start * self._strides[axis]
                shape[axis] = stop - start
        return SliceableTensor(tuple(shape), self.dtype.removeprefix("torch."), self._strides, self.device.index,
                               self._ptr + 2 * offset)

    def __setitem__(self, index, value):
        SliceableTensor.writes.append((self[index].shape, value.shape))


@pytest.mark.parametrize("sq, sk", [(40, 100), (100, 40)])
def test_top_left_causal_is_made_of_bottom_right_launches_on_views(fake, sq, sk):
    """seqlen_q < seqlen_k: one causal launch over the first seqlen_q keys; seqlen_q > seqlen_k: a
    causal launch of the first seqlen_k rows into out's first rows, a non-causal one of the rest."""
    d = 64
    q = SliceableTensor((1, sq, 2, d))
    k, v = SliceableTensor((1, sk, 2, d)), SliceableTensor((1, sk, 2, d))
    fake.launches.records.clear()
    SliceableTensor.writes = []
    out = SliceableTensor((1, sq, 2, d))
    api.attention(q, k, v, causal=True, causal_alignment="top_left", out=out)
    launched = [struct.unpack_from("<4Q", r["params"], 0) for r in fake.launches.records]
    if sq < sk:
        assert launched == [(q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr())]
        assert api._PLANS.get(next(iter(api._PLANS._plans))).spec.causal
    else:
        row = 2 * d * 2    # bytes of one (heads, head_dim) row of bf16
        assert launched == [(q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr()),
                            (q.data_ptr() + sk * row, k.data_ptr(), v.data_ptr(), out.data_ptr() + sk * row)]
        causal = [plan.spec.causal for plan in api._PLANS._plans.values()]
        assert causal == [True, False]
    with pytest.raises(ValueError, match="causal_alignment must be"):
        api.attention(q, k, v, causal=True, causal_alignment="center")


def test_addresses_seen_before_find_their_image_and_move_no_map(fake, monkeypatch):
    """Layers whose activations come back at the same addresses step after step (what caching
    allocators do) launch with the image made for them: no cuTensorMapReplaceAddress after the
    first step; the images per plan are bounded."""
    layers = [qkv() for _ in range(3)]
    outs = [FakeTensor(q.shape) for q, _, _ in layers]
    for _step in range(4):
        for (q, k, v), out in zip(layers, outs):
            api.attention(q, k, v, out=out)
    # the first layer built the plan (its image is the template); the two others made one each
    assert len(fake.launches.map_moves) == 2 * 4 and len(fake.launches.records) == 12
    for (q, k, v), out, record in zip(layers, outs, fake.launches.records[-3:]):
        assert struct.unpack_from("<4Q", record["params"], 0) == (q.data_ptr(), k.data_ptr(), v.data_ptr(),
                                                                 out.data_ptr())
    monkeypatch.setattr(plan_mod, "MAX_IMAGES_PER_PLAN", 2)
    for q, k, v in (qkv() for _ in range(5)):
        api.attention(q, k, v, out=FakeTensor(q.shape))
    plan = next(iter(api._PLANS._plans.values()))
    assert len(plan._images) <= 2


def test_out_of_memory_is_one_clear_error_and_the_next_call_works(fake, monkeypatch):
    """#37: the device out of memory while a call loads its kernel (cuModuleLoadData) or makes its
    scratch (the caller's library's allocation) raises once, naming the step, and leaves no half-made
    state behind: the same call succeeds once memory is free, with its scratch zeroed as new."""
    q, k, v = qkv()
    real_prepare = api._prepare
    monkeypatch.setattr(api, "_prepare", lambda spec, device: driver.check(
        driver.CUDA_ERROR_OUT_OF_MEMORY, "cuModuleLoadData", spec.variant))
    with pytest.raises(driver.DriverError, match=r"cuModuleLoadData failed.*flash_fwd_sm90.*out of memory"):
        api.attention(q, k, v, causal=True)
    assert len(api._PLANS) == 0 and fake.launches.records == []
    monkeypatch.setattr(api, "_prepare", real_prepare)

    torch = sys.modules["torch"]
    make = torch.empty

    def out_of_memory(*a, **kw):
        raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 MiB")
    torch.empty = out_of_memory
    with pytest.raises(RuntimeError, match="CUDA out of memory"):
        api.attention(q, k, v, causal=True)
    assert fake.launches.records == [] and fake.launches.memsets == []
    torch.empty = make
    out = api.attention(q, k, v, causal=True)
    assert len(fake.launches.records) == 1 and len(fake.launches.memsets) == 1      # a scratch made, zeroed
    assert fake.launches.pointers()[:4] == (q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr())
    assert fake.launches.pointers()[5] != 0     # the tile counter: in the scratch made now


def test_stream_scratch_regions_and_streams(monkeypatch):
    """One allocation per stream cut into 16-byte aligned regions (0 for an empty one), on_new once
    per stream, at most MAX_STREAMS_PER_PLAN streams kept (the oldest dropped)."""
    monkeypatch.setattr(driver, "stream_arg", lambda stream: stream)
    made, new = [], []

    def allocate(nbytes):
        made.append(nbytes)
        return object(), 4096 * len(made)
    scratch = plan_mod.StreamScratch({"counter": 4, "lse": 36, "none": 0, "work": 8}, allocate,
                                     lambda s, stream: new.append(stream))
    s = scratch.get(7)
    assert made == [16 + 48 + 0 + 16] and new == [7]
    assert (s.counter, s.lse, s.none, s.work) == (4096, 4096 + 16, 0, 4096 + 64) and s.stream == 7
    assert scratch.offset("work") == 64 and scratch.get(7) is s and new == [7]
    for stream in range(100, 100 + plan_mod.MAX_STREAMS_PER_PLAN):
        scratch.get(stream)
    assert scratch.get(7) is not s and new.count(7) == 2      # evicted by the 16 newer streams, made again


class FakeCupyArray:
    """Just enough of a CuPy array for api's CuPy hit path and its checked path: strides in bytes,
    numpy dtypes, the address and device in ``data`` (a MemoryPointer's ptr and device_id)."""
    _next = 1 << 40

    def __init__(self, shape, dtype="float16", strides=None, device=0, ptr=None):
        import numpy
        self.shape, self.dtype = tuple(shape) if isinstance(shape, tuple) else (shape,), numpy.dtype(dtype)
        if strides is None:
            strides, acc = [], 1
            for n in reversed(self.shape):
                strides.insert(0, acc)
                acc *= n
        self.strides = tuple(s * self.dtype.itemsize for s in strides)
        if ptr is None:
            ptr, FakeCupyArray._next = FakeCupyArray._next, FakeCupyArray._next + (1 << 28)
        self.data = types.SimpleNamespace(ptr=ptr, device_id=device)
        self.device = types.SimpleNamespace(id=device)


@pytest.fixture
def fake_cupy(fake, monkeypatch):
    """The fake driver of ``fake`` and a fake cupy whose current device is ``fake.device`` (arrays
    are made there), each device with its own current stream; ``fake.switches`` records the devices
    made current by cupy.cuda.Device."""
    fake.switches = []

    class Device:
        def __init__(self, device):
            self.device = device

        def __enter__(self):
            fake.switches.append(self.device)
            self.before, fake.device = fake.device, self.device

        def __exit__(self, *exc):
            fake.device = self.before

    class ndarray(FakeCupyArray):  # noqa: N801 (CuPy's name)
        def __init__(self, shape, dtype, strides=None, device=None, ptr=None):
            super().__init__(shape, dtype, strides, fake.device if device is None else device, ptr)

    cupy = types.ModuleType("cupy")
    cupy.ndarray = ndarray
    cupy.empty = lambda shape, dtype: ndarray(shape, dtype)
    cupy.uint8, cupy.float32 = "uint8", "float32"
    import numpy
    cupy.dtype = numpy.dtype
    cupy.cuda = types.SimpleNamespace(Device=Device, runtime=types.SimpleNamespace(getDevice=lambda: fake.device),
                                      get_current_stream=lambda: types.SimpleNamespace(ptr=5000 + fake.device))
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    fake.cupy = cupy
    return fake


def cupy_qkv(fake, hkv=HKV, device=0, q_strides=None):
    made = fake.cupy.ndarray
    return (made((B, SQ, HQ, D), "float16", strides=q_strides, device=device),
            made((B, SK, hkv, D), "float16", device=device), made((B, SK, hkv, D), "float16", device=device))


def test_cupy_second_call_hits_and_allocates_what_the_miss_did(fake_cupy):
    fake = fake_cupy
    first_out, first_lse = api.attention(*cupy_qkv(fake), causal=True, return_lse=True)
    q, k, v = cupy_qkv(fake)
    out, lse = api.attention(q, k, v, causal=True, return_lse=True)
    assert (api._PLANS.misses, hits(fake)) == (1, 1)
    for made, like in ((out, first_out), (lse, first_lse)):
        assert (made.shape, made.dtype, made.strides, made.data.device_id) == \
            (like.shape, like.dtype, like.strides, like.data.device_id)
    assert out.shape == q.shape and str(out.dtype) == "float16"
    assert lse.shape == (B, HQ, SQ) and str(lse.dtype) == "float32"
    assert fake.launches.pointers()[:5] == (q.data.ptr, k.data.ptr, v.data.ptr, out.data.ptr, lse.data.ptr)
    assert fake.launches.records[-1]["stream"] == 5000
    # q's device is the current one: the miss's helpers switch (their own way), the hit never does
    switches = list(fake.switches)
    api.attention(q, k, v, causal=True, return_lse=True)
    assert fake.switches == switches and hits(fake) == 2


def test_cupy_arrays_on_another_device_hit_with_their_device_current(fake_cupy):
    """cuda:1 arrays with cuda:0 current: the hit allocates on cuda:1 and launches on cuda:1's stream."""
    fake = fake_cupy
    api.attention(*cupy_qkv(fake, device=1), causal=True)
    fake.switches.clear()
    q, k, v = cupy_qkv(fake, device=1)
    out = api.attention(q, k, v, causal=True)
    assert hits(fake) == 1 and fake.switches == [1] and fake.device == 0
    assert out.data.device_id == 1 and fake.launches.records[-1]["stream"] == 5001


@pytest.mark.parametrize("change", ["stride", "gqa", "current device", "lse"])
def test_cupy_anything_that_changes_the_launch_misses(fake_cupy, change):
    fake = fake_cupy
    api.attention(*cupy_qkv(fake))
    kwargs = {}
    args = cupy_qkv(fake)
    if change == "stride":
        args = cupy_qkv(fake, q_strides=(SQ * HQ * 2 * D, HQ * 2 * D, D, 1))
    elif change == "gqa":
        args = cupy_qkv(fake, hkv=4)
    elif change == "current device":
        fake.device = 1
    elif change == "lse":
        kwargs = dict(return_lse=True)
    api.attention(*args, **kwargs)
    assert (api._PLANS.misses, hits(fake)) == (2, 0)


@pytest.mark.parametrize("fields", [dict(q_descale="dq", k_descale="dk", v_descale="dv"), dict(k_descale="dk"),
                                    dict(q_descale=None, k_descale="dk"), dict(block_n=64, q_descale="dq"),
                                    dict(stages=2, block_n=64)])
def test_split_knobs_keeps_every_knob_and_descale(fields):
    """The fast case (descales only) and the general one give what a plain reading of the fields does."""
    knobs, descales = api._split_knobs(fields)
    assert knobs == tuple(sorted((n, x) for n, x in fields.items() if not n.endswith("_descale")))
    assert descales == tuple(fields.get(f"{n}_descale") for n in "qkv")


def test_fp8_hits_write_the_unit_descale_where_one_is_left_out(fake):
    descale_at = {f.name: off for f, off in params.layout("sm90", "fp8")[0]}["q_descale"]
    q, k, v = qkv(dtype="float8_e4m3fn")
    unit = api._unit_descale(0, "torch").data_ptr()
    for _ in range(2):
        api.attention(q, k, v)      # every descale left out
    assert struct.unpack_from("<3Q", fake.launches.records[-1]["params"], descale_at) == (unit, unit, unit)
    for _ in range(2):
        dv = FakeTensor((), "float32")
        api.attention(q, k, v, v_descale=dv)
    assert struct.unpack_from("<3Q", fake.launches.records[-1]["params"], descale_at) == (unit, unit, dv.data_ptr())
    assert (api._PLANS.misses, hits(fake)) == (2, 2)


@pytest.mark.parametrize("arch", ["sm90", "sm80"])
def test_launch_plain_writes_what_launch_writes(fake, arch):
    """LaunchPlan.launch_plain (the common call's hit: it skips writing what an image already holds)
    launches the same FlashParams bytes as the general launch, over calls that move the operands,
    alternate streams (one scratch evicted and made again), pass an LSE and go back to scratch's."""
    from facodegen.spec import KernelSpec
    spec = KernelSpec(arch=arch, head_dim=D, dtype="bf16", causal=True)
    size = params.layout(arch, "bf16")[1]

    def plan():     # each plan's scratch addresses from a counter of its own: the two plans' are alike
        made = iter(range(1 << 20, 1 << 40, 1 << 20))
        return plan_mod.LaunchPlan(spec, driver.LoadedFunction(1, 1, 0), (132, 1, 1), bytes(range(256)) * (size // 256)
                                   + bytes(size % 256), tensor_maps=tma.map_operands(spec) if arch == "sm90" else {},
                                   lse_floats=B * HQ * SQ, workspace_floats=0, stream_k_flags=(0, 0),
                                   switch_context=False, allocate=lambda n: (object(), next(made)))
    general, fast = plan(), plan()
    assert fast.plain
    a, b, c = (tuple(range(base, base + 4 * 4096, 4096)) for base in (1 << 32, 2 << 32, 3 << 32))
    calls = [(1, a, 0), (1, a, 0), (1, b, 0), (2, b, 0), (1, a, 0), (1, a, 7 << 32), (1, a, 0), (2, c, 0), (2, c, 0)]
    calls += [(100 + i, a, 0) for i in range(plan_mod.MAX_STREAMS_PER_PLAN)] + [(1, a, 0), (1, b, 0)]
    for stream, operands, lse in calls:
        general.launch(stream, *operands, lse)
        fast.launch_plain(stream, *operands, lse)
    records = fake.launches.records
    assert len(records) == 2 * len(calls)
    for i in range(0, len(records), 2):
        assert records[i]["params"][:size] == records[i + 1]["params"][:size], calls[i // 2]
        assert records[i]["stream"] == records[i + 1]["stream"]


def test_launch_plain_with_descales_writes_what_launch_writes(fake):
    """fp8 (a ``descaled`` plan, not a ``plain`` one): launch_plain with the call's descale addresses
    launches the bytes the general launch does, the descales of each call included."""
    from facodegen.spec import KernelSpec
    spec = KernelSpec(arch="sm90", head_dim=D, dtype="fp8", causal=True)
    size = params.layout("sm90", "fp8")[1]

    def plan():
        made = iter(range(1 << 20, 1 << 40, 1 << 20))
        return plan_mod.LaunchPlan(spec, driver.LoadedFunction(1, 1, 0), (132, 1, 1), bytes(range(256)) * (size // 256)
                                   + bytes(size % 256), tensor_maps=tma.map_operands(spec),
                                   lse_floats=B * HQ * SQ, workspace_floats=0, stream_k_flags=(0, 0),
                                   switch_context=False, allocate=lambda n: (object(), next(made)))
    general, fast = plan(), plan()
    assert fast.descaled and not fast.plain
    a, b = (tuple(range(base, base + 4 * 4096, 4096)) for base in (1 << 32, 2 << 32))
    calls = [(1, a, 0, (8, 16, 24)), (1, a, 0, (32, 16, 24)), (1, b, 0, (32, 16, 24)), (2, b, 7 << 32, (8, 8, 8)),
             (1, a, 0, (40, 48, 56))]
    for stream, operands, lse, descales in calls:
        general.launch(stream, *operands, lse, descales)
        fast.launch_plain(stream, *operands, lse, descales)
    records = fake.launches.records
    assert len(records) == 2 * len(calls)
    for i in range(0, len(records), 2):
        assert records[i]["params"][:size] == records[i + 1]["params"][:size], calls[i // 2]


def test_fp8_call_with_its_three_descales_hits_its_own_key(fake):
    """An fp8 call that gives all three descales (and no other knob) keys on their layouts: new
    descale arrays of the same layout hit and have their addresses written; another layout misses."""
    descale_at = {f.name: off for f, off in params.layout("sm90", "fp8")[0]}["q_descale"]
    q, k, v = qkv(dtype="float8_e4m3fn")
    scalar = lambda: FakeTensor((), "float32")      # noqa: E731
    for _ in range(3):
        qd, kd, vd = scalar(), scalar(), scalar()
        api.attention(q, k, v, q_descale=qd, k_descale=kd, v_descale=vd)
        got = struct.unpack_from("<3Q", fake.launches.records[-1]["params"], descale_at)
        assert got == (qd.data_ptr(), kd.data_ptr(), vd.data_ptr())
    assert (api._PLANS.misses, hits(fake)) == (1, 2)
    per_head = FakeTensor((B, HKV), "float32")
    api.attention(q, k, v, q_descale=qd, k_descale=per_head, v_descale=vd)      # (batch, heads_kv) k descale
    assert api._PLANS.misses == 2
    assert struct.unpack_from("<3Q", fake.launches.records[-1]["params"], descale_at)[1] == per_head.data_ptr()
    api.attention(q, k, v, q_descale=qd, k_descale=kd, v_descale=vd, return_lse=True)   # another key: a miss
    assert api._PLANS.misses == 3
