#!/usr/bin/env python3
"""Count events inside an fp8 kernel with a source patch that adds counters (GPU, sm90).

    python3 scripts/lab.py count-events --cell 256,16384,1 --cell 256,16384,0 \
        --patch docs/experiments/fp8-vote-count.blocks [--variant k=v,...]

Renders each cell's kernel as facodegen.ops.api picks it (with --variant's spec overrides), applies the
patch (scripts/lab.py trace-steps' format), which must define `__device__ unsigned long long
fcg_count[4]` and bump its slots (e.g. one atomicAdd per warp and step: which way a vote went), runs
the kernel once to load it, zeroes the counters, runs it once more and prints them with the share of
slot 1 in slots 0 + 1.
"""

from __future__ import annotations

import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(os.path.dirname(HERE)), HERE]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cell", action="append", required=True, help="head_dim,seqlen,causal (as lab.py sweep's)")
    p.add_argument("--patch", required=True)
    p.add_argument("--variant", default="", help="spec overrides k=v,... for every kernel")
    args = p.parse_args(argv)
    import cupy
    import torch
    from facodegen.ops import api
    from facodegen import bench
    from facodegen.runtime import compiler
    from facodegen.codegen import render
    from facodegen.bench.inputs import _make_inputs
    from facodegen.bench.variants import _facodegen_fn
    from sweep import parse_cell
    from trace_steps import apply_patch

    text = open(args.patch).read()
    compiler.spec_index = False     # the kernels compiled here are patched renderings: not the index's
    plain_emit = render.emit
    render.emit = lambda spec: apply_patch(plain_emit(spec), text)
    overrides = dict(bench.parse_variant("sm90:" + args.variant)[1], dtype="fp8")
    for cell in args.cell:
        c = parse_cell(cell, "fp8")
        s = _make_inputs(c, 1)[0]
        compiler.clear_memo()
        api._prepare.cache_clear()
        fn, _, variant, _ = _facodegen_fn("sm90", overrides, s, c["causal"])
        fn()
        torch.cuda.synchronize()
        (_, _), kernel = next(iter(compiler._spec_memo.items()))
        module = kernel._lazy[("function", torch.cuda.current_device())][0]
        ptr = module.get_global_var("fcg_count")
        if isinstance(ptr, int):        # cupy returns a MemoryPointer (an address in some versions)
            ptr = cupy.cuda.MemoryPointer(cupy.cuda.UnownedMemory(ptr, 32, module), 0)
        counts = cupy.ndarray((4,), dtype=cupy.uint64, memptr=ptr)
        counts.fill(0)
        torch.cuda.synchronize()
        fn()
        torch.cuda.synchronize()
        h = [int(x) for x in cupy.asnumpy(counts)]
        share = h[1] / max(1, h[0] + h[1])
        print(f"{cell} {variant} counts {h} slot-1 share {share:.3f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
