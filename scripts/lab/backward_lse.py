"""Which input of a failing backward fuzz case carries the error: the forward's LSE, its O, or the
backward kernel (GPU).

    python3 scripts/lab.py backward-lse CASE_JSON [CASE_JSON ...]     # backward family cases

For each case (the fuzz's own inputs, fuzz.backward_inputs): the forward's LSE against float64 (the
largest error, where, and the forward check's own allowance there, 1e-3 + 1e-4 |lse|), then
attention_backward with each backward arch the GPU runs, fed (a) the forward's O and LSE, (b) its O
and the float64 LSE, (c) float64 O (rounded to the dtype) and LSE, each judged by the fuzz's criterion
(fuzz.backward_failures). An error that (b) removes is the forward's LSE; one (c) removes, its O; one
that stays, the backward's.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from facodegen.verify import fuzz  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("cases", nargs="+", help="a backward fuzz case as JSON (facodegen check prints them)")
    args = parser.parse_args(argv)
    import torch

    import facodegen
    from facodegen.ops import api
    archs = ("sm80", "sm90") if api.default_arch(api.device_info(0)) == "sm90" else ("sm80",)
    for text in args.cases:
        case = fuzz.Case.from_json(text)
        if case.family != "backward":
            print(f"skipped (backward cases only): {text}")
            continue
        q, k, v, do, scale = fuzz.backward_inputs(case)
        out, lse = facodegen.attention(q, k, v, causal=case.causal, softmax_scale=case.softmax_scale, arch=case.arch,
                                       return_lse=True)
        ref_out, ref_lse = fuzz.attention_torch(q, k, v, case.causal, scale, upcast=True)
        seen = torch.isfinite(ref_lse)
        err = (lse.double() - ref_lse).abs().where(seen, torch.zeros_like(ref_lse))
        worst = tuple(int(i) for i in torch.unravel_index(err.argmax(), err.shape))
        print(f"{case.family} seed {case.seed} {case.arch} {case.dtype} d{case.head_dim} {case.seqlen_q}x{case.seqlen_k}: "
              f"forward LSE max err {err.max().item():.3e} at {worst} (lse {ref_lse[worst].item():.6g}, the forward "
              f"check allows {1e-3 + 1e-4 * abs(ref_lse[worst].item()):.3g})")
        for label, arch, knobs in _FORWARDS:
            try:
                _, lse_f = facodegen.attention(q, k, v, causal=case.causal, softmax_scale=case.softmax_scale,
                                               arch=arch, return_lse=True, **knobs)
            except Exception as e:      # a forward that does not cover the case
                print(f"  forward {label}: n/a ({type(e).__name__}: {e})")
                continue
            print(f"  forward {label}: LSE max err {(lse_f.double() - ref_lse).abs().where(seen, 0).max().item():.3e}")
        _score_errors(q, k, worst, scale)
        _single_key(q, k, v, do, worst, scale, archs)
        _row(q, k, v, worst, scale, archs)
        feeds = {"forward O, LSE": (out, lse), "forward O, float64 LSE": (out, ref_lse.float()),
                 "float64 O, LSE": (ref_out.to(q.dtype), ref_lse.float())}
        for arch in archs:
            for feed, (o, l) in feeds.items():
                try:
                    grads = facodegen.attention_backward(do, q, k, v, o.contiguous(), l.contiguous(),
                                                         causal=case.causal, softmax_scale=scale, arch=arch)
                except Exception as e:      # an arch that does not cover the case (head_dim, ...)
                    print(f"  {arch} backward, {feed}: n/a ({type(e).__name__}: {e})")
                    continue
                failures = fuzz.backward_failures(q, k, v, do, case.causal, scale, grads)
                print(f"  {arch} backward, {feed}: {'; '.join(failures) or 'pass'}")


# Forwards whose LSE error is printed beside the case's own: which knob (or arch) carries an LSE error.
_FORWARDS = (("sm80", "sm80", {}), ("sm90", "sm90", {}), ("sm90 poly_exp2_tiles=0", "sm90", {"poly_exp2_tiles": 0}),
             ("sm90 lazy_rescale=False", "sm90", {"lazy_rescale": False}),
             ("sm90 optimistic_max=False", "sm90", {"optimistic_max": False}),
             ("sm90 all three off", "sm90", {"poly_exp2_tiles": 0, "lazy_rescale": False, "optimistic_max": False}))


def _score_errors(q, k, worst, scale) -> None:
    """The scores of the worst LSE row against float64, as float32 GEMMs compute them: FFMA (IEEE
    rounding) and the tensor cores' fp32 accumulation (torch.mm with out_dtype, cuBLAS)."""
    import torch
    b, h, i = worst
    group = q.shape[2] // k.shape[2]
    qi, kh = q[b, i, h], k[b, :, h // group]
    exact = kh.double() @ qi.double()
    torch.backends.cuda.matmul.allow_tf32 = False
    rows = {"fp32 FFMA": kh.float() @ qi.float()}
    try:
        rows["tensor cores, fp32 accumulation"] = torch.mm(kh, qi[:, None], out_dtype=torch.float32)[:, 0]
    except (TypeError, RuntimeError) as e:
        print(f"  scores: torch.mm(out_dtype=float32) n/a ({e})")
    top = exact.argmax()
    for name, s in rows.items():
        print(f"  scores of row {worst} by {name}: max |err| {(s.double() - exact).abs().max().item():.3e}, "
              f"at the max score ({exact[top].item():.6g}) {(s[top].double() - exact[top]).item():+.3e} "
              f"(x scale {scale:.4g})")


def _single_key(q, k, v, do, worst, scale, archs) -> None:
    """The worst row's query against its top key alone, so that each kernel's score of that pair
    shows: the forward's LSE is its score (x scale, one key: l = 1), and the backward's P = e^(its
    score x scale - LSE) makes dV = P dO, so dV / dO - 1 is (backward score - forward score) x scale."""
    import torch

    import facodegen
    b, h, i = worst
    group = q.shape[2] // k.shape[2]
    exact = k[b, :, h // group].double() @ q[b, i, h].double()
    j = int(exact.argmax())
    q1 = q[b:b + 1, i:i + 1, h:h + 1].contiguous()
    k1, v1 = (x[b:b + 1, j:j + 1, h // group:h // group + 1].contiguous() for x in (k, v))
    do1 = torch.ones_like(q1)
    s64 = exact[j].item() * scale
    for arch in archs:
        _, lse = facodegen.attention(q1, k1, v1, softmax_scale=scale, arch=arch, return_lse=True)
        print(f"  one key: {arch} forward score x scale - float64: {lse.item() - s64:+.3e} (of {s64:.6g})")
        for barch in archs:
            try:
                _, _, dv = facodegen.attention_backward(do1, q1, k1, v1, v1.clone(), lse, softmax_scale=scale,
                                                        arch=barch)
            except Exception as e:
                print(f"    {barch} backward: n/a ({type(e).__name__})")
                continue
            print(f"    {barch} backward on it: dV/dO - 1 = {dv.double().mean().item() - 1:+.3e}")


def _row(q, k, v, worst, scale, archs) -> None:
    """The worst row's top logits (float64) and its LSE error when the call holds only its batch
    (another batch's keys next in memory or not) and only the keys up to and around its top key."""
    import torch

    import facodegen
    b, h, i = worst
    group = q.shape[2] // k.shape[2]
    logits = (k[b, :, h // group].double() @ q[b, i, h].double()) * scale
    top = torch.topk(logits, 5)
    print(f"  row {worst}: top logits {[round(x, 3) for x in top.values.tolist()]} at keys {top.indices.tolist()}, "
          f"float64 LSE {torch.logsumexp(logits, 0).item():.6f}")
    j = int(top.indices[0])
    cuts = {"its batch alone": slice(0, k.shape[1]), f"keys 0..{j}": slice(0, j + 1),
            f"keys {j // 128 * 128}..{j // 128 * 128 + 127}": slice(j // 128 * 128, j // 128 * 128 + 128)}
    for name, keys in cuts.items():
        qb = q[b:b + 1].contiguous()
        kb, vb = (x[b:b + 1, keys].contiguous() for x in (k, v))
        exact = torch.logsumexp((kb[0, :, h // group].double() @ q[b, i, h].double()) * scale, 0).item()
        for arch in archs:
            _, lse = facodegen.attention(qb, kb, vb, softmax_scale=scale, arch=arch, return_lse=True)
            print(f"  {name}, {arch} forward: LSE - float64 {lse[0, h, i].item() - exact:+.3e}")


if __name__ == "__main__":
    main()
