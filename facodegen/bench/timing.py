"""Timing: CUDA events around groups of back-to-back calls, several callables taking turns group
by group (time_cuda_interleaved, time_cuda); host microseconds per call (time_host_per_call); and
the ceilings a result is read against (bf16 and e4m3 GEMM TFLOP/s, copy bandwidth). Everything
here that needs a GPU imports torch lazily, through _torch."""

from __future__ import annotations

import contextlib
import statistics
import time

from .grids import tflops

WARMUP = 5
GROUPS = 7
CALLS_PER_GROUP = 20


def _torch():
    import torch
    return torch


def time_cuda_interleaved(fns: list, warmup: int = WARMUP, groups: int = GROUPS,
                          calls: int = CALLS_PER_GROUP, spans: list | None = None,
                          contexts: list | None = None) -> list[dict]:
    """time_cuda for several callables at once, group by group in turn (A B C A B C ...), so a
    drift of the GPU's clocks or temperature over the run falls on all of them alike. ``spans``
    (a list per callable) receives every group as (wall start, wall end, ms per call).
    ``contexts`` (a factory per callable, e.g. an SDPA backend choice) is entered around each
    callable's warm-up and each of its groups, outside the CUDA events."""
    torch = _torch()
    contexts = contexts or [contextlib.nullcontext] * len(fns)
    for fn, context in zip(fns, contexts):
        with context():
            for _ in range(warmup):
                fn()
    torch.cuda.synchronize()
    means = [[] for _ in fns]
    host = [[] for _ in fns]
    for _ in range(groups):
        for i, fn in enumerate(fns):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            with contexts[i]():
                wall0 = time.time()
                start.record()
                t0 = time.perf_counter()
                for _ in range(calls):
                    fn()
                t1 = time.perf_counter()
                end.record()
                end.synchronize()
            means[i].append(start.elapsed_time(end) / calls)
            host[i].append((t1 - t0) * 1e3 / calls)
            if spans is not None:
                spans[i].append((wall0, time.time(), means[i][-1]))
    return [{"ms": statistics.median(m), "min_ms": min(m), "max_ms": max(m), "host_ms": statistics.median(h)}
            for m, h in zip(means, host)]


def time_cuda(fn, warmup: int = WARMUP, groups: int = GROUPS, calls: int = CALLS_PER_GROUP) -> dict:
    """Median over ``groups`` of the mean time of ``calls`` back-to-back calls, between two CUDA
    events on the current torch stream. Also the host time per call: when it is near the device
    time, the calls were launch-bound and the number measures the host, not the kernel."""
    return time_cuda_interleaved([fn], warmup, groups, calls)[0]


def gemm_ceiling(n: int = 8192) -> float:
    """TFLOP/s of a bf16 n^3 torch matmul on random data (the context for attention numbers)."""
    torch = _torch()
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    t = time_cuda(lambda: torch.mm(a, b), warmup=3, groups=5, calls=5)
    return tflops(2.0 * n ** 3, t["ms"])


def fp8_gemm_ceiling(n: int = 8192) -> float:
    """TFLOP/s of an e4m3 n^3 ``torch._scaled_mm`` (bf16 out): the FP8 ceiling issue 6 reports against."""
    torch = _torch()
    a = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn)
    b = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn).t()      # column-major, as cuBLASLt wants
    one = torch.ones((), device="cuda")
    t = time_cuda(lambda: torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16),
                  warmup=3, groups=5, calls=5)
    return tflops(2.0 * n ** 3, t["ms"])


def copy_bandwidth(nbytes: int = 2 << 30) -> float:
    """TB/s of a device-to-device copy, counting bytes read plus bytes written."""
    torch = _torch()
    src = torch.empty(nbytes, device="cuda", dtype=torch.uint8).random_()
    dst = torch.empty_like(src)
    t = time_cuda(lambda: dst.copy_(src), warmup=3, groups=5, calls=5)
    return 2 * nbytes / (t["ms"] * 1e-3) / 1e12


def time_host_per_call(fn, synchronize, warmup: int = 200, calls: int = 2000, repeats: int = 5,
                       chunk: int = 100) -> dict:
    """Host cost of one call of ``fn`` in microseconds, after ``warmup`` calls, two ways, each the
    median over ``repeats``:

    * ``loop_us``: ``calls`` back-to-back calls with time.perf_counter() around the loop and one
      ``synchronize()`` after it, divided by ``calls``: a call's steady-state cost in a loop (the
      host's as long as the GPU keeps up, else the GPU's).
    * ``host_us``: the same number of calls in chunks of ``chunk``, a ``synchronize()`` before each
      chunk and only the chunk's loop on the clock, divided by ``calls``: the pure host time, the GPU
      never the bottleneck (a chunk never fills the launch queue, so no launch waits for the GPU).
    """
    for _ in range(warmup):
        fn()
    synchronize()
    loop, host = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        synchronize()
        loop.append((time.perf_counter() - t0) / calls)
    chunks = max(1, calls // chunk)
    for _ in range(repeats):
        spent = 0.0
        for _ in range(chunks):
            synchronize()
            t0 = time.perf_counter()
            for _ in range(chunk):
                fn()
            spent += time.perf_counter() - t0
        host.append(spent / (chunks * chunk))
    synchronize()
    return {"host_us": statistics.median(host) * 1e6, "loop_us": statistics.median(loop) * 1e6}
