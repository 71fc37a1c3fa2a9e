"""``facodegen tune``: search the template space of one problem family and remember the winner.

Pipeline (each stage records why a candidate was dropped, in ``Candidate.dropped``/``reason``):

1. **enumerate** the points of the product of the knobs in :data:`SEARCH_SPACE` nearest the
   default spec, lazily in order of distance (never the product in memory), plus the default
   itself, always: what a call of the tuned lengths runs without a tuned entry, i.e. the head_dim
   defaults with spec.seqlen_rule_fields on top;
2. **budget**: build a :class:`KernelSpec` from each; a ``SpecError`` (shared memory, registers,
   shape rules) drops it with the budget model's own message;
3. **cap**: rank the survivors by their distance from the default spec (:func:`distance`: about one
   per changed switch or stage, one per factor of two in a tile size) and keep ``max_candidates`` (48), the
   default first; the rest are dropped as "beyond the cap";
4. **compile** the rest with NVRTC in worker processes (``ProcessPoolExecutor``, spawn: NVRTC is
   CPU-bound, the disk cache makes re-runs fast); a compile error, a spill (ptxas reports spill
   stores or loads) or a ptxas C75xx warning (wgmma serialised, setmaxnreg ignored) drops it;
5. **time** (GPU) every survivor on one input set with ``bench.timing.time_cuda`` (warm-up, median of
   groups), each output first checked against the float64 reference on a slice
   (``bench.inputs._slice_check``); a failed check drops it;
6. **final round**: the default and the fastest ``final_top`` candidates are timed again
   ``final_reps`` times, interleaved; each one's time is the median of its rounds. The fastest
   wins, but a candidate replaces the default only when it is at least ``min_gain`` (1%) faster
   in the same run, so a stored config is never slower than the default it replaces; when the
   default wins, the default is stored (the database then says "tuned: the default is best").

The winner goes into the tuning database (:mod:`facodegen.tuning.tunedb`), which
``facodegen.attention()`` reads.
"""

from __future__ import annotations

import math
import os
import statistics
import time
from dataclasses import dataclass, field

from ..spec import knobs
from ..spec import DEFAULT_GPU, KernelSpec, SpecError, seqlen_rule_fields

# The knobs searched per arch and their values: the registry's ``search`` (facodegen/spec/knobs.py says
# why those values). Fields not listed keep the spec's defaults (sm90: producer/consumer registers
# follow consumer_warpgroups; sm80: schedule fa2). cluster_m is not searched: two-CTA multicast
# measured slower in every cell (spec.py) and would double the space again.
SEARCH_SPACE = {arch: knobs.search_space(arch) for arch in knobs.ARCHS}
# Switches that cannot both be on (one O tile placement): such points are skipped, not built.
EXCLUSIVE_SWITCHES = (("separate_o", "o_in_v"),)
MAX_CANDIDATES = 48
FINAL_TOP = 3
FINAL_REPS = 2
MIN_GAIN = 0.01
_TILE_FIELDS = ("block_m", "block_n", "num_warps")
# Distance of a changed switch (see distance()); non-persistent lost 2-5% in every ablation cell.
_SWITCH_WEIGHTS = {"pingpong": 1.0, "intra_wg_overlap": 1.0, "persistent": 1.5, "q_in_regs": 1.0,
                   "separate_o": 1.0, "l2_hints": 1.0, "anchor_softmax": 1.0, "lazy_rescale": 1.0,
                   "rescale_under_qk": 1.0, "softmax_chains": 1.0, "poly_exp2_tiles": 1.0, "optimistic_max": 1.0,
                   "uniform_wg": 1.0, "ctas_per_sm": 1.0, "o_in_v": 1.0, "p_buffers": 1.0,
                   "rebuild_q_desc": 1.0, "stream_k": 1.0}


def _spec_field_names() -> set:
    import dataclasses
    return {f.name for f in dataclasses.fields(KernelSpec)}


# Knobs a dtype does not have: fp8 stores O from registers (no O tile to place in shared memory).
NOT_FOR_DTYPE = {"fp8": ("separate_o", "o_in_v")}


