#!/usr/bin/env python3
"""Where the host time of a plan-cache hit of facodegen.attention() goes (GPU, torch).

    python3 scripts/host_cost_breakdown.py [--calls 20000]

Times, on (1, 128, 8, 128) bf16 causal tensors, each step of api._attention_torch's hit path in a
loop of its own (the call-key tuple, the dict lookup, empty_like for O, the data pointers, the
stream query, the launch) and the whole call; the call that records autograd and its pieces;
a forward + backward beside SDPA's; in microseconds per call: bench.time_host_per_call's
host_us (chunks of calls after a synchronize, so no launch waits for the GPU) and its loop_us.
Then the alternatives beside each piece: cuLaunchKernel through CuPy's binding and through ctypes,
other ways to allocate O and the LSE, the fp8 call with descales (sm90) and the CuPy fp16 call
with the CuPy calls on its hit path.
The steps do not add up exactly (a loop of one step keeps its objects in cache), but they say which
step a faster path must remove.

Its CPU twin, scripts/hit_path_cpu.py, times the same hit path's Python on a machine without a GPU
(CPU tensors behind a faked device, stream and launch binding): for trimming the Python between
GPU runs; the numbers that count are this script's and `bench --suite overhead`'s on the GPU.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calls", type=int, default=2000)
    args = p.parse_args()
    import torch

    import facodegen
    from facodegen.ops import api
    from facodegen import bench
    from facodegen.tuning import tunedb
    q, k, v = (torch.randn(1, 128, 8, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    facodegen.attention(q, k, v, causal=True)
    torch.cuda.synchronize()
    device = q.get_device()
    qg, kg, vg = (x.detach().clone().requires_grad_(True) for x in (q, k, v))
    facodegen.attention(qg, kg, vg, causal=True)
    dout = torch.randn_like(q)
    dout_t = dout.transpose(1, 2)
    o_saved, lse_saved = facodegen.attention(q, k, v, causal=True, return_lse=True)

    class AllocateOnly(torch.autograd.Function):
        """torch_op._Attention's autograd bookkeeping around a forward that launches nothing."""

        @staticmethod
        def forward(ctx, q, k, v, call):
            out, lse = torch.empty_like(q), q.new_empty((q.shape[0], q.shape[2], q.shape[1]), dtype=torch.float32)
            ctx.save_for_backward(q, k, v, out, lse)
            ctx.call = call
            ctx.mark_non_differentiable(lse)
            return out, lse

        @staticmethod
        def backward(ctx, grad_out, grad_lse):
            return None, None, None, None

    # Each layer of a model calls with its own tensors: one plan, a params image per address set.
    sets = [tuple(torch.randn_like(q) for _ in range(3)) for _ in range(32)]
    turns = itertools.cycle(sets)
    for qkv in sets:
        facodegen.attention(*qkv, causal=True)
    key = None

    def make_key():
        nonlocal key
        key = (q.dtype, q.shape, q.stride(), k.dtype, k.shape, k.stride(), k.get_device(),
               v.dtype, v.shape, v.stride(), v.get_device(), q.get_device(), torch._C._cuda_getDevice(),
               bool, True, type(None), None, False, None, None, tunedb.generation())   # attention()'s fast path
    make_key()
    plan = next(iter(api._PLANS._plans.values()))
    out = torch.empty_like(q)
    rows = [
        ("attention() whole call", lambda: facodegen.attention(q, k, v, causal=True)),
        ("attention(), 32 input sets in turn (a model's layers)", lambda: facodegen.attention(*next(turns), causal=True)),
        ("prepare()() whole call", facodegen.prepare(q, k, v, causal=True)),
        # Training: the forward of a call that records the backward (torch_op._Attention: the plan
        # launch inside an autograd.Function, O and LSE saved), beside SDPA's with autograd (#38: at
        # most 2x SDPA's), then its pieces: the Function's forward body alone (the plan launch with
        # the LSE), the Function's bookkeeping around a forward that only allocates O and LSE, and
        # the op's register_autograd formula that torch.compile traces (what eager calls used before).
        ("attention() recording autograd", lambda: facodegen.attention(qg, kg, vg, causal=True)),
        ("torch SDPA recording autograd", lambda: torch.nn.functional.scaled_dot_product_attention(
            qg.transpose(1, 2), kg.transpose(1, 2), vg.transpose(1, 2), is_causal=True)),
        ("  _Attention's forward body: api._attention_torch with the LSE", lambda: api._attention_torch(
            torch, qg, kg, vg, True, None, True, None, None, None, {})),
        ("  autograd.Function around O, LSE allocation only", lambda: AllocateOnly.apply(qg, kg, vg, None)),
        ("  torch.ops.facodegen.attention recording (register_autograd)", lambda: torch.ops.facodegen.attention(
            qg, kg, vg, True, None, None, None, None, None, "")),
        # A training step's attention: forward and backward (three backward launches, dQ accumulator).
        ("attention() forward + backward", lambda: facodegen.attention(qg, kg, vg, causal=True).backward(dout)),
        ("torch SDPA forward + backward", lambda: torch.nn.functional.scaled_dot_product_attention(
            qg.transpose(1, 2), kg.transpose(1, 2), vg.transpose(1, 2), is_causal=True).backward(dout_t)),
        ("  attention_backward() alone", lambda: facodegen.attention_backward(dout, q, k, v, o_saved, lse_saved,
                                                                              causal=True)),
        # (the sm90 backward's TMA maps: one params image per (q, k, v, dout) address set, as the forward's)
        ("  attention_backward(), 32 input sets in turn (a model's layers)", lambda: facodegen.attention_backward(
            dout, *next(turns), o_saved, lse_saved, causal=True)),
        ("  3 x empty_like(x, contiguous) (its dq, dk, dv)", lambda: tuple(
            torch.empty_like(x, memory_format=torch.contiguous_format) for x in (q, k, v))),
        ("torch SDPA whole call", lambda: torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)),
        ("call key tuple", make_key),
        ("  tunedb.generation()", tunedb.generation),
        ("  q.stride()", q.stride),
        ("  q.shape", lambda: q.shape),
        ("  torch._C._cuda_getDevice()", torch._C._cuda_getDevice),
        ("hash(key) + dict get", lambda: api._PLANS.get(key)),
        ("empty_like(q)", lambda: torch.empty_like(q)),
        ("4 x data_ptr()", lambda: (q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr())),
        ("current raw stream", lambda: torch._C._cuda_getCurrentRawStream(device)),
        ("is_grad_enabled + requires_grad x3", lambda: torch.is_grad_enabled() and (
            q.requires_grad or k.requires_grad or v.requires_grad)),
        ("torch.compiler.is_compiling()", torch.compiler.is_compiling),
    ]
    # Decode (#39): a paged one-token step through attention_with_kvcache, FA3's call beside it.
    cache = [torch.randn(8, 64, 8, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
    q1 = torch.randn(1, 1, 32, 128, device="cuda", dtype=torch.bfloat16)
    lengths = torch.tensor([500], dtype=torch.int32, device="cuda")
    table = torch.arange(8, dtype=torch.int32, device="cuda")[None]
    rows.append(("attention_with_kvcache() paged, 1 token", lambda: facodegen.attention_with_kvcache(
        q1, *cache, lengths, page_table=table, num_splits=1)))
    try:
        from flash_attn_interface import flash_attn_with_kvcache
        rows.append(("FA3 flash_attn_with_kvcache paged, 1 token", lambda: flash_attn_with_kvcache(
            q1, *cache, cache_seqlens=lengths, page_table=table, causal=True, num_splits=1)))
    except ImportError:
        pass
    stream = torch._C._cuda_getCurrentRawStream(device)
    ptrs = (q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), 0)
    rows.append(("plan.launch (patch + cuLaunchKernel)", lambda: plan.launch(stream, *ptrs, None)))
    rows.append(("plan.launch_plain (the common call's: attention()'s fast path)",
                 lambda: plan.launch_plain(stream, *ptrs)))
    binding = "CuPy's binding" if isinstance(plan._launcher._launch, functools.partial) else "ctypes"
    rows.append((f"  launcher alone (driver.Launcher, {binding})",
                 lambda: plan._launcher(stream, plan._last.kernel_params)))
    rows += _launch_rows(plan, stream, ptrs)
    rows += _allocation_rows(torch, q)
    if torch.cuda.get_device_capability(device) == (9, 0):
        rows += _fp8_rows(torch, q, k, v)
    rows += _cupy_rows(torch, q, k, v)
    print("| step | host µs per call | loop µs per call |\n|---|---|---|")
    for name, fn in rows:
        t = bench.time_host_per_call(fn, torch.cuda.synchronize, calls=args.calls)
        print(f"| {name} | {t['host_us']:.2f} | {t['loop_us']:.2f} |", flush=True)
    return 0


def _launch_rows(plan, stream: int, ptrs: tuple) -> list:
    """cuLaunchKernel of the plan's kernel on ``ptrs`` (q, k, v, out, lse: tensors that outlive the
    timing), two ways: CuPy's Cython binding called bare (what driver.Launcher wraps) and ctypes with
    prebuilt ctypes arguments (the launcher before 2026-12-03): the binding's gain is the difference."""
    import ctypes

    from cupy_backends.cuda.api.driver import launchKernel
    from facodegen.runtime.plan import _Image
    function, grid, spec = plan.function, plan.grid, plan.spec
    plan.launch(stream, *ptrs, None)        # the image now points at ptrs' tensors, not a freed O
    image = _Image(plan.param_bytes())      # our own copy: the plan may drop its images; `bare` keeps this one
    ints = (function.ptr, *grid, spec.threads, 1, 1, spec.smem_bytes, stream)
    raw = ctypes.CDLL("libcuda.so.1").cuLaunchKernel      # no argtypes: the arguments are ctypes objects
    u = ctypes.c_uint
    prebuilt = (ctypes.c_void_p(function.ptr), u(grid[0]), u(grid[1]), u(grid[2]), u(spec.threads), u(1), u(1),
                u(spec.smem_bytes), ctypes.c_void_p(stream), ctypes.c_void_p(image.kernel_params), None)

    def bare():
        launchKernel(*ints, image.kernel_params, 0)
    return [("  cuLaunchKernel via CuPy's binding, bare", bare),
            ("  cuLaunchKernel via ctypes, prebuilt arguments (the launcher before)", lambda: raw(*prebuilt))
            ] + _driver_floor_rows(stream, len(plan.param_bytes()), spec.smem_bytes)


def _driver_floor_rows(stream: int, param_bytes: int, smem_bytes: int) -> list:
    """The driver's own floor: cuLaunchKernel (CuPy's binding) of an empty kernel with 8 bytes of
    parameters, with ``param_bytes`` of them (the plan's FlashParams size), and with the plan's
    dynamic shared memory too: what of the plan's launch is the driver's per-launch cost, what
    its parameter size or its shared-memory configuration adds."""
    import ctypes

    import cupy
    from cupy_backends.cuda.api.driver import launchKernel
    from facodegen.runtime import driver
    words = (param_bytes + 7) // 8
    src = (f"struct Big {{ unsigned long long w[{words}]; }};\n"
           "extern \"C\" __global__ void small(unsigned long long x) { if (x == 1) asm volatile(\"trap;\"); }\n"
           "extern \"C\" __global__ void big(const __grid_constant__ Big b) {"
           " if (b.w[0] == 1) asm volatile(\"trap;\"); }\n")
    module = cupy.RawModule(code=src, options=("-std=c++17",))
    small, big = (module.get_function(n).kernel for n in ("small", "big"))   # cupy.cuda.function.Function: .ptr
    driver.lib().cuFuncSetAttribute(ctypes.c_void_p(big.ptr), 8, smem_bytes)   # max dynamic smem
    word = ctypes.c_uint64(0)
    blob = (ctypes.c_uint64 * words)()

    def launcher(function, ctas: int, threads: int, smem: int, value):
        """launchKernel of ``function`` with one argument, ``value``; the closure's default holds the
        module and the argument array (a freed module unloads, a freed array dangles)."""
        args = (ctypes.c_void_p * 1)(ctypes.addressof(value))
        ptr, address = function.ptr, ctypes.addressof(args)

        def launch(_held=(module, function, value, args)):
            launchKernel(ptr, ctas, 1, 1, threads, 1, 1, smem, stream, address, 0)
        return launch
    return [("  driver floor: empty kernel, 8 B of params", launcher(small, 1, 32, 0, word)),
            (f"  driver floor: empty kernel, {param_bytes} B of params", launcher(big, 1, 32, 0, blob)),
            (f"  driver floor: same, {smem_bytes} B dynamic smem, 384 threads, 132 CTAs",
             launcher(big, 132, 384, smem_bytes, blob))]


def _allocation_rows(torch, q) -> list:
    """Ways to allocate O (q's shape) and the LSE; empty_like keeps q's layout where q is dense,
    which is what the plan's O strides were packed for (api._resolve allocates the miss's O so)."""
    from facodegen.ops import api
    shape, strides = tuple(q.shape), q.stride()
    made = api._Outputs(shape, "bfloat16", (shape[0], shape[2], shape[1]), torch.bfloat16, None, True, ())
    made.new_lse(torch, q)
    return [("  empty_like(q, dtype=float16) (fp8's O)", lambda: torch.empty_like(q, dtype=torch.float16)),
            ("  q.new_empty(shape tuple)", lambda: q.new_empty(shape)),
            ("  torch.empty(*shape, dtype=, device=)", lambda: torch.empty(*shape, dtype=q.dtype, device=q.device)),
            ("  torch.empty_strided(shape, strides, dtype=, device=)",
             lambda: torch.empty_strided(shape, strides, dtype=q.dtype, device=q.device)),
            ("  LSE: new_lse (empty_like of a stride-0 template)", lambda: made.new_lse(torch, q)),
            ("  LSE: q.new_empty(lse shape, dtype=float32)",
             lambda: q.new_empty(made.lse_shape, dtype=torch.float32))]


def _fp8_rows(torch, q, k, v) -> list:
    """The fp8 call of `bench --suite overhead` (e4m3 inputs, scalar descales) and its extra pieces."""
    import facodegen
    from facodegen.ops import api
    q8, k8, v8 = (x.to(torch.float8_e4m3fn) for x in (q, k, v))
    descales = {f"{n}_descale": torch.ones((), dtype=torch.float32, device=q.device) for n in "qkv"}
    out = torch.empty_like(q)
    for options in ({}, {"return_lse": True}, {"out": out}):
        facodegen.attention(q8, k8, v8, causal=True, **descales, **options)
    plan = next(p for p in api._PLANS._plans.values() if p.spec.dtype == "fp8")
    stream = torch._C._cuda_getCurrentRawStream(q.get_device())
    ptrs = (q8.data_ptr(), k8.data_ptr(), v8.data_ptr(), out.data_ptr(), 0)
    descale_ptrs = tuple(d.data_ptr() for d in descales.values())
    dq, dk, dv = descales.values()
    return [("attention() fp8 + descales whole call",
             lambda: facodegen.attention(q8, k8, v8, causal=True, **descales)),
            ("attention() fp8 + descales, return_lse", lambda: facodegen.attention(
                q8, k8, v8, causal=True, return_lse=True, **descales)),
            ("attention() fp8 + descales, out=", lambda: facodegen.attention(q8, k8, v8, causal=True, out=out,
                                                                            **descales)),
            ("  fp8: _split_knobs(descales)", lambda: api._split_knobs(descales)),
            ("  fp8: 3 descale metas (key)",
             lambda: (api._torch_meta(dq), api._torch_meta(dk), api._torch_meta(dv))),
            ("  fp8: plan.launch with descales", lambda: plan.launch(stream, *ptrs, descale_ptrs))]


def _cupy_rows(torch, q, k, v) -> list:
    """The CuPy fp16 call of `bench --suite overhead` and the CuPy calls on its hit path."""
    try:
        import cupy
    except ImportError:
        return []
    import numpy

    import facodegen
    q16, k16, v16 = (cupy.asarray(x.to(torch.float16)) for x in (q, k, v))
    facodegen.attention(q16, k16, v16)
    facodegen.attention(q16, k16, v16, return_lse=True)
    shape, fp16 = q16.shape, numpy.dtype("float16")
    device = cupy.cuda.Device(q16.data.device_id)

    def switch_device():
        with device:
            pass
    return [("attention() CuPy fp16 whole call", lambda: facodegen.attention(q16, k16, v16)),
            ("attention() CuPy fp16, return_lse", lambda: facodegen.attention(q16, k16, v16, return_lse=True)),
            ("  cupy.cuda.runtime.getDevice()", cupy.cuda.runtime.getDevice),
            ("  cupy key: 3 x (dtype, shape, strides, data.device_id)", lambda: tuple(
                (x.dtype, x.shape, x.strides, x.data.device_id) for x in (q16, k16, v16))),
            ("  cupy.ndarray(shape, numpy.dtype) (the hit's O)", lambda: cupy.ndarray(shape, fp16)),
            ("  cupy.empty(shape, dtype='float16') (the hit's O before)", lambda: cupy.empty(shape, dtype="float16")),
            ("  with cupy.cuda.Device(q's) (the hit before, every call)", switch_device),
            ("  cupy.cuda.get_current_stream().ptr", lambda: cupy.cuda.get_current_stream().ptr)]


if __name__ == "__main__":
    sys.exit(main())
