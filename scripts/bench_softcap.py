"""Time softcap's cost and poly_exp2_tiles against it (issue 40): facodegen.attention, bf16, causal,
head_dim 128 with 16 heads (--head-dims: each with 2048 / head_dim heads), batch 1 (--batch), seqlen 4k and 16k: without softcap, with softcap 50, and
with softcap 50 and each --tiles value of poly_exp2_tiles (n8 key tiles per score fragment whose
exp2 runs as a polynomial on the FMA pipe instead of MUFU.EX2, beside softcap's MUFU.TANH). All
arms of a sequence length take turns group by group (timing.time_cuda_interleaved: CUDA events,
the median over groups), each with its own output buffer. Prints each arm's kernel, ms, TFLOP/s
and its time over the no-softcap arm's and over the plain softcap arm's.

    python scripts/bench_softcap.py
    python scripts/bench_softcap.py --seqlens 16384 --tiles 1,2,4,6,8 --groups 15

Imports without torch (the timing needs a GPU).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

HIDDEN, SOFTCAP = 2048, 50.0     # heads = HIDDEN / head_dim


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seqlens", default="4096,16384", help="comma-separated sequence lengths")
    parser.add_argument("--head-dims", default="128", help="comma-separated head dims")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--tiles", default="2,4,8", help="poly_exp2_tiles values to time with softcap")
    parser.add_argument("--arm", action="append", default=[], metavar="KNOB=VALUE[,...]",
                        help="another softcap arm with these spec knobs (repeatable), e.g. pingpong=1 or "
                             "pingpong=1,block_n=112: a tile the softcap's second MUFU op may suit better")
    parser.add_argument("--groups", type=int, default=11, help="timed groups per arm (the median is kept)")
    parser.add_argument("--calls", type=int, default=20, help="calls per group")
    return parser.parse_args(argv)


def arms(tiles: tuple[int, ...], knob_arms: tuple[str, ...] = ()) -> list[tuple[str, dict]]:
    """(label, attention keywords) of each arm: no softcap, softcap, softcap + each tile count, softcap + each
    --arm's knobs (typed by the knob registry)."""
    from facodegen.bench.variants import knob_values
    from facodegen.spec.knobs import BY_NAME
    cap = {"softcap": SOFTCAP}
    return ([("no softcap", {}), (f"softcap {SOFTCAP:g}", cap)]
            + [(f"softcap {SOFTCAP:g} px{n}", {**cap, "poly_exp2_tiles": n}) for n in tiles]
            + [(f"softcap {SOFTCAP:g} {text}", {**cap, **knob_values(text, BY_NAME, "the forward")})
               for text in knob_arms])


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch
    if not torch.cuda.is_available():
        print("bench_softcap needs a CUDA GPU", file=sys.stderr)
        return 2
    import facodegen
    from facodegen.bench.grids import attention_flops, tflops
    from facodegen.bench.timing import time_cuda_interleaved
    from facodegen.ops import api

    tiles = tuple(int(t) for t in args.tiles.split(",") if t)
    timed = arms(tiles, tuple(args.arm))
    print(f"{torch.cuda.get_device_name()}, bf16, causal, batch {args.batch}, {HIDDEN} / head_dim heads")
    print(f"{'d':>3} {'seqlen':>6}  {'arm':<30} {'ms':>8} {'TFLOP/s':>8} {'/no cap':>8} {'/softcap':>8}  kernel")
    for head_dim in (int(d) for d in args.head_dims.split(",")):
        heads = HIDDEN // head_dim
        for seqlen in (int(s) for s in args.seqlens.split(",")):
            shape = (args.batch, seqlen, heads, head_dim)
            q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(3))
            fns, kernels = [], []
            for _, kwargs in timed:
                out = torch.empty_like(q)
                fields = {n: kwargs[n] for n in kwargs if n != "softcap"}
                spec = api.resolve_spec(head_dim, "bf16", True, q.device.index or 0,
                                        shape=(args.batch, seqlen, seqlen, heads), softcap="softcap" in kwargs, **fields)
                kernels.append(spec.variant)
                fns.append(lambda out=out, kwargs=kwargs: facodegen.attention(q, k, v, causal=True, out=out, **kwargs))
            results = time_cuda_interleaved(fns, groups=args.groups, calls=args.calls)
            flops = attention_flops(args.batch, heads, seqlen, seqlen, head_dim, True)
            for (label, _), r, kernel in zip(timed, results, kernels):
                print(f"{head_dim:>3} {seqlen:>6}  {label:<30} {r['ms']:>8.3f} {tflops(flops, r['ms']):>8.1f} "
                      f"{r['ms'] / results[0]['ms']:>8.3f} {r['ms'] / results[1]['ms']:>8.3f}  {kernel}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
