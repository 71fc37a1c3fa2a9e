"""The decode suite (`facodegen bench --suite decode`, scripts/bench_decode.py): decode bandwidth,
facodegen.attention_with_kvcache beside FlashAttention-3's flash_attn_with_kvcache (num_splits=0, its
own heuristics) and torch SDPA's flash backend (GQA through enable_gqa), in one run, one query token
per sequence, bf16, full caches (cache_seqlens = context).

Cells: batch {1, 8, 64} x context {1k, 8k, 32k, 256k} x heads q/kv {32/32, 32/8, 64/8} x d {64, 128,
256} x layout {contiguous, paged 16, paged 64, paged 256} (issue 39's grid), skipping cells whose K+V
exceed ``max_gb`` (60 GB); QUICK is a subset that runs in about 3 minutes on an H200. Effective
bandwidth = bytes of K and V read (2 x batch x context x heads_kv x d x 2) / time.

Timing: timing.time_cuda_interleaved (CUDA events, warm-up, implementations in turns group by group,
median of the group means); where one cell's K+V is under twice the L2 (inputs.L2_BYTES_DEFAULT) the
calls rotate over several caches (inputs.input_sets_needed) so no timing is of a warm L2. Each
implementation's O is checked against facodegen's reference-tested output on the first cache
(max |diff| < 2e-2) before timing. The pure parts import without torch.

CUDA-graph replay: where a cell's K+V is at most GRAPH_MAX_BYTES (the cells where a call's host
work can matter: a 2 GB read takes ~0.5 ms, 30x a call's host cost), each implementation is also
captured into a CUDA graph of one call per rotating cache and replayed, in the same interleaved
groups as the eager calls: the ``<impl>_graph`` columns, the time a server that replays its decode
step sees. Above it the eager call is already device-bound and the graph columns are left out.

Variants: ``variants`` (knob dicts of attention_with_kvcache, e.g. ``{"fused_combine": True}``;
`--variant fused_combine=1` on the command line) time facodegen with those knobs as columns of their
own, ``facodegen[fused_combine=True]``, in the same interleaved groups as the default call, so the
two are compared under the same clocks and L2 state."""

from __future__ import annotations

import csv
import io
import json
import math
import time
from dataclasses import asdict, dataclass

from .inputs import L2_BYTES_DEFAULT, input_sets_needed
from .variants import knob_values, variant_label

BATCHES = (1, 8, 64)
CONTEXTS = (1024, 8192, 32768, 262144)
HEADS = ((32, 32), (32, 8), (64, 8))
HEAD_DIMS = (64, 128, 256)
LAYOUTS = ("contiguous", "paged16", "paged64", "paged256")
GRAPH_MAX_BYTES = 2 * 10 ** 9
MAX_GB = 60.0
QUICK = {"batch": (1, 8, 64), "context": (8192, 262144), "heads": ((32, 8),), "d": (128,),
         "layout": ("contiguous", "paged64")}
FULL = {"batch": BATCHES, "context": CONTEXTS, "heads": HEADS, "d": HEAD_DIMS, "layout": LAYOUTS}
DECODE_PEERS = ("fa3", "sdpa")
IMPLS = ("facodegen", *DECODE_PEERS)
GRAPH_IMPLS = tuple(f"{impl}_graph" for impl in IMPLS)
CSV_FIELDS = ("cell", "batch", "context", "heads_q", "heads_kv", "d", "layout", "kv_bytes", "impl", "tbps", "ms",
              "host_ms", "ratio", "splits", "note")


@dataclass(frozen=True)
class Cell:
    batch: int
    context: int
    heads_q: int
    heads_kv: int
    d: int
    layout: str

    @property
    def page_size(self) -> int:
        return int(self.layout.removeprefix("paged")) if self.layout.startswith("paged") else 0

    @property
    def kv_bytes(self) -> int:
        """Bytes of K and V a decode step reads (bf16)."""
        return 2 * self.batch * self.context * self.heads_kv * self.d * 2

    @property
    def name(self) -> str:
        return f"b{self.batch} ctx{self.context} h{self.heads_q}/{self.heads_kv} d{self.d} {self.layout}"


