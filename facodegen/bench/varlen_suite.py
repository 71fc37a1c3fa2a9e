"""The varlen suite (`facodegen bench --suite varlen`): prefill over packed sequences of mixed
lengths, facodegen.attention_varlen beside FlashAttention-3's ``flash_attn_varlen_func`` and beside
the padded way, every sequence padded to the longest: facodegen.attention on (batch, max_seqlen)
(the sm80 kernel and the GPU's native arch where that differs, each the varlen kernel of its arch
without varlen; facodegen varlen runs the native arch's, and on sm90 GPUs the sm80 one is timed
too) and cuDNN through torch SDPA's CUDNN_ATTENTION backend (SDPA's cuDNN backend has no packed
varlen call, so cuDNN is timed padded only).

Cells: bf16, head_dim 64/128, causal and not, heads = 2048 / head_dim (grids.HIDDEN), and per cell
two sets of sequences: ``mixed`` (lengths drawn with a fixed seed, uniform in [100, 8192], summing to
about 32k tokens: draw_lengths) and ``equal`` (8 x 4096), where the padded kernel does no extra work
and varlen should be within 5% of it (EQUAL_TOLERANCE; the verdict is a note under the table). On
sm90 GPUs the varlen kernel also runs with persistent=False (one CTA per tile, the column "facodegen
varlen (not persistent)"), timed in the same turns, with its ratios in a note (persistent_verdict),
and on causal cells with varlen_lpt=True (each sequence's tiles longest first over L2-sized groups of
its heads, the column "facodegen varlen (lpt)": issue 39's A/B of that order; its ratios in a note,
lpt_verdict).
``--quick``: head_dim 128 only and fewer groups and calls (QUICK_TIMING).

TFLOP/s counts only the real work: the sum over sequences of 4 * heads * seqlen_q * seqlen_k *
head_dim, half of that for causal (varlen_flops); the padded implementations are charged the same
FLOPs, so their TFLOP/s fall by the padding they compute (the table's `real/padded` column).

Timing: timing.time_cuda_interleaved, every implementation in turns group by group; where one input
set is under twice the L2 the calls rotate over several (inputs.input_sets_needed; the suite's
32k-token cells need one). Before timing, each varlen output is checked against the float64
reference (inputs.reference_torch) on the first and the last sequence, heads 0 and 1, and each padded
output against the reference of the padded problem on batch 0 (inputs._slice_check); a failing,
missing or refusing implementation is reported with the reason and not timed. The pure parts
(lengths, cu_seqlens, FLOPs, cells, rows, the table, the files) import without torch."""

from __future__ import annotations

import csv
import io
import json
import random
import time

from .grids import HIDDEN, attention_flops, tflops
from .inputs import L2_BYTES_DEFAULT, input_sets_needed
from .timing import time_cuda_interleaved

DTYPE = "bf16"
HEAD_DIMS = (64, 128)
QUICK_HEAD_DIMS = (128,)
CAUSAL = (False, True)
TOTAL_TOKENS = 32768
MIN_LEN, MAX_LEN = 100, 8192
SEED = 0
EQUAL = (8, 4096)                 # sequences x tokens of the equal-lengths cell
EQUAL_TOLERANCE = 0.05            # varlen within 5% of the padded kernel of the same code there
QUICK_TIMING = {"warmup": 2, "groups": 3, "calls": 5}
VARLEN_PEERS = ("fa3", "cudnn")

# implementation -> column title; the varlen ones first, then the padded ones
FACODEGEN_VARLEN = "facodegen-varlen"             # the GPU's own arch (sm90 on H100/H200), as a call picks it
FACODEGEN_VARLEN_SM80 = "facodegen-varlen-sm80"   # where that is not sm80: the sm80 kernel beside it
FACODEGEN_VARLEN_NP = "facodegen-varlen-np"       # on sm90: its varlen kernel with persistent=False (one CTA a tile)
FACODEGEN_VARLEN_LPT = "facodegen-varlen-lpt"     # on sm90, causal: its varlen kernel with varlen_lpt=True
FA3_VARLEN = "fa3-varlen"
PADDED_SM80 = "facodegen-padded-sm80"
PADDED_SM90 = "facodegen-padded-sm90"
CUDNN_PADDED = "cudnn-padded"
TITLES = {
    FACODEGEN_VARLEN: "facodegen varlen",
    FACODEGEN_VARLEN_SM80: "facodegen varlen (sm80)",
    FACODEGEN_VARLEN_NP: "facodegen varlen (not persistent)",
    FACODEGEN_VARLEN_LPT: "facodegen varlen (lpt)",
    FA3_VARLEN: "FA3 varlen",
    PADDED_SM80: "facodegen padded (sm80)",
    PADDED_SM90: "facodegen padded (sm90)",
    CUDNN_PADDED: "cuDNN padded (SDPA)",
}
IMPLS = tuple(TITLES)
CSV_FIELDS = ("cell", "dtype", "head_dim", "causal", "heads", "sequences", "tokens", "max_seqlen", "flops",
              "padded_flops", "impl", "tflops", "ms", "host_ms", "err", "note")
