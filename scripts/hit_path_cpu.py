#!/usr/bin/env python3
"""The Python cost of a plan-cache hit of facodegen.attention() on torch tensors, on a CPU-only
machine: the CPU twin of scripts/host_cost_breakdown.py (which times the real thing on a GPU).

    python3 scripts/hit_path_cpu.py [--calls 20000] [--repeat 30] [--only forward|backward|varlen|decode]

The backward section times facodegen.attention_backward's hit and the eager autograd backward
(torch_op._Attention: through the engine, through grad_fn.apply, and a forward+backward step) on
(1, 128, 8, 128) bf16 causal (the sm90 backward on the fake H200), and their pieces. The varlen section
times attention_varlen's hit (issue 39: a server's step where only the lengths change) beside
attention()'s on the same tokens; the decode section attention_with_kvcache's step (its fast path).

CPU torch tensors cannot take the real hit path (their get_device() is -1 and no kernel runs),
so this script fakes the GPU around the same Python code, as tests/test_plan_cache.py does:

- ``torch.Tensor.get_device`` returns 0 (a Python lambda: ~30 ns here, ~20 ns less than the C
  method), ``torch._C._cuda_getDevice`` and ``_cuda_getCurrentRawStream`` (absent from CPU
  builds) are lambdas returning 0 and a fixed stream;
- the miss that builds the plan sees the CPU tensors as cuda:0 tensors (api._view), on a fake H200
  (sm90: four TMA maps per plan, encoded as zeros), its kernels "loaded" without compiling;
- the plan's driver.Launcher is the real one over a no-op binding (driver._launch_binding: what
  CuPy's launchKernel or ctypes would call) and its scratch is CPU memory.

So attention()'s whole hit is timed minus the driver call (~4.7 µs on the H200) and with a CPU
allocation for O (``torch.empty_like``: malloc, set never to mmap or trim, not CUDA's caching
allocator: compare it as a piece, not as the H200's 3.6 µs). The pieces are timed in loops of their own; they do not add up
exactly. Numbers are µs per call, the best of ``--repeat`` rounds over all rows of ``--calls`` calls each.
The backward's hit misses three driver calls, not one, and its dq, dk, dv (and before bwd-host its
scratch) are CPU allocations too; moving a TMA map (cuTensorMapReplaceAddress, ~1 µs) is a no-op here.
The varlen backward's rows are dominated by CPU work a GPU does not do: its per-call scratch (MBs of CPU
malloc): read them for the Python around it, not as the device's cost. Its "new token total each call" row
cycles 96 totals (more than a plan keeps images of), so each call encodes its maps, stubbed here.
"""

from __future__ import annotations

import argparse
import ctypes
import sys
import timeit
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

STREAM = 0x5000


def install_fake_gpu():
    """Patch torch and facodegen so CPU tensors take attention()'s torch hit path (see the docstring)."""
    import torch

    from facodegen.ops import api
    from facodegen.runtime import driver, tma

    try:    # glibc: O's 256 KiB from the heap, never mmap'ed or trimmed (syscalls would swamp the Python)
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, 1 << 30)   # M_MMAP_THRESHOLD
        libc.mallopt(-1, 1 << 30)   # M_TRIM_THRESHOLD
    except (OSError, AttributeError):
        pass
    torch.Tensor.get_device = lambda self: 0
    torch._C._cuda_getDevice = lambda: 0
    torch._C._cuda_getCurrentRawStream = lambda device: STREAM
    info = api.DeviceInfo(0, "NVIDIA H200", (9, 0), 132, 232448)
    api.device_info = lambda ordinal: info
    api._prepare = lambda spec, device: api._Prepared(driver.LoadedFunction(1, 1, device), spec.smem_bytes, 132)
    api._current_device = lambda kind: 0
    api._allocate = lambda kind, device, nbytes: (lambda b: (b, b.data_ptr()))(torch.empty(nbytes, dtype=torch.uint8))
    api._empty = lambda like, shape, dtype: torch.empty(shape, dtype=getattr(torch, dtype))
    real_view = api._view

    def view(name, x):      # a CPU tensor seen as a cuda:0 one by the checked path
        if isinstance(x, torch.Tensor):
            return api._View(name, "torch", x.data_ptr(), tuple(x.shape), tuple(x.stride()),
                             str(x.dtype).removeprefix("torch."), 0)
        return real_view(name, x)
    api._view = view
    from facodegen.ops import backward
    backward._load = lambda spec, device: tuple(driver.LoadedFunction(1 + i, 1, device) for i in range(3))
    driver._launch_binding = lambda: (lambda *fixed: (lambda stream, kernel_params, extra: None), driver.LaunchError)
    driver.memset_d32_async = lambda *a: None
    driver.replace_tensor_map_address = lambda m, p: None
    driver.ensure_context = lambda ordinal: None
    tma.encode = lambda args: bytes(128)
    from facodegen.ops import kvcache, varlen        # (their own imports of the names patched above)
    for module in (varlen, kvcache):
        module._allocate, module._empty, module._view = api._allocate, api._empty, view
        module._current_device = lambda kind: 0
        module._current_stream = lambda kind, device: STREAM
    kvcache.device_info = api.device_info
    kvcache._load = lambda spec, device: driver.LoadedFunction(1, 1, device)
    return torch, api


