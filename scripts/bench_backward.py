"""Time the attention backward on a GPU: facodegen's generated backward against torch SDPA's cuDNN
and flash (FlashAttention-2) backends, in the same run, over the FlashAttention-3 paper's grid.

A thin wrapper of facodegen.bench.backward (the same as ``facodegen bench --suite fa3-paper
--backward``): the cells, the timing (timing.time_cuda: --warmup calls, then --iters timed calls,
the median), backward FLOPs = 2.5 x the forward's, the tables and the files are the package's.
Prints a markdown table of TFLOP/s and facodegen's ratio to each peer; writes
bench-fa3-paper-backward-<dtype>.{md,csv,json,png}
(bench-fa3-paper-fwd-bwd-<dtype>.* with --fwd-bwd) under --out.

    python scripts/bench_backward.py --head-dims 64,128 --seqlens 1024,4096 --out results/
    python scripts/bench_backward.py --quick          # seqlen 2k and 8k: fits a 3-minute device call
    python scripts/bench_backward.py --quick --peers facodegen --variant k_unroll=1 --variant k_unroll=2
    python scripts/bench_backward.py --quick --fwd-bwd   # forward + backward, FLOPs = 3.5 x forward

``--variant knob=value[,knob=value]`` (repeatable) adds a column per backward-spec variant, timed
through ``facodegen.attention_backward(..., **knobs)`` on the forward's O and LSE (no autograd).

Import-safe without a GPU (the options are tested in tests/test_bench_backward.py).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from facodegen.bench import backward as bw  # noqa: E402

PEERS = ("facodegen", "cudnn", "flash")


def parse_ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x.strip())


def parse_knobs(text: str) -> dict:
    try:
        return bw.parse_knobs(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--head-dims", type=parse_ints, default=bw.HEAD_DIMS)
    p.add_argument("--seqlens", type=parse_ints, default=bw.SEQLENS)
    p.add_argument("--causal", choices=("both", "yes", "no"), default="both")
    p.add_argument("--peers", default=",".join(PEERS), help="comma-separated subset of " + ",".join(PEERS)
                   + " (fa2 = flash)")
    p.add_argument("--dtype", choices=bw.DTYPES, default="bf16")
    p.add_argument("--warmup", type=int, default=bw.WARMUP)
    p.add_argument("--iters", type=int, default=bw.ITERS)
    p.add_argument("--quick", action="store_true", help="seqlen 2048 and 8192 only (about a minute)")
    p.add_argument("--fwd-bwd", action="store_true", help="time forward + backward (FLOPs = 3.5 x forward)")
    p.add_argument("--out", type=Path, help="folder for bench-fa3-paper-backward-<dtype>.{md,csv,json,png}")
    p.add_argument("--no-plot", action="store_true", help="skip the PNG")
    p.add_argument("--variant", action="append", default=[], type=parse_knobs,
                   help="backward knobs to time as an extra column, e.g. k_unroll=1,block_n=64 (repeatable)")
    args = p.parse_args(argv)
    if args.quick:
        args.seqlens = bw.QUICK_SEQLENS
    args.causals = {"both": (False, True), "yes": (True,), "no": (False,)}[args.causal]
    args.peers = tuple(x for x in args.peers.split(",") if x)
    unknown = set(args.peers) - set(PEERS) - {"fa2"}
    if unknown:
        p.error(f"--peers: unknown {', '.join(sorted(unknown))}")
    if args.fwd_bwd and args.variant:
        p.error("--variant times facodegen.attention_backward alone: not with --fwd-bwd")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch
    if not torch.cuda.is_available():
        print("bench_backward: needs a CUDA GPU", file=sys.stderr)
        return 2
    from facodegen.bench import results
    peers = bw.peer_names(p for p in args.peers if p != "facodegen")
    mode = "fwd-bwd" if args.fwd_bwd else "backward"
    cells = bw.backward_cells(args.head_dims, args.seqlens, args.causals, args.dtype)
    env = results.environment()
    rows = bw.run_backward(cells, peers, facodegen="facodegen" in args.peers, variants=args.variant, mode=mode,
                           warmup=args.warmup, iters=args.iters, log=lambda m: print(m, file=sys.stderr, flush=True))
    print(bw.full_table(rows, peers, args.variant))
    if args.out is not None:
        paths = bw.write_backward_results(rows, args.out, bw.result_stem(mode, args.dtype), env=env, plot=not args.no_plot, peers=peers,
                                          variants=args.variant)
        print("wrote " + ", ".join(str(paths[k]) for k in ("md", "csv", "json", "png") if paths.get(k)),
              file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
