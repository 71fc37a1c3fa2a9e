"""Time the attention backward on a GPU: facodegen's generated backward against torch SDPA's cuDNN
and flash (FlashAttention-2) backends, in the same run, over the FlashAttention-3 paper's grid
(16k tokens per batch: batch = 16384 / seqlen; hidden 2048: heads = 2048 / head_dim; bf16).

Each peer runs its forward once (retain_graph) and then ``torch.autograd.grad`` of the output, timed
with CUDA events after a warm-up; the median of the timed runs counts. Backward FLOPs =
2.5 x the forward's 4 * batch * heads * seqlen_q * seqlen_k * head_dim (half of it causal).
Prints a markdown table of TFLOP/s and facodegen's ratio to each peer; writes JSON under --out.

    python scripts/bench_backward.py --head-dims 64,128 --seqlens 1024,4096 --out results/
    python scripts/bench_backward.py --quick          # seqlen 2k and 8k: fits a 3-minute device call
    python scripts/bench_backward.py --quick --peers facodegen --variant k_unroll=1 --variant k_unroll=2

``--variant knob=value[,knob=value]`` (repeatable) adds a column per backward-spec variant, timed
through ``facodegen.attention_backward(..., **knobs)`` on the forward's O and LSE (no autograd).

Import-safe without a GPU (the pure parts are tested in tests/test_bench_backward.py).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

HEAD_DIMS = (64, 128, 256)
SEQLENS = (512, 1024, 2048, 4096, 8192, 16384)
TOTAL_TOKENS = 16384
HIDDEN = 2048
PEERS = ("facodegen", "cudnn", "flash")
_SDPA = {"cudnn": "CUDNN_ATTENTION", "flash": "FLASH_ATTENTION"}


def grid(head_dims=HEAD_DIMS, seqlens=SEQLENS, causals=(False, True)) -> list[dict]:
    """The FA3-paper cells: batch = 16384 / seqlen, heads = 2048 / head_dim."""
    return [{"head_dim": d, "causal": c, "seqlen": s, "batch": max(1, TOTAL_TOKENS // s), "heads": HIDDEN // d}
            for d in head_dims for c in causals for s in seqlens]


def backward_flops(batch: int, heads: int, seqlen_q: int, seqlen_k: int, head_dim: int, causal: bool) -> float:
    """2.5 x the forward's 4 b h sq sk d (two GEMMs forward, five backward); causal: half."""
    flops = 2.5 * 4.0 * batch * heads * seqlen_q * seqlen_k * head_dim
    return flops / 2 if causal else flops


def tflops(cell: dict, ms: float | None) -> float | None:
    if not ms:
        return None
    flops = backward_flops(cell["batch"], cell["heads"], cell["seqlen"], cell["seqlen"], cell["head_dim"],
                           cell["causal"])
    return flops / (ms * 1e-3) / 1e12


def markdown(rows: list[dict]) -> str:
    """| d | causal | seqlen | facodegen | cudnn | flash | vs cudnn | vs flash | (TFLOP/s), and a geomean row."""
    head = "| head_dim | causal | seqlen | facodegen | cuDNN | FA2 (SDPA flash) | vs cuDNN | vs FA2 |"
    lines = [head, "|---|---|---|---|---|---|---|---|"]
    ratios = {"cudnn": [], "flash": []}
    fmt = lambda x: "–" if x is None else f"{x:.1f}"  # noqa: E731
    for r in rows:
        t = r["tflops"]
        cells = []
        for peer in ("cudnn", "flash"):
            if t.get("facodegen") and t.get(peer):
                ratio = t["facodegen"] / t[peer]
                ratios[peer].append(ratio)
                cells.append(f"{ratio:.2f}x")
            else:
                cells.append("–")
        lines.append(f"| {r['head_dim']} | {'yes' if r['causal'] else 'no'} | {r['seqlen']} | "
                     f"{fmt(t.get('facodegen'))} | {fmt(t.get('cudnn'))} | {fmt(t.get('flash'))} | "
                     f"{cells[0]} | {cells[1]} |")
    geo = [f"{statistics.geometric_mean(v):.2f}x" if v else "–" for v in (ratios["cudnn"], ratios["flash"])]
    lines.append(f"| geomean | | | | | | {geo[0]} | {geo[1]} |")
    return "\n".join(lines)


def variants_markdown(rows: list[dict], labels: list[str]) -> str:
    """TFLOP/s of each --variant column beside facodegen's autograd backward."""
    lines = ["| head_dim | causal | seqlen | facodegen (autograd) | " + " | ".join(labels) + " |",
             "|---|---|---|---|" + "---|" * len(labels)]
    fmt = lambda x: "–" if x is None else f"{x:.1f}"  # noqa: E731
    for r in rows:
        t = r["tflops"]
        lines.append(f"| {r['head_dim']} | {'yes' if r['causal'] else 'no'} | {r['seqlen']} | "
                     f"{fmt(t.get('facodegen'))} | " + " | ".join(fmt(t.get(label)) for label in labels) + " |")
    return "\n".join(lines)


def parse_ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x.strip())


