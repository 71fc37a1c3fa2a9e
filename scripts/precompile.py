#!/usr/bin/env python3
"""Compile here (CPU) the kernels a device call will run, into the compile cache it carries.

    FACODEGEN_CACHE_DIR=$PWD/.fcgcache python3 scripts/precompile.py --dtype fp8 \
        --cell 256,16384,0 --cell 256,16384,1 --variant sm90: --variant sm90:pingpong=1 \
        [--patch FILE ...] [--traced]

Each cell's spec is picked as facodegen.ops.api.resolve_spec picks it on the H200 with no tuning
database (api.spec_for_shape: the sequence-length rule, gpu=h200, the variant's fields winning),
then rendered, patched (scripts/lab.py trace-steps' patch format; --patch adds one kernel per patch)
and traced (--traced: trace_steps' clock reads too) as scripts/lab.py sweep, lab.py patch-ab and
lab.py trace-steps would, and compiled through
facodegen.runtime.compiler. Prints registers and spills per kernel, so a patch or variant that does not
compile, or spills, is found before a device call; the device finds the same sources under the
same keys when the cache folder is carried (`carry: [".fcgcache"]`; the key holds NVRTC's version).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "lab"))   # sweep.py, trace_steps.py


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cell", action="append", default=[], help="head_dim,seqlen,causal (as lab.py sweep's)")
    p.add_argument("--variant", action="append", default=[], help="arch:field=value,... (as lab.py sweep's)")
    p.add_argument("--dtype", default="fp8")
    p.add_argument("--patch", action="append", default=[])
    p.add_argument("--traced", action="store_true", help="also the traced copies (scripts/lab.py trace-steps)")
    args = p.parse_args()
    from facodegen.ops import api
    from facodegen import bench
    from facodegen.runtime import compiler
    from facodegen.codegen import render
    from sweep import parse_cell
    from trace_steps import apply_patch, traced

    transforms = {"plain": lambda source: source}
    for path in args.patch:
        text = open(path).read()
        transforms[os.path.basename(path)] = lambda source, text=text: apply_patch(source, text)
    if args.traced:
        for name, transform in list(transforms.items()):
            transforms[name + "+traced"] = lambda source, transform=transform: traced(transform(source))
    for cell_text in args.cell:
        c = parse_cell(cell_text, args.dtype)
        for variant in args.variant or ["sm90:"]:
            arch, overrides = bench.parse_variant(variant)
            overrides.setdefault("dtype", c["dtype"])
            dtype = overrides.pop("dtype")
            shape = (c["batch"], c["seqlen_q"], c["seqlen_k"], c["heads_q"])
            spec = api.spec_for_shape(arch, c["head_dim"], dtype, c["causal"], shape, **dict(overrides, gpu="h200"))
            for name, transform in transforms.items():
                kernel = compiler.compile_source(transform(render.emit(spec)), spec.arch, spec.variant, verbose=False)
                r = kernel.resources
                print(f"{cell_text} {variant} {name}: {spec.variant} regs {r.registers} "
                      f"spills {r.spill_stores}/{r.spill_loads}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
