"""The runner: one cell (run_cell: build and check every implementation on the same fresh
inputs, then time them taking turns group by group, so the GPU's clock drift over the cell falls
on each alike), a grid of cells under a time budget (run_grid), and `facodegen bench`'s one cell
as a table (run_cli_bench). A failing, missing or refusing implementation is reported in its row
with the reason and not timed."""

from __future__ import annotations

import contextlib
import time
import traceback

from .grids import attention_flops, cell, tflops
from .inputs import _make_inputs, _slice_check, input_bytes, input_sets_needed, l2_bytes
from .peers import DEFAULT_PEERS, _peer_fn, peer_available
from .tables import facodegen_name, format_notes, format_table
from .timing import _torch, time_cuda, time_cuda_interleaved
from .variants import _facodegen_makers, _facodegen_names, _split_overrides, parse_variant

_LOGGED: set = set()


def _build_impl(make, input_sets):
    """Build the callables (one per input set). Returns (result, fns, context, checked_set):
    context is a factory of the context the calls need (an SDPA backend choice), checked_set the
    inputs fns[0] runs on; fns is None when the implementation refused or failed to build (the
    reason is in result["note"])."""
    result: dict = {"tflops": None, "ms": None, "err": None, "note": None}
    try:
        built = [make(s) for s in input_sets]
    except Exception as err:  # noqa: BLE001
        msg = str(err)
        result["note"] = msg if msg.startswith(("skipped", "unavailable")) else f"setup failed: {type(err).__name__}: {msg}"
        return result, None, None, None
    if len(built[0]) > 2:
        result["variant"] = built[0][2]
    checked_set = built[0][3] if len(built[0]) > 3 else input_sets[0]
    return result, [b[0] for b in built], built[0][1], checked_set


def _check_impl(name: str, result: dict, fns, checked_set, c: dict, log) -> bool:
    """Run fns[0] once (the caller enters its context) and compare with the float64 reference on a slice; False
    with the reason in result["note"] when it fails or raises."""
    torch = _torch()
    try:
        o = fns[0]()
        torch.cuda.synchronize()
        ok, msg, err = _slice_check(o, checked_set, c["causal"], c["dtype"])
    except Exception as err:  # noqa: BLE001
        _note_failure(name, result, err, log)
        return False
    result["err"] = err
    if not ok:
        result["note"] = f"check failed: {msg}"
    return ok


def _rotation(fns):
    """A callable that calls the next input set's callable each time."""
    state = {"i": 0}

    def rotate():
        fns[state["i"] % len(fns)]()
        state["i"] += 1
    return rotate


def _note_failure(name: str, result: dict, err: Exception, log) -> None:
    first = str(err).strip().splitlines()[0] if str(err).strip() else ""
    result["note"] = f"failed: {type(err).__name__}: {first[:300]}"
    log(f"    {name}: {result['note']}")
    key = (name, result["note"])
    if key not in _LOGGED:            # the whole traceback once per distinct failure
        _LOGGED.add(key)
        log("    " + traceback.format_exc().strip().replace("\n", "\n    ")[-2000:])


def _record_time(result: dict, t: dict, c: dict) -> dict:
    flops = attention_flops(c["batch"], c["heads_q"], c["seqlen_q"], c["seqlen_k"], c["head_dim"], c["causal"])
    result.update(ms=t["ms"], tflops=tflops(flops, t["ms"]), min_ms=t["min_ms"], max_ms=t["max_ms"],
                  host_ms=t["host_ms"])
    if t["host_ms"] >= 0.9 * t["ms"]:
        result["note"] = (f"launch-bound: {t['host_ms'] * 1e3:.0f} us of host time per call vs "
                          f"{t['ms'] * 1e3:.0f} us on the device")
    return result