def search_space(arch: str, dtype: str = "bf16") -> dict:
    """SEARCH_SPACE[arch], less any knob this KernelSpec or this dtype does not have."""
    names = _spec_field_names() - set(NOT_FOR_DTYPE.get(dtype, ()))
    return {k: v for k, v in SEARCH_SPACE[arch].items() if k in names}


@dataclass
class Candidate:
    """One point of the search space and what happened to it."""
    fields: dict                        # the knobs this candidate sets (the rest are defaults)
    spec: KernelSpec | None = None      # None where the budget model rejected it
    is_default: bool = False
    distance: float = 0.0
    dropped: str | None = None          # stage that dropped it: budget, cap, compile, spill, ptxas, check, launch
    reason: str = ""
    resources: dict = field(default_factory=dict)
    warnings: list = field(default_factory=list)
    compile_s: float | None = None
    from_cache: bool | None = None
    err: float | None = None            # rel. Frobenius error of the slice check
    times_ms: list = field(default_factory=list)

    @property
    def alive(self) -> bool:
        return self.dropped is None

    def drop(self, stage: str, reason: str) -> None:
        self.dropped, self.reason = stage, reason

    @property
    def ms(self) -> float | None:
        return statistics.median(self.times_ms) if self.times_ms else None

    @property
    def label(self) -> str:
        return self.spec.variant if self.spec is not None else describe(self.fields)

    def overrides(self) -> dict:
        """Every spec field but the family ones: what a launch passes so nothing is re-derived
        (and the tuning database is not consulted)."""
        return {k: v for k, v in self.spec.launch_fields().items() if k != "arch"}


def describe(fields: dict) -> str:
    """Short text of a candidate's knobs, for specs the budget model rejected."""
    names = {"consumer_warpgroups": "cwg", "block_m": "bm", "block_n": "bn", "num_warps": "w",
             "stages": "st", "pingpong": "pp", "intra_wg_overlap": "ov", "persistent": "persistent",
             "q_in_regs": "qreg"}
    parts = []
    for k, v in fields.items():
        short = names.get(k, k)
        if isinstance(v, bool):
            parts.append(short if v else f"no-{short}")
        else:
            parts.append(f"{short}{v}")
    return " ".join(parts)


def distance(spec: KernelSpec, default: KernelSpec) -> float:
    """How far a spec is from the default: 1 per changed switch or stage count (per stage), 1 per
    factor of two in a tile size. The cap keeps the nearest candidates."""
    d = 0.0
    for name in _TILE_FIELDS:
        a, b = getattr(spec, name), getattr(default, name)
        d += abs(math.log2(a / b))
    d += abs(spec.stages - default.stages)
    for name, weight in _SWITCH_WEIGHTS.items():
        if getattr(spec, name, None) != getattr(default, name, None):
            d += weight
    return round(d, 3)


def _axis_cost(name: str, value, default_value) -> float:
    """A knob's share of ``distance`` when it alone moves from the default's value to ``value``."""
    if value == default_value:
        return 0.0
    if name in _TILE_FIELDS or name == "consumer_warpgroups":     # block_m = 64 x warpgroups
        if isinstance(value, int) and isinstance(default_value, int) and value > 0 and default_value > 0:
            return abs(math.log2(value / default_value))
        return 1.0
    if name == "stages" and isinstance(default_value, int):
        return float(abs(value - default_value))
    return _SWITCH_WEIGHTS.get(name, 1.0)


