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


if __name__ == "__main__":
    main()