def _time(rows, args, title):
    best = [float("inf")] * len(rows)
    for _ in range(args.repeat):    # rounds over all rows: a slow spell of the machine hits every row alike
        for i, (_, fn, *count) in enumerate(rows):
            calls = count[0] if count else args.calls     # (a slow row names its own count)
            best[i] = min(best[i], timeit.timeit(fn, number=calls) / calls)
    print(f"| {title} | µs per call (CPU, best of {args.repeat} rounds x {args.calls} calls) |\n|---|---|")
    for (name, *_), t in zip(rows, best):
        print(f"| {name} | {t * 1e6:.3f} |")
    print()


def forward_rows(torch, api):
    """The forward's rows, and a check to run after timing them."""
    import facodegen
    from facodegen.tuning import tunedb

    q, k, v = (torch.randn(1, 128, 8, 128).to(torch.bfloat16) for _ in range(3))
    attention = facodegen.attention
    out = attention(q, k, v, causal=True)
    misses = api._PLANS.misses
    attention(q, k, v, causal=True)
    assert api._PLANS.misses == misses == 1, "the second call must hit the plan the first one built"
    plan = next(iter(api._PLANS._plans.values()))
    key = next(iter(api._PLANS._plans))
    ptrs = (q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), 0)
    shape, strides = tuple(q.shape), q.stride()
    prepared = facodegen.prepare(q, k, v, causal=True)

    rows = [
        ("attention(q, k, v, causal=True) whole hit", lambda: attention(q, k, v, causal=True)),
        ("attention(..., return_lse=True) whole hit", lambda: attention(q, k, v, causal=True, return_lse=True)),
        ("attention(..., out=out) whole hit", lambda: attention(q, k, v, causal=True, out=out)),
        ("prepare(q, k, v, causal=True)() (its launch)", prepared),
        ("  _attention_torch(...) (no attention() frame)", lambda: api._attention_torch(
            torch, q, k, v, True, None, False, None, None, None, {})),
        ("  call key tuple (as attention()'s fast path builds it)", lambda: (
            q.dtype, q.shape, q.stride(), k.dtype, k.shape, k.stride(), k.get_device(),
            v.dtype, v.shape, v.stride(), v.get_device(), q.get_device(), torch._C._cuda_getDevice(),
            bool, True, type(None), None, False, None, None, tunedb.generation())),
        ("    tunedb.generation()", tunedb.generation),
        ("  _PLANS.get(key) (hash + dict get)", lambda: api._PLANS.get(key)),
        ("  torch.empty_like(q) (CPU malloc)", lambda: torch.empty_like(q)),
        ("  q.new_empty(q.shape) (CPU malloc)", lambda: q.new_empty(q.shape)),
        ("  torch.empty_strided(shape, strides, dtype=) (CPU malloc)", lambda: torch.empty_strided(
            shape, strides, dtype=q.dtype)),
        ("  4 x data_ptr()", lambda: (q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr())),
        ("  torch.compiler.is_compiling()", torch.compiler.is_compiling),
        ("  is_grad_enabled + requires_grad x3", lambda: torch.is_grad_enabled() and (
            q.requires_grad or k.requires_grad or v.requires_grad)),
        ("  plan.launch (patch, no-op binding)", lambda: plan.launch(STREAM, *ptrs, None)),
        ("  plan.launch_plain (the fast path's)", lambda: plan.launch_plain(STREAM, *ptrs)),  # (since 6b4d5d0)
        ("    driver.Launcher over the no-op binding", lambda: plan._launcher(STREAM, plan._last.kernel_params)),
    ]
    if not hasattr(plan, "launch_plain"):     # (the script times older commits too, for before/after)
        rows = [row for row in rows if "launch_plain" not in row[0]]
    # fp8 with its three descales (scalars, float32; unit descales made on the CPU): the overhead suite's call
    api._unit_descale = lambda device, kind: torch.ones((), dtype=torch.float32)
    q8, k8, v8 = (x.to(torch.float8_e4m3fn) for x in (q, k, v))
    descales = {f"{n}_descale": torch.ones((), dtype=torch.float32) for n in "qkv"}
    out16 = torch.empty_like(q)
    for options in ({}, {"return_lse": True}, {"out": out16}):
        attention(q8, k8, v8, causal=True, **descales, **options)
    rows += [
        ("attention() fp8 + descales whole hit", lambda: attention(q8, k8, v8, causal=True, **descales)),
        ("attention() fp8 + descales, return_lse", lambda: attention(q8, k8, v8, causal=True, return_lse=True,
                                                                     **descales)),
        ("attention() fp8 + descales, out=", lambda: attention(q8, k8, v8, causal=True, out=out16, **descales)),
    ]

    def check():
        assert api._PLANS.misses == 6, "every timed call must have hit (1 plan + return_lse's + out='s, bf16 and fp8)"
    return rows, check


