"""Autograd against the direct backward call with several calls per group (issue 38): for three
bf16 FA3-paper cells, torch.autograd.grad through facodegen.attention and facodegen.attention_backward
on the same tensors, 3 rounds in turns, each 20 back-to-back calls between CUDA events after 3 of
warm-up: GPU µs per call and host µs per call; then torch's sync debug mode over one call of each
(an empty list: no synchronizing torch op). H200, 2026-12-04 (session 35): autograd 1.00-1.01x the
direct call's GPU time, ~200 µs of host per autograd call against ~50-80 direct.

    python3 scripts/bwd_autograd_gaps.py
"""
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import torch, facodegen
for d, causal, s in ((128, True, 2048), (128, True, 8192), (64, True, 2048)):
    b, h = 16384 // s, 2048 // d
    shape = (b, s, h, d)
    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16).requires_grad_(True) for _ in range(3))
    do = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    out = facodegen.attention(q, k, v, causal=causal)
    qd, kd, vd = q.detach(), k.detach(), v.detach()
    o2, lse = facodegen.attention(qd, kd, vd, causal=causal, return_lse=True)
    arms = {"autograd": lambda: torch.autograd.grad(out, (q, k, v), do, retain_graph=True),
            "direct": lambda: facodegen.attention_backward(do, qd, kd, vd, o2, lse, causal=causal)}
    res = {}
    for rnd in range(3):
        for name in ("autograd", "direct"):
            fn = arms[name]
            for _ in range(3): fn()
            torch.cuda.synchronize()
            st, en = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t0 = time.perf_counter(); st.record()
            for _ in range(20): fn()
            t1 = time.perf_counter(); en.record(); en.synchronize()
            res.setdefault(name, []).append((st.elapsed_time(en) / 20 * 1e3, (t1 - t0) / 20 * 1e6))
    print(f"d{d} causal={causal} s{s}: " + "; ".join(f"{n}: gpu {[round(a) for a, _ in r]} host {[round(b_) for _, b_ in r]}" for n, r in res.items()), flush=True)
torch.cuda.set_sync_debug_mode("warn")
with warnings.catch_warnings(record=True) as w:
    warnings.simplefilter("always")
    torch.autograd.grad(out, (q, k, v), do, retain_graph=True)
    facodegen.attention_backward(do, qd, kd, vd, o2, lse, causal=causal)
    torch.cuda.synchronize()
print("sync warnings:", [str(x.message)[:200] for x in w])
