#!/usr/bin/env python3
"""Old tree against new tree on one GPU, the two taking turns (GPU): the only comparison of two
template versions that survives the 5-10% that whole grids move between device calls.

    python3 scripts/lab.py ab-trees --old .old --out $OUT --rounds 2 --peers fa3 -- \
        --dtype fp8 --cell 128,8192,1 --variant sm90: --variant sm90:pingpong=1

Everything after ``--`` goes to scripts/lab.py sweep, which runs once per tree and round (new, old,
new, old, ...), each time from that tree's own package (PYTHONPATH), with a shared compile cache so
a tree's kernels compile once. --peers are timed in the first new round only. ``--old`` is a copy
of the old tree's facodegen/, templates/ and scripts/ (e.g. `git worktree add` of the base commit,
copied into a git-ignored folder and carried). Prints, last, TFLOP/s per cell and variant: each
round of the old tree, then of the new, and new/old (mean over rounds).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

NEW = Path(__file__).resolve().parents[2]


def sweep_script(tree: Path) -> Path:
    """The tree's own sweep: scripts/lab/sweep.py, or scripts/sweep.py in a tree from before the lab
    probes moved into scripts/lab/."""
    for path in (tree / "scripts" / "lab" / "sweep.py", tree / "scripts" / "sweep.py"):
        if path.exists():
            return path
    raise SystemExit(f"{tree}: neither scripts/lab/sweep.py nor scripts/sweep.py")


def run_sweep(tree: Path, out: Path, sweep_args: list[str], peers: str, env: dict) -> list[dict]:
    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, str(sweep_script(tree)), "--out", str(out), *sweep_args]
    if peers:
        cmd += ["--peers", peers]
    run_env = dict(env, PYTHONPATH=os.pathsep.join(p for p in (str(tree), env.get("PYTHONPATH", "")) if p))
    done = subprocess.run(cmd, env=run_env, capture_output=True, text=True)
    (out / "log.txt").write_text(done.stdout + done.stderr)
    if done.returncode:
        print(f"{tree.name or tree}: sweep failed ({done.returncode}):\n{done.stderr[-3000:]}", flush=True)
        return []
    return json.loads((out / "sweep.json").read_text())


def cell_key(record: dict) -> str:
    causal = "causal" if record.get("causal") else "full"
    return f"{record.get('dtype')} d{record.get('head_dim')} {causal} s{record.get('seqlen_q')}"


def tflops(records: list[dict]) -> dict[tuple[str, str], float]:
    """(cell, implementation) -> TFLOP/s from sweep.json records (results by implementation name)."""
    table = {}
    for record in records:
        for name, result in (record.get("results") or {}).items():
            value = result.get("tflops") if isinstance(result, dict) else None
            if isinstance(value, (int, float)):
                table[(cell_key(record), name)] = float(value)
    return table


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    sweep_args = argv[argv.index("--") + 1:] if "--" in argv else []
    own = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--old", required=True, help="the old tree (facodegen/, templates/, scripts/)")
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--peers", default="", help="peers for the first new round (scripts/lab.py sweep --peers)")
    args = p.parse_args(own)
    env = dict(os.environ)
    env.setdefault("FACODEGEN_CACHE_DIR", "/tmp/facodegen-ab-cache")
    env["FACODEGEN_QUIET"] = "1"
    trees = {"new": NEW, "old": Path(args.old).resolve()}
    runs: dict[str, list[dict]] = {"new": [], "old": []}
    for r in range(args.rounds):
        for side in ("new", "old"):
            peers = args.peers if (side == "new" and r == 0) else ""
            records = run_sweep(trees[side], Path(args.out) / f"{side}{r}", sweep_args, peers, env)
            runs[side].append(tflops(records))
            print(f"round {r} {side}: {len(runs[side][-1])} timings", flush=True)
    keys = sorted({k for side in runs.values() for t in side for k in t})
    rows = ["| cell | implementation | old | new | new/old |", "|---|---|---|---|---|"]
    for key in keys:
        old = [t[key] for t in runs["old"] if key in t]
        new = [t[key] for t in runs["new"] if key in t]
        ratio = f"{(sum(new) / len(new)) / (sum(old) / len(old)):.3f}" if old and new else "-"
        rows.append(f"| {key[0]} | {key[1]} | {' / '.join(f'{x:.1f}' for x in old) or '-'} | "
                    f"{' / '.join(f'{x:.1f}' for x in new) or '-'} | {ratio} |")
    table = "\n".join(rows)
    (Path(args.out) / "ab.md").write_text(table + "\n")
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