def backward_rows(torch, api):
    """attention_backward's hit and the eager autograd backward (torch_op._Attention.backward), on
    (1, 128, 8, 128) bf16 causal (the sm90 backward on the fake H200: four TMA maps), and their
    pieces; a check to run after timing them."""
    import facodegen
    from facodegen.ops import backward, torch_op

    q, k, v, o, do = (torch.randn(1, 128, 8, 128).to(torch.bfloat16) for _ in range(5))
    lse = torch.randn(1, 8, 128)
    attention_backward = facodegen.attention_backward
    attention_backward(do, q, k, v, o, lse, causal=True)
    attention_backward(do, q, k, v, o, lse, causal=True)
    assert backward._PLANS.misses == 1, "the second call must hit the plan the first one built"
    plan = next(iter(backward._PLANS._plans.values()))
    key = next(iter(backward._PLANS._plans))
    dq, dk, dv = (torch.empty_like(x) for x in (q, k, v))
    meta, ptr = api.ARRAY_META["torch"], api.ARRAY_PTR["torch"]
    scratch_bytes = 4 * (plan.accum_floats + plan.dpsum_floats + plan.semaphore_ints)
    pointers = tuple(x.data_ptr() for x in (q, k, v, o, do, lse, dq, dk, dv))
    plain = hasattr(plan, "launch_plain")     # (the script times older commits too, for before/after)
    if not plain:   # (before: the scratch's three pointers too)
        pointers += (1 << 20, 2 << 20, 0)

    # autograd: a forward that records, and its backward through the engine (retain_graph: one graph, timed again
    # and again) and through the Function's own backward (grad_fn.apply: no engine)
    qg, kg, vg = (x.detach().requires_grad_(True) for x in (q, k, v))
    out = facodegen.attention(qg, kg, vg, causal=True)
    assert type(out.grad_fn).__name__ == "_AttentionBackward"
    grad_fn = out.grad_fn

    def step():     # forward + backward of one layer's attention, as a training step runs it (grad: no
        return torch.autograd.grad(facodegen.attention(qg, kg, vg, causal=True), (qg, kg, vg), do)  # .grad adds)

    rows = [
        ("attention_backward(do, q, k, v, o, lse, causal=True) whole hit", lambda: attention_backward(
            do, q, k, v, o, lse, causal=True)),
        ("attention_backward(..., dq=, dk=, dv=) whole hit", lambda: attention_backward(
            do, q, k, v, o, lse, causal=True, dq=dq, dk=dk, dv=dv)),
        ("autograd: forward + backward (attention(), autograd.backward)", step),
        ("autograd: torch.autograd.grad(out, (q, k, v), do) (engine + backward)", lambda: torch.autograd.grad(
            out, (qg, kg, vg), do, retain_graph=True)),
        ("autograd: out.grad_fn.apply(do, None) (_Attention.backward)", lambda: grad_fn.apply(do, None)),
        ("  autograd: do.contiguous() + _backward_knobs()", lambda: (do.contiguous(), torch_op._backward_knobs())),
        ("  the key (as the torch fast path builds it, since bwd-host)", lambda: (
            do.dtype, do.shape, do.stride(), do.get_device(), q.dtype, q.shape, q.stride(), q.get_device(),
            k.dtype, k.shape, k.stride(), k.get_device(), v.dtype, v.shape, v.stride(), v.get_device(),
            o.dtype, o.shape, o.stride(), o.get_device(), lse.dtype, lse.shape, lse.stride(), lse.get_device(),
            None, None, None, bool, True, type(None), None, None, (), torch._C._cuda_getDevice())),
        ("  the key (meta x 9 + current device, as the checked key)", lambda: (
            "torch", meta(do), meta(q), meta(k), meta(v), meta(o), meta(lse), meta(None), meta(None), meta(None),
            bool, True, type(None), None, None, (), api._current_device("torch"))),
        ("    api._current_device('torch')", lambda: api._current_device("torch")),
        ("  _PLANS.get(key) (hash + dict get)", lambda: backward._PLANS.get(key)),
        ("  3 x torch.empty_like(x, contiguous) (dq, dk, dv: CPU malloc)", lambda: (
            torch.empty_like(q, memory_format=torch.contiguous_format),
            torch.empty_like(k, memory_format=torch.contiguous_format),
            torch.empty_like(v, memory_format=torch.contiguous_format))),
        ("  the scratch: torch.empty(bytes, uint8) (dq_accum, D: CPU malloc)", lambda: torch.empty(
            scratch_bytes, dtype=torch.uint8)),
        ("  9 x data_ptr() (ARRAY_PTR)", lambda: (ptr(q), ptr(k), ptr(v), ptr(o), ptr(do), ptr(lse), ptr(dq),
                                                    ptr(dk), ptr(dv))),
        ("  current stream", lambda: torch._C._cuda_getCurrentRawStream(0)),
        ("  plan.launch (one pack, 3 launches, no-op binding)", lambda: plan.launch(STREAM, pointers)),
        ("  plan.launch_plain (the hit's: one pack, 3 bare launches)", lambda: plan.launch_plain(STREAM, *pointers)),
        ("    one driver.Launcher over the no-op binding", lambda: plan._launchers[0](STREAM, 0)),
    ]
    if not plain:
        rows = [row for row in rows if "launch_plain" not in row[0]]
    for _, fn in rows[:5]:
        fn()     # (dq= builds a plan of its own)
    misses = backward._PLANS.misses

    def check():
        assert backward._PLANS.misses == misses, "every timed backward call must have hit"
    return rows, check