def parse_int_list(text: str) -> tuple[int, ...]:
    """'1,8,64' or '1k,256k' -> ints (k = 1024)."""
    out = []
    for part in text.split(","):
        part = part.strip().lower()
        out.append(int(part[:-1]) * 1024 if part.endswith("k") else int(part))
    return tuple(out)


def parse_heads(text: str) -> tuple[tuple[int, int], ...]:
    """'32/32,32/8' -> ((32, 32), (32, 8))."""
    pairs = []
    for part in text.split(","):
        q, kv = part.split("/")
        pairs.append((int(q), int(kv)))
    return tuple(pairs)


def cells(batch=BATCHES, context=CONTEXTS, heads=HEADS, d=HEAD_DIMS, layout=LAYOUTS,
          max_gb: float = MAX_GB) -> list[Cell]:
    """The grid, K+V kept to max_gb (decimal GB), paged layouts only where the page divides the context."""
    bad = [x for x in layout if x not in LAYOUTS]
    if bad:
        raise ValueError(f"layout {bad[0]}: choose from {', '.join(LAYOUTS)}")
    out = []
    for b in batch:
        for ctx in context:
            for hq, hkv in heads:
                for dim in d:
                    for lay in layout:
                        cell = Cell(b, ctx, hq, hkv, dim, lay)
                        if cell.kv_bytes > max_gb * 1e9:
                            continue
                        if cell.page_size and ctx % cell.page_size:
                            continue
                        out.append(cell)
    return out


def suite_cells(quick: bool = False, head_dim: int | None = None, max_gb: float = MAX_GB) -> list[Cell]:
    """`bench --suite decode`'s cells: the full grid or QUICK, optionally one head_dim."""
    grid = dict(QUICK if quick else FULL)
    if head_dim is not None:
        grid["d"] = tuple(x for x in grid["d"] if x == head_dim)
    return cells(**grid, max_gb=max_gb)


def input_sets(kv_bytes: int, l2_bytes: int = L2_BYTES_DEFAULT) -> int:
    """Caches to rotate over so the calls do not find K/V in the L2: enough for 2 x L2, at most
    inputs.MAX_INPUT_SETS (inputs.input_sets_needed)."""
    return input_sets_needed(kv_bytes, l2_bytes)


def tbps(kv_bytes: int, ms: float | None) -> float | None:
    return None if not ms else kv_bytes / (ms * 1e-3) / 1e12


def parse_knobs(text: str) -> dict:
    """'fused_combine=1,block_n=128' -> {'fused_combine': True, 'block_n': 128}: the knobs
    attention_with_kvcache takes (kvcache.CALL_KNOBS), each typed by its DecodeSpec knob
    (variants.knob_values)."""
    from ..ops.kvcache import CALL_KNOBS
    from ..spec.decode import DECODE_KNOBS, MAX_SPLITS
    from ..spec.knobs import Knob
    knobs = {k.name: k for k in DECODE_KNOBS if k.name in CALL_KNOBS}
    # num_splits is a call argument, not a kernel knob: a fixed split count instead of the heuristic's
    knobs["num_splits"] = Knob("num_splits", "int", "key splits per sequence (0: the heuristic)",
                               choices=tuple(range(MAX_SPLITS + 1)))
    return knob_values(text, knobs, "attention_with_kvcache")


def variant_names(rows: list[dict]) -> list[str]:
    """The variant columns the rows hold, in order of first appearance."""
    return list(dict.fromkeys(name for r in rows for name in r.get("variants", ())))


