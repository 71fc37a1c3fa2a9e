"""Tensor-core rate of one wgmma shape on this GPU: does a tile's N cost in proportion to its FLOPs?

    python3 scripts/lab.py wgmma-rate                         # GPU: the table (TFLOP/s per dtype and N)
    python3 scripts/lab.py wgmma-rate --check                 # CPU: compile every variant for sm_90a

The kernels' S = Q K^T runs wgmma.m64nNk16 (16-bit) or .m64nNk32 (e4m3) with N = block_n (80, 96,
160, 176 ...), O += P V with N = head_dim. Each variant here is a persistent grid of one CTA per
SM with WGS warpgroups, each issuing groups of 8 shared-memory (SS) wgmmas of one shape into its
own accumulator, one group always in flight (commit, wait for the previous one) - no softmax, no
loads: the rate the tensor pipe sustains for that shape, as TFLOP/s and as a fraction of N=256.
The operands are a fixed bit pattern (finite, small) in 128B-swizzled K-major tiles.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the checkout

SHAPES = {"bf16": (16, (64, 80, 96, 112, 128, 160, 176, 192, 256)),
          "fp8": (32, (64, 96, 128, 160, 192, 224, 256))}
GROUP = 8           # wgmmas per commit group: 4 k-steps of one 128-byte row, twice
WGS = 2             # consumer warpgroups per CTA, as the two-warpgroup kernels run


def source(dtype: str, n: int) -> str:
    """CUDA for one (dtype, N) variant: kernel wgmma_rate(iters, sink)."""
    k = SHAPES[dtype][0]
    ptx_type = "bf16.bf16" if dtype == "bf16" else "e4m3.e4m3"
    trans = ", 0, 0" if dtype == "bf16" else ""           # 16-bit wgmma takes transpose immediates
    regs = ", ".join(f"%{i}" for i in range(n // 2))
    outs = ", ".join(f'"+f"(d[{i}])' for i in range(n // 2))
    return f"""
typedef unsigned long long u64;
__device__ __forceinline__ u64 desc(unsigned addr) {{
    // K-major, 128B swizzle: start >> 4, LBO 1 (unused), SBO 1024 >> 4, mode 1 in bits 62-63
    return (u64)((addr & 0x3FFFF) >> 4) | ((u64)1 << 16) | ((u64)(1024 >> 4) << 32) | ((u64)1 << 62);
}}
__device__ __forceinline__ void mma(float (&d)[{n // 2}], u64 a, u64 b) {{
    asm volatile("{{\\n.reg .pred p;\\nsetp.ne.b32 p, 1, 0;\\n"
                 "wgmma.mma_async.sync.aligned.m64n{n}k{k}.f32.{ptx_type} {{{regs}}}, %{n // 2}, %{n // 2 + 1}, p, 1, 1{trans};\\n}}\\n"
                 : {outs} : "l"(a), "l"(b));
}}
extern "C" __global__ void __launch_bounds__({128 * WGS}, 1) wgmma_rate(int iters, float* sink) {{
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    const unsigned base = ((unsigned)__cvta_generic_to_shared(smem_raw) + 1023u) & ~1023u;
    unsigned char* smem = smem_raw + (base - (unsigned)__cvta_generic_to_shared(smem_raw));
    for (int i = threadIdx.x; i < (64 + 256) * 128 / 4; i += blockDim.x) {{
        ((unsigned*)smem)[i] = {"0x3c003c00u" if dtype == "bf16" else "0x20202020u"};   // 2^-7 / 2^-3
    }}
    asm volatile("fence.proxy.async.shared::cta;\\n" ::: "memory");
    __syncthreads();
    const u64 a = desc(base), b = desc(base + 64 * 128);
    float d[{n // 2}];
#pragma unroll
    for (int i = 0; i < {n // 2}; ++i) d[i] = 0.f;
    for (int it = 0; it < iters; ++it) {{
        asm volatile("wgmma.fence.sync.aligned;\\n" ::: "memory");
#pragma unroll
        for (int s = 0; s < {GROUP}; ++s) {{
            mma(d, a + 2 * (s % 4), b + 2 * (s % 4));          // k-step s%4: +32 bytes along the row
        }}
        asm volatile("wgmma.commit_group.sync.aligned;\\n" ::: "memory");
        asm volatile("wgmma.wait_group.sync.aligned 1;\\n" ::: "memory");
    }}
    asm volatile("wgmma.wait_group.sync.aligned 0;\\n" ::: "memory");
    float s = 0.f;
#pragma unroll
    for (int i = 0; i < {n // 2}; ++i) s += d[i];
    if (s == -1.f) sink[threadIdx.x] = s;                        // keeps the accumulator live
}}
"""


SMEM = (64 + 256) * 128 + 1024


def compile_all() -> dict:
    from facodegen.runtime import compiler
    out = {}
    for dtype, (_, ns) in SHAPES.items():
        for n in ns:
            cubin, log = compiler._nvrtc_compile(source(dtype, n), f"wgmma_rate_{dtype}_{n}",
                                                 compiler.NVRTC_OPTIONS("sm90"))
            out[(dtype, n)] = (cubin, compiler.parse_ptxas_log(log))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--check", action="store_true", help="compile only (no GPU): report registers and spills")
    p.add_argument("--ms", type=float, default=20.0, help="target milliseconds per timed launch")
    args = p.parse_args(argv)
    kernels = compile_all()
    if args.check:
        for (dtype, n), (_, res) in kernels.items():
            r = next(iter(res.values()))
            print(f"{dtype} N={n}: {r.registers} registers, spills {r.spill_stores}/{r.spill_loads} B")
        return 0
    import cupy
    sms = cupy.cuda.runtime.getDeviceProperties(0)["multiProcessorCount"]
    sink = cupy.zeros(128 * WGS, dtype=cupy.float32)
    rows = []
    for (dtype, n), (cubin, _) in kernels.items():
        k = SHAPES[dtype][0]
        module = cupy.cuda.Module()
        module.load(cubin)
        fn = module.get_function("wgmma_rate")              # SMEM < 48 KB: no opt-in attribute needed
        flops_per_iter = sms * WGS * GROUP * 2 * 64 * n * k
        iters = 1000
        start, stop = cupy.cuda.Event(), cupy.cuda.Event()
        for _ in range(2):                                      # calibrate, then time at ~args.ms
            fn((sms,), (128 * WGS,), (cupy.int32(iters), sink), shared_mem=SMEM)
            start.record()
            fn((sms,), (128 * WGS,), (cupy.int32(iters), sink), shared_mem=SMEM)
            stop.record()
            stop.synchronize()
            ms = cupy.cuda.get_elapsed_time(start, stop)
            iters = max(1000, int(iters * args.ms / max(ms, 1e-3)))
        times = []
        for _ in range(5):
            start.record()
            fn((sms,), (128 * WGS,), (cupy.int32(iters), sink), shared_mem=SMEM)
            stop.record()
            stop.synchronize()
            times.append(cupy.cuda.get_elapsed_time(start, stop))
        ms = sorted(times)[2]
        rows.append((dtype, n, flops_per_iter * iters / (ms * 1e-3) / 1e12))
    print("| dtype | N | TFLOP/s | vs N=256 |\n|---|---|---|---|")
    for dtype, n, tf in rows:
        ref = next(t for d, m, t in rows if d == dtype and m == 256)
        print(f"| {dtype} | {n} | {tf:.0f} | {tf / ref:.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
