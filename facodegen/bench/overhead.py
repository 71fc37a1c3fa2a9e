"""The overhead suite (`facodegen bench --suite overhead`): host microseconds per call.

Where the kernels' suites divide FLOPs by device time, this one asks what a call costs the host:
argument checks, kernel lookup, allocation, launch. The shape is tiny, so the GPU's few
microseconds per call stay below the host's and the clock on the host measures the host. Here:
its cases and options, the callables of facodegen's three ways of calling and of the peers
(SDPA, FlashAttention-3), the runner (run_overhead, each row timed by timing.time_host_per_call),
the ratio to SDPA, and its table, notes, CSV and files."""

from __future__ import annotations

import statistics

from .grids import cell
from .inputs import InputSet, _make_inputs
from .peers import _fa3_module
from .timing import _torch, time_host_per_call


OVERHEAD_SHAPE = (1, 128, 8, 128)                 # (batch, seqlen, heads, head_dim), q, k and v alike
OVERHEAD_CASES = (("bf16", True), ("fp16", False), ("fp8", True))   # (dtype, causal); fp8 with descales
OVERHEAD_OPTIONS = ("plain", "return_lse", "out=")
OVERHEAD_SDPA = "torch SDPA"                      # the reference of the ratio column
OVERHEAD_FA3 = "FlashAttention-3"
OVERHEAD_IMPLS = ("facodegen.attention", "facodegen.attention (CuPy)", "facodegen.prepare()()",
                  OVERHEAD_SDPA, OVERHEAD_FA3)
OVERHEAD_PEERS = ("fa3",)                         # optional peers besides SDPA (always timed: the reference)
# warm-up calls, calls timed per repeat, repeats (medians over these), calls per synchronize for the
# pure host figure: 100 calls (a few launches each) stay far below the ~1000 launches a stream queues
# before a launch blocks, so no call of a chunk waits for the GPU.
OVERHEAD_TIMING = {"warmup": 200, "calls": 2000, "repeats": 5, "chunk": 100}
OVERHEAD_CSV_FIELDS = ("impl", "dtype", "causal", "options", "host_us", "loop_us", "ratio_to_sdpa", "note")


def overhead_row(impl: str, dtype: str, causal: bool, options: str, host_us: float | None = None,
                 loop_us: float | None = None, note: str | None = None) -> dict:
    """One (implementation, case, options) record of the overhead suite."""
    return {"impl": impl, "dtype": dtype, "causal": bool(causal), "options": options,
            "host_us": host_us, "loop_us": loop_us, "ratio_to_sdpa": None, "note": note}


def _sdpa_host_us(rows: list[dict], row: dict) -> float | None:
    """SDPA's plain-call host time for the case of ``row``: same mask, same dtype; fp8 rows take
    SDPA on bf16 (it has no e4m3 path, and bf16 is what the fp8 inputs were quantised from).
    The options of ``row`` (return_lse, out=) have no SDPA counterpart: their ratio says what the
    option costs against SDPA's plain call."""
    dtype = "bf16" if row["dtype"] == "fp8" else row["dtype"]
    for r in rows:
        if (r["impl"], r["options"], r["dtype"], r["causal"]) == (OVERHEAD_SDPA, "plain", dtype, row["causal"]):
            return r["host_us"]
    return None


def with_sdpa_ratios(rows: list[dict]) -> list[dict]:
    """The rows with ``ratio_to_sdpa`` = host_us / SDPA's (see _sdpa_host_us), where both exist."""
    out = []
    for row in rows:
        ref = _sdpa_host_us(rows, row)
        ratio = row["host_us"] / ref if row["host_us"] is not None and ref else None
        out.append(dict(row, ratio_to_sdpa=ratio))
    return out


def _not_run(row: dict) -> bool:
    """A row that was skipped or whose implementation is unavailable (not a failure)."""
    return row["host_us"] is None and str(row.get("note") or "").startswith(("skipped", "unavailable"))