def _build_and_check(name: str, make, input_sets, c: dict, check_first: bool, log, then=None):
    """Build the implementation, enter its context once, check set 0 and, still inside that entry
    (SDPA's backend choice is a single-use context manager), run ``then(result, rotate)`` if given.
    Returns (result, rotate, context); rotate is None when it refused, failed to build or failed
    the check (the reason in result["note"])."""
    result, fns, context, checked_set = _build_impl(make, input_sets)
    if fns is None:
        return result, None, None
    with context():
        if check_first and not _check_impl(name, result, fns, checked_set, c, log):
            return result, None, None
        rotate = _rotation(fns)
        if then is not None:
            then(result, rotate)
    return result, rotate, context


def _time_alone(name: str, result: dict, rotate, c: dict, timing: dict, log, context=contextlib.nullcontext) -> None:
    """time_cuda of one implementation inside ``context()``, recorded into result (a failure: its note)."""
    try:
        with context():
            _record_time(result, time_cuda(rotate, **timing), c)
    except Exception as err:  # noqa: BLE001
        _note_failure(name, result, err, log)


def _run_impl(name: str, make, input_sets, c: dict, check_first: bool, timing: dict, log) -> dict:
    """Build, check set 0, then time rotating over the sets, all inside one entry of the
    implementation's context (one implementation at a time: run_cell's sequential mode)."""
    def time_in_check_entry(result: dict, rotate) -> None:
        _time_alone(name, result, rotate, c, timing, log)
    return _build_and_check(name, make, input_sets, c, check_first, log, then=time_in_check_entry)[0]


def _time_in_turns(prepared: list, row: dict, c: dict, timing: dict, log) -> None:
    """Time the checked implementations [(name, rotate, context)] group by group in turn. Should
    one raise while they take turns, each is timed alone so the others still get a number."""
    try:
        times = time_cuda_interleaved([rotate for _, rotate, _ in prepared],
                                      contexts=[context for _, _, context in prepared], **timing)
    except Exception as err:  # noqa: BLE001
        log(f"    taking turns failed ({type(err).__name__}: {str(err)[:200]}); timing each alone")
        for name, rotate, context in prepared:
            _time_alone(name, row["results"][name], rotate, c, timing, log, context)
        return
    for (name, _, _), t in zip(prepared, times):
        _record_time(row["results"][name], t, c)


def run_cell(c: dict, archs=("sm90",), peers=DEFAULT_PEERS, spec_overrides=None, check_first: bool = True,
             timing: dict | None = None, log=print, variants: dict | None = None, prepared: bool = True) -> dict:
    """Time facodegen (each arch, or each named variant: {name: "arch:field=value,..."}, names
    starting with "facodegen") and each peer on one cell, all on the same inputs. facodegen is
    timed through its public call under that name and, unless ``prepared`` is False, through a
    launcher prepared once beside it (prepared_name). Every implementation is built and checked
    first; then they all take turns group by group (time_cuda_interleaved), so the GPU's clock
    drift over the cell falls on each alike. ``timing={"interleave": False}`` times them one after
    the other instead."""
    torch = _torch()
    timing = dict(timing or {})
    interleave = timing.pop("interleave", True)
    row = dict(c)
    row["flops"] = attention_flops(c["batch"], c["heads_q"], c["seqlen_q"], c["seqlen_k"], c["head_dim"], c["causal"])
    row["results"] = {}
    try:
        n_sets = input_sets_needed(input_bytes(c), l2_bytes())
        input_sets = _make_inputs(c, n_sets)
    except Exception as err:  # noqa: BLE001
        for name in _facodegen_names(archs, variants, prepared):
            row["results"][name] = {"tflops": None, "note": f"inputs failed: {err}"}
        return row
    row["input_sets"] = n_sets
    makers = []                       # (name, make: InputSet -> (fn, context factory, ...))
    for name, text in (variants or {facodegen_name(arch): arch + ":" for arch in archs}).items():
        arch, fields = parse_variant(text)
        overrides = {**_split_overrides(spec_overrides, arch), **fields}
        makers += _facodegen_makers(name, arch, overrides, c["causal"], prepared)
    for name in peers:
        available, note = peer_available(name)
        if not available:
            makers.append((name, f"unavailable: {note}"))
            continue
        makers.append((name, (lambda n: lambda s: _peer_fn(n, s, c["causal"]))(name)))
    prepared = []
    for name, make in makers:
        if isinstance(make, str):
            row["results"][name] = {"tflops": None, "note": make}
            continue
        if not interleave:
            row["results"][name] = _run_impl(name, make, input_sets, c, check_first, timing, log)
            continue
        result, rotate, context = _build_and_check(name, make, input_sets, c, check_first, log)
        row["results"][name] = result
        if rotate is not None:
            prepared.append((name, rotate, context))
    if prepared:
        _time_in_turns(prepared, row, c, timing, log)
    del input_sets
    torch.cuda.synchronize()
    return row


