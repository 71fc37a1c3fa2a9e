#!/usr/bin/env python3
"""Run one FA3-paper backward cell a few times, for a profiler to attach to (GPU, torch).

    python3 scripts/bwd_one.py --d 128 --seqlen 2048 --causal [--peer cudnn|fa2] [--calls 3] [--knob lpt=1]

The cell is the FA3-paper grid's (bf16, 16k tokens, hidden 2048: batch 16384 / seqlen, heads 2048 / d);
the call is facodegen.attention_backward on the forward's O and LSE (knobs given by --knob, repeatable),
or with --peer torch SDPA's cuDNN or flash backend's autograd backward on the same tensors. Under
Nsight Compute, e.g. (the main kernel only; cuDNN's is cudnn_generated_*):

    ncu --clock-control none -k regex:'flash_bwd_sm90_[a-z0-9_]*[0-9a-z]$' --launch-skip 1 --launch-count 1 \\
        --section SpeedOfLight --section ComputeWorkloadAnalysis --section WarpStateStats \\
        python3 scripts/bwd_one.py --d 128 --seqlen 2048 --causal
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--d", type=int, required=True)
    ap.add_argument("--seqlen", type=int, required=True)
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--peer", choices=("cudnn", "fa2"))
    ap.add_argument("--calls", type=int, default=3)
    ap.add_argument("--knob", action="append", default=[], metavar="KNOB=VALUE")
    args = ap.parse_args(argv)
    args.knobs = {}
    for text in args.knob:
        name, _, value = text.partition("=")
        args.knobs[name] = int(value) if value.lstrip("-").isdigit() else value
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch
    import facodegen
    b, h = 16384 // args.seqlen, 2048 // args.d
    q, k, v, do = (torch.randn(b, args.seqlen, h, args.d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    if args.peer:
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel
        backend = SDPBackend.CUDNN_ATTENTION if args.peer == "cudnn" else SDPBackend.FLASH_ATTENTION
        qt, kt, vt = (x.transpose(1, 2).requires_grad_(True) for x in (q, k, v))
        with sdpa_kernel(backend):
            out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=args.causal)
        call = lambda: torch.autograd.grad(out, (qt, kt, vt), do.transpose(1, 2), retain_graph=True)  # noqa: E731
    else:
        out, lse = facodegen.attention(q, k, v, causal=args.causal, return_lse=True)
        call = lambda: facodegen.attention_backward(do, q, k, v, out, lse, causal=args.causal, **args.knobs)  # noqa: E731
    for _ in range(args.calls):
        call()
    torch.cuda.synchronize()
    print(f"{args.calls} calls: d{args.d} seqlen {args.seqlen} {'causal' if args.causal else 'full'} "
          f"{args.peer or 'facodegen'} {args.knobs or ''}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