def best_peer(row: dict, suffix: str = "") -> float | None:
    """The faster peer's TB/s in ``row`` (``suffix`` "_graph": of their CUDA-graph replays), or None."""
    return max([x for x in (row.get("fa3" + suffix), row.get("sdpa" + suffix)) if x], default=None)


def table(rows: list[dict]) -> str:
    """Markdown: one row per cell, TB/s of facodegen and each peer, then facodegen / peer ratios last;
    variant columns (facodegen with knobs) after facodegen's, each with its ratio to the default call;
    where any row has CUDA-graph replays, their TB/s and facodegen's replay over the best peer's."""
    variants = variant_names(rows)
    graphs = any(r.get(g) for r in rows for g in GRAPH_IMPLS)
    head = ("| cell | K+V MB | facodegen TB/s | " + "".join(f"{v} TB/s | {v} / default | " for v in variants)
            + "FA3 TB/s | SDPA flash TB/s | splits | vs FA3 | vs SDPA | vs best |"
            + (" graph: facodegen | FA3 | SDPA | vs best |" if graphs else ""))
    lines = [head, "|" + "---|" * (9 + 2 * len(variants) + 4 * graphs)]
    for r in rows:
        ours, fa3, sdpa, best = r.get("facodegen"), r.get("fa3"), r.get("sdpa"), best_peer(r)
        cols = "".join(f"{_num(r.get(v))} | {_ratio(r.get(v), ours)} | " for v in variants)
        line = (f"| {r['cell']} | {r['kv_bytes'] / 1e6:.0f} | {_num(ours)} | {cols}{_num(fa3)} | {_num(sdpa)} | "
                f"{r.get('splits', '–')} | {_ratio(ours, fa3)} | {_ratio(ours, sdpa)} | {_ratio(ours, best)} |")
        if graphs:
            ours_g, fa3_g, sdpa_g = (r.get(g) for g in GRAPH_IMPLS)
            line += f" {_num(ours_g)} | {_num(fa3_g)} | {_num(sdpa_g)} | {_ratio(ours_g, best_peer(r, '_graph'))} |"
        lines.append(line)
    return "\n".join(lines)


def _num(x) -> str:
    return f"{x:.2f}" if x else "–"


def _ratio(ours, peer) -> str:
    return f"{ours / peer:.2f}x" if ours and peer else "–"


def geomean(values) -> float | None:
    values = [v for v in values if v]
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else None


def geomeans(rows: list[dict]) -> dict:
    """peer -> geomean of facodegen / peer over the cells where both ran; "<peer>_graph" -> the same
    over CUDA-graph replays, where any."""
    out = {}
    for peer in DECODE_PEERS:
        for ours, theirs in (("facodegen", peer), ("facodegen_graph", peer + "_graph")):
            g = geomean(r[ours] / r[theirs] for r in rows if r.get(ours) and r.get(theirs))
            if g:
                out[theirs] = g
    return out


# Issue 39's decode bars: TB/s where K+V is at least BAR_MIN_BYTES, the ratio to the best peer in every
# cell, paged (pages of 64 and 256) against contiguous where K+V is at least BAR_MIN_BYTES.
BAR_TBPS = 3.4
BAR_MIN_BYTES = 64 * 10 ** 6
BAR_PEER_RATIO = 0.97
BAR_PAGED_RATIO = 0.95
BAR_PAGED_LAYOUTS = ("paged64", "paged256")


def _bar_line(label: str, values: list[tuple[str, float]], bar: float, unit: str) -> str:
    """One bar's line: how many of the (cell, value) pairs reach ``bar``, and the lowest that does not."""
    low = min(((cell, x) for cell, x in values if x < bar), key=lambda p: p[1], default=None)
    met = sum(x >= bar for _, x in values)
    return f"{label}: {met} of {len(values)} cells" + (f"; lowest {low[0]} {low[1]:.2f}{unit}" if low else "")