NOTES = (
    "TFLOP/s count only the real (unpadded) work: the sum over sequences of 4 * heads * seqlen^2 * "
    "head_dim, half for causal; the padded columns compute every sequence padded to the longest "
    "(real/padded: the share of their work that is real) and are charged the real FLOPs; the copies "
    "that pad and unpad are not timed.",
    "cuDNN padded: torch SDPA's CUDNN_ATTENTION backend on (batch, max_seqlen) tensors; SDPA's cuDNN "
    "backend has no packed varlen call, so cuDNN is timed the padded way only.",
    "facodegen varlen is the GPU's own arch's varlen kernel (sm90 on H100/H200: wgmma and TMA, persistent "
    "CTAs numbering the tiles densely over the sequences, O stored by TMA where 64 rows lie inside the "
    "sequence, else row by row; sm80 elsewhere), held to the "
    "padded kernel of its arch (the same code without varlen; sm90's padded one is persistent too); on sm90 "
    "GPUs facodegen varlen (not persistent) is the same kernel with persistent=False (one CTA per tile, "
    "the grid sized by max_seqlen_q), facodegen varlen (lpt) the same kernel with varlen_lpt=True (causal: "
    "each sequence's tiles longest first over L2-sized groups of its heads) and facodegen varlen (sm80) the "
    "sm80 kernel compiled for them.",
)


# ------------------------------------------------------------------ the pure part

def draw_lengths(total: int = TOTAL_TOKENS, lo: int = MIN_LEN, hi: int = MAX_LEN, seed: int = SEED) -> list[int]:
    """Sequence lengths uniform in [lo, hi] from random.Random(seed), drawn until the next would pass
    ``total``; the rest is one more sequence where it is at least ``lo`` long. The sum is in
    (total - lo, total], every length in [lo, hi], the same list for the same arguments."""
    if not 0 < lo <= hi or total < lo:
        raise ValueError(f"lengths: need 0 < lo <= hi and total >= lo, got lo={lo} hi={hi} total={total}")
    rng = random.Random(seed)
    lengths: list[int] = []
    while True:
        x = rng.randint(lo, hi)
        rest = total - sum(lengths)
        if x >= rest:
            if rest >= lo:
                lengths.append(rest)
            return lengths
        lengths.append(x)


def cu_seqlens(lengths) -> list[int]:
    """Prefix sums starting at 0: sequence b is tokens cu[b] .. cu[b+1]-1 (FlashAttention's layout)."""
    out = [0]
    for n in lengths:
        if n < 0:
            raise ValueError(f"lengths must be >= 0, got {n}")
        out.append(out[-1] + int(n))
    return out


def varlen_flops(lengths_q, lengths_k, heads: int, head_dim: int, causal: bool) -> float:
    """Real forward FLOPs of packed sequences: grids.attention_flops summed over the sequences."""
    return sum(attention_flops(1, heads, sq, sk, head_dim, causal) for sq, sk in zip(lengths_q, lengths_k))


def padded_flops(lengths, heads: int, head_dim: int, causal: bool) -> float:
    """FLOPs of the padded problem: batch = len(lengths) sequences of max(lengths) tokens."""
    return attention_flops(len(lengths), heads, max(lengths), max(lengths), head_dim, causal)


def cell(lengths, head_dim: int, causal: bool, name: str) -> dict:
    lengths = [int(n) for n in lengths]
    heads = HIDDEN // head_dim
    return {"cell": name, "dtype": DTYPE, "head_dim": head_dim, "causal": bool(causal), "heads": heads,
            "lengths": lengths, "sequences": len(lengths), "tokens": sum(lengths), "max_seqlen": max(lengths),
            "flops": varlen_flops(lengths, lengths, heads, head_dim, causal),
            "padded_flops": padded_flops(lengths, heads, head_dim, causal)}


