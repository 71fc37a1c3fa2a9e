"""Profile facodegen and a peer on one cell with Nsight Compute, side by side (GPU).

    python3 scripts/lab.py ncu-compare --out $OUT --cell 128,8192,0 --variant sm90: --peer fa3
    python3 scripts/lab.py ncu-compare --backward --out $OUT --cell 64,8192,1 --variant arch=sm90 --peer cudnn

runs itself under ``ncu --clock-control none --profile-from-start off`` (warm-up and compilation
stay outside the profiled range), one launch per implementation, with the sections that say where
a kernel's time goes: SpeedOfLight, ComputeWorkloadAnalysis (pipe utilisation), SchedulerStats
(issue slots), WarpStateStats (stall reasons), InstructionStats, MemoryWorkloadAnalysis (+ tables:
shared-memory wavefronts and bank conflicts). Writes ncu.txt (the full report)
under --out and prints, last, a table of the metrics that differ most between the two kernels.
A cell is ``head_dim,seqlen,causal`` of the FlashAttention-3 paper's grid (16k tokens, hidden 2048).
``--backward`` profiles the backward instead: facodegen.attention_backward with the variant's knobs
(backward knobs as ``bench --backward --variant`` takes them: arch=sm90,dq_tma_reduce=false) on the
forward's O and LSE, against the peer's autograd backward (an SDPA backend: cudnn, fa2); each
side launches several kernels (ours: preprocess, main, dQ conversion), so the table compares the two
longest kernels of the report, the main kernels.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the checkout

SECTIONS = ("SpeedOfLight", "ComputeWorkloadAnalysis", "SchedulerStats", "WarpStateStats", "InstructionStats",
            "MemoryWorkloadAnalysis", "MemoryWorkloadAnalysis_Tables")
# Report lines worth a side-by-side look (substring of the metric name as ncu prints it).
KEY_METRICS = ("Duration", "Compute (SM) Throughput", "Issue Slots Busy", "Issued Ipc Active", "No Eligible",
               "One or More Eligible", "Active Warps Per Scheduler", "Eligible Warps Per Scheduler",
               "Warp Cycles Per Issued Instruction", "Executed Instructions", "SM Busy", "Registers Per Thread",
               "issue_stalled", "Memory Throughput", "Mem Pipes Busy", "Max Bandwidth", "Shared", "Bank")
# Stall reasons, cycles per issued instruction (regex: names ncu does not have are simply absent).
STALL_METRICS = r"regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio"


def backward_launchers(args, c: dict):
    """(ours, peer, the peer's context): facodegen.attention_backward (the variant's arch and knobs)
    on the forward's O and LSE, and the peer's torch.autograd.grad through its forward's graph."""
    import torch

    import facodegen
    from facodegen.bench.backward import _forward_fn, parse_knobs
    arch, colon, rest = args.variant.partition(":")    # (the forward's arch:knobs spelling works too)
    knobs = parse_knobs(",".join(filter(None, (f"arch={arch}" if arch else "", rest))) if colon else args.variant)
    dt = {"bf16": torch.bfloat16, "fp16": torch.float16}[c["dtype"]]
    shape = (c["batch"], c["seqlen_q"], c["heads_q"], c["head_dim"])
    q, k, v, do = (torch.randn(shape, device="cuda", dtype=dt) for _ in range(4))
    out, lse = facodegen.attention(q, k, v, causal=c["causal"], return_lse=True)
    ours = lambda: facodegen.attention_backward(do, q, k, v, out, lse, causal=c["causal"], **knobs)  # noqa: E731
    leaves = [x.detach().clone().requires_grad_(True) for x in (q, k, v)]
    forward, context = _forward_fn(args.peer, *leaves, c["causal"])
    with context():
        peer_out = forward()
    return ours, (lambda: torch.autograd.grad(peer_out, leaves, do, retain_graph=True)), context


