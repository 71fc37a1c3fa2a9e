"""GPU diagnostic for issue 38: torch.autograd.grad through facodegen.attention against
facodegen.attention_backward on the same tensors (bf16 FA3-paper cells), in two parts:

1. ``profile`` (the default): for two cells, the CUDA kernels each path launches over five calls
   (torch.profiler: count, mean device time, name), so an extra kernel or a slower launch shows.
2. ``--gaps``: for three cells, 3 rounds in turns of 20 back-to-back calls of each path between CUDA
   events after 3 of warm-up: GPU µs and host µs per call; then torch's sync debug mode over one call
   of each (an empty list: no synchronizing torch op).

H200, 2026-12-04 (session 35): both paths launch the same three kernels with the same device times
(hd128 causal 2k: 797.0 / 79.0 / 57.6 µs autograd, 794.5 / 79.2 / 57.2 direct); with 20 calls a group
autograd reads 1.00-1.01x the direct call's GPU time, with ~200 µs of host per autograd call against
~50-80 direct. So the 2-11% gap scripts/bwd_ab.py measured in session 34 was its 3 calls per group,
which put autograd's host hand-off before the first kernel on the clock.

3. ``--peers``: the kernel lists of part 1 for cuDNN's and FlashAttention-2's backward too (torch SDPA's
   CUDNN_ATTENTION and FLASH_ATTENTION backends through autograd on the same tensors, (batch, heads,
   seqlen, head_dim) views), over the cells where facodegen loses most to cuDNN (head_dim 64 and 128 at
   512 keys, head_dim 128 causal at 2k, head_dim 256 at 2k): whether cuDNN pays a preprocess (D, a
   zeroed dQ accumulator) and a dQ conversion as facodegen does (79 + 57.6 µs of 933 at hd128 causal 2k),
   and what its main kernel takes beside facodegen's.

    python3 scripts/bwd_autograd_profile.py [--gaps | --peers]
"""
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import torch
import facodegen
from torch.profiler import profile, ProfilerActivity


def arms(d: int, causal: bool, s: int, peers: bool = False) -> dict:
    """The two callables of one FA3-paper cell (16k tokens, hidden 2048): autograd through
    attention() on a retained graph, and attention_backward on the same O and LSE; with ``peers``
    SDPA's cuDNN and flash backends' autograd backward on the same tensors too."""
    b, h = 16384 // s, 2048 // d
    shape = (b, s, h, d)
    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16).requires_grad_(True) for _ in range(3))
    do = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    out = facodegen.attention(q, k, v, causal=causal)
    qd, kd, vd = q.detach(), k.detach(), v.detach()
    o2, lse = facodegen.attention(qd, kd, vd, causal=causal, return_lse=True)
    fns = {"autograd": lambda: torch.autograd.grad(out, (q, k, v), do, retain_graph=True),
           "direct": lambda: facodegen.attention_backward(do, qd, kd, vd, o2, lse, causal=causal)}
    if peers:
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel
        for name, backend in (("cuDNN", SDPBackend.CUDNN_ATTENTION), ("FA2", SDPBackend.FLASH_ATTENTION)):
            qt, kt, vt = (x.detach().transpose(1, 2).requires_grad_(True) for x in (q, k, v))
            with sdpa_kernel(backend):
                peer_out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
            fns[name] = (lambda o=peer_out, ins=(qt, kt, vt), g=do.transpose(1, 2):
                         torch.autograd.grad(o, ins, g, retain_graph=True))
    return fns


PROFILE_CELLS = ((128, True, 2048), (64, False, 8192))
PEER_CELLS = ((64, False, 512), (128, False, 512), (128, True, 2048), (256, False, 2048))


def kernel_lists(cells=PROFILE_CELLS, peers: bool = False) -> None:
    for d, causal, s in cells:
        for name, fn in arms(d, causal, s, peers).items():
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


def gaps() -> None:
    for d, causal, s in ((128, True, 2048), (128, True, 8192), (64, True, 2048)):
        fns, res = arms(d, causal, s), {}
        for _ in range(3):
            for name, fn in fns.items():
                for _ in range(3):
                    fn()
                torch.cuda.synchronize()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                t0 = time.perf_counter()
                start.record()
                for _ in range(20):
                    fn()
                t1 = time.perf_counter()
                end.record()
                end.synchronize()
                res.setdefault(name, []).append((start.elapsed_time(end) / 20 * 1e3, (t1 - t0) / 20 * 1e6))
        print(f"d{d} causal={causal} s{s}: " + "; ".join(
            f"{n}: gpu {[round(a) for a, _ in r]} host {[round(b) for _, b in r]}" for n, r in res.items()), flush=True)
    torch.cuda.set_sync_debug_mode("warn")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for fn in fns.values():
            fn()
        torch.cuda.synchronize()
    print("sync warnings:", [str(x.message)[:200] for x in caught])


if __name__ == "__main__":
    if "--gaps" in sys.argv[1:]:
        gaps()
    elif "--peers" in sys.argv[1:]:
        kernel_lists(PEER_CELLS, peers=True)
    else:
        kernel_lists()
