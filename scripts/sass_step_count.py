#!/usr/bin/env python3
"""Instructions a warp of the sm80 backward issues per step of its main loop, read from the SASS (no GPU).

    python3 scripts/sass_step_count.py [--sm sm_90] [knob=value ...]     # e.g. head_dim=128 k_unroll=4

Nsight Compute on the H200 (2026-12-05, docs/results/ncu-s46/) showed the sm80 backward and FlashAttention-2's
issuing at the same rate (IPC ~1.0, 2 warps per scheduler), so a step's time follows this count. The main loop
is the longest backward branch of the main kernel; its innermost loops are the warp GEMMs' k16 loops. The
count is the loop body outside them on its hot path (instructions an unconditional forward branch jumps over,
an if/else's other arm, left out) plus each inner loop's body times its trips, which gemm_loop_trips takes
from warp_gemm's rules (change them together: the script stops where the SASS has another number of loops).
An estimate: it takes the fall-through of an if/else as the hot arm, as the kernel lays its common paths out.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def instructions(sass: str, kernel: str) -> list[tuple[int, str, str]]:
    """(address, opcode, whole text) of the named kernel's instructions."""
    body = next(part for part in sass.split("Function : ")[1:] if part.startswith(kernel + "\n"))
    out = []
    for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+((?:@!?U?P\w+\s+)?)([A-Z][A-Z0-9_]*)([^;]*);", body):
        out.append((int(m.group(1), 16), m.group(3), m.group(2) + m.group(3) + m.group(4)))
    return out


def step_count(ins: list[tuple[int, str, str]], loop_trips: list[int]) -> dict:
    """The main loop's hot-path count outside its inner loops, the inner loops, and the step's total;
    ``loop_trips``: the trips of each GEMM loop left in the kernel, in program order (gemm_loop_trips)."""
    loops, jumps = _branches(ins)
    main = max(loops, key=lambda lp: lp[1] - lp[0])
    skipped = [span for span in jumps if main[0] <= span[0] <= main[1]]
    inside = lambda at, spans: any(lo <= at <= hi for lo, hi in spans)
    spins = [lp for lp in loops if lp != main and any(op == "NANOSLEEP" for at, op, _ in ins if lp[0] <= at <= lp[1])]
    inner = sorted(lp for lp in loops if lp != main and main[0] <= lp[0] and lp[1] <= main[1]
                   and not any(o != lp and lp[0] <= o[0] and o[1] <= lp[1] for o in loops)
                   and not inside(lp[0], skipped)   # (a GEMM's copy in the cold arm of an if/else)
                   and lp not in spins)             # (deterministic: thread 0's wait for its dQ turn)
    skipped += spins
    if len(inner) != len(loop_trips):
        raise SystemExit(f"{len(inner)} GEMM loops in the SASS, {len(loop_trips)} expected: the model is stale")
    hot = [op for at, op, _ in ins if main[0] <= at <= main[1] and not inside(at, inner + skipped)]
    loops_out, total = [], len(hot)
    for (lo, hi), trips in zip(inner, loop_trips):
        body = [op for at, op, _ in ins if lo <= at <= hi]
        loops_out.append((len(body), body.count("HMMA"), body.count("LDSM"), trips))
        total += len(body) * trips
    return {"hot": len(hot), "hot_hmma": hot.count("HMMA"), "loops": loops_out, "total": total}


def _branches(ins):
    """(the loops: backward branches as (target, branch); the spans unconditional forward branches jump over:
    an if/else's other arm)."""
    loops, skips = [], []
    for at, op, text in ins:
        m = re.search(r"BRA\s+(?:`\()?0x([0-9a-f]+)", text)
        if op == "BRA" and m:
            target = int(m.group(1), 16)
            if target < at:
                loops.append((target, at))
            elif not text.startswith("@"):
                skips.append((at + 1, target - 1))
    return loops, skips


def hot_path(ins, innermost: bool) -> list[tuple[str, str]]:
    """(opcode, text) of one step: the innermost loop (FA2's query-block loop) or the longest (ours)."""
    loops, skips = _branches(ins)
    lo, hi = (min if innermost else max)(loops, key=lambda lp: lp[1] - lp[0])
    skipped = [s for s in skips if lo <= s[0] <= hi]
    return [(op, text) for at, op, text in ins if lo <= at <= hi and not any(a <= at <= b for a, b in skipped)]


def opcode(op: str, text: str) -> str:
    """The opcode, with its width and cache modifiers for memory operations (LDSM.16.MT88.4, REDG...F32x2)."""
    if op in ("LDS", "STS", "LDG", "STG", "REDG", "LDSM", "LDGSTS"):
        return text.split()[1] if text.startswith("@") else text.split()[0]
    return op


_WIDTH = {".64": 2, ".128": 4}


def _registers(operands: str) -> set[int]:
    return {int(r) for r in re.findall(r"\bR(\d+)\b", operands)}