def neighbourhood(axes: dict, default_fields: dict):
    """The points of the product of ``axes`` ({knob: values}) in order of increasing distance from
    ``default_fields`` (the sum of each knob's own cost, _axis_cost), generated one at a time: a
    heap over per-knob rank vectors, so memory grows with the points taken, never with the
    product (6-9 million points for sm90)."""
    import heapq

    names = list(axes)
    ranked, costs = [], []
    for name in names:
        pairs = sorted(((_axis_cost(name, v, default_fields.get(name)), i, v) for i, v in enumerate(axes[name])))
        ranked.append([v for _, _, v in pairs])
        costs.append([c for c, _, _ in pairs])
    if not names or any(not values for values in ranked):
        return
    start = (0,) * len(names)
    heap, seen = [(sum(c[0] for c in costs), start)], {start}
    while heap:
        total, index = heapq.heappop(heap)
        yield {name: ranked[i][j] for i, (name, j) in enumerate(zip(names, index))}
        for i, j in enumerate(index):
            if j + 1 < len(ranked[i]):
                step = index[:i] + (j + 1,) + index[i + 1:]
                if step not in seen:
                    seen.add(step)
                    heapq.heappush(heap, (total - costs[i][j] + costs[i][j + 1], step))


def space_size(axes: dict) -> int:
    """Points in the product of ``axes`` (counted, not enumerated)."""
    return math.prod(len(v) for v in axes.values())


MAX_EXAMINED = 3000     # points built into a KernelSpec at most per search (bounds time and memory)


def enumerate_candidates(arch: str, head_dim: int, dtype: str, causal: bool, gpu: str | None = None,
                         max_candidates: int = MAX_CANDIDATES, space: dict | None = None,
                         seqlen: tuple[int, int] | None = None, max_examined: int = MAX_EXAMINED) -> list[Candidate]:
    """The points of the search space nearest the default, each a live candidate or dropped at
    'budget' or 'cap' with the reason; live ones first, in rank order (the default first, then by
    distance from it). Points are taken lazily in order of distance (:func:`neighbourhood`) until
    twice ``max_candidates`` have passed the budget model, the space is exhausted, or
    ``max_examined`` points were built; the nearest ``max_candidates`` stay live and the rest are
    dropped at 'cap'. ``seqlen`` = (seqlen_q, seqlen_k): the default is what a call of that length
    runs without a tuned entry (spec.seqlen_rule_fields on top of the head_dim defaults), so a
    stored winner is never slower than the rule it replaces."""
    gpu = gpu or DEFAULT_GPU[arch]
    base = dict(arch=arch, head_dim=head_dim, dtype=dtype, causal=causal, gpu=gpu)
    rule = seqlen_rule_fields(arch, head_dim, dtype, causal, *seqlen) if seqlen else {}
    default = KernelSpec(**base, **rule)
    axes = space if space is not None else search_space(arch, dtype)
    names = list(axes)
    seen: dict = {}
    out: list[Candidate] = []
    default_cand = Candidate(fields={n: getattr(default, n) for n in names}, spec=default, is_default=True)
    seen[default] = default_cand
    wanted, examined = 2 * max(1, max_candidates), 0
    for fields in neighbourhood(axes, default_cand.fields):
        if any(fields.get(a) and fields.get(b) for a, b in EXCLUSIVE_SWITCHES):
            continue                # not a point of the space (KernelSpec would reject it)
        if examined >= max_examined or sum(c.alive for c in out) >= wanted:
            break
        examined += 1
        cand = Candidate(fields=fields)
        try:
            cand.spec = KernelSpec(**base, **fields)
        except SpecError as err:
            cand.drop("budget", str(err))
            out.append(cand)
            continue
        if cand.spec in seen:       # the default, or a point another spelling already reaches
            continue
        seen[cand.spec] = cand
        cand.distance = distance(cand.spec, default)
        out.append(cand)
    live = sorted((c for c in out if c.alive), key=lambda c: c.distance)
    dead = [c for c in out if not c.alive]
    keep = max(1, max_candidates) - 1
    for c in live[keep:]:
        c.drop("cap", f"beyond --max-candidates {max_candidates} (distance {c.distance:g} from the default)")
    ranked = [default_cand] + live
    return [c for c in ranked if c.alive] + [c for c in ranked if not c.alive] + dead


# ----------------------------------------------------------------------------------------------
# compile (CPU, worker processes)
# ----------------------------------------------------------------------------------------------