def format_overhead_table(rows: list[dict]) -> str:
    """Markdown: one line per (implementation, dtype, mask, options) that ran, with the pure host
    µs per call, the back-to-back loop's µs per call and the host time's ratio to SDPA's ("fail":
    it raised). Rows not run (an option or dtype a peer lacks, a peer not installed) stay out of
    the table; format_overhead_notes gives their reasons."""
    head = ["implementation", "dtype", "causal", "options", "host µs/call", "loop µs/call", "ratio to SDPA"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        if _not_run(r):
            continue
        cells = [r["impl"], r["dtype"], "yes" if r["causal"] else "no", r["options"],
                 "fail" if r["host_us"] is None else f"{r['host_us']:.1f}",
                 "–" if r["loop_us"] is None else f"{r['loop_us']:.1f}",
                 "–" if r.get("ratio_to_sdpa") is None else f"{r['ratio_to_sdpa']:.2f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def format_overhead_notes(rows: list[dict]) -> str:
    """One line per implementation and note (skipped, unavailable, failed, GPU-bound loop) with the
    rows it applies to: a missing peer is one line, not one per case and option."""
    groups: dict = {}
    for r in rows:
        if r.get("note"):
            tag = f"{r['dtype']} {'causal' if r['causal'] else 'full'} {r['options']}"
            groups.setdefault((r["impl"], r["note"]), []).append(tag)
    return "\n".join(f"- {impl} ({', '.join(tags) if len(tags) <= 3 else f'{len(tags)} rows'}): {note}"
                     for (impl, note), tags in groups.items())


def overhead_csv(rows: list[dict]) -> str:
    import csv
    import io

    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=OVERHEAD_CSV_FIELDS, lineterminator="\n", extrasaction="ignore")
    writer.writeheader()
    for r in rows:
        writer.writerow({k: ("" if r.get(k) is None else (f"{r[k]:.6g}" if isinstance(r[k], float) else r[k]))
                         for k in OVERHEAD_CSV_FIELDS})
    return buf.getvalue()


def write_overhead_results(rows: list[dict], out_dir, stem: str, env: dict | None = None) -> dict:
    """Write <stem>.md (table + notes), .csv and .json (rows, shape, timing, environment) into
    ``out_dir`` (no plot: a table of microseconds reads better); returns {"md": path, ...}."""
    import json
    from pathlib import Path

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    notes = format_overhead_notes(rows)
    paths = {"md": out / f"{stem}.md", "csv": out / f"{stem}.csv", "json": out / f"{stem}.json"}
    paths["md"].write_text(format_overhead_table(rows) + ("\n\nNotes:\n" + notes if notes else "") + "\n")
    paths["csv"].write_text(overhead_csv(rows))
    paths["json"].write_text(json.dumps({"env": env or {}, "shape": OVERHEAD_SHAPE, "timing": OVERHEAD_TIMING,
                                         "rows": rows}, indent=1, default=str) + "\n")
    return paths


def _overhead_inputs(dtype: str, causal: bool) -> InputSet:
    """One input set of the tiny shape (fp8: quantised per tensor from bf16 randn, with descales).
    One set is enough: the kernel's time is not what is measured."""
    batch, seqlen, heads, head_dim = OVERHEAD_SHAPE
    return _make_inputs(cell(head_dim, causal, seqlen, batch, heads, dtype), 1)[0]


def _out_like(s: InputSet):
    """A torch out buffer for an ``out=`` call: q's shape, bf16 for e4m3 inputs (facodegen's default)."""
    torch = _torch()
    return torch.empty(s.q.shape, dtype=torch.bfloat16 if s.fp8 else s.q.dtype, device=s.q.device)


def _facodegen_kwargs(s: InputSet, causal: bool, options: str, kwargs: dict, out) -> dict:
    """facodegen's keyword arguments of one overhead row: mask, descales, the CLI's arch and spec
    fields, then the option (return_lse=True, or out= an array allocated once)."""
    extra = {"plain": {}, "return_lse": {"return_lse": True}, "out=": {"out": out}}[options]
    return dict(causal=causal, **s.descales, **kwargs, **extra)


def _overhead_attention(s: InputSet, causal: bool, options: str, kwargs: dict):
    """``facodegen.attention`` on torch tensors, every call from scratch (what users write)."""
    import facodegen
    q, k, v = s.q, s.k, s.v
    call = _facodegen_kwargs(s, causal, options, kwargs, _out_like(s) if options == "out=" else None)
    return lambda: facodegen.attention(q, k, v, **call)


def _overhead_attention_cupy(s: InputSet, causal: bool, options: str, kwargs: dict):
    """``facodegen.attention`` on CuPy arrays (zero-copy views of the torch tensors). CuPy has neither
    bfloat16 nor e4m3, so only the fp16 case runs."""
    if s.fp8 or str(s.q.dtype) != "torch.float16":
        raise RuntimeError(f"skipped: CuPy has no {'e4m3' if s.fp8 else 'bfloat16'} dtype")
    import cupy

    import facodegen
    q, k, v = (cupy.asarray(x) for x in (s.q, s.k, s.v))
    out = cupy.empty(q.shape, dtype=q.dtype) if options == "out=" else None
    call = _facodegen_kwargs(s, causal, options, kwargs, out)
    return lambda: facodegen.attention(q, k, v, **call)


def _overhead_prepared(s: InputSet, causal: bool, options: str, kwargs: dict):
    """``facodegen.prepare(...)`` once, then the prepared call: the least host work per launch."""
    import facodegen
    call = _facodegen_kwargs(s, causal, options, kwargs, _out_like(s) if options == "out=" else None)
    return facodegen.prepare(s.q, s.k, s.v, **call)


def _overhead_sdpa(s: InputSet, causal: bool, options: str, kwargs: dict):
    """torch SDPA with torch's own backend choice on (b, h, s, d) views made once (no transpose
    back: the least a caller holding (b, h, s, d) tensors would pay)."""
    if s.fp8:
        raise RuntimeError("skipped: SDPA has no e4m3 path")
    if options != "plain":
        raise RuntimeError(f"skipped: SDPA has no {'LSE output' if options == 'return_lse' else 'out= argument'}")
    import torch.nn.functional as F
    qt, kt, vt = (x.transpose(1, 2) for x in (s.q, s.k, s.v))
    return lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)


