"""Decode bandwidth on a GPU: facodegen.attention_with_kvcache beside FlashAttention-3's
flash_attn_with_kvcache (num_splits=0, its own heuristics) and torch SDPA's flash backend (GQA through
enable_gqa), in one run, one query token per sequence, bf16, full caches (cache_seqlens = context).

A thin wrapper of facodegen.bench.decode (the same as ``facodegen bench --suite decode``), which
holds the cells, the timing (timing.time_cuda_interleaved, caches rotated past twice the L2), the
check and the table. Cells: batch {1, 8, 64} x context {1k, 8k, 32k, 256k} x heads q/kv {32/32,
32/8, 64/8} x d {64, 128} x layout {contiguous, paged 64, paged 256}, skipping cells whose K+V
exceed --max-gb (60 GB). Effective bandwidth = bytes of K and V read / time.

    python scripts/bench_decode.py --quick --out results/           # ~3 minutes on an H200
    python scripts/bench_decode.py --batch 1,8 --context 32k,256k --heads 32/8 --d 128 --layout contiguous,paged64
    python scripts/bench_decode.py --quick --variant fused_combine=1    # + facodegen with that knob, a column

Prints a markdown table (TB/s of each, then the ratios) and writes bench-decode.{md,csv,json} under
--out. Importing this module needs no GPU.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from facodegen.bench import decode as dec  # noqa: E402


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=dec.parse_int_list, default=dec.BATCHES)
    ap.add_argument("--context", type=dec.parse_int_list, default=dec.CONTEXTS)
    ap.add_argument("--heads", type=dec.parse_heads, default=dec.HEADS)
    ap.add_argument("--d", type=dec.parse_int_list, default=dec.HEAD_DIMS)
    ap.add_argument("--layout", type=lambda s: tuple(s.split(",")), default=dec.LAYOUTS)
    ap.add_argument("--peers", type=lambda s: tuple(x for x in s.split(",") if x), default=dec.DECODE_PEERS)
    ap.add_argument("--max-gb", type=float, default=dec.MAX_GB)
    ap.add_argument("--quick", action="store_true", help="a subset that runs in ~3 minutes: " + json.dumps(dec.QUICK))
    ap.add_argument("--out", type=Path, help="write bench-decode.{md,csv,json} here")
    ap.add_argument("--list", action="store_true", help="print the cells and exit")
    ap.add_argument("--no-graphs", dest="graphs", action="store_false",
                    help="leave out the CUDA-graph replay columns (timed where K+V <= %d GB)"
                         % (dec.GRAPH_MAX_BYTES // 10 ** 9))
    ap.add_argument("--variant", action="append", default=[], metavar="KNOB=VALUE[,...]",
                    help="also time facodegen with these attention_with_kvcache knobs (e.g. fused_combine=1), "
                         "a column of its own; repeatable")
    args = ap.parse_args(argv)
    try:
        args.variants = [dec.parse_knobs(text) for text in args.variant]
    except ValueError as err:
        ap.error(f"--variant: {err}")
    args.grid = {"batch": args.batch, "context": args.context, "heads": args.heads, "d": args.d, "layout": args.layout}
    if args.quick:
        args.grid = dict(dec.QUICK)
    bad = [x for x in args.grid["layout"] if x not in dec.LAYOUTS]
    if bad:
        ap.error(f"--layout {bad[0]}: choose from {', '.join(dec.LAYOUTS)}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    todo = dec.cells(**args.grid, max_gb=args.max_gb)
    if args.list:
        for c in todo:
            print(c.name, f"{c.kv_bytes / 1e9:.2f} GB")
        return 0
    from facodegen.bench import results
    env = results.environment()
    rows = dec.run_decode(todo, args.peers, log=lambda m: print(m, file=sys.stderr, flush=True),
                          variants=args.variants, graphs=args.graphs)
    print(dec.summary(rows))
    if args.out:
        paths = dec.write_decode_results(rows, args.out, env=env, grid=args.grid)
        print(f"wrote {paths['md']}, {paths['csv']}, {paths['json']}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
