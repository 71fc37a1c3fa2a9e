"""Implementation names and the result tables: the peers' titles, facodegen's column names (its
public call and, beside it, the prepared launcher), the best peer and facodegen's ratio to it, and
the markdown table and notes of a grid's rows. Runs anywhere: no torch, no GPU."""

from __future__ import annotations

PEER_TITLES = {
    "fa3": "FlashAttention-3",
    "cudnn": "cuDNN (SDPA)",
    "fa2": "FlashAttention-2 (SDPA)",
    "efficient": "mem-efficient (SDPA)",
    "flex": "FlexAttention",
}


def facodegen_name(arch: str) -> str:
    return f"facodegen-{arch}"


def is_facodegen(name: str) -> bool:
    return name.startswith("facodegen")


# facodegen is timed twice per cell: through the public call (``facodegen.attention``, what users
# run: the name as given, e.g. "facodegen-sm90") and through a launcher prepared once (the kernel
# with the least host work: the same name + this suffix), shown beside it, never instead of it.
PREPARED_SUFFIX = " (prepared)"


def prepared_name(name: str) -> str:
    return name + PREPARED_SUFFIX


def is_prepared(name: str) -> bool:
    return is_facodegen(name) and name.endswith(PREPARED_SUFFIX)


def has_ratio(name: str) -> bool:
    """Whether an implementation gets a ratio to the best peer: facodegen's public call only (the
    peers are timed through their public calls too, so that is the like-for-like figure)."""
    return is_facodegen(name) and not is_prepared(name)


def best_peer(row: dict) -> tuple[str | None, float | None]:
    """(name, TFLOP/s) of the fastest peer that passed its check, or (None, None)."""
    best = (None, None)
    for name, r in row.get("results", {}).items():
        t = r.get("tflops")
        if is_facodegen(name) or t is None:
            continue
        if best[1] is None or t > best[1]:
            best = (name, t)
    return best


def ratio_to_best_peer(row: dict, name: str) -> float | None:
    t = row.get("results", {}).get(name, {}).get("tflops")
    _, best = best_peer(row)
    if t is None or not best:
        return None
    return t / best


def implementations(rows: list[dict], facodegen_first: bool = True) -> list[str]:
    """Every implementation in the rows, facodegen's first (table columns) or last (plot bars)."""
    names: list[str] = []
    for row in rows:
        for name in row.get("results", {}):
            if name not in names:
                names.append(name)
    ours = [n for n in names if is_facodegen(n)]
    peers = [n for n in names if not is_facodegen(n)]
    return ours + peers if facodegen_first else peers + ours


def _fmt_result(r: dict | None, ceiling: float | None = None) -> str:
    """TFLOP/s, with the fraction of the GEMM ceiling when the row carries one."""
    if r is None:
        return "–"
    if r.get("tflops") is not None:
        return f"{r['tflops']:.1f}" + (f" ({r['tflops'] / ceiling:.0%})" if ceiling else "")
    note = (r.get("note") or "").lower()
    if note.startswith("skipped") or note.startswith("unavailable"):
        return "–"
    return "fail"


def format_table(rows: list[dict]) -> str:
    """Markdown: one line per cell, TFLOP/s of each implementation (and the fraction of the bf16
    GEMM rate where a row carries ``gemm_tflops``), the best peer and the ratio of each facodegen
    arch's public call to it; the prepared launcher's column stands beside its public call with no
    ratio of its own ("fail" = ran but failed its check or raised; "–" = not run)."""
    impls = implementations(rows)
    ours = [n for n in impls if has_ratio(n)]
    head = ["dtype", "head_dim", "causal", "seqlen", "batch", "heads"]
    head += [n if is_facodegen(n) else PEER_TITLES.get(n, n) for n in impls]
    head += ["best peer"] + [f"{n.removeprefix('facodegen-')}/best" for n in ours]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        seqlen = str(row["seqlen_q"]) if row["seqlen_q"] == row["seqlen_k"] else f"{row['seqlen_q']}/{row['seqlen_k']}"
        heads = str(row["heads_q"]) if row["heads_q"] == row["heads_kv"] else f"{row['heads_q']}/{row['heads_kv']}"
        cells = [row["dtype"], str(row["head_dim"]), "yes" if row["causal"] else "no", seqlen,
                 str(row["batch"]), heads]
        cells += [_fmt_result(row.get("results", {}).get(n), row.get("gemm_tflops")) for n in impls]
        name, _ = best_peer(row)
        cells.append(PEER_TITLES.get(name, name) if name else "–")
        for n in ours:
            r = ratio_to_best_peer(row, n)
            cells.append(f"{r:.2f}" if r is not None else "–")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def format_notes(rows: list[dict]) -> str:
    """One line per implementation that was not timed, or timed with a remark, with the reason."""
    out = []
    for row in rows:
        tag = (f"{row['dtype']} d{row['head_dim']} {'causal' if row['causal'] else 'full'} "
               f"s{row['seqlen_q']}x{row['seqlen_k']} b{row['batch']} h{row['heads_q']}/{row['heads_kv']}")
        for name, r in row.get("results", {}).items():
            extra = [r["note"]] if r.get("note") else []
            if r.get("err") is not None:
                extra.append(f"rel_fro {r['err']:.2e}")
            if r.get("variant"):
                extra.append(r["variant"])
            if r.get("note"):
                out.append(f"- {tag} {name}: " + "; ".join(extra))
    return "\n".join(out)