def cells(quick: bool = False, head_dim: int | None = None, causal: bool | None = None) -> list[dict]:
    """`bench --suite varlen`'s cells: per head_dim and mask the mixed draw and the equal lengths
    (--quick: head_dim 128 only); optionally one head_dim and/or one mask."""
    dims = QUICK_HEAD_DIMS if quick else HEAD_DIMS
    if head_dim is not None:
        dims = tuple(d for d in dims if d == head_dim)
    masks = CAUSAL if causal is None else (bool(causal),)
    mixed, equal = draw_lengths(), [EQUAL[1]] * EQUAL[0]
    return [cell(lengths, d, c, name) for d in dims for c in masks
            for name, lengths in (("mixed", mixed), (f"equal {EQUAL[0]}x{EQUAL[1]}", equal))]


def varlen_bytes(c: dict) -> int:
    """Bytes of packed Q, K, V and O of a cell (bf16)."""
    return 4 * c["tokens"] * c["heads"] * c["head_dim"] * 2


def padded_bytes(c: dict) -> int:
    return 4 * c["sequences"] * c["max_seqlen"] * c["heads"] * c["head_dim"] * 2


def input_sets(c: dict, l2_bytes: int = L2_BYTES_DEFAULT) -> int:
    """Input sets to rotate over so the calls do not find them in the L2 (inputs.input_sets_needed over
    the smaller, packed, set)."""
    return input_sets_needed(varlen_bytes(c), l2_bytes)


def ratio(row: dict, a: str, b: str) -> float | None:
    """TFLOP/s of ``a`` over ``b`` (> 1: a is faster), None where either was not timed."""
    ta = row["results"].get(a, {}).get("tflops")
    tb = row["results"].get(b, {}).get("tflops")
    return ta / tb if ta and tb else None


def padded_reference(row: dict) -> str | None:
    """The padded kernel varlen is held to on the equal-lengths cell: the one of facodegen varlen's
    arch (sm90 where the sm80 varlen kernel ran beside it, else sm80), else the other."""
    order = (PADDED_SM90, PADDED_SM80) if FACODEGEN_VARLEN_SM80 in row["results"] else (PADDED_SM80, PADDED_SM90)
    for name in order:
        if row["results"].get(name, {}).get("tflops"):
            return name
    return None


def equal_verdict(row: dict) -> str | None:
    """On an equal-lengths cell: whether varlen is within EQUAL_TOLERANCE of the padded kernel."""
    if not row["cell"].startswith("equal"):
        return None
    ref = padded_reference(row)
    r = ratio(row, FACODEGEN_VARLEN, ref) if ref else None
    if r is None:
        return None
    ok = r >= 1 - EQUAL_TOLERANCE
    return (f"{_tag(row)}: varlen / {TITLES[ref]} = {r:.3f} "
            f"({'within' if ok else 'NOT within'} {EQUAL_TOLERANCE:.0%})")


def persistent_verdict(row: dict) -> str | None:
    """On an equal-lengths cell where the sm90 varlen kernel ran with persistent=False beside it: that
    one's ratio to the padded kernel, and the persistent one's to it (> 1: persistent is faster)."""
    if not row["cell"].startswith("equal") or not row["results"].get(FACODEGEN_VARLEN_NP, {}).get("tflops"):
        return None
    ref = padded_reference(row)
    np_padded = ratio(row, FACODEGEN_VARLEN_NP, ref) if ref else None
    persistent_np = ratio(row, FACODEGEN_VARLEN, FACODEGEN_VARLEN_NP)
    return (f"{_tag(row)}: varlen (not persistent) / {TITLES.get(ref, ref)} = "
            f"{'–' if np_padded is None else f'{np_padded:.3f}'}, varlen / varlen (not persistent) = "
            f"{'–' if persistent_np is None else f'{persistent_np:.3f}'}")


def lpt_verdict(row: dict) -> str | None:
    """On a cell where the sm90 varlen kernel ran with varlen_lpt=True beside it (issue 39's A/B of the
    causal tile order): its ratio to the default (> 1: longest first is faster) and to the padded kernel."""
    if not row["results"].get(FACODEGEN_VARLEN_LPT, {}).get("tflops"):
        return None
    ref = padded_reference(row)
    lpt_padded = ratio(row, FACODEGEN_VARLEN_LPT, ref) if ref else None
    lpt_default = ratio(row, FACODEGEN_VARLEN_LPT, FACODEGEN_VARLEN)
    return (f"{_tag(row)}: varlen (lpt) / varlen = {'–' if lpt_default is None else f'{lpt_default:.3f}'}, "
            f"varlen (lpt) / {TITLES.get(ref, ref)} = {'–' if lpt_padded is None else f'{lpt_padded:.3f}'}")


