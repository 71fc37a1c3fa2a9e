#!/usr/bin/env python3
"""compute-sanitizer over attention_with_kvcache with hostile inputs (GPU): memcheck, racecheck,
synccheck and initcheck, each over a few cases whose cache_seqlens are negative or far past the
cache's capacity and whose page tables hold negative and out-of-range page indices, with new tokens
appended past the capacity, contiguous and paged, split and not. The kernels must clamp: no error.

    python3 scripts/sanitize_decode.py [--tools memcheck,initcheck] [--out DIR]

The parent runs every case once (compiling the kernels), then each (tool, case) in a child process
`compute-sanitizer --tool T --error-exitcode 99 python scripts/sanitize_decode.py --case N`, and prints
a table of errors per tool and case. Logs go to DIR/<tool>-<case>.log.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

TOOLS = ("memcheck", "racecheck", "synccheck", "initcheck")
# (name, batch, seqlen_q, heads_q, heads_kv, d, capacity, page_size, lengths, new, num_splits)
CASES = (
    ("contiguous, split, append", 4, 1, 8, 2, 128, 512, 0, (-5, 10 ** 9, 0, 37), 3, 0),
    ("paged16, append, bad pages", 3, 2, 8, 1, 64, 256, 16, (-1, 300, 255), 2, 4),
    ("paged64, gqa8 x 4 queries", 2, 4, 16, 2, 128, 1024, 64, (1023, 10 ** 6), 0, 1),
    ("paged256, d256, split", 2, 1, 4, 4, 256, 2048, 256, (2048, 5), 1, 0),
)


def run_case(index: int) -> None:
    import torch

    import facodegen

    name, batch, seqlen_q, heads_q, heads_kv, d, capacity, page_size, lengths, new, splits = CASES[index]
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
    kw = {"page_table": table, "num_splits": splits, "return_lse": True}
    if new:
        kw["k"] = torch.randn(batch, new, heads_kv, d, device="cuda", dtype=dt)
        kw["v"] = torch.randn(batch, new, heads_kv, d, device="cuda", dtype=dt)
    out, _ = facodegen.attention_with_kvcache(q, k_cache, v_cache, seqlens, **kw)
    torch.cuda.synchronize()
    assert torch.isfinite(out).all(), f"{name}: O not finite"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tools", default=",".join(TOOLS))
    p.add_argument("--out", type=Path, default=Path("sanitize-decode"))
    p.add_argument("--case", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.case is not None:
        run_case(args.case)
        return 0
    tool_path = shutil.which("compute-sanitizer")
    if tool_path is None:
        print("compute-sanitizer not found on PATH", file=sys.stderr)
        return 2
    for i in range(len(CASES)):
        run_case(i)                                          # compile first: the sanitizer runs are slow
    args.out.mkdir(parents=True, exist_ok=True)
    from sanitize import errors_in  # scripts/sanitize.py's summary parser

    rows = []
    for tool in args.tools.split(","):
        for i, case in enumerate(CASES):
            cmd = [tool_path, "--tool", tool, "--error-exitcode", "99", "--kernel-name", "kns=flash_",
                   sys.executable, __file__, "--case", str(i)]
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
            log = done.stdout + done.stderr
            (args.out / f"{tool}-{i}.log").write_text(log)
            rows.append((tool, case[0], done.returncode, errors_in(log)))
    print("| tool | case | exit | errors |\n|---|---|---|---|")
    for tool, name, rc, errors in rows:
        print(f"| {tool} | {name} | {rc} | {'?' if errors is None else errors} |")
    return 0 if all(rc == 0 and not errors for _, _, rc, errors in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