def _overhead_fa3(s: InputSet, causal: bool, options: str, kwargs: dict):
    """FlashAttention-3's ``flash_attn_func`` ((b, s, h, d), fp8 with (batch, heads_kv) descales)."""
    import inspect

    mod, err = _fa3_module()
    if mod is None:
        raise RuntimeError(f"unavailable: flash_attn_interface not importable ({err})")
    if options == "out=":
        raise RuntimeError("skipped: flash_attn_func takes no out=")
    extra = {}
    if options == "return_lse":
        try:
            takes_probs = "return_attn_probs" in inspect.signature(mod.flash_attn_func).parameters
        except (TypeError, ValueError):
            takes_probs = False
        if not takes_probs:
            raise RuntimeError("skipped: this flash_attn_func has no return_attn_probs (LSE) switch")
        extra["return_attn_probs"] = True
    q, k, v = s.q, s.k, s.v
    descales = {n: t.reshape(1, 1).expand(k.shape[0], k.shape[2]).contiguous() for n, t in s.descales.items()}
    return lambda: mod.flash_attn_func(q, k, v, causal=causal, **descales, **extra)


OVERHEAD_BUILDERS = {
    "facodegen.attention": _overhead_attention,
    "facodegen.attention (CuPy)": _overhead_attention_cupy,
    "facodegen.prepare()()": _overhead_prepared,
    OVERHEAD_SDPA: _overhead_sdpa,
    OVERHEAD_FA3: _overhead_fa3,
}


def _overhead_impls(peers) -> list[str]:
    """The implementations timed: facodegen's three ways and SDPA always, FlashAttention-3 if asked."""
    return [n for n in OVERHEAD_IMPLS if n != OVERHEAD_FA3 or "fa3" in peers]


