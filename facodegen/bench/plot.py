"""The plot of a grid's results, in the style of the FlashAttention papers' figures.

One panel per (head_dim, causal), sequence lengths along x, one bar per implementation in each
seqlen group, TFLOP/s on y with the value written on each bar; a bar that ran but failed its check
is marked with an "x" at its base. facodegen's prepared launcher ("... (prepared)") stands next to
its public call in the same colour, hatched. Input: the rows of ``runner.run_grid``.

matplotlib is an optional dependency (``pip install 'facodegen[plot]'``); it is imported only when
a plot is drawn, and never through pyplot (no global backend state: a ``Figure`` drawn by Agg).
"""

from __future__ import annotations

from pathlib import Path

from . import tables
from .tables import PEER_TITLES, PREPARED_SUFFIX, is_facodegen, is_prepared

# Fixed colours so an implementation keeps its colour across figures (facodegen in the warm
# colours, peers in the cool ones; FlashAttention-3 purple as in its paper).
COLORS = {
    "facodegen-sm90": "#d62728", "facodegen-sm80": "#ff7f0e",
    "fa3": "#9467bd", "cudnn": "#2ca02c", "fa2": "#1f77b4", "efficient": "#7f7f7f", "flex": "#17becf",
}
_FALLBACK = ("#8c564b", "#e377c2", "#bcbd22", "#aec7e8", "#98df8a", "#ffbb78", "#c5b0d5", "#c49c94",
             "#f7b6d2", "#dbdb8d", "#9edae5", "#393b79")


class PlotUnavailable(ImportError):
    """matplotlib is not installed."""


def _matplotlib():
    try:
        from matplotlib.figure import Figure
    except ImportError as err:
        raise PlotUnavailable(
            f"plots need matplotlib ({err}); install it with `pip install 'facodegen[plot]'`") from None
    return Figure


def impl_title(name: str) -> str:
    return name if is_facodegen(name) else PEER_TITLES.get(name, name)


def _seqlen_label(s: int) -> str:
    return f"{s // 1024}k" if s >= 1024 and s % 1024 == 0 else str(s)


def panels(rows: list[dict]) -> list[tuple[int, bool, str]]:
    """(head_dim, causal, family) of each panel: non-causal first (the papers' top row), head_dim
    up; ``family`` is a row's optional label for cells that share head_dim and mask but not the
    batch (the evolution suite's "16k tokens per batch" and "batch 1")."""
    keys = sorted({(r["head_dim"], bool(r["causal"]), r.get("family", "")) for r in rows},
                  key=lambda k: (k[1], k[0], k[2]))
    return keys


def implementations(rows: list[dict]) -> list[str]:
    """Implementations in the rows, peers first and facodegen last (rightmost bar of a group)."""
    return tables.implementations(rows, facodegen_first=False)


def _ran(result: dict | None) -> bool:
    if not result:
        return False
    return result.get("tflops") is not None or not str(result.get("note") or "").lower().startswith(
        ("skipped", "unavailable"))


def _colors(impls: list[str]) -> dict:
    """Each implementation's colour: COLORS, a prepared launcher its public call's, the rest from
    _FALLBACK in turn."""
    colors = dict(COLORS)
    spare = 0
    for name in sorted(impls, key=is_prepared):      # public calls first: a prepared one copies its colour
        if name in colors:
            continue
        public = name.removesuffix(PREPARED_SUFFIX) if is_prepared(name) else None
        if public in colors:
            colors[name] = colors[public]
        else:
            colors[name] = _FALLBACK[spare % len(_FALLBACK)]
            spare += 1
    return colors


def _hatch(name: str) -> dict:
    """Bar style that sets a prepared launcher's bar apart from its public call's (same colour)."""
    return {"hatch": "//", "edgecolor": "white"} if is_prepared(name) else {}