def _tag(row: dict) -> str:
    return f"{row['cell']} d{row['head_dim']} {'causal' if row['causal'] else 'full'}"


def _num(r: dict | None) -> str:
    if not r:
        return "–"
    if r.get("tflops") is not None:
        return f"{r['tflops']:.1f}"
    note = (r.get("note") or "").lower()
    return "–" if note.startswith(("skipped", "unavailable")) else "fail"


def _x(r: float | None) -> str:
    return f"{r:.2f}x" if r is not None else "–"


def implementations(rows: list[dict]) -> list[str]:
    """The implementations in the rows, in IMPLS order (varlen first, then padded)."""
    seen = {name for row in rows for name in row.get("results", {})}
    return [name for name in IMPLS if name in seen] + sorted(seen - set(IMPLS))


def format_table(rows: list[dict]) -> str:
    """Markdown: one line per cell, TFLOP/s (real work) of each implementation, then facodegen varlen's
    ratio to FA3 varlen, to its own padded kernel and to cuDNN padded ("fail" = ran and failed its
    check or raised; "–" = not run)."""
    impls = implementations(rows)
    head = ["cell", "d", "causal", "seqs", "tokens", "max", "real/padded"]
    head += [TITLES.get(n, n) for n in impls] + ["varlen/FA3", "varlen/padded", "varlen/cuDNN"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        res = row.get("results", {})
        ref = padded_reference(row)
        cells_ = [row["cell"], str(row["head_dim"]), "yes" if row["causal"] else "no", str(row["sequences"]),
                  str(row["tokens"]), str(row["max_seqlen"]), f"{row['flops'] / row['padded_flops']:.2f}"]
        cells_ += [_num(res.get(n)) for n in impls]
        cells_ += [_x(ratio(row, FACODEGEN_VARLEN, FA3_VARLEN)),
                   _x(ratio(row, FACODEGEN_VARLEN, ref) if ref else None),
                   _x(ratio(row, FACODEGEN_VARLEN, CUDNN_PADDED))]
        lines.append("| " + " | ".join(cells_) + " |")
    return "\n".join(lines)


def format_notes(rows: list[dict]) -> str:
    """The suite's notes (real FLOPs, cuDNN padded, the sm80 kernel), the mixed lengths, the
    equal-lengths verdicts, and one line per implementation not timed or timed with a remark."""
    out = [f"- {n}" for n in NOTES]
    mixed = next((r for r in rows if r["cell"] == "mixed"), None)
    if mixed is not None:
        out.append(f"- mixed lengths (seed {SEED}, uniform in [{MIN_LEN}, {MAX_LEN}]): "
                   + ", ".join(map(str, mixed["lengths"])))
    out += [f"- {v}" for v in (equal_verdict(r) for r in rows) if v]
    out += [f"- {v}" for v in (persistent_verdict(r) for r in rows) if v]
    out += [f"- {v}" for v in (lpt_verdict(r) for r in rows) if v]
    for row in rows:
        for note in row.get("notes", ()):
            out.append(f"- {_tag(row)}: {note}")
        for name, r in row.get("results", {}).items():
            if r.get("note"):
                out.append(f"- {_tag(row)} {name}: {r['note']}")
    return "\n".join(out)


def summary(rows: list[dict]) -> str:
    """The table and its notes, as printed and written."""
    return format_table(rows) + "\n\nNotes:\n" + format_notes(rows)


def to_csv(rows: list[dict]) -> str:
    """One record per (cell, implementation)."""
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=CSV_FIELDS, lineterminator="\n")
    writer.writeheader()
    for row in rows:
        for name, r in row.get("results", {}).items():
            rec = {k: row.get(k) for k in CSV_FIELDS[:10]}
            rec.update(impl=name, tflops=r.get("tflops"), ms=r.get("ms"), host_ms=r.get("host_ms"), err=r.get("err"),
                       note=r.get("note"))
            writer.writerow({k: ("" if v is None else (f"{v:.6g}" if isinstance(v, float) else v))
                             for k, v in rec.items()})
    return buf.getvalue()


