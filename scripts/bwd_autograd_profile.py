"""GPU diagnostic for issue 38: torch.autograd.grad through facodegen.attention ran the same sm90
backward kernels 2-11% slower than facodegen.attention_backward in the same turns (scripts/bwd_ab.py,
H200 2026-12-04). This prints, for two cells, the CUDA kernels each path launches over five calls
(torch.profiler: count, mean device time, name), so an extra kernel or a slower launch shows.
Run on the H200 (2026-12-04, session 35): both paths launch the same three kernels with the same
device times (hd128 causal 2k: 797.0 / 79.0 / 57.6 µs autograd, 794.5 / 79.2 / 57.2 direct). The gap was
the timing's: bwd_ab.py took 3 calls per group, so autograd's ~150-200 µs host hand-off before the first
kernel was on the clock; with 20 calls per group autograd reads 1.00-1.01x the direct call.

    python3 scripts/bwd_autograd_profile.py
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import torch
import facodegen
from torch.profiler import profile, ProfilerActivity

for d, causal, s in ((128, True, 2048), (64, False, 8192)):
    b, h = 16384 // s, 2048 // d
    shape = (b, s, h, d)
    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16).requires_grad_(True) for _ in range(3))
    do = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    out = facodegen.attention(q, k, v, causal=causal)
    qd, kd, vd = q.detach(), k.detach(), v.detach()
    o2, lse = facodegen.attention(qd, kd, vd, causal=causal, return_lse=True)
    arms = {"autograd": lambda: torch.autograd.grad(out, (q, k, v), do, retain_graph=True),
            "direct": lambda: facodegen.attention_backward(do, qd, kd, vd, o2, lse, causal=causal)}
    for name, fn in arms.items():
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                fn()
            torch.cuda.synchronize()
        print(f"== d{d} {'causal' if causal else 'full'} s{s} {name}")
        rows = [(e.key, e.count, e.device_time_total / max(1, e.count)) for e in prof.key_averages()
                if e.device_time_total > 0]
        for key, count, us in sorted(rows, key=lambda r: -r[2] * r[1])[:8]:
            print(f"   {count:3d} x {us:10.1f} us  {key[:110]}")
    print(flush=True)