def first_use_distances(step: list[tuple[str, str]], loads=("LDG", "LDS", "LDSM")) -> dict[str, int]:
    """Per load opcode, the fewest instructions between a load of the step and the first instruction that reads
    what it loaded (a load whose registers are overwritten first, or never read in the step, counts not):
    a short one is latency the warp waits out there, with nothing of its own to issue."""
    def dest_and_sources(text):
        body = text.split(None, 1)[1] if text.startswith("@") else text
        op, _, operands = body.partition(" ")
        if op.startswith(("ST", "RED", "BAR", "BRA", "LDGSTS")):
            return set(), _registers(operands)
        first, _, rest = operands.partition(",")
        width = 4 if op.startswith("LDSM") and op.endswith(".4") else next(
            (n for key, n in _WIDTH.items() if key in op), 1)
        return {r + i for r in _registers(first) for i in range(width)}, _registers(rest)
    shortest = {}
    for i, (op, text) in enumerate(step):
        if op not in loads:
            continue
        loaded, _ = dest_and_sources(text)
        for j in range(i + 1, len(step)):
            written, read = dest_and_sources(step[j][1])
            if read & loaded:
                shortest[op] = min(shortest.get(op, j - i), j - i)
                break
            if written & loaded:
                break
    return shortest


def gemm_loop_trips(spec) -> tuple[list[int], int]:
    """(the trips of each warp GEMM's k16 loop that stays a loop, in program order; the step's HMMA per warp),
    by templates/sm80/bwd_gemm.cuh.j2's warp_gemm: an iteration takes K_UNROLL k16 steps (2 with
    frag_prefetch; k_unroll 0: all of them); a FRESH GEMM (S^T, dP^T, dQ) with 32 accumulator registers or
    fewer runs its first iteration before the loop where that iteration is at most 2 steps (PEELED); a loop as
    long as one iteration is straight line; dQ's GEMMs come before dK's where flash_bwd's DK_AFTER_DQ holds."""
    w, kw, qw = spec.num_warps, spec.key_warps, spec.dq_row_warps
    s_slabs, s_tiles = spec.block_n // (16 * kw), spec.block_m // (8 * (w // kw))
    kv_slabs, kv_tiles = spec.block_n // (16 * kw), spec.head_dim // (8 * (w // kw))
    dq_slabs, pairs = spec.block_m // (16 * qw), spec.head_dim // (16 * (w // qw))
    chunk = next(c for c in (4, 3, 2, 1) if pairs % c == 0)
    dq_chunks = [(dq_slabs, 2 * chunk, spec.block_n // 16, True)] * (pairs // chunk)
    dv = dk = [(kv_slabs, kv_tiles, spec.block_m // 16, False)]
    gemms = [(s_slabs, s_tiles, spec.head_dim // 16, True)] * 2               # S^T, dP^T
    if spec.stages == 2 and not spec.deterministic and spec.k_unroll == 0:   # (flash_bwd's DK_AFTER_DQ)
        gemms += dv + dq_chunks + dk
    else:
        gemms += dv + dk + dq_chunks
    trips, hmma = [], 0
    for slabs, tiles, k_steps, fresh in gemms:
        hmma += slabs * tiles * k_steps
        per_step = k_steps if spec.k_unroll == 0 else 2 if spec.frag_prefetch else spec.k_unroll   # (0: every step)
        peeled = per_step if (fresh and slabs * tiles * 4 <= 32 and per_step <= 2 and k_steps % per_step == 0
                              and k_steps > per_step) else 0
        if k_steps - peeled > per_step:
            trips.append((k_steps - peeled) // per_step)
    return trips, hmma


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sm", default="sm_90", help="the real target to compile for (sm_90: an H100/H200)")
    parser.add_argument("knobs", nargs="*", help="BackwardSpec fields, knob=value (default: head_dim=128)")
    args = parser.parse_args()
    from facodegen.ops import backward
    from facodegen.spec.backward import BackwardSpec
    fields = {"head_dim": 128}
    for item in args.knobs:
        name, value = item.split("=", 1)
        fields[name] = {"true": True, "false": False}.get(value.lower(), int(value) if value.isdigit() else value)
    spec = BackwardSpec(arch="sm80", **fields)
    kernel = backward.compile(spec, sm=args.sm)
    trips, hmma = gemm_loop_trips(spec)
    count = step_count(instructions(kernel.sass(), kernel.name), trips)
    r = kernel.resources
    print(f"{kernel.name} ({args.sm}): {r.registers} registers, {r.spill_stores} B spilled")
    print(f"HMMA per warp per step: {hmma}")
    print(f"main loop outside the GEMM loops (hot path): {count['hot']} instructions ({count['hot_hmma']} HMMA)")
    for size, hmma, ldsm, trips in count["loops"]:
        print(f"  GEMM loop: {size} instructions ({hmma} HMMA, {ldsm} LDSM) x {trips}")
    print(f"per warp per step: ~{count['total']} instructions")


if __name__ == "__main__":
    main()
