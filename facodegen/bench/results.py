"""The results files of a grid: the flat CSV records (one per cell and implementation, with the
ratio to the best peer), the environment a result needs to be read later (GPU, versions, commit,
date, which peers were importable), and write_results: <stem>.md, .csv, .json and .png."""

from __future__ import annotations

from .peers import peer_available
from .tables import PEER_TITLES, best_peer, format_notes, format_table, has_ratio, ratio_to_best_peer
from .timing import _torch

CSV_FIELDS = ("dtype", "head_dim", "causal", "seqlen_q", "seqlen_k", "batch", "heads_q", "heads_kv", "impl",
              "tflops", "ms", "ratio_to_best_peer", "best_peer", "err", "variant", "note")


def csv_rows(rows: list[dict]) -> list[dict]:
    """One flat record per (cell, implementation), facodegen's public call with its ratio to the
    best peer (the prepared launcher's record has none, as in the table)."""
    out = []
    for row in rows:
        peer, _ = best_peer(row)
        for name, r in row.get("results", {}).items():
            rec = {k: row.get(k) for k in CSV_FIELDS[:8]}
            ratio = ratio_to_best_peer(row, name) if has_ratio(name) else None
            rec.update(impl=name, tflops=r.get("tflops"), ms=r.get("ms"), ratio_to_best_peer=ratio,
                       best_peer=peer, err=r.get("err"), variant=r.get("variant"), note=r.get("note"))
            out.append(rec)
    return out


def to_csv(rows: list[dict]) -> str:
    import csv
    import io

    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=CSV_FIELDS, lineterminator="\n")
    writer.writeheader()
    for rec in csv_rows(rows):
        writer.writerow({k: ("" if v is None else (f"{v:.6g}" if isinstance(v, float) else v)) for k, v in rec.items()})
    return buf.getvalue()


def environment() -> dict:
    """What a benchmark result needs to be read later: GPU, versions, commit, date."""
    import datetime
    import os
    import subprocess

    from .. import __version__
    env: dict = {"facodegen": __version__, "date": datetime.date.today().isoformat()}
    if os.environ.get("FACODEGEN_COMMIT"):
        # a copied checkout whose .git lags the tree (e.g. a lent GPU machine) says which commit it is
        env["commit"] = os.environ["FACODEGEN_COMMIT"]
    try:
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        done = subprocess.run(["git", "-C", root, "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=10)
        if done.returncode == 0 and "commit" not in env:
            env["commit"] = done.stdout.strip()
            dirty = subprocess.run(["git", "-C", root, "status", "--porcelain", "--untracked-files=no"],
                                   capture_output=True, text=True, timeout=10)
            env["dirty"] = bool(dirty.stdout.strip())
    except Exception:  # noqa: BLE001
        pass
    try:
        from ..runtime.compiler import nvrtc_identity
        env["nvrtc"] = nvrtc_identity()
    except Exception:  # noqa: BLE001
        pass
    try:
        torch = _torch()
        env["torch"] = torch.__version__
        if torch.cuda.is_available():
            p = torch.cuda.get_device_properties(0)
            env.update(gpu=p.name, cc=f"{p.major}.{p.minor}", sms=p.multi_processor_count)
    except Exception:  # noqa: BLE001
        pass
    env["peers"] = {name: list(peer_available(name)) for name in PEER_TITLES}
    return env


def write_results(rows: list[dict], out_dir, stem: str, env: dict | None = None, plot: bool = True,
                  title: str | None = None) -> dict:
    """Write <stem>.md (table + notes), .csv, .json (rows + environment) and .png into ``out_dir``;
    returns {"md": path, "csv": ..., "json": ..., "png": path or None, "plot_error": text or None}."""
    import json
    from pathlib import Path

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths: dict = {}
    notes = format_notes(rows)
    paths["md"] = out / f"{stem}.md"
    paths["md"].write_text(format_table(rows) + ("\n\nNotes:\n" + notes if notes else "") + "\n")
    paths["csv"] = out / f"{stem}.csv"
    paths["csv"].write_text(to_csv(rows))
    paths["json"] = out / f"{stem}.json"
    paths["json"].write_text(json.dumps({"env": env or {}, "rows": rows}, indent=1, default=str) + "\n")
    paths["png"], paths["plot_error"] = None, None
    if plot:
        from .plot import PlotUnavailable, plot_rows
        env = env or {}
        subtitle = ", ".join(x for x in (env.get("gpu"), env.get("date"),
                                         f"commit {env['commit']}{'+' if env.get('dirty') else ''}"
                                         if env.get("commit") else None) if x)
        try:
            paths["png"] = plot_rows(rows, out / f"{stem}.png", title=title, subtitle=subtitle or None)
        except (PlotUnavailable, ValueError) as err:
            paths["plot_error"] = str(err)
    return paths
