"""Diagnose a varlen backward fuzz case whose gradients came back non-finite (GPU): rerun it with the
backward's arguments captured, then per sequence: the float64 reference's largest |dq|, |dk|, |dv|, the
rows/keys of the kernel's non-finite entries, D = rowsum(dO o O) and LSE at those rows, and the same call
again with other knobs (each: finite? max error against float64).

    python3 scripts/lab.py varlen-bwd-nonfinite '<case json>' [--knobs stages=1 --knobs k_unroll=0]
"""
from __future__ import annotations

import argparse


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("case")
    p.add_argument("--knobs", action="append", default=[], help="name=value,... of another call")
    args = p.parse_args(argv)
    import torch

    import facodegen
    from facodegen.verify import fuzz
    from facodegen.bench.variants import knob_values
    from facodegen.spec.backward import BACKWARD_BY_NAME
    case = fuzz.Case.from_json(args.case)
    captured = {}
    real = facodegen.attention_varlen_backward

    def spy(*a, **kw):
        out = real(*a, **kw)
        captured.setdefault("call", (a, kw, out))
        return out
    facodegen.attention_varlen_backward = spy
    ok, why = fuzz._run_varlen(case)
    print("fuzz:", ok, why)
    (do, q, k, v, out, lse, cu_q, cu_k, mq, mk), kw, grads = captured["call"]
    scale = case.softmax_scale if case.softmax_scale is not None else case.head_dim ** -0.5
    cq, ck = cu_q.tolist(), cu_k.tolist()
    print("cu_q", cq, "cu_k", ck, "kw", kw, "strides q", q.stride(), "out", out.stride())
    dsum = (do.double() * out.double()).sum(-1)          # (total_q, heads_q)
    print("D finite:", bool(torch.isfinite(dsum).all()), "max |D|", dsum.abs().max().item(),
          "LSE finite rows:", int(torch.isfinite(lse).sum()), "of", lse.numel(), "max |O|", out.abs().max().item())

    def refs(seq):
        q0, q1, k0, k1 = cq[seq], cq[seq + 1], ck[seq], ck[seq + 1]
        inputs = [x[None, a:b].double().requires_grad_(True) for x, a, b in ((q, q0, q1), (k, k0, k1), (v, k0, k1))]
        ref_out, _ = fuzz.attention_torch(*inputs, case.causal, scale, upcast=True)
        return torch.autograd.grad(ref_out, inputs, do[None, q0:q1].double())

    variants = [("fuzz call", grads)]
    for text in args.knobs:
        knobs = {**kw, **knob_values(text, BACKWARD_BY_NAME, "the backward")}
        variants.append((text, real(do, q, k, v, out, lse, cu_q, cu_k, mq, mk, **knobs)))
    for seq in range(len(cq) - 1):
        if cq[seq] == cq[seq + 1] or ck[seq] == ck[seq + 1]:
            continue
        r = refs(seq)
        print(f"sequence {seq}: {cq[seq + 1] - cq[seq]} queries, {ck[seq + 1] - ck[seq]} keys; reference max |dq| "
              f"{r[0].abs().max().item():.4g}, |dk| {r[1].abs().max().item():.4g}, |dv| {r[2].abs().max().item():.4g}")
        for name, g in variants:
            parts = []
            for gname, gt, ref, a, b in zip("qkv", g, r, (cq[seq], ck[seq], ck[seq]), (cq[seq + 1], ck[seq + 1], ck[seq + 1])):
                x = gt[a:b]
                bad = ~torch.isfinite(x)
                if bad.any():
                    rows = sorted(set(bad.nonzero()[:, 0].tolist()))
                    heads = sorted(set(bad.nonzero()[:, 1].tolist()))
                    parts.append(f"d{gname}: {int(bad.sum())} non-finite, rows {rows[:12]}{'...' if len(rows) > 12 else ''}"
                                 f" heads {heads}")
                else:
                    err = (x[None].double() - ref).abs().max().item()
                    parts.append(f"d{gname}: err {err:.3g}")
            print(f"  {name}: " + "; ".join(parts))
            if name == "fuzz call" and not bool(torch.isfinite(g[0][cq[seq]:cq[seq + 1]]).all()):
                rows = sorted(set((~torch.isfinite(g[0][cq[seq]:cq[seq + 1]])).nonzero()[:, 0].tolist()))[:4]
                for row in rows:
                    t = cq[seq] + row
                    print(f"    row {row}: LSE {lse[:, t].tolist()}, D {dsum[t].tolist()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
