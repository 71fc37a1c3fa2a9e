"""Where one facodegen kernel's warps wait, instruction by instruction (GPU, Nsight Compute).

    python3 scripts/lab.py ncu-source --out $OUT --cell 256,8192,0 --dtype fp8
    python3 scripts/lab.py ncu-source --csv $OUT/source.csv          # summarise a saved profile (no GPU)

Profiles one launch of the kernel (after warm-up, ``--clock-control none``) with the SourceCounters
section and ``--page source --print-source sass --csv``: per SASS instruction, the warp-state samples
by stall reason and the shared-memory wavefronts (actual and ideal). Writes source.csv under --out
and prints, last: the samples per stall reason, the instructions with the most samples (and their
main reason), and every instruction whose shared-memory accesses take more wavefronts than ideal
(bank conflicts). Samples attach to the instruction a warp waits at: a barrier's wait shows on the
instruction after the BAR, a wgmma's on its WARPGROUP.DEPBAR, an mbarrier's on the branch after its
try-wait. A cell is ``head_dim,seqlen,causal`` of the FlashAttention-3 paper's grid, as in
scripts/lab.py ncu-compare (whose --child builds and warms the launchers).
"""

from __future__ import annotations

import argparse
import collections
import csv
import io
import os
import shutil
import subprocess
import sys

STALL_PREFIX = "stall_"


def _rows(csv_text: str) -> tuple[str, list[dict]]:
    """(kernel name, one dict per SASS instruction) from ncu's --page source --csv output."""
    lines = list(csv.reader(io.StringIO(csv_text)))
    kernel = next((r[1] for r in lines if len(r) > 1 and r[0] == "Kernel Name"), "?")
    header_at = next(i for i, r in enumerate(lines) if r and r[0] == "Address")
    header = lines[header_at]
    rows = [dict(zip(header, r)) for r in lines[header_at + 1:] if r and r[0].startswith("0x")]
    return kernel, rows


def _int(text: str) -> int:
    try:
        return int(text.replace(",", ""))
    except (AttributeError, ValueError):
        return 0


def summarize(csv_text: str, top: int = 25) -> str:
    kernel, rows = _rows(csv_text)
    if not rows:
        return f"{kernel}: no instructions in the profile"
    base = int(rows[0]["Address"], 16)
    reasons = [k for k in rows[0] if k.startswith(STALL_PREFIX) and "Not Issued" not in k]
    total = sum(_int(r["# Samples"]) for r in rows)
    by_reason = collections.Counter()
    for r in rows:
        for k in reasons:
            by_reason[k[len(STALL_PREFIX):]] += _int(r[k])
    out = [f"{kernel}: {total} samples over {len(rows)} instructions", "", "| stall reason | samples | share |",
           "|---|---|---|"]
    out += [f"| {k} | {v} | {100 * v / max(total, 1):.1f}% |" for k, v in by_reason.most_common() if v]
    out += ["", "| offset | samples | executed | main reason | instruction |", "|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: -_int(r["# Samples"]))[:top]:
        main = max(reasons, key=lambda k: _int(r[k]))[len(STALL_PREFIX):] if reasons else "-"
        out.append(f"| {int(r['Address'], 16) - base:#06x} | {_int(r['# Samples'])} | "
                   f"{_int(r.get('Instructions Executed', '0'))} | {main} | `{r['Source'].strip()}` |")
    shared = [(r, _int(r.get("L1 Wavefronts Shared", "0")), _int(r.get("L1 Wavefronts Shared Ideal", "0")))
              for r in rows]
    actual, ideal = sum(a for _, a, _ in shared), sum(i for _, _, i in shared)
    out += ["", f"shared-memory wavefronts: {actual} (ideal {ideal}, excess {actual - ideal})"]
    for r, a, i in sorted(shared, key=lambda x: x[2] - x[1]):
        if a > i:
            out.append(f"  {int(r['Address'], 16) - base:#06x} {a} vs ideal {i}: `{r['Source'].strip()}`")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    from ncu_compare import add_child_arguments  # scripts/lab/ is this script's sys.path[0]
    add_child_arguments(p, "the peer ncu_compare's child builds (runs, not profiled)")
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--csv", help="summarise this saved source.csv instead of profiling")
    p.add_argument("--kernel-regex", default=None,
                   help="the kernel to profile (ncu -k regex:...; default: the forward's flash_fwd, with --backward "
                        "facodegen's main backward kernel; FA2's main backward kernel: flash_bwd_dq_dk_dv)")
    args = p.parse_args(argv)
    if args.csv:
        with open(args.csv) as f:
            print(summarize(f.read(), args.top))
        return 0
    ncu = shutil.which("ncu") or "/usr/local/cuda/bin/ncu"
    here = os.path.dirname(os.path.abspath(__file__))
    # (facodegen's backward launches its preprocess, main and postprocess kernels in turn, all flash_bwd_sm*)
    kernel, skip = (args.kernel_regex, 0) if args.kernel_regex else ("flash_bwd_sm", 1) if args.backward else \
        ("flash_fwd", 0)
    cmd = [ncu, "--clock-control", "none", "--profile-from-start", "off", "-k", f"regex:{kernel}",
           "--launch-skip", str(skip), "--launch-count", "1",
           "--section", "SourceCounters", "--section", "WarpStateStats", "--page", "source",
           "--print-source", "sass", "--csv", sys.executable, os.path.join(here, "ncu_compare.py"), "--child",
           "--cell", args.cell, "--dtype", args.dtype, "--variant", args.variant, "--peer", args.peer,
           *(["--backward"] if args.backward else [])]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=400)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "source.csv")
    with open(path, "w") as f:
        f.write(run.stdout)
    if run.returncode:
        print(run.stderr[-2000:], file=sys.stderr)
        return run.returncode
    print(summarize(run.stdout, args.top))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