def bar_lines(rows: list[dict]) -> list[str]:
    """Issue 39's decode bars over the rows, one line each: the cells that miss each bar (count and
    the worst), eager, and where any row has them, as CUDA-graph replays for the TB/s bar."""
    big = [r for r in rows if r["kv_bytes"] >= BAR_MIN_BYTES and r.get("facodegen")]
    where = f"where K+V >= {BAR_MIN_BYTES // 10 ** 6} MB"
    lines = []
    for column, what in (("facodegen", "public call"), ("facodegen_graph", "CUDA-graph replays")):
        timed = [(r["cell"], r[column]) for r in big if r.get(column)]
        if timed:
            lines.append(_bar_line(f"bar >= {BAR_TBPS} TB/s {where} ({what})", timed, BAR_TBPS, ""))
    peered = [(r["cell"], r["facodegen"] / best_peer(r)) for r in rows if r.get("facodegen") and best_peer(r)]
    if peered:
        lines.append(_bar_line(f"bar >= {BAR_PEER_RATIO}x the best peer", peered, BAR_PEER_RATIO, "x"))

    def shape(r):   # a cell's shape without its layout
        return tuple(r.get(k) for k in ("batch", "context", "heads_q", "heads_kv", "d"))
    contiguous = {shape(r): r["facodegen"] for r in rows if r.get("layout") == "contiguous" and r.get("facodegen")}
    paged = [(r["cell"], r["facodegen"] / contiguous[shape(r)]) for r in big
             if r.get("layout") in BAR_PAGED_LAYOUTS and shape(r) in contiguous]
    if paged:
        lines.append(_bar_line(f"bar paged 64/256 >= {BAR_PAGED_RATIO}x contiguous {where}", paged,
                               BAR_PAGED_RATIO, "x"))
    return lines


def summary(rows: list[dict]) -> str:
    """The table, the geomean lines and issue 39's bar lines, as printed."""
    lines = [table(rows)]
    for key, g in geomeans(rows).items():
        graph = " (CUDA-graph replays)" if key.endswith("_graph") else ""
        lines.append(f"geomean facodegen / {key.removesuffix('_graph')}{graph}: {g:.3f}x")
    lines.extend(bar_lines(rows))
    return "\n\n".join(lines)


def to_csv(rows: list[dict]) -> str:
    """One record per (cell, implementation): TB/s, ms, facodegen's ratio to that peer, the note."""
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=CSV_FIELDS, lineterminator="\n")
    writer.writeheader()
    for r in rows:
        for impl in (*IMPLS, *r.get("variants", ()), *GRAPH_IMPLS):
            graph = impl.endswith("_graph")
            if r.get(impl) is None and not r.get(impl + "_note") and (graph or not r.get("error")):
                continue
            ours = r.get("facodegen_graph" if graph else "facodegen")
            ratio = ours / r[impl] if impl not in ("facodegen", "facodegen_graph") and ours and r.get(impl) else None
            rec = {k: r.get(k) for k in CSV_FIELDS[:8]}
            rec.update(impl=impl, tbps=r.get(impl), ms=r.get(impl + "_ms"), host_ms=r.get(impl + "_host_ms"),
                       ratio=ratio, splits=r.get("splits"), note=r.get(impl + "_note") or r.get("error"))
            writer.writerow({k: ("" if v is None else (f"{v:.6g}" if isinstance(v, float) else v))
                             for k, v in rec.items()})
    return buf.getvalue()


def write_decode_results(rows: list[dict], out_dir, stem: str = "bench-decode", env: dict | None = None,
                         grid: dict | None = None) -> dict:
    """Write <stem>.md (table, geomeans), .csv and .json (rows, grid, environment) into ``out_dir``."""
    from pathlib import Path

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"md": out / f"{stem}.md", "csv": out / f"{stem}.csv", "json": out / f"{stem}.json"}
    paths["md"].write_text(summary(rows) + "\n")
    paths["csv"].write_text(to_csv(rows))
    paths["json"].write_text(json.dumps({"env": env or {}, "grid": {k: list(v) for k, v in (grid or {}).items()},
                                         "rows": rows}, indent=1, default=str) + "\n")
    return paths


