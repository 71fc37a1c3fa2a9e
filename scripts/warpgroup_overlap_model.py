#!/usr/bin/env python3
"""Two consumer warpgroups of the sm90 backward (head_dim 128) on one in-order tensor pipe: a model (CPU only).

    python3 scripts/warpgroup_overlap_model.py [--gemm 256] [--write-out 150] [--steps 40]

Each warpgroup's step, as templates/sm90/flash_bwd.cu.j2 orders it with s_lookahead and dp_lookahead:
wait for its S^T, dP^T; exponentials and dS^T (``A`` clocks of its own issue, the column of the table);
dV; dQ; dK; wait for dV and dQ; the dQ write-out (``--write-out`` clocks); the next step's S^T, dP^T; wait
for dK. Every GEMM takes ``--gemm`` clocks of the pipe (m64n64k128 at ~4096 dense FLOP a clock per SM:
256), in issue order. ``lockstep``: both warpgroups meet before dQ every step (the default kernel's
named barrier); ``dq_lag``: each step issues the previous step's dQ once the other warpgroup wrote that
step's dS^T (a tile's last step its own too). Printed: the pipe's busy share, 2 x 5 GEMMs a step over the
time the last warpgroup finishes. A model, not a measurement: no L2, no barriers' own cost, no MUFU queue.
"""

from __future__ import annotations

import argparse
import sys


def pipe_share(exp_clocks: float, write_out: float, gemm: float = 256.0, steps: int = 40, lag: bool = False,
               issue: float = 8.0) -> float:
    """The tensor pipe's busy share over ``steps`` steps of both warpgroups (see the module docstring)."""
    pipe_free = 0.0
    done: dict = {}

    def program(wg):
        yield ("issue", "S", 0)
        yield ("issue", "dP", 0)
        for s in range(steps):
            yield ("wait", [("S", s), ("dP", s)])
            yield ("alu", exp_clocks)
            yield ("signal", s)
            yield ("issue", "dV", s)
            dq = s - 1 if lag else s
            if dq >= 0:
                yield ("await", dq)
                yield ("issue", "dQ", dq)
            yield ("issue", "dK", s)
            yield ("wait", [("dV", s)] + ([("dQ", dq)] if dq >= 0 else []))
            if dq >= 0:
                yield ("alu", write_out)
            if lag and s == steps - 1:
                yield ("await", s)
                yield ("issue", "dQ", s)
                yield ("wait", [("dQ", s), ("dK", s)])
                yield ("alu", write_out)
            if s + 1 < steps:
                yield ("issue", "S", s + 1)
                yield ("issue", "dP", s + 1)
            yield ("wait", [("dK", s)])

    signals: dict = {}
    programs = [program(0), program(1)]
    now = [0.0, 0.0]
    current = [next(programs[0]), next(programs[1])]
    finished = [False, False]
    while not all(finished):
        for wg in sorted((w for w in (0, 1) if not finished[w]), key=lambda w: now[w]):
            op = current[wg]
            if op[0] == "issue":
                start = max(now[wg], pipe_free)
                pipe_free = start + gemm
                done[(wg, op[1], op[2])] = pipe_free
                now[wg] += issue
            elif op[0] == "alu":
                now[wg] += op[1]
            elif op[0] == "wait":
                if not all((wg,) + k in done for k in op[1]):
                    continue
                now[wg] = max([now[wg]] + [done[(wg,) + k] for k in op[1]])
            elif op[0] == "signal":
                signals.setdefault(op[1], {})[wg] = now[wg]
            elif op[0] == "await":
                seen = signals.get(op[1], {})
                if len(seen) < 2:
                    continue
                now[wg] = max(now[wg], max(seen.values()))
            try:
                current[wg] = next(programs[wg])
            except StopIteration:
                finished[wg] = True
            break
        else:
            raise RuntimeError("the model deadlocked")
    return 2 * 5 * steps * gemm / max(now)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gemm", type=float, default=256.0)
    p.add_argument("--write-out", type=float, default=150.0)
    p.add_argument("--steps", type=int, default=40)
    args = p.parse_args(argv)
    print("| exponentials a step (clocks) | lockstep | dq_lag |\n|---|---|---|")
    for exp_clocks in (200, 400, 600, 800, 1000):
        row = [pipe_share(exp_clocks, args.write_out, args.gemm, args.steps, lag) for lag in (False, True)]
        print(f"| {exp_clocks} | {row[0]:.3f} | {row[1]:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
