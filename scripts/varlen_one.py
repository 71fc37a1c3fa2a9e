#!/usr/bin/env python3
"""Run one equal-lengths varlen cell, packed and padded, a number of times each, for a profiler (GPU, torch).

    python3 scripts/varlen_one.py --d 128 [--causal] [--sequences 8 --seqlen 4096] [--calls 5] [--knob varlen_lpt=1]

The varlen suite's equal cell (bf16, heads 2048 / d): facodegen.attention_varlen on the packed tokens
(kernel name ..._varlen) and facodegen.attention on the same tokens as (sequences, seqlen, heads, d),
the kernel the suite holds varlen to (issue 39: 0.88-0.95x of it). --knob VALUE goes to the varlen call
only (repeatable). It prints both calls' kernels and their CUDA-event times. Under Nsight Compute, e.g.:

    ncu --clock-control none -k regex:flash_fwd --launch-skip 4 --launch-count 2 \\
        --section SpeedOfLight --section WarpStateStats --section SchedulerStats --section MemoryWorkloadAnalysis \\
        python3 scripts/varlen_one.py --d 128
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from facodegen.spec.knobs import BY_NAME  # noqa: E402


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--d", type=int, required=True)
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--sequences", type=int, default=8)
    ap.add_argument("--seqlen", type=int, default=4096)
    ap.add_argument("--calls", type=int, default=5, help="calls of each, after one warm-up call each")
    ap.add_argument("--knob", action="append", default=[], metavar="KNOB=VALUE")
    args = ap.parse_args(argv)
    args.knobs = {}
    for text in args.knob:
        name, _, value = text.partition("=")
        if name not in BY_NAME:
            ap.error(f"--knob: {name!r} is not a forward knob")
        try:
            args.knobs[name] = BY_NAME[name].parse(value)
        except ValueError as err:
            ap.error(f"--knob: {err}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    import facodegen
    b, s, d = args.sequences, args.seqlen, args.d
    h = 2048 // d
    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    cu = torch.arange(0, (b + 1) * s, s, device="cuda", dtype=torch.int32)
    packed = [x.view(b * s, h, d) for x in (q, k, v)]
    calls = {
        "varlen": lambda: facodegen.attention_varlen(*packed, cu, cu, s, s, causal=args.causal, **args.knobs),
        "padded": lambda: facodegen.attention(q, k, v, causal=args.causal),
    }
    flops = 4 * b * h * s * s * d / (2 if args.causal else 1)
    for name, call in calls.items():
        call()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(args.calls):
            call()
        end.record()
        torch.cuda.synchronize()
        ms = start.elapsed_time(end) / args.calls
        print(f"{name}: {ms:.3f} ms, {flops / ms / 1e9:.1f} TFLOP/s", flush=True)
    from facodegen.ops import api, varlen
    shape = (b, varlen.plan_bound(s), varlen.plan_bound(s), h)    # (as attention_varlen resolves it)
    print("varlen kernel:", api.resolve_spec(d, "bf16", args.causal, 0, shape=shape, varlen=True, **args.knobs).variant)
    print("padded kernel:", api.resolve_spec(d, "bf16", args.causal, 0, shape=(b, s, s, h)).variant)
    return 0


if __name__ == "__main__":
    sys.exit(main())
