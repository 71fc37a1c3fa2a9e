#!/usr/bin/env python3
"""A source patch of the backward's kernels against the plain ones, taking turns on the same inputs (GPU).

    python3 scripts/lab.py bwd-patch-ab --cell 128,2048,0 --patch scripts/lab/patches/sm80_bwd_no_dq_adds.patch \
        [--variant arch=sm80,stages=2] [--peer fa2] [--groups 10]
    python3 scripts/lab.py bwd-patch-ab --check --cell 128,2048,0 --patch P    # CPU: the patches apply and compile

Renders the backward's kernels (ops.backward.emit) as attention_backward picks them for each cell of the
FlashAttention-3 paper's grid (head_dim,seqlen,causal: 16k tokens, hidden 2048, bf16), applies each patch
(scripts/lab.py trace-steps' format: blocks 'OLD\\n===\\nNEW' separated by lines '%%%') to the rendered
source, and builds one attention_backward plan per kernel on the forward's O and LSE. The plans take turns
group by group (time_cuda_interleaved: each call puts its own plan back under the call's key first), with
the peer's autograd backward beside them. A patched kernel's gradients are compared with the plain one's
(relative Frobenius error, printed: a patch may break them on purpose, e.g. to time a step without its dQ
adds). Prints TFLOP/s (2.5 x the forward's FLOPs) and patched/plain per cell, last.
"""

from __future__ import annotations

import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(os.path.dirname(HERE)), HERE]


def emitters(patches: list[str]) -> dict:
    """{name: emit(spec) -> source}: the plain backward emitter and one per patch file."""
    from facodegen.ops import backward
    from trace_steps import patched_emitters
    return patched_emitters(backward.emit, patches)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cell", action="append", required=True, help="head_dim,seqlen,causal (16k tokens, hidden 2048)")
    p.add_argument("--patch", action="append", default=[])
    p.add_argument("--variant", default="arch=sm80", help="attention_backward knobs k=v,... (arch too)")
    p.add_argument("--peer", default="fa2", help="the peer's autograd backward beside them ('' for none)")
    p.add_argument("--groups", type=int, default=10)
    p.add_argument("--check", action="store_true", help="CPU: render, patch and compile each kernel (sm_90)")
    args = p.parse_args(argv)
    from facodegen.bench.backward import parse_knobs
    from facodegen.ops import backward
    from facodegen.runtime import compiler
    from sweep import parse_cell
    knobs = parse_knobs(args.variant)
    found = emitters(args.patch)
    compiler.spec_index = False     # the kernels compiled here are patched renderings: not the index's
    if args.check:
        from facodegen.spec.backward import BackwardSpec
        for text in args.cell:
            c = parse_cell(text, "bf16")
            spec = BackwardSpec(head_dim=c["head_dim"], causal=c["causal"], gpu="h100", **knobs)
            for name, emit in found.items():
                kernel = compiler.compile_source(emit(spec), spec.arch, spec.variant, sm="sm_90")
                r = kernel.resources
                print(f"{text} {name}: {spec.variant} {r.registers} registers, {r.spill_stores} bytes spilled, "
                      f"{kernel.sass().count('REDG')} REDG")
        return 0
    import torch

    import facodegen
    from facodegen import bench
    from facodegen.bench.backward import _forward_fn
    rows = []
    for text in args.cell:
        c = parse_cell(text, "bf16")
        shape = (c["batch"], c["seqlen_q"], c["heads_q"], c["head_dim"])
        q, k, v, do = (torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(4))
        out, lse = facodegen.attention(q, k, v, causal=c["causal"], return_lse=True)
        names, fns, plain_grads, row = [], [], None, {"cell": text}
        for name, emit in found.items():
            backward.emit = emit
            backward._compiled.clear()
            backward._PLANS._plans.clear()
            grads = facodegen.attention_backward(do, q, k, v, out, lse, causal=c["causal"], **knobs)
            torch.cuda.synchronize()
            (key, plan), = backward._PLANS._plans.items()

            def fn(key=key, plan=plan):
                backward._PLANS._plans[key] = plan
                return facodegen.attention_backward(do, q, k, v, out, lse, causal=c["causal"], **knobs)
            if plain_grads is None:
                plain_grads = [g.clone() for g in grads]
            errs = [((g.double() - p).norm() / p.double().norm()).item() for g, p in zip(grads, plain_grads)]
            print(f"{text} {name}: {plan.spec.variant if hasattr(plan, 'spec') else ''} rel_fro against plain "
                  f"dq {errs[0]:.1e} dk {errs[1]:.1e} dv {errs[2]:.1e}", flush=True)
            names.append(name)
            fns.append(fn)
        backward.emit = found["plain"]
        if args.peer:
            leaves = [x.detach().clone().requires_grad_(True) for x in (q, k, v)]
            forward, context = _forward_fn(args.peer, *leaves, c["causal"])
            with context():
                peer_out = forward()
            fns.append(lambda: torch.autograd.grad(peer_out, leaves, do, retain_graph=True))
            names.append(args.peer)
        times = bench.time_cuda_interleaved(fns, groups=args.groups)
        flops = 2.5 * bench.attention_flops(c["batch"], c["heads_q"], c["seqlen_q"], c["seqlen_k"], c["head_dim"],
                                            c["causal"])
        for name, t in zip(names, times):
            row[name] = bench.tflops(flops, t["ms"])
        rows.append(row)
    patched = list(found)[1:]
    peers = [args.peer] if args.peer else []
    print("| cell | plain | " + " | ".join(f"{n} | /plain" for n in patched) + "".join(f" | {n}" for n in peers) + " |")
    print("|---|---|" + "---|---|" * len(patched) + "---|" * len(peers))
    for row in rows:
        print(f"| {row['cell']} | {row['plain']:.1f} | "
              + " | ".join(f"{row[n]:.1f} | {row[n] / row['plain']:.3f}" for n in patched)
              + "".join(f" | {row[n]:.1f}" for n in peers) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