def compile_worker(spec_fields: dict, sm: str | None) -> dict:
    """Compile one spec (runs in a worker process); what ptxas said about it, no cubin (the parent
    reads the cubin from the disk cache when it launches)."""
    from ..runtime import compiler

    t0 = time.perf_counter()
    try:
        kernel = compiler.compile(KernelSpec(**spec_fields), verbose=False, sm=sm)
    except Exception as err:  # noqa: BLE001 (reported per candidate)
        text = str(err).strip()
        return {"ok": False, "error": f"{type(err).__name__}: {text.splitlines()[0] if text else ''}"[:400],
                "seconds": time.perf_counter() - t0}
    return {"ok": True, "resources": kernel.resources.as_dict(), "warnings": list(kernel.warnings),
            "from_cache": kernel.from_cache, "seconds": time.perf_counter() - t0}


def compile_verdict(resources: dict, warnings: list) -> tuple[str, str] | None:
    """(stage, reason) when a compiled kernel should not be timed, else None."""
    stores, loads = resources.get("spill_stores", 0), resources.get("spill_loads", 0)
    if stores or loads:
        return "spill", (f"spills {stores} B stores / {loads} B loads at {resources.get('registers')} registers")
    bad = [w for w in warnings if "C75" in w]
    if bad:
        return "ptxas", f"ptxas: {bad[0][:300]}"
    return None


def compile_candidates(cands: list[Candidate], jobs: int | None = None, sm: str | None = None,
                       on_done=None, worker=None) -> None:
    """Compile the live candidates (``jobs`` processes; 1 = in this process) and drop those that
    fail, spill or draw a C75xx warning. The default is never dropped here (it is the baseline),
    but its problems are recorded in ``reason``. ``worker`` replaces :func:`compile_worker` (tests)."""
    live = [c for c in cands if c.alive]
    worker = worker or compile_worker
    jobs = max(1, min(jobs or os.cpu_count() or 1, len(live) or 1))

    def record(cand: Candidate, res: dict) -> None:
        cand.compile_s = res.get("seconds")
        if not res.get("ok"):
            if cand.is_default:
                cand.reason = f"default does not compile: {res.get('error')}"
            cand.drop("compile", res.get("error", "compile failed"))
        else:
            cand.resources, cand.warnings = res["resources"], res["warnings"]
            cand.from_cache = res.get("from_cache")
            verdict = compile_verdict(cand.resources, cand.warnings)
            if verdict is not None:
                if cand.is_default:
                    cand.reason = f"(kept as the baseline) {verdict[1]}"
                else:
                    cand.drop(*verdict)
        if on_done is not None:
            on_done(cand)

    if jobs == 1:
        for cand in live:
            record(cand, worker(cand.spec.as_dict(), sm))
        return
    import concurrent.futures as cf
    import multiprocessing

    # spawn: the parent may hold a CUDA context (forking one is undefined); workers only need NVRTC.
    ctx = multiprocessing.get_context("spawn")
    with cf.ProcessPoolExecutor(max_workers=jobs, mp_context=ctx) as pool:
        futures = {pool.submit(worker, c.spec.as_dict(), sm): c for c in live}
        for fut in cf.as_completed(futures):
            cand = futures[fut]
            try:
                res = fut.result()
            except Exception as err:  # noqa: BLE001 (a worker that died)
                res = {"ok": False, "error": f"worker failed: {type(err).__name__}: {err}"}
            record(cand, res)


# ----------------------------------------------------------------------------------------------
# time (GPU)
# ----------------------------------------------------------------------------------------------

def _first_line(err: Exception) -> str:
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[0][:300] if text else ''}"