def cell_specs(cell: Cell, device: int = 0) -> list:
    """The kernel specs the default call of ``cell`` launches on ``device`` (decode, and combine where
    its keys are split), as attention_with_kvcache resolves them: what scripts/warm_cache.py
    --decode-grid compiles ahead of a run. Needs the device's properties (no torch)."""
    from ..ops import kvcache
    pages = cell.batch * cell.context // cell.page_size if cell.page_size else 0
    problem = kvcache._Problem(cell.batch, 1, cell.heads_q, cell.heads_kv, cell.d, "bf16", bool(cell.page_size),
                               cell.page_size, pages, cell.context, 0)
    return kvcache.device_plan_specs(problem, device)


# ------------------------------------------------------------------ GPU part

def make_cache(torch, cell: Cell, dtype=None) -> tuple:
    """(k_cache, v_cache, page_table) of ``cell`` on the GPU, random (bf16 unless ``dtype``): contiguous
    (batch, context, heads_kv, d), or pages (pages, page_size, heads_kv, d) with the pages shuffled
    (a (batch, context / page_size) int32 table of a random permutation; page_table None if contiguous)."""
    dtype = dtype or torch.bfloat16
    if cell.page_size:
        pages = cell.batch * cell.context // cell.page_size
        shape = (pages, cell.page_size, cell.heads_kv, cell.d)
        table = torch.randperm(pages, device="cuda").view(cell.batch, -1).to(torch.int32)
    else:
        shape, table = (cell.batch, cell.context, cell.heads_kv, cell.d), None
    return torch.randn(shape, dtype=dtype, device="cuda"), torch.randn(shape, dtype=dtype, device="cuda"), table


def _fa3():
    from .peers import _fa3_module
    mod, _ = _fa3_module()
    return getattr(mod, "flash_attn_with_kvcache", None) if mod is not None else None


