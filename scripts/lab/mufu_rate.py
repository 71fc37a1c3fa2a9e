"""Throughput of the special-function ops a softcap score needs, per SM per clock (GPU): is MUFU.TANH as
cheap as MUFU.EX2, and what does a tanh from one MUFU.EX2 and FMA work cost instead?

    python3 scripts/lab.py mufu-rate            # GPU: the table
    python3 scripts/lab.py mufu-rate --check    # CPU: compile every variant for sm_90a, print its MUFU counts

Each variant is one kernel: every thread runs CHAINS independent chains of ITERS steps of one op (so the
pipe, not latency, bounds it), a full grid of 8 warps an SM x 4 CTAs an SM. Reported: ops per clock per SM,
from the elapsed time (CUDA events) and the SM clock nvidia-smi reads during the run (clocks are not set).

H100, 2026-12-05: ex2, tanh and rcp 15.9 each, ex2+tanh 8.0 (two ops a step), the EX2-and-polynomial tanh
10.0, FFMA 120. MUFU.TANH is as cheap as MUFU.EX2, so softcap's cost is its second MUFU op a score, not a
slow one; the EX2-and-polynomial tanh on a share of the n8 tiles was slower in the kernel (session 49).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the checkout

CHAINS, ITERS = 8, 4096
OPS = {   # name: (CUDA for one step on float x, what it costs)
    "ex2": 'asm("ex2.approx.ftz.f32 %0, %0;" : "+f"(x)); x = x * -0.5f;',
    "tanh": 'asm("tanh.approx.f32 %0, %0;" : "+f"(x)); x = x * 1.5f;',
    "rcp": 'asm("rcp.approx.ftz.f32 %0, %0;" : "+f"(x)); x = x + 1.0f;',
    "ex2+tanh": 'float t; asm("tanh.approx.f32 %0, %1;" : "=f"(t) : "f"(x)); asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(x) : "f"(t));',
    # tanh(|y|) = (1 - e) / (1 + e), e = 2^(-2 log2(e) |y|): one MUFU.EX2, 1 / (1 + e) on e in (0, 1] by a
    # degree-5 polynomial (Chebyshev-fitted on [0, 1]: 4.4e-5 at most), the sign copied back
    "tanh_ex2poly": ('float e; asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(e) : "f"(-2.8853900817779268f * fabsf(x)));'
                     ' float r = fmaf(fmaf(fmaf(fmaf(fmaf(-0.107653f, e, 0.425996f), e, -0.777783f), e, 0.956075f), e,'
                     ' -0.996623f), e, 0.999956f); x = copysignf((1.f - e) * r, x) * 1.5f;'),
    "ffma": "x = fmaf(x, 0.999f, 0.001f);",
}


def source(op: str) -> str:
    return f"""
extern "C" __global__ void __launch_bounds__(256) rate(float* sink, float seed) {{
    float v[{CHAINS}];
#pragma unroll
    for (int c = 0; c < {CHAINS}; ++c) v[c] = seed * (threadIdx.x + c) * 1e-3f;
    for (int it = 0; it < {ITERS}; ++it) {{
#pragma unroll
        for (int c = 0; c < {CHAINS}; ++c) {{ float x = v[c]; {OPS[op]} v[c] = x; }}
    }}
    float s = 0.f;
#pragma unroll
    for (int c = 0; c < {CHAINS}; ++c) s += v[c];
    if (s == 12345.f) sink[threadIdx.x] = s;   // (never: keeps the chains)
}}
"""


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="compile for sm_90a only (CPU)")
    args = p.parse_args(argv)
    if args.check:
        import re

        from facodegen.runtime import compiler
        for op in OPS:
            log = compiler.compile_source(source(op), "sm90", "rate").sass()
            print(op, {m: len(re.findall(m, log)) for m in ("MUFU.EX2", "MUFU.TANH", "MUFU.RCP", "FFMA")})
        return 0
    import subprocess

    import cupy as cp
    dev = cp.cuda.Device()
    sms = dev.attributes["MultiProcessorCount"]
    print(f"{cp.cuda.runtime.getDeviceProperties(dev.id)['name'].decode()}, {sms} SMs, {CHAINS} chains x {ITERS} "
          "steps a thread, 256 threads x 4 CTAs an SM")
    print("| op | ms | SM MHz | ops / clk / SM (one step = one op) |\n|---|---|---|---|")
    sink = cp.zeros(256, dtype=cp.float32)
    for op in OPS:
        kernel = cp.RawKernel(source(op), "rate", options=("--use_fast_math",))
        grid = (sms * 4,)
        for _ in range(3):
            kernel(grid, (256,), (sink, cp.float32(0.5)))
        cp.cuda.Device().synchronize()
        start, stop = cp.cuda.Event(), cp.cuda.Event()
        clocks = []
        start.record()
        for _ in range(20):
            kernel(grid, (256,), (sink, cp.float32(0.5)))
        stop.record()
        clocks.append(subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm", "--format=csv,noheader,nounits"],
                                     capture_output=True, text=True).stdout.strip())
        stop.synchronize()
        ms = cp.cuda.get_elapsed_time(start, stop) / 20
        mhz = float(clocks[-1].split()[0]) if clocks[-1] else float("nan")
        ops = sms * 4 * 256 * CHAINS * ITERS
        print(f"| {op} | {ms:.3f} | {mhz:.0f} | {ops / (ms * 1e-3) / (mhz * 1e6) / sms:.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