def time_candidates(cands: list[Candidate], c: dict, arch: str, *, timing: dict | None = None,
                    on_done=None, final_top: int = FINAL_TOP, final_reps: int = FINAL_REPS, log=None) -> None:
    """Check and time every live candidate on one input set, then the final round (module
    docstring). Times land in ``Candidate.times_ms``."""
    from ..bench.inputs import _make_inputs, _slice_check
    from ..bench.timing import _torch, time_cuda
    from ..bench.variants import _facodegen_fn

    torch = _torch()
    timing = timing or {}
    inputs, = _make_inputs(c, 1)
    fns = {}
    for cand in [x for x in cands if x.alive]:
        try:
            fn, _, _, checked = _facodegen_fn(arch, cand.overrides(), inputs, c["causal"])
            o = fn()
            torch.cuda.synchronize()
            ok, msg, err = _slice_check(o, checked, c["causal"], c["dtype"])
            cand.err = err
            if not ok:
                cand.drop("check", f"check failed: {msg}")
            else:
                cand.times_ms.append(time_cuda(fn, **timing)["ms"])
                fns[id(cand)] = fn
        except Exception as err:  # noqa: BLE001
            cand.drop("launch", _first_line(err))
            if log:
                log(f"  {cand.label}: {cand.reason}")
        if on_done is not None:
            on_done(cand)
    timed = [x for x in cands if x.alive and x.times_ms]
    default = next((x for x in timed if x.is_default), None)
    others = sorted((x for x in timed if not x.is_default), key=lambda x: x.times_ms[0])[:final_top]
    final = ([default] if default else []) + others
    for _ in range(final_reps):
        for cand in final:
            cand.times_ms.append(time_cuda(fns[id(cand)], **timing)["ms"])
    del fns
    torch.cuda.synchronize()


def pick_winner(cands: list[Candidate], min_gain: float = MIN_GAIN) -> tuple[Candidate | None, Candidate | None]:
    """(winner, default) among the timed candidates: the fastest by median time, except that the
    default is kept unless the fastest beats it by ``min_gain`` (measured in the same run)."""
    timed = [c for c in cands if c.alive and c.times_ms]
    default = next((c for c in timed if c.is_default), None)
    # only candidates that were in the final round (several times) compete with the default
    contenders = [c for c in timed if len(c.times_ms) > 1 or c.is_default] or timed
    if not contenders:
        return None, default
    best = min(contenders, key=lambda c: c.ms)
    if default is not None and best is not default and default.ms < best.ms * (1 + min_gain):
        best = default
    return best, default


# ----------------------------------------------------------------------------------------------
# tables
# ----------------------------------------------------------------------------------------------

def _knobs(spec: KernelSpec) -> str:
    if spec.arch == "sm90":
        return (f"{spec.block_m}x{spec.block_n} st{spec.stages} "
                f"{'pp' if spec.pingpong else '--'} {'ov' if spec.intra_wg_overlap else '--'} "
                f"{'pers' if spec.persistent else 'np'}")
    return f"{spec.block_m}x{spec.block_n} w{spec.num_warps} st{spec.stages}{' qreg' if spec.q_in_regs else ''}"


def _table(head: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(head)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(head, widths)).rstrip(),
             "  ".join("-" * w for w in widths)]
    lines += ["  ".join(x.ljust(w) for x, w in zip(r, widths)).rstrip() for r in rows]
    return "\n".join(lines)


def format_candidates(cands: list[Candidate], show_pruned: bool = True, verbose: bool = False) -> str:
    """The dry-run listing: live candidates in rank order, then the pruned ones: with ``verbose``
    each with its reason, else a count per stage and reason, with one example each."""
    live = [c for c in cands if c.alive]
    rows = []
    for i, c in enumerate(live, 1):
        r = c.resources
        res = f"{r['registers']} regs" if r else ""
        rows.append([str(i), c.label + (" (default)" if c.is_default else ""), _knobs(c.spec),
                     f"{c.spec.smem_bytes // 1024} KB", f"{c.distance:g}", res, c.reason])
    out = [_table(["#", "variant", "knobs", "smem", "dist", "compiled", "note"], rows)]
    dead = [c for c in cands if not c.alive]
    if show_pruned and dead:
        out.append("")
        out.append(f"pruned ({len(dead)}):")
        if verbose:
            out.append(_table(["stage", "candidate", "reason"], [[c.dropped, c.label, c.reason] for c in dead]))
        else:
            groups: dict = {}
            for c in dead:
                groups.setdefault((c.dropped, _reason_kind(c.reason)), []).append(c)
            out.append(_table(["stage", "count", "reason (one example)"],
                              [[stage, str(len(g)), g[0].reason] for (stage, _), g in
                               sorted(groups.items(), key=lambda kv: -len(kv[1]))]))
            out.append("(--verbose lists every pruned candidate)")
    return "\n".join(out)


