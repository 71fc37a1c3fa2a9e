"""Time the attention variants (issue 40) on the GPU: bf16, causal, 16 heads, head_dim 128, 16k tokens
per batch (batch = 16384 / seqlen).

A thin wrapper of facodegen.bench.variants_suite (the same as ``facodegen bench --suite variants``):
window (4096, 0) beside FlashAttention-3's window and facodegen's own full causal kernel; softcap 50
and sinks beside facodegen without them (and FA3's softcap where its module takes one); each group
timed in turns (timing.time_cuda_interleaved) through ``facodegen.attention``. Results are time
ratios. Files go to ``--out`` (a folder: bench-variants.{md,json} in it), the markdown table is
printed last.

    python scripts/bench_variants.py --out /tmp/bench-variants
    python scripts/bench_variants.py --seqlens 4096 --quick

Imports without torch or a GPU (tested in tests/test_bench_variants.py).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from facodegen.bench import variants_suite as vs  # noqa: E402


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seqlens", default=",".join(map(str, vs.SEQLENS)), help="comma-separated sequence lengths")
    parser.add_argument("--out", type=Path, help="folder for bench-variants.{md,json}")
    parser.add_argument("--quick", action="store_true", help="fewer groups and calls (a smoke run)")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch
    if not torch.cuda.is_available():
        print("bench_variants needs a CUDA GPU", file=sys.stderr)
        return 2
    from facodegen.bench import results
    env = results.environment()
    rows = vs.run_variants(vs.cells(tuple(int(s) for s in args.seqlens.split(","))), args.quick,
                           log=lambda m: print(m, file=sys.stderr, flush=True))
    if args.out is not None:
        paths = vs.write_variants_results(rows, args.out, env=env)
        print(f"wrote {paths['md']}, {paths['json']}", file=sys.stderr)
    print(vs.format_table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
