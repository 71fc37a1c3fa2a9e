#!/usr/bin/env python3
"""Compile the shipped kernels for the GPU at hand into the compile cache, in parallel processes.

    python3 scripts/warm_cache.py [--jobs N] [--fuzz N]

A device call starts on a fresh machine with an empty cache; the GPU tests compile each default
spec on first use, one after another (about 40 kernels, minutes of NVRTC). Run this first and the
tests only load them. --fuzz N also compiles the kernels of `facodegen check --fuzz N --family all`'s
cases (seed 1), every family's; --decode-grid those of `facodegen bench --suite decode`'s full grid
(facodegen.bench.decode.cells, the default call of each cell).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from facodegen.ops import api
from facodegen.verify import fuzz  # noqa: E402
from facodegen.spec import default_fp8_specs, default_specs  # noqa: E402


def shipped_specs(native: str) -> list:
    """The defaults the GPU can run: sm80 kernels everywhere, sm90 ones (16-bit and fp8) on sm90."""
    specs = [s for s in default_specs() if s.arch == "sm80" or native == "sm90"]
    return specs + (list(default_fp8_specs()) if native == "sm90" else [])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--jobs", type=int, help="processes (default: one per core)")
    p.add_argument("--fuzz", type=int, default=0, help="also the kernels of this many fuzz cases (seed 1)")
    p.add_argument("--decode-grid", action="store_true", help="also the kernels of the decode suite's cells")
    p.add_argument("--no-shipped", dest="shipped", action="store_false",
                   help="leave out the shipped defaults (only what --fuzz / --decode-grid add)")
    args = p.parse_args()
    native = api.default_arch(api.device_info(0))
    specs = set(shipped_specs(native)) if args.shipped else set()
    if args.fuzz:
        archs = ("sm80", "sm90") if native == "sm90" else ("sm80",)
        specs |= {s for c in fuzz.generate(args.fuzz, 1, "all", archs) for s in fuzz.case_specs(c)}
    if args.decode_grid:
        from facodegen.bench import decode
        specs |= {s for cell in decode.cells() for s in decode.cell_specs(cell)}
    fuzz.compile_specs(sorted(specs, key=lambda s: (type(s).__name__, s.variant)), args.jobs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
