#!/usr/bin/env python3
"""Run one decode cell's call a number of times, for a profiler to attach to (GPU, torch).

    python3 scripts/decode_one.py --batch 8 --context 32k --heads 32/8 --d 256 --layout paged16 [--calls 20]
        [--knob stages=3] [--fa3]

The cell is bench_decode.py's (facodegen.bench.decode.Cell: bf16, one query token, full caches, pages
shuffled); the call is facodegen.attention_with_kvcache with num_splits=0 and the knobs given
(--knob, repeatable), or with --fa3 FlashAttention-3's flash_attn_with_kvcache on the same cache. It
prints the plan's kernel and split count. Under Nsight Compute, e.g.:

    ncu --clock-control none -k regex:flash_decode --launch-skip 10 --launch-count 1 \\
        --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats \\
        python3 scripts/decode_one.py --batch 8 --context 32k --heads 32/8 --d 256 --layout paged64
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from facodegen.bench import decode as dec  # noqa: E402


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, required=True)
    ap.add_argument("--context", type=lambda s: dec.parse_int_list(s)[0], required=True)
    ap.add_argument("--heads", type=lambda s: dec.parse_heads(s)[0], required=True)
    ap.add_argument("--d", type=int, required=True)
    ap.add_argument("--layout", choices=dec.LAYOUTS, default="contiguous")
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--knob", action="append", default=[], metavar="KNOB=VALUE[,...]")
    ap.add_argument("--fa3", action="store_true", help="FlashAttention-3's call instead of facodegen's")
    args = ap.parse_args(argv)
    try:
        args.knobs = {k: v for text in args.knob for k, v in dec.parse_knobs(text).items()}
    except ValueError as err:
        ap.error(f"--knob: {err}")
    args.cell = dec.Cell(args.batch, args.context, args.heads[0], args.heads[1], args.d, args.layout)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    import facodegen
    from facodegen.ops import kvcache

    cell = args.cell
    q = torch.randn(cell.batch, 1, cell.heads_q, cell.d, dtype=torch.bfloat16, device="cuda")
    lengths = torch.full((cell.batch,), cell.context, dtype=torch.int32, device="cuda")
    k_cache, v_cache, table = dec.make_cache(torch, cell)
    if args.fa3:
        from facodegen.bench.peers import _fa3_module
        mod, why = _fa3_module()
        if mod is None:
            print(f"FlashAttention-3 not found: {why}", file=sys.stderr)
            return 1
        call = lambda: mod.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths,  # noqa: E731
                                                   page_table=table, causal=True, num_splits=0)
    else:
        call = lambda: facodegen.attention_with_kvcache(q, k_cache, v_cache, lengths, page_table=table,  # noqa: E731
                                                        num_splits=0, **args.knobs)
    call()
    if not args.fa3:
        plan = list(kvcache._PLANS._plans.values())[-1]
        print(f"{cell.name}: {plan.specs['decode'].variant}, {plan.num_splits} splits, "
              f"{cell.kv_bytes / 1e6:.0f} MB of K+V")
    for _ in range(args.calls):
        call()
    torch.cuda.synchronize()
    return 0


if __name__ == "__main__":
    sys.exit(main())