def write_varlen_results(rows: list[dict], out_dir, stem: str = "bench-varlen", env: dict | None = None) -> dict:
    """Write <stem>.md (table and notes), .csv and .json (rows, environment) into ``out_dir``."""
    from pathlib import Path

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"md": out / f"{stem}.md", "csv": out / f"{stem}.csv", "json": out / f"{stem}.json"}
    paths["md"].write_text(summary(rows) + "\n")
    paths["csv"].write_text(to_csv(rows))
    paths["json"].write_text(json.dumps({"env": env or {}, "rows": rows}, indent=1, default=str) + "\n")
    return paths


# ------------------------------------------------------------------ the GPU part

class Impl:
    """One implementation of a cell: ``fn()`` (one timed call, rotating over the input sets),
    ``check()`` -> (ok, message, rel_fro) on the first set, ``context`` (a factory entered around its
    calls, e.g. the SDPA backend choice)."""

    def __init__(self, fn, check, context=None):
        import contextlib
        self.fn, self.check, self.context = fn, check, context or contextlib.nullcontext


def _inputs(c: dict) -> list[dict]:
    """Fresh randn input sets: packed q, k, v (total, heads, d) with their int32 cu_seqlens, and the
    same tokens padded to (batch, max_seqlen, heads, d), the padding randn too (never zeros)."""
    import torch
    dt = torch.bfloat16
    cu = torch.tensor(cu_seqlens(c["lengths"]), dtype=torch.int32, device="cuda")
    shape = (c["tokens"], c["heads"], c["head_dim"])
    pshape = (c["sequences"], c["max_seqlen"], c["heads"], c["head_dim"])
    sets = []
    for _ in range(input_sets(c)):
        packed = [torch.randn(shape, dtype=dt, device="cuda") for _ in range(3)]
        padded = [torch.randn(pshape, dtype=dt, device="cuda") for _ in range(3)]
        for p, x in zip(padded, packed):
            for b, (s0, n) in enumerate(zip(cu_seqlens(c["lengths"]), c["lengths"])):
                p[b, :n] = x[s0:s0 + n]
        sets.append({"packed": packed, "padded": padded, "cu": cu})
    return sets


def _check_varlen(out, s: dict, c: dict) -> tuple[bool, str, float]:
    """The first and the last sequence, heads 0 and 1, against the float64 reference."""
    from ..verify.reference import check, compare
    from .inputs import reference_torch
    q, k, v = s["packed"]
    cu = cu_seqlens(c["lengths"])
    worst = (True, "", 0.0)
    for b in sorted({0, len(c["lengths"]) - 1}):
        lo, hi = cu[b], cu[b + 1]
        ref = reference_torch(q[None, lo:hi, :2], k[None, lo:hi, :2], v[None, lo:hi, :2], c["causal"])
        got = out[None, lo:hi, :2]
        ok, msg = check(got, ref, DTYPE)
        err = compare(got, ref)["rel_fro"]
        if not ok or err >= worst[2]:
            worst = (ok, f"sequence {b}: {msg}", err)
        if not ok:
            break
    return worst


def _check_padded(out, s: dict, c: dict) -> tuple[bool, str, float]:
    from .inputs import InputSet, _slice_check
    return _slice_check(out, InputSet(*s["padded"]), c["causal"], DTYPE)


