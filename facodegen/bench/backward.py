"""The backward suite (`facodegen bench --suite fa3-paper --backward`, scripts/bench_backward.py):
facodegen's generated backward against torch SDPA's cuDNN and flash (FlashAttention-2) backends'
backward, in the same run, over the FlashAttention-3 paper's grid (grids.paper_cell: 16k tokens per
batch, hidden 2048), bf16 by default.

* Backward (``mode="backward"``): each implementation runs its forward once (autograd recording,
  the graph retained), then ``torch.autograd.grad(out, (q, k, v), do)`` is timed. FLOPs = 2.5 x the
  forward's (grids.attention_flops: two GEMMs forward, five backward).
* Forward + backward (``mode="fwd-bwd"``): the forward and its ``torch.autograd.grad`` together in
  each timed call, FLOPs = 3.5 x the forward's.
* Variants: ``{"k_unroll": 1, ...}`` knob dicts each add a column, ``facodegen.attention_backward(...,
  **knobs)`` on the forward's O and LSE (no autograd; backward mode only).

Timing: timing.time_cuda with ``warmup`` calls, then ``iters`` groups of one call each, the median
(3 and 10 by default); the implementations one after the other, each on fresh randn inputs. facodegen
runs through its public call (``facodegen.attention`` under autograd), the peers through SDPA
(peers._peer_fn: (b, h, s, d) views, the backend chosen around the forward).

Rows are the package's (grids.paper_cell + ``results``), so results.write_results writes them
(.md, .csv, .json, .png); backward_table adds the ratio to each peer and their geomeans. The pure
parts import without torch."""

from __future__ import annotations

import statistics
import time

from .grids import FA3_SEQLENS, attention_flops, paper_cell, tflops
from .variants import knob_values, variant_label

HEAD_DIMS = (64, 128, 256)
# Not the paper's, timed only when --head-dim names one: the paper grid's shapes at that d (16k tokens,
# hidden ~2048: 2048 // d heads).
OTHER_HEAD_DIMS = (96, 192)
SEQLENS = FA3_SEQLENS
QUICK_SEQLENS = (2048, 8192)
FACODEGEN = "facodegen"
BACKWARD_PEERS = ("cudnn", "fa2")          # peers.PEER_TITLES names (SDPA's backends)
PEER_ALIASES = {"flash": "fa2"}            # scripts/bench_backward.py's name for SDPA's flash backend
WARMUP = 3
ITERS = 10
# calls between a group's two CUDA events. One call per group put the host's work before the first
# kernel on the clock with the GPU idle: torch.autograd.grad's engine hand-off and the op's own host
# path, ~150-200 µs for facodegen's and SDPA's alike (scripts/host_cost_breakdown.py), which read as
# 8-10% of a 1 ms backward (hd128 causal 2k: autograd 317 TFLOP/s against 350 for the same kernels
# called directly, H200 2026-12-04) though a training step queues its kernels ahead of the GPU. Five
# back to back keep the GPU busy, as the forward's suites do; the host time per call is reported too.
CALLS = 5
MODES = {"backward": 2.5, "fwd-bwd": 3.5}  # mode -> FLOPs as a multiple of the forward's
DTYPES = ("bf16", "fp16")


def backward_cells(head_dims=HEAD_DIMS, seqlens=SEQLENS, causals=(False, True), dtype: str = "bf16") -> list[dict]:
    """The FA3-paper cells (grids.paper_cell: batch = 16384 / seqlen, heads = 2048 / head_dim)."""
    return [paper_cell(d, c, s, dtype) for d in head_dims for c in causals for s in seqlens]


def backward_flops(batch: int, heads: int, seqlen_q: int, seqlen_k: int, head_dim: int, causal: bool,
                   mode: str = "backward") -> float:
    """2.5 x the forward's 4 b h sq sk d (two GEMMs forward, five backward), 3.5 x for forward +
    backward; causal: half."""
    return MODES[mode] * attention_flops(batch, heads, seqlen_q, seqlen_k, head_dim, causal)


def cell_flops(c: dict, mode: str = "backward") -> float:
    return backward_flops(c["batch"], c["heads_q"], c["seqlen_q"], c["seqlen_k"], c["head_dim"], c["causal"], mode)


def cell_tflops(c: dict, ms: float | None, mode: str = "backward") -> float | None:
    return tflops(cell_flops(c, mode), ms) if ms else None


def peer_names(names) -> tuple[str, ...]:
    """Peers as given (flash = fa2), checked against BACKWARD_PEERS; ValueError names the unknown."""
    out = tuple(PEER_ALIASES.get(n, n) for n in names)
    unknown = sorted(set(out) - set(BACKWARD_PEERS))
    if unknown:
        raise ValueError(f"unknown backward peer(s) {', '.join(unknown)} (known: {', '.join(BACKWARD_PEERS)}, "
                         f"flash = fa2)")
    return out


