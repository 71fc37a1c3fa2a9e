#!/usr/bin/env python3
"""Time the first facodegen.attention() call of a fresh process whose kernel is already in the
compile cache (GPU): what a model pays per shape at start-up once `facodegen precompile` or an
earlier run filled the cache.

    python3 scripts/first_call.py [--runs 5] [--shape 1,2048,2048,16,16,128] [--causal]

Each run is a new Python process that imports torch and facodegen, makes its inputs and
initialises CUDA (a torch op and a synchronize, outside the timed region), then times the
first attention() call up to its completion (torch.cuda.synchronize). One warm-up process
fills the cache first. Prints one line per run and the median last.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys

CHILD = r"""
import sys, time
import torch
import facodegen
b, sq, sk, hq, hkv, d = (int(x) for x in sys.argv[1].split(","))
causal = sys.argv[2] == "1"
q = torch.randn(b, sq, hq, d, device="cuda", dtype=torch.bfloat16)
k, v = (torch.randn(b, sk, hkv, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
torch.cuda.synchronize()
start = time.perf_counter()
facodegen.attention(q, k, v, causal=causal)
torch.cuda.synchronize()
first = time.perf_counter() - start
start = time.perf_counter()
facodegen.attention(q, k, v, causal=causal)
torch.cuda.synchronize()
second = time.perf_counter() - start
print(f"{1e3 * first:.2f} {1e3 * second:.2f} {'cupy' if 'cupy' in sys.modules else 'no-cupy'}")
"""


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--shape", default="1,2048,2048,16,16,128", help="batch,seqlen_q,seqlen_k,heads_q,heads_kv,d")
    p.add_argument("--causal", action="store_true")
    args = p.parse_args()
    argv = [sys.executable, "-c", CHILD, args.shape, "1" if args.causal else "0"]
    warm = subprocess.run(argv, capture_output=True, text=True)
    if warm.returncode:
        print(warm.stderr, file=sys.stderr)
        return 1
    firsts = []
    for i in range(args.runs):
        done = subprocess.run(argv, capture_output=True, text=True)
        if done.returncode:
            print(done.stderr, file=sys.stderr)
            return 1
        first, second, modules = done.stdout.split()
        firsts.append(float(first))
        print(f"run {i}: first call {first} ms, second {second} ms ({modules})", flush=True)
    print(f"first call of a cached kernel in a fresh process, shape {args.shape} causal={args.causal}: "
          f"median {statistics.median(firsts):.2f} ms over {args.runs} runs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