def child(args) -> None:
    """Inside ncu: build both launchers, warm them up, then profile one launch of each."""
    import torch

    from facodegen import bench
    from facodegen.bench.inputs import _make_inputs
    from facodegen.bench.peers import _peer_fn
    from facodegen.bench.variants import _facodegen_fn
    from sweep import parse_cell   # scripts/lab/ is this script's sys.path[0]
    c = parse_cell(args.cell, args.dtype)
    if args.backward:
        ours, peer, peer_context = backward_launchers(args, c)
    else:
        s = _make_inputs(c, 1)[0]
        arch, fields = bench.parse_variant(args.variant)
        ours = _facodegen_fn(arch, fields, s, c["causal"])[0]
        peer, peer_context = _peer_fn(args.peer, s, c["causal"])   # SDPA peers: their backend's context
    with peer_context():
        for fn in (ours, peer):
            for _ in range(3):
                fn()
        torch.cuda.synchronize()
        torch.cuda.profiler.start()
        ours()
        torch.cuda.synchronize()
        peer()
        torch.cuda.synchronize()
        torch.cuda.profiler.stop()


def _duration_us(metrics: dict) -> float:
    """A kernel's Duration in µs (ncu prints it in ns, us or ms)."""
    text = metrics.get("Duration", "0")
    value, _, unit = text.partition(" ")
    scale = {"ns": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3, "s": 1e6, "second": 1e6}
    return float(value.replace(",", "")) * scale.get(unit, 1.0)


def summarize(report: str, longest: bool = False) -> str:
    """The KEY_METRICS values of two kernels side by side: the report's first and last (one launch
    each), or with ``longest`` its two longest, in launch order (two implementations of several
    kernels each: their main kernels)."""
    kernels: list[tuple[str, dict]] = []
    for line in report.splitlines():
        head = re.match(r"\s{2}(\S.*?)\s+\(\d+, \d+, \d+\)x\(\d+, \d+, \d+\)", line)
        if head:
            kernels.append((head.group(1)[:60], {}))
            continue
        m = re.match(r"\s{4}(\S.*?)\s{2,}(?:(\S+)\s+)?([\d.,]+)\s*$", line)
        if m and kernels and any(k in m.group(1) for k in KEY_METRICS):
            kernels[-1][1].setdefault(m.group(1).strip(), f"{m.group(3)} {m.group(2) or ''}".strip())
    if len(kernels) < 2:
        return "fewer than two kernels in the report"
    if longest:
        top = sorted(range(len(kernels)), key=lambda i: _duration_us(kernels[i][1]), reverse=True)[:2]
        (name_a, a), (name_b, b) = (kernels[i] for i in sorted(top))
    else:
        (name_a, a), (name_b, b) = kernels[0], kernels[-1]
    rows = [f"| metric | {name_a} | {name_b} |", "|---|---|---|"]
    rows += [f"| {k} | {a.get(k, '-')} | {b.get(k, '-')} |" for k in a]
    return "\n".join(rows)


def add_child_arguments(p: argparse.ArgumentParser, peer_help: str | None = None) -> None:
    """The options of the child process that runs our kernel and the peer (ncu-source profiles the
    same child, so it takes them too)."""
    p.add_argument("--out", default=".")
    p.add_argument("--cell", default="128,8192,0")
    p.add_argument("--dtype", default="bf16")
    p.add_argument("--variant", default="sm90:")
    p.add_argument("--peer", default="fa3", help=peer_help)
    p.add_argument("--backward", action="store_true",
                   help="the backward: facodegen.attention_backward against the peer's autograd backward")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_child_arguments(p)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        child(args)
        return 0
    ncu = shutil.which("ncu") or "/usr/local/cuda/bin/ncu"
    cmd = [ncu, "--clock-control", "none", "--profile-from-start", "off", "--print-details", "all"]
    for section in SECTIONS:
        cmd += ["--section", section]
    cmd += ["--metrics", STALL_METRICS]
    cmd += [sys.executable, os.path.abspath(__file__), "--child", "--cell", args.cell, "--dtype", args.dtype,
            "--variant", args.variant, "--peer", args.peer] + (["--backward"] if args.backward else [])
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=400)
    report = run.stdout + ("\n" + run.stderr if run.returncode else "")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "ncu.txt"), "w") as f:
        f.write(report)
    print(summarize(report, longest=args.backward))
    return run.returncode


if __name__ == "__main__":
    raise SystemExit(main())
