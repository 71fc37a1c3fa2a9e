"""Where sm90 varlen loses on equal lengths (issue 39), on the GPU: bf16, head_dim 64 and 128, causal
and not, 8 x 4096 and 32 x 1024 tokens: facodegen.attention (padded, persistent by default), the same
with persistent=False, and facodegen.attention_varlen on the same tokens packed, timed in turns
(timing.time_cuda_interleaved); TFLOP/s and ratios. H200, 2026-12-04 (session 35, before varlen was
persistent): varlen 0.88-1.03x the one-CTA padded kernel, which read 0.66-0.95x the persistent one.

    python3 scripts/varlen_vs_padded.py
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import torch
import facodegen
from facodegen.bench.timing import time_cuda_interleaved
for d in (64, 128):
    h = 2048 // d
    for causal in (False, True):
        for b, s in ((8, 4096), (32, 1024)):
            q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
            cu = torch.arange(0, (b + 1) * s, s, device="cuda", dtype=torch.int32)
            qp, kp, vp = (x.view(b * s, h, d) for x in (q, k, v))
            fns = [lambda: facodegen.attention(q, k, v, causal=causal),
                   lambda: facodegen.attention(q, k, v, causal=causal, persistent=False),
                   lambda: facodegen.attention_varlen(qp, kp, vp, cu, cu, s, s, causal=causal)]
            for f in fns: f()
            torch.cuda.synchronize()
            r = time_cuda_interleaved(fns)
            ms = [x["ms"] for x in r]
            fl = 4 * b * h * s * s * d / (2 if causal else 1)
            tf = [fl / (m * 1e-3) / 1e12 for m in ms]
            print(f"| d{d} {'causal' if causal else 'full'} {b}x{s} | persistent {tf[0]:.0f} | one-CTA {tf[1]:.0f} | varlen {tf[2]:.0f} | varlen/persistent {tf[2]/tf[0]:.3f} | varlen/one-CTA {tf[2]/tf[1]:.3f} |", flush=True)
