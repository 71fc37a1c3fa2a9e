"""Does an SM run its tensor cores and its MUFU (or FMA) pipe at the same time? (GPU)

    python3 scripts/lab.py overlap-probe                    # GPU: the table, rates per SM clock
    python3 scripts/lab.py overlap-probe --check            # CPU: compile every variant for sm_90a
    python3 scripts/lab.py overlap-probe --vt-slabs         # GPU: B (V^T) 128B- against 32B-swizzled

The fp8 kernels' profiles (docs/perf-notes.md, sessions 15-16) read as if the GEMMs and the exp2s
never overlapped: at head_dim 256 the tensor pipe's 68.5% and the XU's share of the exp2s (~35%)
add up to the whole step, for FlashAttention-3 as for facodegen, pingpong or not. This probe asks
the hardware directly. One CTA per SM, three warpgroups:
  - GEMM warpgroups (0, 1 or 2) issue groups of 8 e4m3 wgmmas m64nNk32 into their own
    accumulators, one group in flight (commit, wait for the one before), as scripts/lab.py wgmma-rate;
    `rs` takes A from registers as the P V GEMM does, `ss` both operands from shared memory;
    `rs32` / `ss32` read B 32B-swizzled, one k32 step per N x 32-byte slab (a V^T tile in 32-key
    slabs, the layout a row-major V tile can be transposed into in place), instead of four k32
    steps along a 128-byte row.
  - side work: 8 independent chains per thread of `ex2` (MUFU.EX2), `ffma`, or `mix` (FFMA, EX2,
    FADD: the softmax's per-score work), run by warpgroup 2 until the GEMM warpgroups are done (the
    SM quadrants' other warps, as one consumer warpgroup's softmax beside the other's GEMMs). The
    same work in the GEMM warps themselves, between a group's commit and its wait, made ptxas
    serialise the wgmmas (C7514), so this probe does not measure that case.
Each CTA's thread 0 of warpgroups 0 and 2 reads %clock64 around its loop, so the rates come per SM
clock (no matter how the card throttles): GEMM FLOP/clk/SM and side lane-ops/clk/SM, alone and
together. If the two together take the sum of their alone times, they exclude each other.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the checkout

GROUP = 8
CHAINS = 8          # independent side chains per thread: one op of the side's pipe each per round
SIDE_OPS = ("none", "ex2", "ffma", "mix")
# (GEMM warpgroups, shape, N, side op); the alone rows first
VARIANTS = [
    (2, "ss", 256, "none"), (2, "rs", 256, "none"), (2, "ss", 128, "none"), (1, "rs", 256, "none"),
    (0, "ss", 256, "ex2"), (0, "ss", 256, "ffma"), (0, "ss", 256, "mix"),
    (2, "rs", 256, "ex2"), (2, "rs", 256, "ffma"), (2, "rs", 256, "mix"),
    (2, "ss", 256, "ex2"), (2, "ss", 128, "ex2"), (1, "rs", 256, "ex2"), (1, "rs", 256, "mix"),
]
# --vt-slabs: the P V form with V^T 128B- and 32B-swizzled, alone and beside the softmax's mix, and
# the FFMA rate beside SS GEMMs (the table above has it beside RS only); alone rows first
VT_SLAB_VARIANTS = [
    (2, "rs", 256, "none"), (2, "rs32", 256, "none"), (1, "rs", 256, "none"), (1, "rs32", 256, "none"),
    (2, "ss", 256, "none"), (2, "ss32", 256, "none"), (0, "ss", 256, "ffma"), (0, "ss", 256, "mix"),
    (2, "rs", 256, "mix"), (2, "rs32", 256, "mix"), (2, "ss", 256, "ffma"), (2, "rs", 256, "ffma"),
]


def name(v) -> str:
    wgs, shape, n, side = v
    return f"g{wgs}_{shape}{'_' if shape.endswith('32') else ''}{n}_{side}"


def side_body(op: str) -> str:
    """One round of the side work: 8 independent chains in x[], per thread."""
    if op == "ex2":        # x = 2^-x stays in [0.5, 1]
        return "\n".join(f'asm volatile("ex2.approx.ftz.f32 %0, %1;" : "=f"(x[{j}]) : "f"(-x[{j}]));'
                         for j in range(8))
    if op == "ffma":
        return "\n".join(f"x[{j}] = fmaf(x[{j}], 0.999f, 0.001f);" for j in range(8))
    if op == "mix":        # p = 2^(s*c - m), sum += p, the next s from p: FFMA, EX2, FADD
        return "\n".join(
            f'{{ float t = fmaf(x[{j}], 0.5f, -1.f); float p; asm volatile("ex2.approx.ftz.f32 %0, %1;" '
            f': "=f"(p) : "f"(t)); acc[{j % 2}] += p; x[{j}] = p; }}' for j in range(8))
    return ""


def source(v) -> str:
    wgs, shape, n, side = v
    regs = ", ".join(f"%{i}" for i in range(n // 2))
    outs = ", ".join(f'"+f"(d[{i}])' for i in range(n // 2))
    b_swizzle = 32 if shape.endswith("32") else 128
    b_mode = {128: 1, 32: 3}[b_swizzle]
    b_step = 2 if b_swizzle == 128 else n * 32 // 16       # descriptor units (16 bytes) per k32 step
    if shape.startswith("ss"):
        a_operand, a_in = f"%{n // 2}", '"l"(a)'
        b_index = n // 2 + 1
    else:
        a_operand = "{" + ", ".join(f"%{n // 2 + i}" for i in range(4)) + "}"
        a_in = ", ".join(f'"r"(ra[{i}])' for i in range(4))
        b_index = n // 2 + 4
    body = side_body(side)
    return f"""