def varlen_rows(torch, api):
    """attention_varlen's hit (4 sequences of 256 tokens, 8 heads, d128, bf16, causal: the sm90 persistent
    kernel on the fake H200) beside attention()'s on the same tokens as (4, 256, 8, 128), and its pieces."""
    import facodegen
    from facodegen.ops import varlen

    b, s, h, d = 4, 256, 8, 128
    q, k, v = (torch.randn(b * s, h, d).to(torch.bfloat16) for _ in range(3))
    cu = torch.arange(0, (b + 1) * s, s, dtype=torch.int32)
    attention_varlen = facodegen.attention_varlen
    attention_varlen(q, k, v, cu, cu, s, s, causal=True)
    attention_varlen(q, k, v, cu, cu, s, s, causal=True)
    assert varlen._PLANS.misses == 1, "the second call must hit the plan the first one built"
    plan = next(iter(varlen._PLANS._plans.values()))
    padded = [x.view(b, s, h, d) for x in (q, k, v)]
    facodegen.attention(*padded, causal=True)
    ptrs = (q.data_ptr(), k.data_ptr(), v.data_ptr(), q.data_ptr())
    rows = [
        ("attention_varlen(q, k, v, cu, cu, 256, 256, causal=True) whole hit",
         lambda: attention_varlen(q, k, v, cu, cu, s, s, causal=True)),
        ("attention() of the same tokens, (4, 256, 8, 128), whole hit", lambda: facodegen.attention(*padded, causal=True)),
        ("  torch.empty_like(q) (CPU malloc)", lambda: torch.empty_like(q)),
        ("  plan.launch_plain with varlen and extents (the hit's)", lambda: plan.launch_plain(
            STREAM, *ptrs, 0, None, (cu.data_ptr(), cu.data_ptr(), b * s, b * s), (b * s, b * s))),
        ("  plan.launch with varlen and extents (the general one)", lambda: plan.launch(
            STREAM, *ptrs, 0, varlen=(cu.data_ptr(), cu.data_ptr(), b * s, b * s), extents=(b * s, b * s))),
    ]

    # the varlen backward (the sm90 kernels on the fake H200): its hit, and autograd's forward + backward
    from facodegen.ops import varlen_backward
    do = torch.randn(b * s, h, d).to(torch.bfloat16)
    out, lse = attention_varlen(q, k, v, cu, cu, s, s, causal=True, return_lse=True)
    facodegen.attention_varlen_backward(do, q, k, v, out, lse, cu, cu, s, s, causal=True)
    qg, kg, vg = (x.detach().requires_grad_(True) for x in (q, k, v))

    def step():     # forward + backward of one layer's varlen attention, as a training step runs it
        return torch.autograd.grad(attention_varlen(qg, kg, vg, cu, cu, s, s, causal=True), (qg, kg, vg), do)
    step()
    fwd_misses, bwd_misses = varlen._PLANS.misses, varlen_backward._PLANS.misses     # (return_lse: a plan of its own)
    # a training step's packing: other token totals each call (the same sequences count and bounds), 96 of them
    # in turn (more than a plan keeps images of: each call encodes its maps, as a step with a new total does);
    # q, dO and O are views of the first `total` tokens, the LSE its own (heads, total)
    batches = [(do[:b * s - extra], q[:b * s - extra], out[:b * s - extra], torch.empty(h, b * s - extra))
               for extra in range(96)]
    turn = iter(range(1 << 62))

    def new_total():
        don, qn, outn, lsen = batches[next(turn) % len(batches)]
        return facodegen.attention_varlen_backward(don, qn, k, v, outn, lsen, cu, cu, s, s, causal=True)
    rows += [
        ("attention_varlen_backward(do, q, k, v, out, lse, cu, cu, 256, 256, causal=True) whole hit",
         lambda: facodegen.attention_varlen_backward(do, q, k, v, out, lse, cu, cu, s, s, causal=True)),
        ("  ... a new token total each call (its maps encoded; tma.encode is a stub here, ~1.5 µs each on a GPU)",
         new_total),
        ("autograd: forward + backward through attention_varlen", step),
        # what a miss costs (a new layout or bound; new token totals hit since session 44): the checks, the spec,
        # the maps, BwdParams
        ("  a miss's plan: varlen_backward._resolve(...) (200 calls a round)", lambda: varlen_backward._resolve(
            do, q, k, v, out, lse, cu, cu, s, s, True, None, None, None, None, None, {}), 200),
    ]

    def check():
        assert varlen._PLANS.misses == fwd_misses, "a timed varlen call missed the plan"
        assert varlen_backward._PLANS.misses == bwd_misses, "a timed varlen backward call missed its plan"
    return rows, check


