#!/usr/bin/env python3
"""One call on the GPU machine: environment, GPU tests, then facodegen against its peers.

    python3 scripts/device_run.py --out $OUT                      # --suite quick
    python3 scripts/device_run.py --out $OUT --suite full         # tests + FA3-paper grid, sm90 and sm80
    python3 scripts/device_run.py --out $OUT --suite tests -k sm90
    python3 scripts/device_run.py --out $OUT --suite bench --grid fa3 --arch sm90 --spec sm90:block_n=128

Suites: quick (GPU tests + quick grid, sm90 and sm80), full (GPU tests + fa3 grid, sm90 and sm80),
tests (GPU tests only), bench (timings only; --grid, default quick), env (environment only).
Everything runs inside --budget-s seconds of wall clock: the tests get at most --tests-timeout-s,
grid cells past the budget are listed as skipped. A failing cell or peer is reported and the run
goes on. Files under --out: run.log, env.json, pytest.log, bench.json, bench.md (and ncu.txt with
--ncu). The markdown table is printed last.

Wheels carried in .whl/ (e.g. FlashAttention-3) are installed into /tmp/site first (--wheels); a
.tar.xz there (an unpacked wheel, recompressed to fit the carry limit) is extracted into it.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import platform
import shutil
import subprocess
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SITE = "/tmp/site"
START = time.monotonic()

SUITES = {
    #         tests  bench  grid     archs
    "quick": (True, True, "quick", "both"),
    "full": (True, True, "fa3", "both"),
    "tests": (True, False, "quick", "auto"),
    "bench": (False, True, "quick", "both"),
    "env": (False, False, "quick", "auto"),
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.environ.get("OUT", "device-out"), help="folder for logs and JSON ($OUT)")
    p.add_argument("--suite", choices=sorted(SUITES), default="quick")
    p.add_argument("--grid", choices=["quick", "fa3", "sm80"], help="bench grid (default: the suite's)")
    p.add_argument("--arch", choices=["sm90", "sm80", "both", "auto"],
                   help="facodegen arch(s) to time; both = sm90 (if the GPU is cc 9.0) and sm80")
    p.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    p.add_argument("--peers", default="fa3,cudnn,fa2",
                   help="comma list from fa3, cudnn, fa2, efficient; 'none' for no peers")
    p.add_argument("--head-dims", help="only these head dims, e.g. 64,128")
    p.add_argument("--seqlens", help="only these seqlens, e.g. 2048,16384")
    p.add_argument("--causal", choices=["yes", "no", "both"], default="both")
    p.add_argument("--spec", action="append", default=[], metavar="[ARCH:]FIELD=VALUE",
                   help="spec override for the timed kernels, e.g. block_n=128 or sm90:pingpong=false (repeatable)")
    p.add_argument("-k", dest="k", help="pytest -k expression for the GPU tests")
    p.add_argument("--no-tests", action="store_true", help="skip the GPU tests")
    p.add_argument("--no-bench", action="store_true", help="skip the timings")
    p.add_argument("--no-check", action="store_true", help="time without checking outputs first")
    p.add_argument("--no-ceiling", action="store_true", help="skip the GEMM / copy ceilings")
    p.add_argument("--budget-s", type=float, default=540.0, help="wall-clock budget for the whole run")
    p.add_argument("--tests-timeout-s", type=float, default=300.0, help="at most this long for pytest")
    p.add_argument("--ncu", action="store_true", help="profile one facodegen launch per arch with ncu")
    p.add_argument("--wheels", default=str(ROOT / ".whl"), help="folder of wheels to install into /tmp/site")
    p.add_argument("--dry-run", action="store_true", help="print the plan and exit (no GPU needed)")
    p.add_argument("--ncu-child", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args(argv)


# ------------------------------------------------------------------------------------------------
# logging
# ------------------------------------------------------------------------------------------------

class Log:
    def __init__(self, out: Path | None):
        self.path = out / "run.log" if out else None

    def __call__(self, msg: str = "") -> None:
        line = f"[{time.monotonic() - START:6.1f}s] {msg}" if msg else ""
        print(line, flush=True)
        if self.path:
            with open(self.path, "a") as f:
                f.write(line + "\n")


def remaining(args) -> float:
    return args.budget_s - (time.monotonic() - START)


def parse_value(text: str):
    low = text.lower()
    if low in ("true", "yes", "on"):
        return True
    if low in ("false", "no", "off"):
        return False
    try:
        return int(text)
    except ValueError:
        return text


def parse_specs(items: list[str]) -> dict:
    """['block_n=128', 'sm90:pingpong=false'] -> {'sm80': {...}, 'sm90': {...}}."""
    per_arch: dict = {"sm80": {}, "sm90": {}}
    for item in items:
        arch = None
        if ":" in item.split("=", 1)[0]:
            arch, item = item.split(":", 1)
        if "=" not in item:
            raise SystemExit(f"--spec {item!r}: expected FIELD=VALUE")
        key, value = item.split("=", 1)
        for a in ([arch] if arch else ["sm80", "sm90"]):
            if a not in per_arch:
                raise SystemExit(f"--spec: unknown arch {a!r}")
            per_arch[a][key.strip().replace("-", "_")] = parse_value(value.strip())
    return per_arch


def plan(args) -> dict:
    tests, bench, grid, archs = SUITES[args.suite]
    return {
        "tests": tests and not args.no_tests,
        "bench": bench and not args.no_bench,
        "grid": args.grid or grid,
        "archs": args.arch or archs,
        "peers": [] if args.peers.strip().lower() == "none" else [p.strip() for p in args.peers.split(",") if p.strip()],
        "spec": parse_specs(args.spec),
    }


def select_cells(args, grid: str):
    sys.path.insert(0, str(ROOT))
    from facodegen.bench import make_grid
    cells = make_grid(grid, args.dtype)
    if args.head_dims:
        keep = {int(x) for x in args.head_dims.split(",")}
        cells = [c for c in cells if c["head_dim"] in keep]
    if args.seqlens:
        keep = {int(x) for x in args.seqlens.split(",")}
        cells = [c for c in cells if c["seqlen_q"] in keep]
    if args.causal != "both":
        cells = [c for c in cells if c["causal"] == (args.causal == "yes")]
    return cells


# ------------------------------------------------------------------------------------------------
# steps
# ------------------------------------------------------------------------------------------------

def install_wheels(args, log) -> None:
    # Unpacked wheels as .tar.xz (FlashAttention-3's 63 MB wheel is 29 MB so: the carry limit is 64 MiB
    # with the tree): extracted into SITE as they are.
    import tarfile
    for archive in sorted(glob.glob(os.path.join(args.wheels, "*.tar.xz"))):
        log(f"extracting {os.path.basename(archive)} into {SITE}")
        with tarfile.open(archive) as tar:
            tar.extractall(SITE)
    wheels = sorted(glob.glob(os.path.join(args.wheels, "*.whl")))
    if wheels:
        log(f"installing {len(wheels)} wheel(s) from {args.wheels} into {SITE}: "
            + ", ".join(os.path.basename(w) for w in wheels))
        done = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                               "--no-cache-dir", "--upgrade", "--target", SITE, *wheels],
                              capture_output=True, text=True, timeout=300)
        if done.returncode:
            log(f"  pip install failed ({done.returncode}): {done.stderr.strip()[-1500:]}")
    if SITE not in sys.path and os.path.isdir(SITE):
        sys.path.insert(0, SITE)


def child_env() -> dict:
    env = dict(os.environ)
    parts = [str(ROOT)] + ([SITE] if os.path.isdir(SITE) else []) + [env.get("PYTHONPATH", "")]
    env["PYTHONPATH"] = os.pathsep.join(p for p in parts if p)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def environment(log) -> dict:
    env: dict = {"python": sys.version.split()[0], "platform": platform.platform()}
    try:
        import torch
        env["torch"] = torch.__version__
        env["torch_cuda"] = torch.version.cuda
        if torch.cuda.is_available():
            p = torch.cuda.get_device_properties(0)
            env.update(gpu=p.name, sms=p.multi_processor_count, cc=f"{p.major}.{p.minor}",
                       memory_gib=round(p.total_memory / 2 ** 30, 1), l2_bytes=getattr(p, "L2_cache_size", None))
    except Exception as err:  # noqa: BLE001
        env["torch"] = f"unavailable: {err}"
    try:
        import cupy
        env["cupy"] = cupy.__version__
        props = cupy.cuda.runtime.getDeviceProperties(0)
        env["smem_optin"] = props.get("sharedMemPerBlockOptin")
        env["cuda_driver"] = cupy.cuda.runtime.driverGetVersion()
    except Exception as err:  # noqa: BLE001
        env["cupy"] = f"unavailable: {err}"
    try:
        from facodegen import __version__
        from facodegen.runtime import compiler as fc
        env["facodegen"] = __version__
        env["nvrtc"] = fc.nvrtc_identity() if hasattr(fc, "nvrtc_identity") else str(fc.nvrtc_version())
        if hasattr(fc, "gpu_available"):
            env["gpu_available"] = list(fc.gpu_available())
    except Exception as err:  # noqa: BLE001
        env["facodegen"] = f"import failed: {type(err).__name__}: {err}"
    for mod in ("numpy", "jinja2", "click", "pytest", "triton"):
        try:
            env[mod] = __import__(mod).__version__
        except Exception as err:  # noqa: BLE001
            env[mod] = f"unavailable: {err}"
    try:
        from facodegen.bench import peer_available
        env["peers"] = {name: list(peer_available(name)) for name in ("fa3", "cudnn", "fa2", "efficient")}
    except Exception as err:  # noqa: BLE001
        env["peers"] = f"unavailable: {err}"
    try:
        env["nvidia-smi"] = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version,clocks.sm,clocks.max.sm,power.limit,temperature.gpu",
             "--format=csv,noheader"], capture_output=True, text=True, timeout=20).stdout.strip()
    except Exception as err:  # noqa: BLE001
        env["nvidia-smi"] = f"unavailable: {err}"
    for key, value in env.items():
        log(f"  {key}: {value}")
    return env


def run_tests(args, out: Path, log) -> dict:
    timeout = min(args.tests_timeout_s, max(30.0, remaining(args) - 60))
    cmd = [sys.executable, "-m", "pytest", "-q", "tests/gpu", "-x", "--tb=short", "-rs", "-p", "no:cacheprovider"]
    if args.k:
        cmd += ["-k", args.k]
    log(f"$ {' '.join(cmd)}   (timeout {timeout:.0f} s)")
    t0 = time.monotonic()
    try:
        done = subprocess.run(cmd, cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=timeout)
        text, rc = done.stdout + done.stderr, done.returncode
    except subprocess.TimeoutExpired as err:
        text = (err.stdout or b"").decode(errors="replace") if isinstance(err.stdout, bytes) else (err.stdout or "")
        text += f"\n[device_run] pytest stopped after {timeout:.0f} s (--tests-timeout-s / --budget-s)"
        rc = "timeout"
    (out / "pytest.log").write_text(text)
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    summary = lines[-1] if lines else "(no output)"
    tail = "\n".join(lines[-40:])
    log("pytest output (last 40 lines; all in pytest.log):\n" + tail)
    return {"rc": rc, "summary": summary, "seconds": round(time.monotonic() - t0, 1)}


def resolve_archs(spec: str, log) -> list[str]:
    try:
        import torch
        cc = torch.cuda.get_device_capability(0)
    except Exception:  # noqa: BLE001
        import cupy
        text = str(cupy.cuda.Device(0).compute_capability)
        cc = (int(text[:-1]), int(text[-1]))
    native = "sm90" if cc == (9, 0) else "sm80"
    if spec == "auto":
        return [native]
    if spec == "both":
        return ["sm90", "sm80"] if cc == (9, 0) else ["sm80"]
    if spec == "sm90" and cc != (9, 0):
        log(f"--arch sm90 needs compute capability 9.0, this GPU is {cc}: timing sm80 instead")
        return ["sm80"]
    return [spec]


def run_bench(args, p: dict, archs: list[str], out: Path, log, budget_s: float) -> list[dict]:
    from facodegen import bench
    cells = select_cells(args, p["grid"])
    log(f"bench: grid {p['grid']} ({len(cells)} cells), {args.dtype}, facodegen {', '.join(archs)}, "
        f"peers {', '.join(p['peers']) or 'none'}, spec overrides {p['spec']}, budget {budget_s:.0f} s")
    rows = bench.run_grid(cells, archs=tuple(archs), peers=tuple(p["peers"]), spec_overrides=p["spec"],
                          budget_s=budget_s, check_first=not args.no_check, log=log)
    return rows


def run_ncu(args, p: dict, archs: list[str], out: Path, log) -> None:
    ncu = shutil.which("ncu") or next(iter(sorted(glob.glob("/opt/nvidia/nsight-compute/*/ncu")
                                                  + glob.glob("/usr/local/cuda*/bin/ncu"))), None)
    if not ncu:
        log("ncu: not found; skipped")
        return
    timeout = max(30.0, min(240.0, remaining(args) - 20))
    cmd = [ncu, "--clock-control", "none", "--kernel-name", "regex:flash_fwd", "--launch-count", str(len(archs)),
           "--section", "SpeedOfLight", "--section", "LaunchStats", "--section", "Occupancy",
           "--section", "MemoryWorkloadAnalysis", "--section", "ComputeWorkloadAnalysis",
           sys.executable, str(Path(__file__).resolve()), "--ncu-child", "--grid", p["grid"], "--dtype", args.dtype,
           "--arch", "both" if len(archs) > 1 else archs[0], "--out", str(out)]
    for s in args.spec:
        cmd += ["--spec", s]
    if args.head_dims:
        cmd += ["--head-dims", args.head_dims]
    if args.seqlens:
        cmd += ["--seqlens", args.seqlens]
    if args.causal != "both":
        cmd += ["--causal", args.causal]
    log(f"$ {' '.join(cmd)}   (timeout {timeout:.0f} s)")
    try:
        done = subprocess.run(cmd, cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=timeout)
        text = done.stdout + done.stderr
    except subprocess.TimeoutExpired:
        text = f"ncu timed out after {timeout:.0f} s"
    (out / "ncu.txt").write_text(text)
    log("ncu: " + ("\n".join(text.strip().splitlines()[-60:])))


def ncu_child(args) -> int:
    """Run facodegen once on the first selected cell, per arch (ncu filters the launches)."""
    install_wheels(args, lambda m: None)
    sys.path.insert(0, str(ROOT))
    import torch
    from facodegen.bench.inputs import _make_inputs
    from facodegen.bench.variants import _facodegen_fn, _split_overrides
    p = plan(args)
    cells = select_cells(args, p["grid"])
    c = cells[0]
    archs = resolve_archs(p["archs"], print)
    inputs = _make_inputs(c, 1)[0]
    for arch in archs:
        fn, _, variant, _ = _facodegen_fn(arch, _split_overrides(p["spec"], arch), inputs, c["causal"])
        fn()
        torch.cuda.synchronize()
        print(f"ncu child: ran {variant or arch} on {c}")
    return 0


# ------------------------------------------------------------------------------------------------
# main
# ------------------------------------------------------------------------------------------------

def main(argv=None) -> int:
    args = parse_args(argv)
    if args.ncu_child:
        return ncu_child(args)
    p = plan(args)
    if args.dry_run:
        print(f"plan: suite {args.suite}; tests {'pytest -q tests/gpu -x' + (' -k ' + args.k if args.k else '') if p['tests'] else 'no'}; "
              f"bench {'grid ' + p['grid'] if p['bench'] else 'no'}; archs {p['archs']}; dtype {args.dtype}; "
              f"peers {','.join(p['peers']) or 'none'}; spec {p['spec']}; budget {args.budget_s:.0f} s; "
              f"ncu {'yes' if args.ncu else 'no'}")
        if p["bench"]:
            for c in select_cells(args, p["grid"]):
                print(f"  cell {c}")
        return 0

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log = Log(out)
    sys.path.insert(0, str(ROOT))
    os.environ["PYTHONUNBUFFERED"] = "1"
    summary: dict = {"args": vars(args), "plan": {k: v for k, v in p.items()}}
    rows: list[dict] = []
    try:
        install_wheels(args, log)
        log("== environment")
        summary["env"] = environment(log)
        (out / "env.json").write_text(json.dumps(summary["env"], indent=1, default=str))

        if p["tests"]:
            log("== GPU tests")
            summary["tests"] = run_tests(args, out, log)

        archs = []
        if p["bench"] or args.ncu:
            archs = resolve_archs(p["archs"], log)
        if p["bench"] and not args.no_ceiling and remaining(args) > 60:
            log("== ceilings")
            try:
                from facodegen import bench
                summary["gemm_bf16_tflops"] = round(bench.gemm_ceiling(), 1)
                summary["copy_TBps"] = round(bench.copy_bandwidth(), 2)
                log(f"  bf16 GEMM 8192^3: {summary['gemm_bf16_tflops']} TFLOP/s; "
                    f"device copy: {summary['copy_TBps']} TB/s (read + write)")
            except Exception as err:  # noqa: BLE001
                log(f"  ceilings failed: {type(err).__name__}: {err}")

        if p["bench"]:
            log("== timings")
            reserve = 90 if args.ncu else 30
            try:
                rows = run_bench(args, p, archs, out, log, max(0.0, remaining(args) - reserve))
            except Exception:  # noqa: BLE001
                log("bench failed:\n" + traceback.format_exc())

        if args.ncu:
            log("== ncu")
            if remaining(args) > 40:
                run_ncu(args, p, archs, out, log)
            else:
                log("ncu: skipped, the time budget is spent")
    except Exception:  # noqa: BLE001
        log("device_run failed:\n" + traceback.format_exc())
    finally:
        summary["rows"] = rows
        summary["wall_s"] = round(time.monotonic() - START, 1)
        (out / "bench.json").write_text(json.dumps(summary, indent=1, default=str))

    # ---- the end of the output: what the lead reads
    print()
    env = summary.get("env", {})
    peers = env.get("peers") if isinstance(env.get("peers"), dict) else {}
    fa3 = peers.get("fa3", [None, "?"])
    print(f"GPU {env.get('gpu')} ({env.get('sms')} SMs, cc {env.get('cc')}), torch {env.get('torch')}, "
          f"cupy {env.get('cupy')}, nvrtc {env.get('nvrtc')}, FA3 {'available' if fa3[0] else 'missing'} ({fa3[1]})")
    if "tests" in summary:
        t = summary["tests"]
        print(f"GPU tests: rc={t['rc']} in {t['seconds']} s: {t['summary']}")
    if "gemm_bf16_tflops" in summary:
        print(f"ceilings: bf16 GEMM {summary['gemm_bf16_tflops']} TFLOP/s, copy {summary['copy_TBps']} TB/s")
    if rows:
        from facodegen.bench import format_notes, format_table
        notes = format_notes(rows)
        table = format_table(rows)
        (out / "bench.md").write_text(table + "\n\nNotes:\n" + notes + "\n")
        if notes:
            lines = notes.splitlines()
            print("notes (all in bench.md):\n" + "\n".join(line[:300] for line in lines[:25])
                  + (f"\n... {len(lines) - 25} more" if len(lines) > 25 else ""))
        print(f"TFLOP/s ({args.dtype}; wall {summary['wall_s']} s):")
        print(table)
    else:
        print(f"(no timings; wall {summary['wall_s']} s)")
    failed_tests = "tests" in summary and summary["tests"]["rc"] not in (0,)
    return 1 if failed_tests else 0


if __name__ == "__main__":
    sys.exit(main())
