#!/usr/bin/env python3
"""Two template trees' kernels compared instruction for instruction (CPU: NVRTC, no GPU).

    python3 scripts/lab.py sass-ab --templates OLD/templates [--cell D,S,C ...] [--dtype bf16]

For each cell of the FlashAttention-3 paper's grid (default: all 36; head_dim,seqlen,causal as
lab.py sweep takes them) the spec attention() picks on the H200 is rendered from OLD/templates and
from this tree's, with this tree's renderer (render.emit's ``templates``), both compiled for sm_90a,
and their SASS compared with addresses and branch targets taken out: the same SASS is the same
kernel, which no timing can show as well (two processes timing one kernel differ by several per
cent). Where they differ it prints the instruction counts that changed. The old tree must render
with today's renderer (its templates read the context today's render.context gives).
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(os.path.dirname(HERE)), HERE]

GRID = [f"{d},{s},{c}" for d in (64, 128, 256) for s in (512, 1024, 2048, 4096, 8192, 16384) for c in (0, 1)]


def instructions(sass: str) -> list[str]:
    """The SASS's instructions in order, addresses and branch/call targets replaced by X."""
    out = []
    for line in sass.splitlines():
        m = re.match(r"\s*/\*[0-9a-f]{4,}\*/\s*(.*?)\s*;?\s*/\*", line)
        if m:
            text = m.group(1)
            out.append(re.sub(r"0x[0-9a-f]+", "X", text) if "BRA" in text or "CALL" in text else text)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--templates", required=True, help="the other tree's templates/")
    p.add_argument("--cell", action="append", default=[], help="head_dim,seqlen,causal (default: the 36 cells)")
    p.add_argument("--dtype", default="bf16")
    args = p.parse_args(argv)
    from facodegen.codegen import render
    from facodegen.ops import api
    from facodegen.runtime import compiler
    from sweep import parse_cell

    seen: dict[str, str] = {}
    same = 0
    for text in args.cell or GRID:
        c = parse_cell(text, args.dtype)
        spec = api.spec_for_shape("sm90", c["head_dim"], args.dtype, c["causal"],
                                  (c["batch"], c["seqlen_q"], c["seqlen_k"], c["heads_q"]), gpu="h200")
        if spec.variant not in seen:
            old, new = (instructions(compiler.compile_source(source, spec.arch, spec.variant, verbose=False).sass())
                        for source in (render.emit(spec, templates=os.path.abspath(args.templates)),
                                       render.emit(spec)))
            if old == new:
                seen[spec.variant] = f"same SASS ({len(new)} instructions)"
            else:
                before, after = (collections.Counter(i.split()[0] for i in x) for x in (old, new))
                changed = {op: after[op] - before[op] for op in before | after if after[op] != before[op]}
                seen[spec.variant] = f"differs: {len(old)} -> {len(new)} instructions, counts {changed}"
        same += seen[spec.variant].startswith("same")
        print(f"{text} {spec.variant}: {seen[spec.variant]}", flush=True)
    total = len(args.cell or GRID)
    print(f"{same} of {total} cells: the same SASS")
    return 0 if same == total else 1


if __name__ == "__main__":
    raise SystemExit(main())