def result_stem(mode: str = "backward", dtype: str = "bf16") -> str:
    """The files' stem: bench-fa3-paper-backward-bf16, bench-fa3-paper-fwd-bwd-bf16."""
    return f"bench-fa3-paper-{mode}-{dtype}"


def parse_knobs(text: str) -> dict:
    """'k_unroll=1,deterministic=true' -> {'k_unroll': 1, 'deterministic': True}, each value typed
    by its BackwardSpec knob (variants.knob_values)."""
    from ..spec.backward import BACKWARD_BY_NAME
    return knob_values(text, BACKWARD_BY_NAME, "the backward")


def _tflops_of(row: dict, name: str):
    return (row.get("results", {}).get(name) or {}).get("tflops")


def backward_table(rows: list[dict], peers=BACKWARD_PEERS) -> str:
    """| head_dim | causal | seqlen | facodegen | cuDNN | FA2 (SDPA flash) | vs cuDNN | vs FA2 | (TFLOP/s),
    and a geomean row of each ratio."""
    titles = {"cudnn": "cuDNN", "fa2": "FA2 (SDPA flash)"}
    short = {"cudnn": "cuDNN", "fa2": "FA2"}
    peers = tuple(peers)
    head = ["head_dim", "causal", "seqlen", FACODEGEN, *(titles.get(p, p) for p in peers),
            *(f"vs {short.get(p, p)}" for p in peers)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    ratios: dict = {p: [] for p in peers}
    fmt = lambda x: "–" if x is None else f"{x:.1f}"  # noqa: E731
    for r in rows:
        ours = _tflops_of(r, FACODEGEN)
        cells = [str(r["head_dim"]), "yes" if r["causal"] else "no", str(r["seqlen_q"]), fmt(ours)]
        cells += [fmt(_tflops_of(r, p)) for p in peers]
        for p in peers:
            theirs = _tflops_of(r, p)
            if ours and theirs:
                ratios[p].append(ours / theirs)
                cells.append(f"{ours / theirs:.2f}x")
            else:
                cells.append("–")
        lines.append("| " + " | ".join(cells) + " |")
    geo = [f"{statistics.geometric_mean(ratios[p]):.2f}x" if ratios[p] else "–" for p in peers]
    lines.append("| geomean |" + " |" * (2 + 1 + len(peers)) + "".join(f" {g} |" for g in geo))
    return "\n".join(lines)


def variants_table(rows: list[dict], labels: list[str]) -> str:
    """TFLOP/s of each variant column beside facodegen's autograd backward."""
    lines = ["| head_dim | causal | seqlen | facodegen (autograd) | " + " | ".join(labels) + " |",
             "|---|---|---|---|" + "---|" * len(labels)]
    fmt = lambda x: "–" if x is None else f"{x:.1f}"  # noqa: E731
    for r in rows:
        lines.append(f"| {r['head_dim']} | {'yes' if r['causal'] else 'no'} | {r['seqlen_q']} | "
                     f"{fmt(_tflops_of(r, FACODEGEN))} | " + " | ".join(fmt(_tflops_of(r, x)) for x in labels) + " |")
    return "\n".join(lines)


def full_table(rows: list[dict], peers=BACKWARD_PEERS, variants=()) -> str:
    """backward_table, then variants_table when variants were timed."""
    table = backward_table(rows, peers)
    if variants:
        table += "\n\n" + variants_table(rows, [variant_label(k) for k in variants])
    return table


# ------------------------------------------------------------------ GPU part

def _torch_dtype(dtype: str):
    import torch
    return {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]


def _forward_fn(name: str, q, k, v, causal: bool):
    """(forward callable, context factory) of an implementation on (b, s, h, d) tensors that require
    grad: facodegen's public call, or the SDPA peer's public call (peers._peer_fn)."""
    import contextlib

    if name == FACODEGEN:
        import facodegen
        return (lambda: facodegen.attention(q, k, v, causal=causal)), contextlib.nullcontext
    from .inputs import InputSet
    from .peers import _peer_fn
    return _peer_fn(name, InputSet(q, k, v), causal)


def _shape(c: dict):
    return (c["batch"], c["seqlen_q"], c["heads_q"], c["head_dim"])


def time_backward(name: str, c: dict, warmup: int = WARMUP, iters: int = ITERS, mode: str = "backward") -> dict:
    """time_cuda of torch.autograd.grad(out, (q, k, v), do) for one implementation (backward: its
    forward run once, the graph retained; fwd-bwd: the forward inside each call too)."""
    import torch

    from .timing import time_cuda
    dt = _torch_dtype(c["dtype"])
    q, k, v = (torch.randn(_shape(c), device="cuda", dtype=dt).requires_grad_(True) for _ in range(3))
    do = torch.randn(_shape(c), device="cuda", dtype=dt)
    forward, context = _forward_fn(name, q, k, v, c["causal"])
    if mode == "backward":
        with context():
            out = forward()

        def fn():
            return torch.autograd.grad(out, (q, k, v), do, retain_graph=True)
    else:
        def fn():
            with context():
                o = forward()
            return torch.autograd.grad(o, (q, k, v), do)
    return time_cuda(fn, warmup=warmup, groups=iters, calls=CALLS)


def time_direct(c: dict, knobs: dict, warmup: int = WARMUP, iters: int = ITERS) -> dict:
    """time_cuda of facodegen.attention_backward(**knobs) on the forward's O and LSE."""
    import torch

    import facodegen

    from .timing import time_cuda
    dt = _torch_dtype(c["dtype"])
    q, k, v, do = (torch.randn(_shape(c), device="cuda", dtype=dt) for _ in range(4))
    out, lse = facodegen.attention(q, k, v, causal=c["causal"], return_lse=True)
    return time_cuda(lambda: facodegen.attention_backward(do, q, k, v, out, lse, causal=c["causal"], **knobs),
                     warmup=warmup, groups=iters, calls=CALLS)


def _timed(row: dict, name: str, measure, mode: str) -> None:
    try:
        t = measure()
        row["results"][name] = {"tflops": cell_tflops(row, t["ms"], mode), "ms": t["ms"], "min_ms": t["min_ms"],
                                "max_ms": t["max_ms"], "host_ms": t["host_ms"], "note": None}
    except Exception as err:  # noqa: BLE001 (an implementation that cannot run this cell is reported, not fatal)
        row["results"][name] = {"tflops": None, "ms": None, "note": f"failed: {type(err).__name__}: {err}"[:300]}


def run_backward(cells: list[dict], peers=BACKWARD_PEERS, facodegen: bool = True, variants=(),
                 mode: str = "backward", warmup: int = WARMUP, iters: int = ITERS, log=print) -> list[dict]:
    """Time facodegen (unless ``facodegen`` is False), each peer and each variant on every cell, one
    after the other; one row per cell (the cell, ``flops``, ``mode``, ``results``)."""
    if mode not in MODES:
        raise ValueError(f"mode: {mode!r} is not one of {', '.join(MODES)}")
    if variants and mode != "backward":
        raise ValueError("variants time facodegen.attention_backward alone: backward mode only")
    rows = []
    t0 = time.monotonic()
    names = ((FACODEGEN,) if facodegen else ()) + tuple(peers)
    for i, c in enumerate(cells):
        row = dict(c, flops=cell_flops(c, mode), mode=mode, results={})
        for name in names:
            _timed(row, name, lambda: time_backward(name, c, warmup, iters, mode), mode)
        for knobs in variants:
            _timed(row, variant_label(knobs), lambda: time_direct(c, knobs, warmup, iters), mode)
        rows.append(row)
        log(f"[{i + 1}/{len(cells)}] {mode} hd{c['head_dim']} {'causal' if c['causal'] else 'full'} s{c['seqlen_q']}"
            f" ({time.monotonic() - t0:.0f} s): "
            + ", ".join(f"{n} {r['tflops']:.1f}" if r.get("tflops") is not None else f"{n} {r.get('note')}"
                        for n, r in row["results"].items()))
    return rows


def write_backward_results(rows: list[dict], out_dir, stem: str, env: dict | None = None, plot: bool = True,
                           peers=BACKWARD_PEERS, variants=()) -> dict:
    """results.write_results (.md, .csv, .json, .png of the rows) with the backward table (ratios to
    each peer, geomeans) appended to the .md; returns write_results' paths."""
    from .results import write_results
    mode = rows[0].get("mode", "backward") if rows else "backward"
    dtype = rows[0]["dtype"] if rows else "bf16"
    what = "backward" if mode == "backward" else "forward + backward"
    title = f"Attention {what} speed, {dtype} ({(env or {}).get('gpu', 'GPU')})"
    paths = write_results(rows, out_dir, stem, env=env, plot=plot, title=title)
    with open(paths["md"], "a") as f:
        f.write(f"\nTFLOP/s ({what}: FLOPs = {MODES[mode]} x the forward's) and facodegen's ratio to each peer:\n\n"
                + full_table(rows, peers, variants) + "\n")
    return paths