typedef unsigned long long u64;
__device__ __forceinline__ u64 desc(unsigned addr, int swizzle_bytes, int mode) {{
    // K-major, swizzled: start >> 4, LBO 1 (unused), SBO = 8 rows of the swizzle width, mode in bits 62-63
    return (u64)((addr & 0x3FFFF) >> 4) | ((u64)1 << 16) | ((u64)(8 * swizzle_bytes >> 4) << 32) | ((u64)mode << 62);
}}
__device__ __forceinline__ void mma(float (&d)[{n // 2}], u64 a, const unsigned* ra, u64 b) {{
    asm volatile("{{\\n.reg .pred p;\\nsetp.ne.b32 p, 1, 0;\\n"
                 "wgmma.mma_async.sync.aligned.m64n{n}k32.f32.e4m3.e4m3 {{{regs}}}, {a_operand}, %{b_index}, p, 1, 1;\\n}}\\n"
                 : {outs} : {a_in}, "l"(b));
}}
extern "C" __global__ void __launch_bounds__(384, 1) probe(int iters, int side_iters, u64* clocks, float* sink) {{
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    __shared__ int gemm_done;
    const unsigned base = ((unsigned)__cvta_generic_to_shared(smem_raw) + 1023u) & ~1023u;
    unsigned char* smem = smem_raw + (base - (unsigned)__cvta_generic_to_shared(smem_raw));
    for (int i = threadIdx.x; i < (64 + 256) * 128 / 4; i += blockDim.x) {{
        ((unsigned*)smem)[i] = 0x20202020u;                     // e4m3 2^-3
    }}
    if (threadIdx.x == 0) gemm_done = 0;
    asm volatile("fence.proxy.async.shared::cta;\\n" ::: "memory");
    __syncthreads();
    const int wg = threadIdx.x / 128;
    float x[8], acc[2] = {{0.f, 0.f}};
#pragma unroll
    for (int j = 0; j < 8; ++j) x[j] = 0.5f + 0.01f * j + 1e-4f * threadIdx.x;
    if (wg < {wgs}) {{
        const u64 a = desc(base, 128, 1), b = desc(base + 64 * 128, {b_swizzle}, {b_mode});
        asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\\n");
        unsigned ra[4][4];                                      // one A slice per k-step, as P
#pragma unroll
        for (int i = 0; i < 16; ++i) ra[i / 4][i % 4] = 0x20202020u + (threadIdx.x >> 10);
        float d[{n // 2}];
#pragma unroll
        for (int i = 0; i < {n // 2}; ++i) d[i] = 0.f;
        const u64 t0 = clock64();
        for (int it = 0; it < iters; ++it) {{
            asm volatile("wgmma.fence.sync.aligned;\\n" ::: "memory");
#pragma unroll
            for (int s = 0; s < {GROUP}; ++s) {{
                mma(d, a + 2 * (s % 4), ra[s % 4], b + {b_step} * (s % 4));
            }}
            asm volatile("wgmma.commit_group.sync.aligned;\\n" ::: "memory");
            asm volatile("wgmma.wait_group.sync.aligned 1;\\n" ::: "memory");
        }}
        asm volatile("wgmma.wait_group.sync.aligned 0;\\n" ::: "memory");
        const u64 t1 = clock64();
        if (threadIdx.x % 128 == 0) atomicAdd(&gemm_done, 1);
        if (threadIdx.x == 0) {{ clocks[4 * blockIdx.x] = t0; clocks[4 * blockIdx.x + 1] = t1; }}
        float s = 0.f;
#pragma unroll
        for (int i = 0; i < {n // 2}; ++i) s += d[i];
        if (s == -1.f) sink[threadIdx.x] = s;
    }} else if (wg == 2) {{
        asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\\n");    // the GEMM warpgroups' 232
      if ({int(side != "none")}) {{
        const u64 t0 = clock64();
        long long rounds = 0;
        for (;;) {{
#pragma unroll 4
            for (int r = 0; r < 16; ++r) {{
                {body}
            }}
            rounds += 16;
            if ({wgs} == 0 ? rounds >= side_iters : *(volatile int*)&gemm_done == {wgs}) break;
        }}
        const u64 t1 = clock64();
        if (threadIdx.x == 256) {{ clocks[4 * blockIdx.x + 2] = t1 - t0; clocks[4 * blockIdx.x + 3] = rounds; }}
      }}
    }}
    float s = acc[0] + acc[1];
#pragma unroll
    for (int j = 0; j < 8; ++j) s += x[j];
    if (s == -1.f) sink[threadIdx.x] = s;
}}
"""


SMEM = (64 + 256) * 128 + 1024


def compile_all(variants) -> dict:
    from facodegen.runtime import compiler
    out = {}
    for v in variants:
        cubin, log = compiler._nvrtc_compile(source(v), f"probe_{name(v)}", compiler.NVRTC_OPTIONS("sm90"))
        out[v] = (cubin, compiler.parse_ptxas_log(log))
        log_of[v] = log
    return out


log_of: dict = {}   # ptxas's log per variant (compile_all)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--check", action="store_true", help="compile only (no GPU): registers, spills, SASS counts")
    p.add_argument("--iters", type=int, default=20000, help="GEMM groups per warpgroup")
    p.add_argument("--side-iters", type=int, default=200000, help="side rounds when no GEMM runs")
    p.add_argument("--vt-slabs", action="store_true", help="V^T 128B- against 32B-swizzled (VT_SLAB_VARIANTS)")
    args = p.parse_args(argv)
    kernels = compile_all(VT_SLAB_VARIANTS if args.vt_slabs else VARIANTS)
    if args.check:
        for v, (cubin, res) in kernels.items():
            r = next(iter(res.values()))
            serial = "; wgmmas serialised" if "C751" in log_of[v] else ""
            print(f"{name(v)}: {r.registers} registers, spills {r.spill_stores}/{r.spill_loads} B{serial}")
        return 0
    import cupy
    import numpy as np
    sms = cupy.cuda.runtime.getDeviceProperties(0)["multiProcessorCount"]
    sink = cupy.zeros(384, dtype=cupy.float32)
    clocks = cupy.zeros(4 * sms, dtype=cupy.uint64)
    rows = {}
    for v, (cubin, _) in kernels.items():
        wgs, shape, n, side = v
        module = cupy.cuda.Module()
        module.load(cubin)
        fn = module.get_function("probe")
        runs = []
        for _ in range(3):
            clocks.fill(0)
            fn((sms,), (384,), (cupy.int32(args.iters), cupy.int32(args.side_iters), clocks, sink), shared_mem=SMEM)
            cupy.cuda.runtime.deviceSynchronize()
            c = cupy.asnumpy(clocks).reshape(sms, 4).astype(np.float64)
            gemm_clk = float(np.median(c[:, 1] - c[:, 0])) if wgs else 0.0
            gemm_rate = wgs * args.iters * GROUP * 2 * 64 * n * 32 / gemm_clk if wgs else 0.0
            side_rate = float(np.median(c[:, 3] / c[:, 2])) * 128 * CHAINS if side != "none" else 0.0
            runs.append((gemm_rate, side_rate, gemm_clk))
        runs.sort()
        rows[v] = runs[1]
    print("| variant | GEMM FLOP/clk/SM | side ops/clk/SM | GEMM vs alone | side vs alone |")
    print("|---|---|---|---|---|")
    for v, (g, s, _) in rows.items():
        wgs, shape, n, side = v
        g_alone = rows.get((wgs, shape, n, "none"), (0,))[0]
        s_alone = rows.get((0, "ss", 256, side), (0, 0))[1]
        gr = f"{g / g_alone:.3f}" if g_alone and wgs else "-"
        sr = f"{s / s_alone:.3f}" if s_alone and side != "none" else "-"
        print(f"| {name(v)} | {g:.0f} | {s:.1f} | {gr} | {sr} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
