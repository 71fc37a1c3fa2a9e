#!/usr/bin/env python3
"""Why one cell's median moves between runs (GPU): every group's time beside the SM clock and
power the GPU reported while it ran.

    python3 scripts/lab.py clock-probe --out $OUT --cell 128,8192,1 --peers fa3 --groups 40

Times facodegen's default kernel and the peers on one cell of the FlashAttention-3 paper's grid
(head_dim,seqlen,causal; 16k tokens, hidden 2048) with facodegen.bench's timer (groups of back-to-back
calls between CUDA events, the implementations taking turns), keeping every group's span, while
`nvidia-smi` samples clocks.sm, power.draw and the active clock-throttle reasons every 20 ms in the
background. Writes probe.json and smi.csv under --out; prints, last, per implementation the
group times' quartiles and, per SM clock seen during its groups, how many groups ran there and their
median time. Reads the card as it is: changes no clock or power setting.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(os.path.dirname(HERE)), HERE]   # the checkout's facodegen, and sweep.py beside this

from facodegen import bench  # noqa: E402
from facodegen.bench.inputs import _make_inputs  # noqa: E402
from facodegen.bench.peers import _peer_fn  # noqa: E402
from facodegen.bench.variants import _facodegen_fn  # noqa: E402
from sweep import parse_cell  # noqa: E402

SMI_FIELDS = "timestamp,clocks.sm,power.draw,clocks_throttle_reasons.active"


def smi_samples(path: str) -> list[tuple[float, int, float, str]]:
    """(unix time, SM MHz, watts, throttle reasons) per nvidia-smi line."""
    rows = []
    with open(path) as f:
        for r in csv.reader(f):
            if len(r) < 4 or not r[1].strip().split()[0].isdigit():
                continue
            stamp = time.mktime(time.strptime(r[0].strip().split(".")[0], "%Y/%m/%d %H:%M:%S"))
            stamp += float("0." + r[0].strip().split(".")[1]) if "." in r[0] else 0.0
            rows.append((stamp, int(r[1].split()[0]), float(r[2].split()[0]), r[3].strip()))
    return rows


@contextlib.contextmanager
def smi_sampling(path: str):
    """nvidia-smi writes SMI_FIELDS every 20 ms to `path` while the block runs."""
    smi = subprocess.Popen(["nvidia-smi", f"--query-gpu={SMI_FIELDS}", "--format=csv,noheader", "-lms", "20"],
                           stdout=open(path, "w"), stderr=subprocess.DEVNULL)
    try:
        yield
    finally:
        time.sleep(0.1)
        smi.terminate()
        smi.wait()


def samples_during(samples: list, t0: float, t1: float) -> list:
    """The nvidia-smi samples taken while a group ran (10 ms of slack either side)."""
    return [x for x in samples if t0 - 0.01 <= x[0] <= t1 + 0.01]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=".")
    p.add_argument("--cell", default="128,8192,1")
    p.add_argument("--dtype", default="bf16")
    p.add_argument("--peers", default="fa3")
    p.add_argument("--groups", type=int, default=40)
    p.add_argument("--calls", type=int, default=bench.CALLS_PER_GROUP)
    args = p.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    c = parse_cell(args.cell, args.dtype)
    causal = c["causal"]
    s = _make_inputs(c, 1)[0]
    fns = {"facodegen": _facodegen_fn("sm90", {}, s, causal)[:2]}
    for name in filter(None, args.peers.split(",")):
        fns[name] = _peer_fn(name, s, causal)     # (fn, its context: an SDPA peer's backend)
    smi_path = os.path.join(args.out, "smi.csv")
    spans = [[] for _ in fns]
    with smi_sampling(smi_path):
        bench.time_cuda_interleaved([fn for fn, _ in fns.values()], groups=args.groups, calls=args.calls,
                                    spans=spans, contexts=[context for _, context in fns.values()])
    groups = dict(zip(fns, spans))
    samples = smi_samples(smi_path)
    flops = bench.attention_flops(c["batch"], c["heads_q"], c["seqlen_q"], c["seqlen_k"], c["head_dim"], c["causal"])
    with open(os.path.join(args.out, "probe.json"), "w") as f:
        json.dump({"cell": args.cell, "dtype": args.dtype, "flops": flops, "groups": groups}, f, indent=1)
    print(summarize(f"{args.cell} {args.dtype}", groups, samples, flops))
    return 0


def summarize(title: str, groups: dict, samples: list, flops: float) -> str:
    """The table printed last: per implementation its group times' quartiles and, per SM clock
    nvidia-smi reported during a group, that clock's groups and their median time."""
    lines = [f"cell {title}: {len(samples)} nvidia-smi samples, "
             f"SM clock {min((x[1] for x in samples), default=0)}-{max((x[1] for x in samples), default=0)} MHz, "
             f"power {min((x[2] for x in samples), default=0):.0f}-{max((x[2] for x in samples), default=0):.0f} W",
             "| implementation | groups | min ms | q1 | median | q3 | max | median TFLOP/s | by SM clock (MHz: groups, median ms) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, runs in groups.items():
        times = sorted(t for _, _, t in runs)
        q = statistics.quantiles(times, n=4)
        by_clock: dict[int, list[float]] = {}
        for t0, t1, ms in runs:
            seen = [x[1] for x in samples_during(samples, t0, t1)]
            if seen:
                by_clock.setdefault(statistics.median_low(seen), []).append(ms)
        clocks = "; ".join(f"{mhz}: {len(v)}, {statistics.median(v):.3f}" for mhz, v in sorted(by_clock.items()))
        lines.append(f"| {name} | {len(times)} | {times[0]:.3f} | {q[0]:.3f} | {q[1]:.3f} | {q[2]:.3f} | {times[-1]:.3f} | "
                     f"{bench.tflops(flops, q[1]):.1f} | {clocks or '-'} |")
    reasons = sorted({x[3] for x in samples})
    lines.append(f"throttle reasons seen: {', '.join(reasons) or '-'}")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
