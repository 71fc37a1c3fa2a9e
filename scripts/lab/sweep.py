"""Time spec variants side by side on the same inputs (ablations and hand tuning on the GPU).

    python3 scripts/lab.py sweep --out $OUT --plan sm90-ablation
    python3 scripts/lab.py sweep --out $OUT --cell 128,8192,0 --variant 'sm90:pingpong=0' --variant 'sm90:'

A variant is ``arch:field=value,...`` (bench.parse_variant; empty fields = that arch's defaults); a cell is
``head_dim,seqlen,causal`` on the FlashAttention-3 paper's grid (16k tokens, hidden 2048), or
``head_dim,seqlen_q,causal,batch[,heads[,seqlen_k]]`` for any other shape (e.g. the same work cut into
tiles of different lengths: ``256,32768,0,1,33,8192`` runs 33 x 256 tiles of 64 key blocks, a whole
number of waves on 132 SMs).
Every output is checked against the float64 reference on a slice before it is timed; the variants
of a cell and its peers (--peers) take turns group by group (--sequential: one after the other).
Prints a table of TFLOP/s last and writes sweep.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the checkout

from facodegen import bench  # noqa: E402

PLANS = {
    "sm90-ablation": {
        "cells": ["128,8192,0", "128,8192,1", "64,8192,0", "256,8192,0", "128,1024,0", "128,1024,1"],
        "variants": ["sm90:", "sm90:pingpong=0", "sm90:intra_wg_overlap=0", "sm90:pingpong=0,intra_wg_overlap=0",
                     "sm90:persistent=0"],
        "peers": "fa3",
    },
    # FlashAttention-1 -> 2 -> 3 (issue 7, docs/evolution.md): fa1's schedule, each FA2 idea alone,
    # fa2, sm90; head_dim 128, 16k tokens per batch and batch 1 (cells head_dim,seqlen,causal[,batch]).
    # Few calls per cell: fa1 at batch 1 x 16 heads runs on 16 CTAs.
    "evolution": {
        "rows": bench.evolution_grid(),   # the same grid as `facodegen bench --suite evolution`
        "variants": bench.EVOLUTION_VARIANTS,
        "peers": "fa2,fa3",
        "timing": bench.EVOLUTION_TIMING,
        "gemm": True,
    },
    "evolution-causal": {
        "cells": [f"128,{s},1" for s in (1024, 4096, 16384)] + [f"128,{s},1,1" for s in (1024, 4096, 16384)],
        "variants": bench.EVOLUTION_VARIANTS,
        "peers": "fa2,fa3",
        "timing": bench.EVOLUTION_TIMING,
    },
    "sm80-tiles": {
        "cells": ["128,8192,0", "128,8192,1", "128,1024,0", "256,8192,0", "256,2048,1", "64,8192,0"],
        "variants": ["sm80:", "sm80:stages=3", "sm80:block_n=128,num_warps=8", "sm80:num_warps=8,q_in_regs=1",
                     "sm80:block_m=64,num_warps=4", "sm80:block_n=32,stages=3", "sm80:block_m=128,num_warps=8"],
        "peers": "fa2",
    },
}


def parse_cell(text: str, dtype: str) -> dict:
    """head_dim,seqlen,causal (16k tokens per batch, hidden 2048), or with more fields
    head_dim,seqlen,causal,batch[,heads[,seqlen_k]] (seqlen is then seqlen_q)."""
    head_dim, seqlen, causal, *rest = (int(x) for x in text.split(","))
    batch = rest[0] if rest else bench.TOKENS_PER_BATCH // seqlen
    heads = rest[1] if len(rest) > 1 else bench.HIDDEN // head_dim
    seqlen_k = rest[2] if len(rest) > 2 else None
    return bench.cell(head_dim, bool(causal), seqlen, batch, heads, dtype, seqlen_k=seqlen_k)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=".")
    parser.add_argument("--plan", choices=sorted(PLANS), action="append")
    parser.add_argument("--cell", action="append", default=[])
    parser.add_argument("--variant", action="append", default=[])
    parser.add_argument("--peers", default=None)
    parser.add_argument("--dtype", default="bf16")
    parser.add_argument("--groups", type=int, default=None,
                        help="timing groups per variant (default: bench's %d)" % bench.GROUPS)
    parser.add_argument("--sequential", action="store_true",
                        help="time each variant's groups in one block (default: the variants take turns "
                             "group by group, so clock drift falls on all alike)")
    args = parser.parse_args(argv)
    jobs = []
    for name in args.plan or []:
        plan = PLANS[name]
        rows = plan.get("rows") or [parse_cell(text, args.dtype) for text in plan["cells"]]
        jobs.append((rows, plan["variants"], plan["peers"], plan.get("timing"), plan.get("gemm", False)))
    if args.cell:
        jobs.append(([parse_cell(text, args.dtype) for text in args.cell], args.variant or ["sm90:"],
                     args.peers or "", None, False))
    tables, records = [], []
    for rows, variants, peers, timing, gemm in jobs:
        timing = dict(timing or {}, interleave=not args.sequential)
        if args.groups:
            timing["groups"] = args.groups
        if gemm:   # the context of every TFLOP/s: a bf16 8192^3 torch matmul on this GPU
            ceiling = bench.gemm_ceiling()
            tables.append(f"bf16 GEMM (torch.mm 8192^3): {ceiling:.1f} TFLOP/s; cells below also as a fraction of it")
            rows = [dict(c, gemm_tflops=ceiling) for c in rows]
        named = variants if isinstance(variants, dict) else {f"facodegen {v}": v for v in variants}
        peer_names = [p for p in (peers or "").split(",") if p]
        done = bench.run_grid(rows, peers=peer_names, timing=timing, variants=named)
        records += done
        tables.append(bench.format_table(done))
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "sweep.json"), "w") as f:
        json.dump(records, f, indent=1, default=str)
    print("\n\n".join(tables))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
