"""#40's head-dim cells at 16k keys on the GPU (batch 1, heads = 2048 // d, bf16): facodegen.attention
with its default beside knob variants (block_n, pingpong) and FlashAttention-3's flash_attn_func, timed
in turns (timing.time_cuda_interleaved, 7 groups of 10 calls); ms and FA3 / each in brackets. The
evidence of the 176-key rule in docs/seqlen-rules.md (H200, 2026-12-04, session 35).

    python3 scripts/hd16k_sweep.py
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import torch, facodegen
from facodegen.bench.timing import time_cuda_interleaved
from facodegen.bench.peers import _fa3_module
fa3, _ = _fa3_module()
VARIANTS = {80: [dict(block_n=128), dict(block_n=112), dict(block_n=176), dict(pingpong=False)],
            96: [dict(block_n=128), dict(block_n=112), dict(block_n=176), dict(pingpong=False)],
            112: [dict(block_n=128), dict(block_n=112), dict(block_n=176), dict(pingpong=True)]}
for d in (80, 96, 112):
    h = 2048 // d
    for causal in (False, True):
        s = 16384
        q, k, v = (torch.randn(1, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        names, fns = ["default"], [lambda: facodegen.attention(q, k, v, causal=causal)]
        for var in VARIANTS[d]:
            try:
                facodegen.attention(q, k, v, causal=causal, **var)
            except Exception as e:  # noqa
                print(f"  d{d} {var}: {type(e).__name__}: {str(e)[:120]}"); continue
            names.append(",".join(f"{a}={b}" for a, b in var.items()))
            fns.append(lambda var=var: facodegen.attention(q, k, v, causal=causal, **var))
        names.append("fa3"); fns.append(lambda: fa3.flash_attn_func(q, k, v, causal=causal))
        torch.cuda.synchronize()
        r = time_cuda_interleaved(fns, groups=7, calls=10)
        ref = r[-1]["ms"]
        print(f"| d{d} {'causal' if causal else 'full'} 16k | " + " | ".join(
            f"{n} {x['ms']:.3f} ({ref / x['ms']:.3f})" for n, x in zip(names, r)) + " |", flush=True)