def _build_overhead_row(impl: str, s: InputSet, causal: bool, options: str, kwargs: dict,
                        dtype: str) -> tuple[dict, object]:
    """(row, fn): one implementation built for one case and options and called once (compiles, or
    raises before any timing). A refusal ("skipped: ...", "unavailable: ...") or a failure becomes
    the row's note and fn None, and the suite goes on."""
    torch = _torch()
    row = overhead_row(impl, dtype, causal, options)
    try:
        fn = OVERHEAD_BUILDERS[impl](s, causal, options, kwargs)
        fn()
        torch.cuda.synchronize()
    except Exception as err:  # noqa: BLE001
        msg = str(err).strip().splitlines()[0] if str(err).strip() else ""
        row["note"] = msg if msg.startswith(("skipped", "unavailable")) else f"failed: {type(err).__name__}: {msg[:300]}"
        return row, None
    return row, fn


def _time_overhead_rows(built: list[tuple[dict, object]], timing: dict, timer, log) -> None:
    """Time the built rows taking turns: each of timing["repeats"] rounds times every
    row once (one repeat of ``timer``, the first round after the full warm-up, later ones after a
    tenth of it), and a row gets the medians over the rounds. A slow spell of the host (a GC, a
    neighbour) then hits every implementation alike instead of whichever ran during it: the same
    call measured 14.7 and 21.3 µs in two device calls of one day (H200, 2026-12-04) when each
    implementation ran all its repeats in one stretch."""
    torch = _torch()
    timed = [(row, fn) for row, fn in built if fn is not None]
    samples = {id(row): [] for row, _ in timed}
    for round_ in range(timing["repeats"]):
        warmup = timing["warmup"] if round_ == 0 else timing["warmup"] // 10
        for row, fn in timed:
            samples[id(row)].append(timer(fn, torch.cuda.synchronize, **{**timing, "repeats": 1, "warmup": warmup}))
    for row, _ in timed:
        got = samples[id(row)]
        host = statistics.median(t["host_us"] for t in got)
        loop = statistics.median(t["loop_us"] for t in got)
        row.update(host_us=host, loop_us=loop)
        if loop > 1.25 * host:
            # back to back, the calls waited for something other than the host (the GPU or a full queue)
            row["note"] = f"back-to-back loop {loop:.1f} µs/call vs {host:.1f} host: GPU-bound there"
        log(f"    {row['impl']} {row['dtype']} {'causal' if row['causal'] else 'full'} {row['options']}: "
            f"{host:.1f} µs/call host, {loop:.1f} in the loop")


def run_overhead(arch: str | None = None, overrides: dict | None = None, peers=OVERHEAD_PEERS,
                 timing: dict | None = None, timer=time_host_per_call, log=print) -> list[dict]:
    """Host µs per call (time_host_per_call) of facodegen.attention on torch tensors and on CuPy
    arrays, facodegen.prepare(...)(), torch SDPA and (``"fa3" in peers``, if importable)
    FlashAttention-3's flash_attn_func, on OVERHEAD_SHAPE for each of OVERHEAD_CASES and
    OVERHEAD_OPTIONS, every row taking turns with every other (_time_overhead_rows), with each
    row's ratio to SDPA's plain call (with_sdpa_ratios). ``arch`` and
    ``overrides`` (spec fields) are passed to facodegen's calls when given."""
    timing = {**OVERHEAD_TIMING, **(timing or {})}
    kwargs = {**({"arch": arch} if arch else {}), **(overrides or {})}
    impls = _overhead_impls(peers)
    built = []
    for dtype, causal in OVERHEAD_CASES:
        try:
            s = _overhead_inputs(dtype, causal)
        except Exception as err:  # noqa: BLE001 (e.g. no e4m3 in this torch: the other cases still run)
            built += [(overhead_row(i, dtype, causal, o, note=f"skipped: inputs failed: {type(err).__name__}: {err}"),
                       None) for o in OVERHEAD_OPTIONS for i in impls]
            continue
        built += [_build_overhead_row(impl, s, causal, options, kwargs, dtype)
                  for options in OVERHEAD_OPTIONS for impl in impls]
    # every row of every case takes its turn in each round: the cases timed first read up to 1.6x
    # slower than the later ones when each case had its rounds to itself (SDPA bf16 causal 28.8 µs,
    # fp16 18.2 in one run, H200 2026-12-04), a slow spell early in the process
    _time_overhead_rows(built, timing, timer, log)
    return with_sdpa_ratios([row for row, _ in built])
