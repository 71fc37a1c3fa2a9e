"""The sm90 backward's calls and knobs on the GPU, timed in turns (A B C ... per group, CUDA events,
7 groups of 8 calls, medians), bf16, the FA3-paper cells at head_dim 128 and 64, 2k and 8k, full
and causal: torch.autograd.grad through facodegen.attention, cuDNN's through SDPA, and
facodegen.attention_backward as given, with s_lookahead=False (both lookaheads off) and with the
defaults. Prints a markdown table of TFLOP/s (backward FLOPs = 2.5 x forward) and ratios.

    python3 scripts/bwd_ab.py
"""
import sys
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import torch
import facodegen
from facodegen.bench.backward import _forward_fn
from facodegen.bench.timing import time_cuda_interleaved

CELLS = [(128, False, 2048), (128, False, 8192), (128, True, 2048), (128, True, 8192),
         (64, False, 2048), (64, False, 8192), (64, True, 2048), (64, True, 8192)]
ARMS = ["autograd", "cudnn", "direct", "direct lookaheads off", "direct s_lookahead only"]
print("| d | causal | seqlen | " + " | ".join(ARMS) + " | direct/off | direct/cudnn | direct/autograd |")
print("|---|---|---|" + "---|" * (len(ARMS) + 3))
for d, causal, s in CELLS:
    b, h = 16384 // s, 2048 // d
    shape = (b, s, h, d)
    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16).requires_grad_(True) for _ in range(3))
    do = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    out = facodegen.attention(q, k, v, causal=causal)
    fwd_c, ctx_c = _forward_fn("cudnn", q, k, v, causal)
    with ctx_c():
        out_c = fwd_c()
    qd, kd, vd = q.detach(), k.detach(), v.detach()
    o2, lse = facodegen.attention(qd, kd, vd, causal=causal, return_lse=True)
    fns = [lambda: torch.autograd.grad(out, (q, k, v), do, retain_graph=True),
           lambda: torch.autograd.grad(out_c, (q, k, v), do, retain_graph=True),
           lambda: facodegen.attention_backward(do, qd, kd, vd, o2, lse, causal=causal),
           lambda: facodegen.attention_backward(do, qd, kd, vd, o2, lse, causal=causal, s_lookahead=False),
           lambda: facodegen.attention_backward(do, qd, kd, vd, o2, lse, causal=causal, s_lookahead=True,
                                                dp_lookahead=False)]
    ctxs = [None, ctx_c, None, None, None]
    import contextlib
    ctxs = [c or contextlib.nullcontext for c in ctxs]
    res = time_cuda_interleaved(fns, warmup=3, groups=7, calls=8, contexts=ctxs)   # (8: autograd's host hand-off off the clock)
    flops = 2.5 * 4 * b * h * s * s * d / (2 if causal else 1)
    tf = [flops / (r["ms"] * 1e-3) / 1e12 for r in res]
    print(f"| {d} | {'yes' if causal else 'no'} | {s} | " + " | ".join(f"{x:.1f}" for x in tf)
          + f" | {tf[2] / tf[3]:.3f} | {tf[2] / tf[1]:.3f} | {tf[2] / tf[0]:.3f} |", flush=True)
    torch.cuda.empty_cache()