def _captured(torch, fn, steps: int):
    """A CUDA graph of ``steps`` calls of ``fn`` (one per rotating cache), warmed up first on the
    capture's own stream (so every plan, scratch buffer and peer workspace exists before capture)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2 * steps):
            fn()
    stream.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for _ in range(steps):
            fn()
    torch.cuda.synchronize()
    return graph


def run_cell(cell: Cell, peers=DECODE_PEERS, check: bool = True, variants=(), graphs: bool = True) -> dict:
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import facodegen

    from .timing import time_cuda_interleaved

    dt = torch.bfloat16
    sets = input_sets(cell.kv_bytes)
    q = torch.randn(cell.batch, 1, cell.heads_q, cell.d, dtype=dt, device="cuda")
    lengths = torch.full((cell.batch,), cell.context, dtype=torch.int32, device="cuda")
    caches = [make_cache(torch, cell, dt) for _ in range(sets)]
    turn = {"i": 0}

    def rotate():
        turn["i"] = (turn["i"] + 1) % sets
        return caches[turn["i"]]

    def ours():
        kc, vc, pt = rotate()
        return facodegen.attention_with_kvcache(q, kc, vc, lengths, page_table=pt, num_splits=0)

    fns, names = [ours], ["facodegen"]
    for knobs in variants:      # facodegen with knobs, timed in the same groups as the default call
        def ours_with(knobs=knobs):
            kc, vc, pt = rotate()
            return facodegen.attention_with_kvcache(q, kc, vc, lengths, page_table=pt, **{"num_splits": 0, **knobs})
        fns.append(ours_with)
        names.append(variant_label(knobs))
    fa3 = _fa3() if "fa3" in peers else None
    if fa3 is not None:
        def fa3_call():
            kc, vc, pt = rotate()
            out = fa3(q, kc, vc, cache_seqlens=lengths, page_table=pt, causal=True, num_splits=0)
            return out[0] if isinstance(out, tuple) else out
        fns.append(fa3_call)
        names.append("fa3")
    if "sdpa" in peers and not cell.page_size:
        def sdpa_call():
            kc, vc, _ = rotate()
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                return F.scaled_dot_product_attention(q.transpose(1, 2), kc.transpose(1, 2), vc.transpose(1, 2),
                                                      enable_gqa=cell.heads_q != cell.heads_kv).transpose(1, 2)
        fns.append(sdpa_call)
        names.append("sdpa")
    result = {"cell": cell.name, **asdict(cell), "kv_bytes": cell.kv_bytes, "sets": sets}
    if variants:
        result["variants"] = [variant_label(knobs) for knobs in variants]
    # correctness first: every implementation against facodegen on the same cache
    from ..ops import kvcache
    good = []
    turn["i"] = -1
    want = ours().float()
    newest = lambda: list(kvcache._PLANS._plans.values())[-1]      # noqa: E731 (a call's plan, just built)
    default = newest()
    for name, fn in zip(names, fns):
        turn["i"] = -1
        try:
            got = fn().float()
            if name.startswith("facodegen["):   # the kernel a variant runs and its split count
                result[name + "_kernel"] = newest().specs["decode"].variant
                result[name + "_splits"] = newest().num_splits
            err = (got - want).abs().max().item()
            if check and not err < 2e-2:
                result[name + "_note"] = f"differs from facodegen by {err:.3e}: not timed"
                continue
            good.append((name, fn))
        except Exception as exc:  # noqa: BLE001 (a peer that refuses the cell)
            result[name + "_note"] = f"{type(exc).__name__}: {str(exc)[:120]}"
    timed = [(name, fn, 1) for name, fn in good]
    if graphs and cell.kv_bytes <= GRAPH_MAX_BYTES:
        for name, fn in good:
            if name not in IMPLS:
                continue
            try:
                timed.append((name + "_graph", _captured(torch, fn, sets).replay, sets))
            except Exception as exc:  # noqa: BLE001 (a peer that cannot be captured)
                result[name + "_graph_note"] = f"capture: {type(exc).__name__}: {str(exc)[:120]}"
    timings = time_cuda_interleaved([fn for _, fn, _ in timed])
    for (name, _, steps), t in zip(timed, timings):     # a replay runs `steps` decode steps
        result[name] = tbps(cell.kv_bytes, t["ms"] / steps)
        result[name + "_ms"] = t["ms"] / steps
        result[name + "_host_ms"] = t["host_ms"] / steps
    result["splits"] = default.num_splits
    result["variant"] = default.specs["decode"].variant
    del timed, timings
    caches.clear()
    torch.cuda.empty_cache()
    return result


def run_decode(todo: list[Cell], peers=DECODE_PEERS, log=print, variants=(), graphs: bool = True) -> list[dict]:
    """run_cell over the cells (``variants``: knob dicts timed as columns of their own; ``graphs``:
    CUDA-graph replays beside the eager calls where K+V <= GRAPH_MAX_BYTES); a cell that raises is
    reported in its row and the run goes on."""
    rows = []
    t0 = time.time()
    for cell in todo:
        try:
            row = run_cell(cell, peers, variants=variants, graphs=graphs)
        except Exception as exc:  # noqa: BLE001 (one cell's failure must not lose the others)
            row = {"cell": cell.name, **asdict(cell), "kv_bytes": cell.kv_bytes, "error": f"{type(exc).__name__}: {exc}"}
        rows.append(row)
        log(f"[{time.time() - t0:6.1f}s] {cell.name}: " + ", ".join(
            f"{k} {row[k]:.2f} TB/s" for k in (*IMPLS, *row.get("variants", ()), *GRAPH_IMPLS) if row.get(k)) +
            (f" ERROR {row['error']}" if "error" in row else ""))
    return rows