def decode_rows(torch, api):
    """attention_with_kvcache's decode step (batch 2, GQA 32/8, d128, a contiguous 4096-key cache, one query
    token: its fast path), plain, with return_lse and with a sliding window and softcap."""
    import facodegen
    from facodegen.ops import kvcache

    q = torch.randn(2, 1, 32, 128).to(torch.bfloat16)
    kc, vc = (torch.randn(2, 4096, 8, 128).to(torch.bfloat16) for _ in range(2))
    lengths = torch.full((2,), 1000, dtype=torch.int32)
    step = facodegen.attention_with_kvcache
    for kw in ({}, {"return_lse": True}, {"window_size": (256, 0), "softcap": 30.0}):
        step(q, kc, vc, lengths, **kw)
    misses = kvcache._PLANS.misses
    rows = [
        ("attention_with_kvcache(q, k_cache, v_cache, cache_seqlens) whole hit", lambda: step(q, kc, vc, lengths)),
        ("  ... return_lse=True", lambda: step(q, kc, vc, lengths, return_lse=True)),
        ("  ... window_size=(256, 0), softcap=30.0", lambda: step(q, kc, vc, lengths, window_size=(256, 0),
                                                                 softcap=30.0)),
    ]

    def check():
        assert kvcache._PLANS.misses == misses, "a timed decode step missed its plan"
    return rows, check


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calls", type=int, default=20_000)
    p.add_argument("--repeat", type=int, default=30)
    p.add_argument("--only", choices=("forward", "backward", "varlen", "decode"), help="time one section (default: all)")
    args = p.parse_args()
    torch, api = install_fake_gpu()
    for name, make in (("forward", forward_rows), ("backward", backward_rows), ("varlen", varlen_rows),
                       ("decode", decode_rows)):
        if args.only in (None, name):
            rows, check = make(torch, api)
            _time(rows, args, name)
            check()
    return 0


if __name__ == "__main__":
    sys.exit(main())
