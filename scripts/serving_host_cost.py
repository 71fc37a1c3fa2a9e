#!/usr/bin/env python3
"""Host cost per call of the serving calls (issue 39: <= 15 µs at steady state when only the sequence
lengths change), beside FlashAttention-3's own calls and SDPA, on a GPU (torch).

    python3 scripts/serving_host_cost.py [--calls 2000]

Rows, in microseconds per call (bench.timing.time_host_per_call: ``host_us``, chunks of calls after a
synchronize so no launch waits for the GPU, and ``loop_us``, back to back):

* decode step, facodegen.attention_with_kvcache and FA3's flash_attn_with_kvcache: batch 8, one query
  token, GQA 32/8, d128, 512 keys per sequence, bf16, contiguous and paged 64; plain and return_lse;
  and facodegen's call with a knob (fused_combine=True, its default value), which takes the general
  path (_eager's key of every argument's metadata) instead of the step's fast path.
  cache_seqlens is a device tensor whose values change between calls (they do not reach the host);
  the calls alternate between two caches, as a server's steps read other memory.
* varlen prefill, facodegen.attention_varlen and FA3's flash_attn_varlen_func: 8 sequences, GQA
  32/8, d128, causal; the calls alternate between two batches of other lengths (another total of
  tokens, another max_seqlen under the same power of two: the same plan).
* torch SDPA (bf16, (1, 8, 128, 128), causal), the reference a kernel library's call is read against.

The shapes are small so the GPU keeps up with the host and the clock measures the host.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _fa3():
    from facodegen.bench.peers import _fa3_module
    mod, _ = _fa3_module()
    return mod


def rows(calls: int) -> list[tuple[str, str, dict]]:
    import torch
    import torch.nn.functional as F

    import facodegen
    from facodegen.bench.decode import Cell, make_cache
    from facodegen.bench.timing import time_host_per_call

    dev, dt = "cuda", torch.bfloat16
    timing = {"warmup": 200, "calls": calls, "repeats": 5, "chunk": 100}
    sync = torch.cuda.synchronize
    fa3 = _fa3()
    out = []

    def timed(group, name, fn):
        try:
            out.append((group, name, time_host_per_call(fn, sync, **timing)))
        except Exception as exc:  # noqa: BLE001 (a peer that refuses the call: its row says why)
            out.append((group, name, {"error": f"{type(exc).__name__}: {str(exc)[:100]}"}))

    batch, heads_q, heads_kv, d, ctx = 8, 32, 8, 128, 512
    q = torch.randn(batch, 1, heads_q, d, dtype=dt, device=dev)
    lengths = torch.randint(ctx // 2, ctx, (batch,), dtype=torch.int32, device=dev)
    for layout in ("contiguous", "paged64"):
        caches = [make_cache(torch, Cell(batch, ctx, heads_q, heads_kv, d, layout)) for _ in range(2)]
        turn = [0]

        def cache():
            turn[0] ^= 1
            return caches[turn[0]]

        for lse in (False, True):
            option = "return_lse" if lse else "plain"

            def ours(lse=lse):
                kc, vc, pt = cache()
                return facodegen.attention_with_kvcache(q, kc, vc, lengths, page_table=pt, return_lse=lse)
            timed(f"decode {layout} {option}", "facodegen.attention_with_kvcache", ours)
            if not lse:
                def general():
                    kc, vc, pt = cache()
                    return facodegen.attention_with_kvcache(q, kc, vc, lengths, page_table=pt, fused_combine=True)
                timed(f"decode {layout} {option}", "facodegen (general path: a knob given)", general)
            if fa3 is not None:
                def theirs(lse=lse):
                    kc, vc, pt = cache()
                    return fa3.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lengths, page_table=pt, causal=True,
                                                       return_softmax_lse=lse)
                timed(f"decode {layout} {option}", "FA3 flash_attn_with_kvcache", theirs)

    batches = []
    gen = torch.Generator().manual_seed(0)
    for _ in range(2):
        seqlens = torch.randint(65, 129, (8,), generator=gen)
        cu = torch.zeros(9, dtype=torch.int32)
        cu[1:] = torch.cumsum(seqlens, 0)
        total = int(cu[-1])
        batches.append((torch.randn(total, heads_q, d, dtype=dt, device=dev),
                        torch.randn(total, heads_kv, d, dtype=dt, device=dev),
                        torch.randn(total, heads_kv, d, dtype=dt, device=dev), cu.to(dev), int(seqlens.max())))
    turn = [0]

    def batch_():
        turn[0] ^= 1
        return batches[turn[0]]

    def ours_varlen():
        qv, kv, vv, cu, mx = batch_()
        return facodegen.attention_varlen(qv, kv, vv, cu, cu, mx, mx, causal=True)
    timed("varlen causal", "facodegen.attention_varlen", ours_varlen)
    if fa3 is not None:
        def theirs_varlen():
            qv, kv, vv, cu, mx = batch_()
            return fa3.flash_attn_varlen_func(qv, kv, vv, cu, cu, mx, mx, causal=True)
        timed("varlen causal", "FA3 flash_attn_varlen_func", theirs_varlen)

    qs, ks, vs = (torch.randn(1, 8, 128, 128, dtype=dt, device=dev) for _ in range(3))
    timed("reference", "torch SDPA", lambda: F.scaled_dot_product_attention(qs, ks, vs, is_causal=True))
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calls", type=int, default=2000)
    args = p.parse_args()
    import torch
    with torch.no_grad():
        table = rows(args.calls)
    print("| call | implementation | host µs | loop µs |")
    print("|---|---|---|---|")
    for group, name, r in table:
        if "error" in r:
            print(f"| {group} | {name} | – | – ({r['error']}) |")
        else:
            print(f"| {group} | {name} | {r['host_us']:.1f} | {r['loop_us']:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