def parse_knobs(text: str) -> dict:
    """'k_unroll=1,block_n=64' -> {'k_unroll': 1, 'block_n': 64} (ints where they parse)."""
    knobs = {}
    for item in filter(None, text.split(",")):
        name, sep, value = item.partition("=")
        if not sep:
            raise argparse.ArgumentTypeError(f"{item!r}: expected knob=value")
        knobs[name.strip()] = int(value) if value.strip().lstrip("-").isdigit() else value.strip()
    return knobs


def variant_label(knobs: dict) -> str:
    return "facodegen[" + ",".join(f"{k}={v}" for k, v in sorted(knobs.items())) + "]"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--head-dims", type=parse_ints, default=HEAD_DIMS)
    p.add_argument("--seqlens", type=parse_ints, default=SEQLENS)
    p.add_argument("--causal", choices=("both", "yes", "no"), default="both")
    p.add_argument("--peers", default=",".join(PEERS), help="comma-separated subset of " + ",".join(PEERS))
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--quick", action="store_true", help="seqlen 2048 and 8192 only (about a minute)")
    p.add_argument("--out", type=Path, help="folder for bench_backward.json")
    p.add_argument("--variant", action="append", default=[], type=parse_knobs,
                   help="backward knobs to time as an extra column, e.g. k_unroll=1,block_n=64 (repeatable)")
    args = p.parse_args(argv)
    if args.quick:
        args.seqlens = (2048, 8192)
    args.causals = {"both": (False, True), "yes": (True,), "no": (False,)}[args.causal]
    args.peers = tuple(x for x in args.peers.split(",") if x)
    unknown = set(args.peers) - set(PEERS)
    if unknown:
        p.error(f"--peers: unknown {', '.join(sorted(unknown))}")
    return args


# ------------------------------------------------------------------ GPU part

def _forward(peer: str, q, k, v, causal: bool):
    """The peer's forward on (batch, seqlen, heads, head_dim) tensors that require grad."""
    import torch
    if peer == "facodegen":
        import facodegen
        return facodegen.attention(q, k, v, causal=causal)
    from torch.nn.attention import SDPBackend, sdpa_kernel
    with sdpa_kernel(getattr(SDPBackend, _SDPA[peer])):
        out = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal)
    return out.transpose(1, 2)


def time_backward(peer: str, cell: dict, warmup: int, iters: int) -> float:
    """Median ms of torch.autograd.grad(out, (q, k, v), do) for the peer (forward once, retained)."""
    import torch
    shape = (cell["batch"], cell["seqlen"], cell["heads"], cell["head_dim"])
    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16).requires_grad_(True) for _ in range(3))
    do = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    out = _forward(peer, q, k, v, cell["causal"])
    times = []
    for i in range(warmup + iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.autograd.grad(out, (q, k, v), do, retain_graph=True)
        end.record()
        end.synchronize()
        if i >= warmup:
            times.append(start.elapsed_time(end))
    return statistics.median(times)


def time_direct(cell: dict, knobs: dict, warmup: int, iters: int) -> float:
    """Median ms of facodegen.attention_backward(**knobs) on the forward's O and LSE."""
    import torch

    import facodegen
    shape = (cell["batch"], cell["seqlen"], cell["heads"], cell["head_dim"])
    q, k, v, do = (torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    out, lse = facodegen.attention(q, k, v, causal=cell["causal"], return_lse=True)
    times = []
    for i in range(warmup + iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        facodegen.attention_backward(do, q, k, v, out, lse, causal=cell["causal"], **knobs)
        end.record()
        end.synchronize()
        if i >= warmup:
            times.append(start.elapsed_time(end))
    return statistics.median(times)


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch
    if not torch.cuda.is_available():
        print("bench_backward: needs a CUDA GPU", file=sys.stderr)
        return 2
    rows = []
    t0 = time.monotonic()
    for cell in grid(args.head_dims, args.seqlens, args.causals):
        row = dict(cell, ms={}, tflops={}, errors={})
        for peer in args.peers:
            try:
                ms = time_backward(peer, cell, args.warmup, args.iters)
                row["ms"][peer], row["tflops"][peer] = ms, tflops(cell, ms)
            except Exception as err:  # noqa: BLE001 (a peer that cannot run this cell is reported, not fatal)
                row["errors"][peer] = f"{type(err).__name__}: {err}"[:300]
        for knobs in args.variant:
            label = variant_label(knobs)
            try:
                ms = time_direct(cell, knobs, args.warmup, args.iters)
                row["ms"][label], row["tflops"][label] = ms, tflops(cell, ms)
            except Exception as err:  # noqa: BLE001
                row["errors"][label] = f"{type(err).__name__}: {err}"[:300]
        rows.append(row)
        t = row["tflops"]
        print(f"hd{cell['head_dim']} {'causal' if cell['causal'] else 'full'} s{cell['seqlen']}: "
              + ", ".join(f"{p} {t[p]:.1f}" for p in t) + (f" errors {row['errors']}" if row["errors"] else ""),
              file=sys.stderr, flush=True)
    table = markdown(rows)
    if args.variant:
        table += "\n\n" + variants_markdown(rows, [variant_label(k) for k in args.variant])
    print(table)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        device = torch.cuda.get_device_name()
        path = args.out / "bench_backward.json"
        path.write_text(json.dumps({"device": device, "torch": torch.__version__, "seconds": time.monotonic() - t0,
                                    "rows": rows, "table": table}, indent=1) + "\n")
        print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