def _impls(c: dict, sets: list[dict], peers=VARLEN_PEERS) -> tuple[dict, list[str]]:
    """name -> Impl for the cell (facodegen varlen, FA3 varlen, facodegen padded sm80 and native,
    cuDNN padded), and notes on the peers left out."""
    import facodegen
    from torch.nn.attention import SDPBackend, sdpa_kernel
    import torch.nn.functional as F

    from ..ops import api
    from .peers import _fa3_module

    causal, n = c["causal"], len(sets)
    lengths_max = c["max_seqlen"]
    turn = {"i": 0}

    def pick():
        turn["i"] = (turn["i"] + 1) % n
        return sets[turn["i"]]

    def first(check_fn, call):          # the check runs on the first set
        return lambda: check_fn(call(sets[0]), sets[0], c)

    def ours_varlen(s, arch=None, **spec_fields):
        q, k, v = s["packed"]
        return facodegen.attention_varlen(q, k, v, s["cu"], s["cu"], lengths_max, lengths_max, causal=causal,
                                          arch=arch, **spec_fields)

    native = api.default_arch(api.device_info(0))
    impls, notes = {}, []
    impls[FACODEGEN_VARLEN] = Impl(lambda: ours_varlen(pick()), first(_check_varlen, ours_varlen))
    if native == "sm90":        # the same kernel with one CTA per tile (issue 39: persistent against not)
        def ours_np(s):
            return ours_varlen(s, "sm90", persistent=False)
        impls[FACODEGEN_VARLEN_NP] = Impl(lambda: ours_np(pick()), first(_check_varlen, ours_np))

        if causal:                  # issue 39's A/B: each sequence's tiles longest first
            def ours_lpt(s):
                return ours_varlen(s, "sm90", varlen_lpt=True)
            impls[FACODEGEN_VARLEN_LPT] = Impl(lambda: ours_lpt(pick()), first(_check_varlen, ours_lpt))
    if native != "sm80":
        def ours_sm80(s):
            return ours_varlen(s, "sm80")
        impls[FACODEGEN_VARLEN_SM80] = Impl(lambda: ours_sm80(pick()), first(_check_varlen, ours_sm80))
    if "fa3" in peers:
        mod, err = _fa3_module()
        fa3 = getattr(mod, "flash_attn_varlen_func", None) if mod is not None else None
        if fa3 is None:
            notes.append(f"FA3 varlen skipped: flash_attn_interface.flash_attn_varlen_func not importable "
                         f"({err or 'no flash_attn_varlen_func'})")
        else:
            def fa3_varlen(s):
                q, k, v = s["packed"]
                r = fa3(q, k, v, s["cu"], s["cu"], lengths_max, lengths_max, causal=causal)
                return r[0] if isinstance(r, (tuple, list)) else r
            impls[FA3_VARLEN] = Impl(lambda: fa3_varlen(pick()), first(_check_varlen, fa3_varlen))
    archs = ["sm80"]
    if native != "sm80":
        archs.append(native)
    for arch in archs:
        def padded(s, arch=arch):
            q, k, v = s["padded"]
            return facodegen.attention(q, k, v, causal=causal, arch=arch)
        impls[PADDED_SM80 if arch == "sm80" else PADDED_SM90] = Impl(lambda padded=padded: padded(pick()),
                                                                     first(_check_padded, padded))
    if "cudnn" in peers:
        def cudnn(s):
            q, k, v = s["padded"]
            return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                  is_causal=causal).transpose(1, 2)
        backend = lambda: sdpa_kernel(SDPBackend.CUDNN_ATTENTION)  # noqa: E731

        def cudnn_check():
            with backend():
                return _check_padded(cudnn(sets[0]), sets[0], c)
        impls[CUDNN_PADDED] = Impl(lambda: cudnn(pick()), cudnn_check, backend)
    return impls, notes


def _synchronize() -> None:
    import torch
    torch.cuda.synchronize()


def _release() -> None:
    import torch
    torch.cuda.empty_cache()


def measure(c: dict, peers=VARLEN_PEERS, quick: bool = False) -> dict:
    """One row: each implementation checked, then the ones that passed timed in turns."""
    sets = _inputs(c)
    impls, notes = _impls(c, sets, peers)
    results, good = {}, []
    for name, impl in impls.items():
        try:
            with impl.context():
                ok, msg, err = impl.check()
        except Exception as exc:  # noqa: BLE001 (a peer that refuses the cell is reported, not fatal)
            results[name] = {"note": f"{type(exc).__name__}: {str(exc)[:200]}"}
            continue
        if not ok:
            results[name] = {"err": err, "note": f"failed its check, not timed ({msg})"}
            continue
        results[name] = {"err": err}
        good.append(name)
    _synchronize()
    kwargs = dict(QUICK_TIMING) if quick else {}
    timed = time_cuda_interleaved([impls[n].fn for n in good], contexts=[impls[n].context for n in good],
                                  **kwargs) if good else []
    for name, t in zip(good, timed):
        results[name].update(ms=t["ms"], host_ms=t["host_ms"], tflops=tflops(c["flops"], t["ms"]))
    sets.clear()
    _release()
    return dict(c, sets=input_sets(c), results=results, notes=notes)


def run_varlen(todo: list[dict], peers=VARLEN_PEERS, quick: bool = False, log=print) -> list[dict]:
    """measure over the cells; a cell that raises is reported in its row and the run goes on."""
    rows = []
    t0 = time.time()
    for c in todo:
        try:
            row = measure(c, peers, quick)
        except Exception as exc:  # noqa: BLE001 (one cell's failure must not lose the others)
            row = dict(c, results={}, notes=[f"ERROR {type(exc).__name__}: {exc}"])
        rows.append(row)
        log(f"[{time.time() - t0:6.1f}s] {_tag(row)}: " + ", ".join(
            f"{name} {r['tflops']:.1f}" for name, r in row["results"].items() if r.get("tflops"))
            + "".join(f" {n}" for n in row["notes"]))
    return rows