def _cell_tag(c: dict) -> str:
    return (f"{c['dtype']} d{c['head_dim']} {'causal' if c['causal'] else 'full'} s{c['seqlen_q']}"
            f"{'' if c['seqlen_q'] == c['seqlen_k'] else 'x' + str(c['seqlen_k'])} b{c['batch']} h{c['heads_q']}")


def run_grid(cells: list[dict], archs=("sm90",), peers=DEFAULT_PEERS, spec_overrides=None,
             budget_s: float | None = None, check_first: bool = True, timing: dict | None = None,
             log=print, variants: dict | None = None, prepared: bool = True) -> list[dict]:
    """run_cell over a grid. A cell that raises is reported in its row and the grid goes on;
    once ``budget_s`` seconds have passed, the remaining cells are listed as skipped."""
    if isinstance(archs, str):
        archs = (archs,)
    t0 = time.monotonic()
    rows = []
    for i, c in enumerate(cells):
        elapsed = time.monotonic() - t0
        if budget_s is not None and elapsed > budget_s:
            row = dict(c, results={n: {"tflops": None, "note": "skipped: time budget spent"}
                                   for n in _facodegen_names(archs, variants, prepared)})
            rows.append(row)
            continue
        log(f"[{i + 1}/{len(cells)}] {_cell_tag(c)}  ({elapsed:.0f} s)")
        try:
            row = run_cell(c, archs, peers, spec_overrides, check_first, timing, log, variants, prepared)
        except Exception as err:  # noqa: BLE001
            log("    " + traceback.format_exc().strip().replace("\n", "\n    "))
            row = dict(c, results={n: {"tflops": None, "note": f"cell failed: {err}"}
                                   for n in _facodegen_names(archs, variants, prepared)})
        summary = ", ".join(f"{n} {r['tflops']:.1f}" if r.get("tflops") is not None else f"{n} -"
                            for n, r in row["results"].items())
        log(f"    {summary}")
        rows.append(row)
    return rows


def run_cli_bench(spec, arch: str | None = None, head_dim: int | None = None, dtype: str | None = None,
                  causal: bool | None = None, seqlen: int = 4096, batch: int = 4, heads: int = 16,
                  peers=DEFAULT_PEERS, seqlen_k: int | None = None, heads_kv: int | None = None,
                  prepared: bool = True) -> str:
    """``facodegen bench``: one cell, facodegen's public call (and, unless ``prepared`` is False,
    its prepared launcher beside it) against the peers, as a markdown table plus notes.

    ``spec`` is a KernelSpec (its tile fields are passed to the launcher as overrides) or a dict
    of spec overrides, with arch/head_dim/dtype/causal given separately."""
    if hasattr(spec, "as_dict"):
        fields = spec.as_dict()
        arch = arch or fields["arch"]
        head_dim = head_dim or fields["head_dim_real"]      # the problem's d (80 on the 96 tile: 80)
        dtype = dtype or fields["dtype"]
        causal = fields["causal"] if causal is None else causal
        overrides = {k: v for k, v in spec.launch_fields().items() if k != "arch"}
    else:
        overrides = dict(spec or {})
    c = cell(head_dim or 128, bool(causal), seqlen, batch, heads, dtype or "bf16", seqlen_k, heads_kv)
    row = run_cell(c, (arch or "sm90",), peers, overrides, prepared=prepared)
    notes = format_notes([row])
    return format_table([row]) + ("\n\n" + notes if notes else "")
