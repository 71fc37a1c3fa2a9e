#!/usr/bin/env python3
"""compute-sanitizer over attention_with_kvcache with hostile inputs (GPU): memcheck, racecheck,
synccheck and initcheck, each over a few cases whose cache_seqlens are negative or far past the
cache's capacity and whose page tables hold negative and out-of-range page indices, with new tokens
appended past the capacity, contiguous and paged, split and not, with and without producer warps. The
kernels must clamp: no error.

    python3 scripts/sanitize_decode.py [--tools memcheck,initcheck] [--out DIR]

The parent runs every case once (compiling the kernels), then each (tool, case) in a child process
`compute-sanitizer --tool T --error-exitcode 99 python scripts/sanitize_decode.py --case N` (sanitize.py's
run_children: several at once, each under a time limit), and prints a table of errors per tool and
case. Logs go to DIR/<tool>.log. The kernels are compiled first in parallel processes.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

TOOLS = ("memcheck", "racecheck", "synccheck", "initcheck")
# (name, batch, seqlen_q, heads_q, heads_kv, d, capacity, page_size, lengths, new, num_splits, fused_combine
#  [, the call's other arguments: issue 40's window and softcap (LOCAL / SOFTCAP decode, whose first-key clamps
#  meet the same hostile lengths), or producer_warps (the copies and their page lookups in warps of their own)])
CASES = (
    ("contiguous, split, append", 4, 1, 8, 2, 128, 512, 0, (-5, 10 ** 9, 0, 37), 3, 0, False),
    ("paged16, append, bad pages", 3, 2, 8, 1, 64, 256, 16, (-1, 300, 255), 2, 4, False),
    ("paged64, gqa8 x 4 queries", 2, 4, 16, 2, 128, 1024, 64, (1023, 10 ** 6), 0, 1, False),
    ("paged256, d256, split", 2, 1, 4, 4, 256, 2048, 256, (2048, 5), 1, 0, False),
    # the splits merged by the decode kernel's last CTA (counters, fences, partials read back)
    ("contiguous, split, append, fused", 4, 1, 8, 2, 128, 512, 0, (-5, 10 ** 9, 0, 37), 3, 0, True),
    ("paged16, append, bad pages, fused", 3, 2, 8, 1, 64, 256, 16, (-1, 300, 255), 2, 4, True),
    # d256's 3-stage ring (kvcache.choose -> split_stages: one split of 32 or more key blocks)
    ("contiguous, d256, one long split", 2, 1, 8, 2, 256, 2048, 0, (2047, -3), 0, 1, False),
    ("paged256, d256, one long split, append", 1, 1, 4, 1, 256, 4096, 256, (10 ** 6,), 1, 1, False),
    ("paged16, window 20 causal, softcap, bad pages, split", 3, 2, 8, 1, 64, 256, 16, (-1, 300, 255), 2, 4, True,
     dict(window_size=(20, 0), softcap=30.0)),
    ("contiguous, window (5, 3) not causal, split, append", 4, 3, 8, 2, 128, 512, 0, (-5, 10 ** 9, 0, 37), 3, 3,
     False, dict(window_size=(5, 3), causal=False)),
    ("paged16, d256, a producer warp, bad pages, split, append, fused", 3, 1, 8, 1, 256, 1024, 16, (-1, 10 ** 6, 511),
     2, 4, True, dict(producer_warps=1)),
    ("contiguous, two producer warps, split, append", 4, 1, 8, 2, 128, 512, 0, (-5, 10 ** 9, 0, 37), 3, 3, False,
     dict(producer_warps=2)),
)


def _case(index: int) -> tuple:
    """CASES[index] with its other arguments ({} where it has none) as a 13th item."""
    case = CASES[index]
    return case if len(case) == 13 else (*case, {})


def run_case(index: int) -> None:
    import torch

    import facodegen

    name, batch, seqlen_q, heads_q, heads_kv, d, capacity, page_size, lengths, new, splits, fused, extra = _case(index)
    dt = torch.bfloat16
    q = torch.randn(batch, seqlen_q, heads_q, d, device="cuda", dtype=dt)
    table = None
    if page_size:
        pages = batch * capacity // page_size
        shape = (pages, page_size, heads_kv, d)
        table = torch.randperm(pages, device="cuda").view(batch, -1).to(torch.int32)
        table[0, 0], table[-1, -1] = -100, 10 ** 6          # clamped into [0, num_pages)
    else:
        shape = (batch, capacity, heads_kv, d)
    k_cache = torch.randn(shape, device="cuda", dtype=dt)
    v_cache = torch.randn(shape, device="cuda", dtype=dt)
    seqlens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    kw = {"page_table": table, "num_splits": splits, "return_lse": True, "fused_combine": fused, **extra}
    if new:
        kw["k"] = torch.randn(batch, new, heads_kv, d, device="cuda", dtype=dt)
        kw["v"] = torch.randn(batch, new, heads_kv, d, device="cuda", dtype=dt)
    out, _ = facodegen.attention_with_kvcache(q, k_cache, v_cache, seqlens, **kw)
    torch.cuda.synchronize()
    assert torch.isfinite(out).all(), f"{name}: O not finite"


def fuzz_case(index: int, arch: str):
    """The case's shapes as a fuzz kvcache Case: what fuzz.case_specs needs to list its kernels. The knobs a
    Case reads off its seed (fused_combine: odd; producer_warps: Case.producer_warps) are the call's: the
    first seed from 2 x index on that gives both."""
    from facodegen.verify import fuzz
    _, batch, seqlen_q, heads_q, heads_kv, d, capacity, page_size, _, new, splits, fused, extra = _case(index)
    left, right = extra.get("window_size", (-1, -1))
    for seed in range(2 * index + fused, 2 * index + fused + 24, 2):
        case = fuzz.Case("kvcache", arch, "bf16", batch=batch, seqlen_q=seqlen_q, seqlen_k=capacity, heads_q=heads_q,
                         heads_kv=heads_kv, head_dim=d, causal=extra.get("causal", True), softmax_scale=None,
                         layout="contiguous", magnitude=1.0, return_lse=True, use_out=False, page_size=page_size,
                         seqlen_new=new, num_splits=splits, seed=seed, window_left=left, window_right=right,
                         softcap=extra.get("softcap", 0.0))
        if case.producer_warps == extra.get("producer_warps"):   # (None: the call's default)
            return case
    raise AssertionError(f"no seed gives case {index}'s knobs")


def main() -> int:
    from facodegen.ops import api
    from facodegen.verify import fuzz
    from sanitize import hostile_sweep_main     # scripts/sanitize.py

    def precompile():   # in parallel processes (one by one they took the whole step on a fresh H200)
        arch = api.default_arch(api.device_info(0))
        fuzz.precompile([fuzz_case(i, arch) for i in range(len(CASES))])
    return hostile_sweep_main(__doc__, __file__, [case[0] for case in CASES], run_case, precompile, "sanitize-decode")

if __name__ == "__main__":
    sys.exit(main())
