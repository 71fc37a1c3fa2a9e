#!/usr/bin/env python3
"""A source patch against the plain kernel, the two taking turns on the same inputs (GPU, sm90).

    python3 scripts/lab.py patch-ab --cell 256,8192,0 --cell 256,16384,1 --patch a.patch --patch b.patch \
        [--templates .old/templates [--zero-counter]] [--dtype fp8] [--variant k=v,...] [--peers fa3] [--groups 10] [--out DIR]

Renders each cell's kernel as facodegen.ops.api picks it (with --variant's spec overrides), applies each
patch (scripts/lab.py trace-steps' format: blocks 'OLD\\n===\\nNEW' separated by lines '%%%') to the
rendered source (--templates: renders it from another copy of templates/ instead, e.g. the base
commit's: `git worktree add /tmp/base HEAD~1 && cp -r /tmp/base/templates .old/`, carried), and times
the plain kernel, every patched one and the peers group by group in turn (--zero-counter: a --templates
tree from before 2026-12-03 wants the host to zero the tile counter before each launch; its launches
then do so, as that tree's own prepared path did)
(facodegen.bench.time_cuda_interleaved), so clock drift falls on all alike. Every output is checked
against the float64 reference on a slice first; a patch that breaks it (a bound, e.g. O never
stored) is timed anyway and marked. nvidia-smi samples the SM clock and power meanwhile (as
scripts/lab.py clock-probe does): the table gives each kernel's median of both over its groups, since a
patch can move the power-capped clock as much as the kernel's cycles. Prints TFLOP/s and
patched/plain per cell, last.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(os.path.dirname(HERE)), HERE]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cell", action="append", required=True, help="head_dim,seqlen,causal (16k tokens, hidden 2048)")
    p.add_argument("--patch", action="append", default=[])
    p.add_argument("--templates", action="append", default=[],
                   help="another copy of templates/ (e.g. the base commit's, from git worktree): its kernel "
                        "is timed beside the plain one as a patch is")
    p.add_argument("--dtype", default="fp8")
    p.add_argument("--zero-counter", action="store_true",
                   help="--templates kernels: zero the tile scheduler's counter before each launch, as the host "
                        "did before the kernels reset it themselves (sm90/scheduler.cuh.j2, 2026-12-03): an "
                        "older tree's persistent kernels timed as its own prepared path ran them")
    p.add_argument("--variant", default="", help="spec overrides k=v,... for every kernel")
    p.add_argument("--peers", default="")
    p.add_argument("--groups", type=int, default=10)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    from facodegen.ops import api
    from facodegen import bench
    from facodegen.runtime import compiler
    from facodegen.codegen import render
    from facodegen.bench.inputs import _make_inputs, _slice_check
    from facodegen.bench.peers import _peer_fn
    from facodegen.bench.variants import _facodegen_fn
    from sweep import parse_cell
    from clock_probe import samples_during, smi_samples, smi_sampling
    from trace_steps import patched_emitters
    overrides = dict(bench.parse_variant("sm90:" + args.variant)[1], dtype=args.dtype)
    compiler.spec_index = False     # the kernels compiled here are patched renderings: not the index's
    plain_emit = render.emit
    emitters = patched_emitters(plain_emit, args.patch)
    zeroed = set()      # emitters whose kernels get the host's counter reset (--zero-counter)
    for d in args.templates:
        name = os.path.basename(os.path.dirname(os.path.abspath(d))) or d
        emitters[name] = lambda spec, d=os.path.abspath(d): plain_emit(spec, templates=d)
        if args.zero_counter:
            zeroed.add(name)
    if args.out:
        os.makedirs(args.out, exist_ok=True)          # nvidia-smi's samples go there while timing
    rows = []
    for text in args.cell:
        c = parse_cell(text, args.dtype)
        s = _make_inputs(c, 1)[0]
        names, fns = [], []
        row = {"cell": text}
        for name, emit in emitters.items():
            render.emit = emit
            compiler.clear_memo()
            api._prepare.cache_clear()
            fn, _, variant, checked = _facodegen_fn("sm90", overrides, s, c["causal"])
            if name in zeroed:
                fn = _with_counter_zeroed(fn)
            ok, _, err = _slice_check(fn(), checked, c["causal"], args.dtype)
            row[f"{name} check"] = f"{'ok' if ok else 'FAILS'} rel_fro {err:.2e}"
            print(f"{text} {name}: {variant} {row[f'{name} check']}", flush=True)
            names.append(name)
            fns.append(fn)
        render.emit = plain_emit
        for peer in filter(None, args.peers.split(",")):
            fns.append(_peer_fn(peer, s, c["causal"])[0])
            names.append(peer)
        smi_path = os.path.join(args.out or "/tmp", f"smi_{text.replace(',', '_')}.csv")
        spans = [[] for _ in fns]
        with smi_sampling(smi_path):
            times = bench.time_cuda_interleaved(fns, groups=args.groups, spans=spans)
        samples = smi_samples(smi_path)
        for name, runs in zip(names, spans):
            seen = [x for t0, t1, _ in runs for x in samples_during(samples, t0, t1)]
            row[f"{name} clock"] = statistics.median(x[1] for x in seen) if seen else float("nan")
            row[f"{name} power"] = statistics.median(x[2] for x in seen) if seen else float("nan")
        flops = bench.attention_flops(c["batch"], c["heads_q"], c["seqlen_q"], c["seqlen_k"], c["head_dim"],
                                      c["causal"])
        for name, t in zip(names, times):
            row[name] = bench.tflops(flops, t["ms"])
        rows.append(row)
    if args.out:
        with open(os.path.join(args.out, "patch_ab.json"), "w") as f:
            json.dump(rows, f, indent=1)
    patched = list(emitters)[1:]
    peers = [n for n in rows[0] if n not in emitters and n != "cell" and " " not in n]
    print("| cell | plain | " + " | ".join(f"{n} | /plain" for n in patched) + "".join(f" | {n}" for n in peers) + " |")
    print("|---|---|" + "---|---|" * len(patched) + "---|" * len(peers))
    for row in rows:
        cells = [f"{row[n]:.1f} | {row[n] / row['plain']:.3f}" + ("" if row[f"{n} check"].startswith("ok") else " (wrong)")
                 for n in patched]
        print(f"| {row['cell']} | {row['plain']:.1f} | " + " | ".join(cells)
              + "".join(f" | {row[n]:.1f}" for n in peers) + " |")
    print("median SM MHz / W over each kernel's groups:")
    for row in rows:
        print(f"  {row['cell']}: " + ", ".join(f"{n} {row[n + ' clock']:.0f} / {row[n + ' power']:.0f}"
                                             for n in list(emitters) + peers))
    return 0


def _with_counter_zeroed(fn):
    """fn (bench's prepared launcher) after a cuMemsetD32Async of its plan's tile counter on the
    current stream: what facodegen's host did before every launch of a persistent sm90 kernel until
    the kernels left the counter at zero themselves."""
    import torch
    from facodegen.runtime import driver
    call = fn.prepared._call

    def zeroed():
        stream = torch.cuda.current_stream().cuda_stream
        driver.memset_d32_async(call.plan.scratch(stream).counter, 0, 1, stream)
        return fn()
    return zeroed


if __name__ == "__main__":
    raise SystemExit(main())
