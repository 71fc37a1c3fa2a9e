#!/usr/bin/env python3
"""compute-sanitizer over every kernel family and arch (GPU): memcheck, racecheck, synccheck and
initcheck, each over facodegen.verify.fuzz.representative_cases() (one small case per arch, dtype and
causal: odd lengths, GQA, strided inputs, LSE and out= asked for), one child process per tool and
case, and a table of errors per tool and case last.

    python3 scripts/sanitize.py [--tools memcheck,racecheck] [--out DIR]

Each child runs `python -m facodegen.verify.fuzz --launch-only CASE_JSON` (facodegen's call on the case's inputs,
no references: their kernels are most of a case's, and initcheck instruments them all) under `compute-sanitizer --tool T
--error-exitcode 99` (racecheck, memcheck and synccheck instrument only facodegen's kernels); the first
lines of each child's log and its summary go to DIR/<tool>.log. The kernels are compiled first (in
parallel processes, then one plain run of the same cases) so the sanitizer does not time NVRTC.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import re
import shutil
import subprocess
import sys
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from facodegen.verify import fuzz  # noqa: E402

TOOLS = ("memcheck", "racecheck", "synccheck", "initcheck")
LOG_LINES = 120       # of each child's log, kept in <tool>.log (then its summary lines)
_SUMMARY = re.compile(r"(?:ERROR|RACECHECK) SUMMARY: (\d+) (?:error|hazard)")


def errors_in(log: str) -> int | None:
    """The errors (racecheck: hazards) compute-sanitizer counted, None if it printed no summary."""
    found = [int(n) for n in _SUMMARY.findall(log)]
    return sum(found) if found else None


def run_children(jobs, sanitizer: str, out: Path, workers: int, child_seconds: int, only_flash: bool = True) -> list:
    """Run each job (tool, label, python argv, what the log calls it) as `compute-sanitizer --tool
    TOOL python ARGV` in ``workers`` threads, each child killed after ``child_seconds`` (status
    "timeout"); append the first LOG_LINES lines of each child's log and its summary to
    out/<tool>.log as the child ends (a killed sweep keeps what finished). Returns (tool, label,
    errors or "?", exit status) per job, in order."""
    write_lock = threading.Lock()
    for tool in {job[0] for job in jobs}:      # one log per tool (a device call brings back few files)
        (out / f"{tool}.log").write_text("")

    def one(job):
        tool, label, argv, what = job
        cmd = [sanitizer, "--tool", tool, "--error-exitcode", "99"]
        if tool == "racecheck":
            cmd += ["--racecheck-report", "hazard"]
        if tool != "initcheck" and only_flash:
            # Only facodegen's kernels are instrumented (racecheck over torch's reference kernels costs
            # minutes and says nothing about ours). Not for initcheck: memory written by a kernel it
            # does not instrument counts as never written, so every read of the inputs would be flagged.
            cmd += ["--kernel-name", "kns=flash_"]
        try:
            done = subprocess.run([*cmd, sys.executable, *argv], check=False, capture_output=True, text=True,
                                  timeout=child_seconds)
            log, status = done.stdout + done.stderr, done.returncode
        except subprocess.TimeoutExpired as err:    # a hung kernel (or a tool far slower than usual): say so
            log = "".join(x.decode(errors="replace") if isinstance(x, bytes) else x or "" for x in (err.stdout, err.stderr))
            log += f"\nsanitize: no result after {child_seconds} s; the child was killed"
            status = "timeout"
        errors = errors_in(log)
        row = (tool, label, "?" if errors is None else str(errors), status)
        print(f"{tool:10s} {label:32s} errors {row[2]:>4s} exit {status}", flush=True)
        lines = log.splitlines()
        head = lines[:LOG_LINES] + (["... (%d lines left out)" % (len(lines) - LOG_LINES)] if len(lines) > LOG_LINES else [])
        with write_lock, open(out / f"{tool}.log", "a") as f:
            f.write(f"==== {tool}: {what}\n" + "\n".join(head + [x for x in lines[LOG_LINES:] if "SUMMARY" in x]) + "\n\n")
        return row

    # The children share the GPU: each is small, and the sanitizer's host side is the slow part.
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        return list(pool.map(one, jobs))


def hostile_sweep_main(doc: str, script: str, names: list[str], run_case, precompile, default_out: str) -> int:
    """The main of a sweep of hostile cases (scripts/sanitize_decode.py, sanitize_varlen.py): `--case N` runs
    case N (``run_case(N)``, in a child); else ``precompile()`` compiles the kernels (in parallel processes),
    every case runs once plainly (it must run at all), then each (tool, case) under compute-sanitizer
    (run_children, several at once), and a table of errors per tool and case prints last."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tools", default=",".join(TOOLS))
    p.add_argument("--out", type=Path, default=Path(default_out))
    p.add_argument("--jobs", type=int, default=8, help="sanitizer runs at once")
    p.add_argument("--child-seconds", type=int, default=120)
    p.add_argument("--case", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.case is not None:
        run_case(args.case)
        return 0
    tool_path = shutil.which("compute-sanitizer")
    if tool_path is None:
        print("compute-sanitizer not found on PATH", file=sys.stderr)
        return 2
    precompile()
    for i in range(len(names)):
        run_case(i)
    args.out.mkdir(parents=True, exist_ok=True)
    jobs = [(tool, name, [script, "--case", str(i)], f"case {i}: {name}")
            for tool in args.tools.split(",") for i, name in enumerate(names)]
    rows = run_children(jobs, tool_path, args.out, args.jobs, args.child_seconds)
    print("| tool | case | errors | exit |\n|---|---|---|---|")
    for row in rows:
        print("| " + " | ".join(map(str, row)) + " |")
    return 0 if all(r[2] == "0" and r[3] == 0 for r in rows) else 1


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tools", default=",".join(TOOLS))
    p.add_argument("--out", default=os.environ.get("OUT", "sanitize-out"))
    p.add_argument("--jobs", type=int, default=8, help="sanitizer runs at once")
    p.add_argument("--all-kernels", dest="only_flash", action="store_false",
                   help="instrument every kernel, not only facodegen's (initcheck always does)")
    p.add_argument("--child-seconds", type=int, default=240, help="a tool x case run still going after this is "
                   "killed and reported as a timeout")
    p.add_argument("--cases", help="indices into representative_cases() (comma-separated; default all)")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    sanitizer = shutil.which("compute-sanitizer") or "/usr/local/cuda/bin/compute-sanitizer"
    cases = fuzz.representative_cases()
    if args.cases:
        cases = [cases[int(i)] for i in args.cases.split(",")]
    fuzz.precompile(cases)      # in parallel processes: a fresh machine's cache is empty
    warm = subprocess.run([sys.executable, "-m", "facodegen.verify.fuzz", *[c.to_json() for c in cases]],
                          capture_output=True, text=True)
    print(warm.stdout or warm.stderr, flush=True)
    jobs = [(tool, f"{case.family} {case.arch} {case.dtype} {'causal' if case.causal else 'full'}",
             ["-m", "facodegen.verify.fuzz", "--launch-only", case.to_json()], case.to_json())
            for tool in args.tools.split(",") for case in cases]
    rows = run_children(jobs, sanitizer, out, args.jobs, args.child_seconds, args.only_flash)
    print("\n| tool | case | errors | exit |\n|---|---|---|---|")
    for row in rows:
        print("| " + " | ".join(map(str, row)) + " |")
    return 0 if all(r[2] == "0" and r[3] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