def _reason_kind(reason: str) -> str:
    """A reason with its numbers blanked: pruned candidates with the same cause group together."""
    import re
    return re.sub(r"\d+", "#", reason.split(";")[0])


def summary_counts(cands: list[Candidate]) -> dict:
    counts = {"enumerated": len(cands), "live": sum(c.alive for c in cands)}
    for c in cands:
        if c.dropped:
            counts[c.dropped] = counts.get(c.dropped, 0) + 1
    return counts


def format_results(cands: list[Candidate], flops: float, top: int = 10, winner: Candidate | None = None) -> str:
    """The top ``top`` timed candidates with TFLOP/s and the ratio to the default: first the final
    round (the default and the contenders timed again beside it, which alone decide the winner), by
    median time, then the candidates timed once in the screening round ("screen only": a single
    time is noisier, so one of these can show above the default without having beaten it)."""
    from ..bench.grids import tflops

    def final_round(c: Candidate) -> bool:
        return c.is_default or len(c.times_ms) > 1

    timed = sorted((c for c in cands if c.alive and c.times_ms), key=lambda c: (not final_round(c), c.ms))
    default = next((c for c in timed if c.is_default), None)
    rows = []
    shown = timed[:top]
    if default is not None and default not in shown:
        shown.append(default)
    for i, c in enumerate(shown, 1):
        rank = str(timed.index(c) + 1)
        note = ", ".join(x for x in ("default" if c.is_default else "", "stored" if c is winner else "",
                                     "" if final_round(c) else "screen only") if x)
        rows.append([rank, c.label, _knobs(c.spec), f"{c.resources.get('registers', '?')}",
                     f"{c.ms:.4f}", f"{tflops(flops, c.ms):.1f}",
                     f"{default.ms / c.ms:.3f}x" if default else "–", str(len(c.times_ms)),
                     f"{c.err:.1e}" if c.err is not None else "–", note])
    return _table(["rank", "variant", "knobs", "regs", "ms", "TFLOP/s", "vs default", "runs", "err", ""], rows)


# ----------------------------------------------------------------------------------------------
# the whole run
# ----------------------------------------------------------------------------------------------

def report(cands: list[Candidate]) -> list[dict]:
    """JSON-ready rows of every candidate (for --report)."""
    out = []
    for c in cands:
        out.append({"label": c.label, "fields": c.fields, "is_default": c.is_default, "distance": c.distance,
                    "dropped": c.dropped, "reason": c.reason, "resources": c.resources, "warnings": c.warnings,
                    "compile_s": c.compile_s, "from_cache": c.from_cache, "err": c.err, "times_ms": c.times_ms,
                    "ms": c.ms})
    return out


def device_key(info, arch: str, head_dim: int, dtype: str, causal: bool, c: dict):
    """The tuning-database key of this device and problem (``info`` is api.DeviceInfo)."""
    from . import tunedb
    from ..runtime.compiler import nvrtc_identity

    return tunedb.make_key(info.name, info.compute_capability, nvrtc_identity(), arch, head_dim, dtype, causal,
                           c["seqlen_q"], c["seqlen_k"], c["batch"], c["heads_q"])


def make_db_entry(key, winner: Candidate, default: Candidate | None, flops: float, c: dict, cands) -> dict:
    from . import tunedb
    from ..bench.grids import tflops

    info = {
        "variant": winner.spec.variant, "is_default": winner.is_default,
        "ms": winner.ms, "tflops": tflops(flops, winner.ms), "err": winner.err,
        "shape": {k: c[k] for k in ("batch", "seqlen_q", "seqlen_k", "heads_q", "heads_kv")},
        "candidates_timed": sum(1 for x in cands if x.times_ms),
    }
    if default is not None:
        info.update(default_variant=default.spec.variant, default_ms=default.ms,
                    default_tflops=tflops(flops, default.ms), speedup=default.ms / winner.ms)
    return tunedb.make_entry(key, winner.spec.as_dict(), **info)
