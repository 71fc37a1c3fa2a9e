"""Fuzz cases run by facodegen and by FlashAttention-2 on the same inputs, each judged by the fuzz's
criterion with and without the floors of FlashAttention's rounding (GPU).

    python3 scripts/lab.py peer-error CASE_JSON [CASE_JSON ...]     # forward or backward family cases

For a failing 16-bit case this separates a kernel bug from the algorithm's precision: if FA2
(torch's flash backend, aten._scaled_dot_product_flash_attention: bottom-right causal, GQA by
repetition) fails standard attention's bound on the same inputs too, and both pass once the
criterion takes the bound of FlashAttention's rounding off each error (facodegen.verify.flash_rounding's
floors), the error is the algorithm's. FA2 stands in for facodegen.attention inside fuzz.run_case, so inputs, layouts and
references are the fuzz's own.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from facodegen.verify import fuzz  # noqa: E402


def fa2_attention(q, k, v, causal=False, softmax_scale=None, return_lse=False, out=None, lse_out=None, **rest):
    """facodegen.attention's signature served by FlashAttention-2 (plain attention only)."""
    import torch
    if any(rest.get(name) not in (None, (-1, -1), 0.0, "bottom_right") for name in
           ("window_size", "softcap", "sinks", "causal_alignment")):
        raise NotImplementedError("FA2 stand-in: plain attention only")
    group = q.shape[2] // k.shape[2]
    k, v = (x.repeat_interleave(group, dim=2) for x in (k, v))
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    o, lse = torch.ops.aten._scaled_dot_product_flash_attention(
        *(x.transpose(1, 2) for x in (q, k, v)), 0.0, bool(causal), False, scale=scale)[:2]
    o = o.transpose(1, 2)
    if out is not None:
        out.copy_(o)
        o = out
    if lse_out is not None:
        lse_out.copy_(lse)
        lse = lse_out
    return (o, lse) if return_lse else o


@contextlib.contextmanager
def standard_reference_only():
    """The fuzz's criterion without flash_rounding's floors: standard attention's error alone."""
    saved = fuzz.forward_floor, fuzz.backward_floor
    fuzz.forward_floor = lambda *args, **kwargs: None
    fuzz.backward_floor = lambda *args, **kwargs: (None, None)
    try:
        yield
    finally:
        fuzz.forward_floor, fuzz.backward_floor = saved


@contextlib.contextmanager
def attention_by(impl):
    import facodegen
    saved = facodegen.attention
    facodegen.attention = impl or saved
    try:
        yield
    finally:
        facodegen.attention = saved


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("cases", nargs="+", help="a fuzz case as JSON (facodegen check prints them)")
    args = parser.parse_args(argv)
    rows = []
    for text in args.cases:
        case = fuzz.Case.from_json(text)
        if case.family not in ("forward", "backward") or case.dtype == "fp8":
            print(f"skipped (forward/backward 16-bit only): {text}")
            continue
        cells = []
        for who, impl in (("facodegen", None), ("FA2", fa2_attention)):
            for criterion, ctx in (("standard", standard_reference_only), ("floors", contextlib.nullcontext)):
                with attention_by(impl), ctx():
                    try:
                        ok, message = fuzz.run_case(case)
                    except NotImplementedError as e:
                        ok, message = None, str(e)
                print(f"{case.family} seed {case.seed} {who:>9} {criterion:>8}: {'pass' if ok else 'FAIL' if ok is False else 'n/a'}"
                      f"  {message}")
                cells.append("pass" if ok else "FAIL" if ok is False else "n/a")
        rows.append((case, cells))
    print("\n| case | facodegen, standard ref | facodegen, + floors | FA2, standard ref | FA2, + floors |")
    print("|---|---|---|---|---|")
    for case, cells in rows:
        what = (f"{case.family} {case.arch} {case.dtype} d{case.head_dim} {case.seqlen_q}x{case.seqlen_k} "
                f"h{case.heads_q}/{case.heads_kv} x{case.magnitude:g}{' causal' if case.causal else ''}")
        print(f"| {what} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