def plot_rows(rows: list[dict], path, title: str | None = None, subtitle: str | None = None,
              dpi: int = 110) -> Path:
    """Draw the figure for ``rows`` to ``path`` (PNG, or whatever the suffix says); returns the path."""
    Figure = _matplotlib()
    keys = panels(rows)
    if not keys:
        raise ValueError("nothing to plot: no rows")
    impls = implementations(rows)
    causal_values = sorted({c for _, c, _ in keys})
    columns = sorted({(d, f) for d, _, f in keys})
    nrows, ncols = len(causal_values), len(columns)
    width_in = max(6.0, 5.6 * ncols)
    legend_cols = max(1, min(len(impls), int(width_in / 2.8)))     # ~2.8 inches per legend entry
    legend_rows = -(-len(impls) // legend_cols)
    fig = Figure(figsize=(width_in, 4.2 * nrows + (0.9 if title else 0.4) + 0.3 * legend_rows))
    axes = fig.subplots(nrows, ncols, squeeze=False)
    colors = _colors(impls)
    handles = {}
    for ri, causal in enumerate(causal_values):
        for ci, (d, family) in enumerate(columns):
            ax = axes[ri][ci]
            cell_rows = sorted((r for r in rows if r["head_dim"] == d and bool(r["causal"]) == causal
                                and r.get("family", "") == family), key=lambda r: r["seqlen_q"])
            dtype = cell_rows[0]["dtype"] if cell_rows else ""
            ax.set_title(f"{'Causal' if causal else 'Non-causal'}, head dim {d} ({dtype})"
                         + (f", {family}" if family else ""), fontsize=11)
            if not cell_rows:
                ax.set_axis_off()
                continue
            # bars for what ran in this panel (timed or failed); "unavailable"/"skipped" take no slot
            present = [n for n in impls if any(_ran(r.get("results", {}).get(n)) for r in cell_rows)]
            width = 0.8 / max(1, len(present))
            top = max([r["results"][n]["tflops"] for r in cell_rows for n in present
                       if r["results"].get(n, {}).get("tflops") is not None] or [1.0])
            for j, n in enumerate(present):
                xs, ys, failed = [], [], []
                for gi, r in enumerate(cell_rows):
                    res = r.get("results", {}).get(n)
                    x = gi - 0.4 + width * (j + 0.5)
                    if res is None:
                        continue
                    if res.get("tflops") is not None:
                        xs.append(x)
                        ys.append(res["tflops"])
                    elif not str(res.get("note") or "").lower().startswith(("skipped", "unavailable")):
                        failed.append(x)
                ax.bar(xs, ys, width * 0.95, color=colors[n], label=impl_title(n), **_hatch(n))
                handles.setdefault(n, colors[n])
                for x, y in zip(xs, ys):
                    ax.text(x, y + top * 0.01, f"{y:.0f}", ha="center", va="bottom",
                            fontsize=7 if len(present) > 3 else 8, rotation=90 if len(present) > 4 else 0)
                if failed:
                    ax.plot(failed, [top * 0.02] * len(failed), "x", color=colors[n], markersize=6)
            ax.set_xticks(range(len(cell_rows)))
            ax.set_xticklabels([_seqlen_label(r["seqlen_q"]) for r in cell_rows])
            ax.set_xlabel("Sequence length")
            ax.set_ylabel("Speed (TFLOP/s)")
            ax.set_ylim(0, top * 1.18)
            ax.grid(axis="y", alpha=0.3)
            ax.set_axisbelow(True)
    if handles:
        from matplotlib.patches import Patch
        fig.legend([Patch(facecolor=handles[n], **_hatch(n)) for n in impls if n in handles],
                   [impl_title(n) for n in impls if n in handles],
                   loc="lower center", ncol=legend_cols, frameon=False,
                   bbox_to_anchor=(0.5, 0.0))
    if title:
        fig.suptitle(title + (f"\n{subtitle}" if subtitle else ""), fontsize=12)
    fig.tight_layout(rect=(0, 0.05 * legend_rows / nrows, 1, 0.95 if title else 1))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)
    return path
