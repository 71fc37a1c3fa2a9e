"""The variants suite (`facodegen bench --suite variants`, scripts/bench_variants.py): the attention
variants of issue 40 timed on the GPU, bf16, causal, head_dim 128, 16k tokens per batch and hidden
2048 (grids.TOKENS_PER_BATCH, grids.HIDDEN: batch = 16384 / seqlen, 16 heads).

* window (4096, 0) at seqlen 4k and 16k: facodegen's window kernel beside FlashAttention-3's
  ``flash_attn_interface.flash_attn_func(..., window_size=(4096, 0))`` (skipped where the module is
  missing) and beside facodegen's own full causal kernel (the ideal speed-up is the ratio of
  visible (query, key) pairs, printed as `ideal`);
* softcap 50 and sinks: facodegen with each beside facodegen without it (and FA3's softcap where
  its module takes one);
* the same three in fp8 (e4m3 with per-tensor descales, O in bf16) at seqlen 16k (fp8_cells), beside
  FlashAttention-3's fp8 call with the same window (and softcap, where it takes one);
* head dims without a tile of their own (80, 96's neighbours 112, ...) and V narrower than Q/K
  (192/128, DeepSeek MLA prefill), causal and not, at seqlen 1k, 4k and 16k (HEAD_DIM_CELLS, 16k
  tokens, heads = 2048 // head_dim): facodegen beside FlashAttention-3 on the same shapes, whose
  wheel takes head dims 8..256 and 192/128.

Each group of implementations is timed in turns (timing.time_cuda_interleaved: CUDA events,
warm-up, the median of groups of back-to-back calls; ``quick``: QUICK_TIMING) through the call users
make (``facodegen.attention``). Results are time ratios (FLOPs differ between variants).
(facodegen's own spec variants as the forward suites time them are variants.py's.) The pure parts
(cells, visible-pair counts, ratios, the table) import without torch."""

from __future__ import annotations

import json

from .grids import HIDDEN, TOKENS_PER_BATCH

SEQLENS = (4096, 16384)
QUICK_TIMING = {"warmup": 2, "groups": 3, "calls": 5}

HEAD_DIM = 128
TOKENS = TOKENS_PER_BATCH
HEADS = HIDDEN // HEAD_DIM       # 16
WINDOW = (4096, 0)
SOFTCAP = 50.0
# (head_dim, head_dim_v) of the head-dim rows: issue 40's bar is >= 1.0x FlashAttention-3 on each
HEAD_DIMS = ((80, 80), (96, 96), (112, 112), (192, 128))
HEAD_DIM_SEQLENS = (1024, 4096, 16384)
FP8_SEQLENS = (16384,)


