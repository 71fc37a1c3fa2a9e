#!/usr/bin/env python3
"""compute-sanitizer over attention_varlen and attention_varlen_backward with hostile cu_seqlens (GPU):
memcheck, racecheck, synccheck and initcheck over boundaries that decrease, start below 0, run far past
the packed tokens or past max_seqlen, on every varlen kernel (the sm80 forward and backward, the sm90
forward persistent and not, fp8, the sm90 backward, both deterministic backwards). The kernels clamp
each sequence into the packed tokens (templates/common/varlen_span.cuh.j2): no error, and whatever they
computed is finite: each clamped sequence's first max_seqlen rows and, in the gradients the call made, the
rows before the first sequence and after the last (zeroed by the preprocess); rows past a sequence's
max_seqlen no kernel writes. (check_inputs=True would refuse these boundaries on the host instead.)

    python3 scripts/sanitize_varlen.py [--tools memcheck,initcheck] [--out DIR]

As scripts/sanitize_decode.py: the parent compiles the kernels in parallel processes, runs every case
once plainly, then each (tool, case) in a child `compute-sanitizer --tool T --error-exitcode 99 python
scripts/sanitize_varlen.py --case N` (sanitize.py's run_children), and prints a table of errors.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

TOOLS = ("memcheck", "racecheck", "synccheck", "initcheck")
TOTAL_Q, TOTAL_K, MAX_SEQLEN = 120, 90, 64
# (name, cu_seqlens_q, cu_seqlens_k): each against TOTAL_Q / TOTAL_K packed tokens, max_seqlen MAX_SEQLEN
BOUNDARIES = (
    ("decreasing", (0, 50, 20, 120), (0, 60, 30, 90)),
    ("negative and past the tokens", (-30, 40, 10 ** 6, 120), (-5, 10 ** 9, 50, 2 ** 31 - 1)),
    ("longer than max_seqlen", (0, 119, 119, 120), (0, 1, 90, 90)),
)
# (label, arch, dtype, forward knobs, backward arch and knobs or None: fp8 has no backward)
KERNELS = (
    ("sm80", "sm80", "bf16", {}, ("sm80", {})),
    ("sm90 persistent", "sm90", "bf16", {}, ("sm90", {})),
    ("sm90 one CTA a tile, vector dQ", "sm90", "fp16", {"persistent": False}, ("sm90", {"dq_tma_reduce": False})),
    ("sm90 fp8", "sm90", "fp8", {}, None),
    ("sm80 deterministic backward", "sm80", "fp16", {}, ("sm80", {"deterministic": True})),
    ("sm90 deterministic backward", "sm90", "bf16", {}, ("sm90", {"deterministic": True})),
)
CASES = [(f"{kernel[0]}, {bounds[0]}", kernel, bounds) for kernel in KERNELS for bounds in BOUNDARIES]


def defined_rows(cu: tuple, total: int, outside: bool) -> list[int]:
    """The rows of a packed array a varlen call writes for boundaries ``cu`` over ``total`` tokens: each
    sequence's span as seq_span clamps it, its first MAX_SEQLEN rows (a power of two: the plans' bound), and
    with ``outside`` (the backward's zero_outside) the rows before the first span and after the last."""
    rows, starts, ends = set(), [], []
    for begin, finish in zip(cu, cu[1:]):
        start = min(max(begin, 0), total)
        end = min(max(finish, start), total)
        rows.update(range(start, min(end, start + MAX_SEQLEN)))
        starts.append(start)
        ends.append(end)
    if outside:
        rows.update(range(0, starts[0]))
        rows.update(range(ends[-1], total))
    return sorted(rows)


def run_case(index: int) -> None:
    import torch

    import facodegen

    name, (_, arch, dtype, knobs, backward), (_, cu_q, cu_k) = CASES[index]
    heads_q, heads_kv, d = 4, 2, 128
    dt = torch.float16 if dtype == "fp16" else torch.bfloat16
    q = torch.randn(TOTAL_Q, heads_q, d, device="cuda", dtype=dt)
    k, v = (torch.randn(TOTAL_K, heads_kv, d, device="cuda", dtype=dt) for _ in range(2))
    bounds = [torch.tensor(c, dtype=torch.int32, device="cuda") for c in (cu_q, cu_k)]
    extra = dict(knobs)
    if dtype == "fp8":
        (q, qd), (k, kd), (v, vd) = (facodegen.quantize_e4m3(x) for x in (q, k, v))
        extra.update(q_descale=qd, k_descale=kd, v_descale=vd)
    out, lse = facodegen.attention_varlen(q, k, v, *bounds, MAX_SEQLEN, MAX_SEQLEN, causal=True, return_lse=True,
                                          arch=arch, **extra)
    torch.cuda.synchronize()
    assert not torch.isnan(out[defined_rows(cu_q, TOTAL_Q, False)].float()).any(), f"{name}: O has NaN"
    if backward is not None:
        do = torch.randn_like(out)
        grads = facodegen.attention_varlen_backward(do, q, k, v, out, lse, *bounds, MAX_SEQLEN, MAX_SEQLEN,
                                                    causal=True, arch=backward[0], **backward[1])
        torch.cuda.synchronize()
        rows_q, rows_k = defined_rows(cu_q, TOTAL_Q, True), defined_rows(cu_k, TOTAL_K, True)
        assert all(torch.isfinite(g[rows].float()).all() for g, rows in zip(grads, (rows_q, rows_k, rows_k))), \
            f"{name}: a gradient is not finite"


def fuzz_cases():
    """Fuzz varlen Cases of the same kernels, for fuzz.precompile (its case_specs lists what they launch): seed
    3 runs the case's arch's varlen backward (Case.varlen_backward: 3 mod 4), 19 also the one CTA a tile sm90
    forward (one_cta_per_tile: 1 mod 3), 7 and 15 the deterministic backward (7 mod 8: the case arch's; 15
    neither 1 mod 3 nor varlen_lpt's 2 mod 6). The vector-dQ sm90 backward compiles in the plain runs."""
    from facodegen.verify import fuzz
    seeds = (3, 3, 19, 3, 7, 15)    # (KERNELS' order)
    return [fuzz.Case("varlen", arch, dtype, batch=3, seqlen_q=MAX_SEQLEN, seqlen_k=MAX_SEQLEN, heads_q=4, heads_kv=2,
                      head_dim=128, causal=True, softmax_scale=None, layout="contiguous", magnitude=1.0,
                      return_lse=True, use_out=False, seed=seed)
            for (_, arch, dtype, _, _), seed in zip(KERNELS, seeds)]


def main() -> int:
    from facodegen.verify import fuzz
    from sanitize import hostile_sweep_main     # scripts/sanitize.py
    return hostile_sweep_main(__doc__, __file__, [case[0] for case in CASES], run_case,
                              lambda: fuzz.precompile(fuzz_cases()), "sanitize-varlen")

if __name__ == "__main__":
    sys.exit(main())