def cells(seqlens=SEQLENS) -> list[dict]:
    """The measured problems: per seqlen the window row, then softcap and sinks at the same shape."""
    out = []
    for s in seqlens:
        base = dict(seqlen=s, batch=max(1, TOKENS // s), heads=HEADS, head_dim=HEAD_DIM)
        out.append(dict(base, variant="window", window_size=WINDOW))
        out.append(dict(base, variant="softcap", softcap=SOFTCAP))
        out.append(dict(base, variant="sinks"))
    return out


def fp8_cells(seqlens=FP8_SEQLENS) -> list[dict]:
    """cells() in e4m3 (dtype "fp8"): window, softcap and sinks per seqlen."""
    return [dict(cell, dtype="fp8") for cell in cells(seqlens)]


def head_dim_cells(seqlens=HEAD_DIM_SEQLENS, head_dims=HEAD_DIMS) -> list[dict]:
    """The head-dim rows: each (head_dim, head_dim_v) x causal no/yes x seqlen, 16k tokens per batch."""
    return [dict(seqlen=s, batch=max(1, TOKENS // s), heads=HIDDEN // d, head_dim=d, head_dim_v=dv,
                 causal=causal, variant="head_dim")
            for d, dv in head_dims for causal in (False, True) for s in seqlens]


def label(row: dict) -> str:
    """A row's variant as the table names it: head_dim rows say their dims and mask."""
    if row["variant"] != "head_dim":
        return f"fp8 {row['variant']}" if row.get("dtype") == "fp8" else row["variant"]
    dims = f"{row['head_dim']}" if row["head_dim_v"] == row["head_dim"] else f"{row['head_dim']}/{row['head_dim_v']}"
    return f"d{dims} {'causal' if row['causal'] else 'full'}"


def visible_pairs(seqlen_q: int, seqlen_k: int, window=(-1, -1), causal: bool = False) -> int:
    """(query, key) pairs a bottom-right aligned window (FlashAttention's (left, right), -1 unbounded)
    leaves visible: the work the kernels must do."""
    left, right = window
    if causal:
        right = 0
    total = 0
    for i in range(seqlen_q):
        d = i + seqlen_k - seqlen_q
        lo = 0 if left < 0 else max(0, d - left)
        hi = seqlen_k - 1 if right < 0 else min(seqlen_k - 1, d + right)
        total += max(0, hi - lo + 1)
    return total


def ideal_window_speedup(seqlen: int, window=WINDOW) -> float:
    """Full causal's visible pairs over the window's: what skipping every hidden tile could give."""
    return visible_pairs(seqlen, seqlen, (-1, 0)) / visible_pairs(seqlen, seqlen, window)


def ratios(row: dict) -> dict:
    """Time ratios of one measured row (>1: the named one is faster, except `cost`, the variant's
    time over the plain kernel's)."""
    ms = row["ms"]
    out = {}
    if row["variant"] == "head_dim":
        if ms.get("fa3_head_dim") and ms.get("facodegen_head_dim"):
            out["vs_fa3"] = ms["fa3_head_dim"] / ms["facodegen_head_dim"]
        return out
    if row["variant"] == "window":
        if ms.get("fa3_window"):
            out["vs_fa3_window"] = ms["fa3_window"] / ms["facodegen_window"]
        out["vs_own_full_causal"] = ms["facodegen_full_causal"] / ms["facodegen_window"]
        out["ideal"] = ideal_window_speedup(row["seqlen"])
    else:
        name = f"facodegen_{row['variant']}"
        out["cost"] = ms[name] / ms["facodegen_plain"]
        if ms.get(f"fa3_{row['variant']}") and ms.get("fa3_plain"):
            out["fa3_cost"] = ms[f"fa3_{row['variant']}"] / ms["fa3_plain"]
            out["vs_fa3"] = ms[f"fa3_{row['variant']}"] / ms[name]
    return out


def format_table(rows: list[dict]) -> str:
    lines = ["| variant | seqlen | batch | ms (facodegen) | peers (ms) | ratios |", "|---|---|---|---|---|---|"]
    for row in rows:
        ms = row["ms"]
        ours = ms.get(f"facodegen_{row['variant']}")
        peers = ", ".join(f"{k} {v:.3f}" for k, v in ms.items() if k != f"facodegen_{row['variant']}" and v)
        rat = ", ".join(f"{k} {v:.2f}x" if k != "cost" and k != "fa3_cost" else f"{k} {v:.3f}"
                        for k, v in ratios(row).items())
        lines.append(f"| {label(row)} | {row['seqlen']} | {row['batch']} | "
                     f"{'' if ours is None else f'{ours:.3f}'} | {peers} | {rat} |")
    for note in sorted({n for row in rows for n in row.get("notes", ())}):
        lines.append(f"\n{note}")
    return "\n".join(lines)


# ------------------------------------------------------------------ the GPU part

def _fa3():
    from .peers import _fa3_module
    mod, err = _fa3_module()
    return mod, (None if mod is not None else f"FlashAttention-3 skipped: flash_attn_interface not importable ({err})")


def _fa3_call(fa3, q, k, v, causal=True, **kwargs):
    out = fa3.flash_attn_func(q, k, v, causal=causal, **kwargs)
    return out[0] if isinstance(out, tuple) else out


def measure(cell: dict, quick: bool = False) -> dict:
    import torch

    import facodegen

    from .timing import time_cuda_interleaved
    gen = torch.Generator(device="cuda").manual_seed(0)
    shape = (cell["batch"], cell["seqlen"], cell["heads"], cell["head_dim"])
    q, k, v = (torch.randn(shape, generator=gen, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    if cell.get("head_dim_v", cell["head_dim"]) != cell["head_dim"]:
        v = torch.randn(shape[:3] + (cell["head_dim_v"],), generator=gen, device="cuda", dtype=torch.bfloat16)
    sinks = torch.randn(cell["heads"], generator=gen, device="cuda") if cell["variant"] == "sinks" else None
    ours, theirs = {}, {}       # fp8: each call's descales (FlashAttention-3 takes them per (batch, kv head))
    if cell.get("dtype") == "fp8":
        (q, qd), (k, kd), (v, vd) = (facodegen.quantize_e4m3(x) for x in (q, k, v))
        ours = dict(q_descale=qd, k_descale=kd, v_descale=vd)
        theirs = {n: d.reshape(1, 1).expand(shape[0], shape[2]).contiguous() for n, d in ours.items()}

    def attention(**kwargs):
        return facodegen.attention(q, k, v, **ours, **kwargs)
    fa3, why = _fa3()
    notes = [why] if why else []
    fns = {}
    if cell["variant"] == "head_dim":
        fns["facodegen_head_dim"] = lambda: attention(causal=cell["causal"])
        if fa3 is not None:
            fns["fa3_head_dim"] = lambda: _fa3_call(fa3, q, k, v, causal=cell["causal"], **theirs)
    elif cell["variant"] == "window":
        fns["facodegen_window"] = lambda: attention(causal=True, window_size=cell["window_size"])
        fns["facodegen_full_causal"] = lambda: attention(causal=True)
        if fa3 is not None:
            fns["fa3_window"] = lambda: _fa3_call(fa3, q, k, v, window_size=cell["window_size"], **theirs)
    else:
        fns["facodegen_plain"] = lambda: attention(causal=True)
        if cell["variant"] == "softcap":
            fns["facodegen_softcap"] = lambda: attention(causal=True, softcap=cell["softcap"])
            if fa3 is not None:
                fns["fa3_plain"] = lambda: _fa3_call(fa3, q, k, v, **theirs)
                fns["fa3_softcap"] = lambda: _fa3_call(fa3, q, k, v, softcap=cell["softcap"], **theirs)
        else:
            fns["facodegen_sinks"] = lambda: attention(causal=True, sinks=sinks)
    usable = {}
    for name, fn in fns.items():          # a peer that fails is noted and left out, not fatal
        try:
            fn()
            usable[name] = fn
        except Exception as err:  # noqa: BLE001
            notes.append(f"{name} skipped: {type(err).__name__}: {err}")
    torch.cuda.synchronize()
    check = {}
    for ours_name, fa3_name in (("facodegen_window", "fa3_window"), ("facodegen_head_dim", "fa3_head_dim")):
        if fa3_name in usable and ours_name in usable:   # the two agree (same bf16 inputs; `ours` is the closures')
            check["max_abs_diff_vs_fa3"] = (usable[ours_name]().float()
                                            - usable[fa3_name]().float()).abs().max().item()
    kwargs = dict(QUICK_TIMING) if quick else {}
    timed = time_cuda_interleaved(list(usable.values()), **kwargs)
    row = dict(cell, ms={name: t["ms"] for name, t in zip(usable, timed)},
               host_ms={name: t["host_ms"] for name, t in zip(usable, timed)}, notes=notes, check=check)
    row["ratios"] = ratios(row)
    return row


def run_variants(todo: list[dict], quick: bool = False, log=print) -> list[dict]:
    """measure over the cells, one row each."""
    rows = []
    for cell in todo:
        rows.append(measure(cell, quick))
        log(f"{label(cell)} s{cell['seqlen']}: " + ", ".join(f"{k} {v:.3f} ms" for k, v in rows[-1]["ms"].items()))
    return rows


def write_variants_results(rows: list[dict], out_dir, stem: str = "bench-variants", env: dict | None = None) -> dict:
    """Write <stem>.md (the table) and .json (rows, environment) into ``out_dir``."""
    from pathlib import Path

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"md": out / f"{stem}.md", "json": out / f"{stem}.json"}
    paths["md"].write_text(format_table(rows) + "\n")
    paths["json"].write_text(json.dumps({"env": env or {}, "rows": rows}, indent=1, default=str) + "\n")
    return paths
