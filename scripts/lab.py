#!/usr/bin/env python3
"""The lab probes behind one entry point: measurements and diagnoses made while working on the
kernels, not run on every change (that is scripts/verify_gpu.sh and the scripts beside this one).

    python3 scripts/lab.py --help                 # every subcommand, what it measures, when to use it
    python3 scripts/lab.py SUBCOMMAND --help      # its options and what it prints
    python3 scripts/lab.py sweep --out $OUT --cell 128,8192,0 --variant sm90: --variant sm90:pingpong=0

Each subcommand is a module of scripts/lab/ (underscores for the hyphens) with its own argparse
main(argv); this file only picks it. The modules also run on their own (python3
scripts/lab/sweep.py ...), which is how ab-trees, diagnose, ncu-compare and ncu-source start
their child processes. A cell is head_dim,seqlen,causal of the FlashAttention-3 paper's grid (16k
tokens, hidden 2048) unless a probe says otherwise; a variant is arch:field=value,...
"""

from __future__ import annotations

import difflib
import importlib
import os
import sys

LAB = os.path.join(os.path.dirname(os.path.abspath(__file__)), "lab")

# subcommand: (module in scripts/lab/, where it runs, what it measures and when to use it)
SUBCOMMANDS = {
    "sweep": ("sweep", "GPU",
              "TFLOP/s of spec variants side by side on the same inputs, each checked first: ablations, hand tuning"),
    "ab-trees": ("ab_trees", "GPU",
                 "an old tree against this one, taking turns round by round: a template change against its base"),
    "patch-ab": ("patch_ab", "GPU",
                 "a patch of the rendered kernel against the plain one, in turns, with SM clock and power: try an edit"),
    "trace-steps": ("trace_steps", "GPU",
                    "cycles per phase of the fp8 consumer step and per tile (%clock reads): where a step's time goes"),
    "count-events": ("count_events", "GPU",
                     "counters a source patch adds to an fp8 kernel (e.g. the rescale vote): count what ncu cannot"),
    "clock-probe": ("clock_probe", "GPU",
                    "each timing group beside the SM clock and power nvidia-smi saw: when a median moves between runs"),
    "ncu-compare": ("ncu_compare", "GPU",
                    "Nsight Compute sections of facodegen and a peer on one cell (--backward: the backward's main "
                    "kernels): which pipe or stall differs"),
    "ncu-source": ("ncu_source", "GPU",
                   "Nsight Compute per SASS instruction (stall samples, bank conflicts): where one kernel's warps wait"),
    "overlap-probe": ("overlap_probe", "GPU",
                      "microbenchmark: do wgmma and another warpgroup's MUFU/FFMA run at once on an SM"),
    "wgmma-rate": ("wgmma_rate", "GPU",
                   "microbenchmark: tensor-core rate per wgmma N (bf16, e4m3): does a block_n cost as its FLOPs"),
    "diagnose": ("diagnose", "GPU",
                 "a ladder of cases, one process each with a timeout, error by rows and columns: a wrong or hung kernel"),
    "fp8-error-ratio": ("fp8_error_ratio", "GPU",
                        "fp8 error over FlashAttention-3's on the GPU test's inputs, per variant: before an fp8 default"),
    "peer-error": ("peer_error", "GPU",
                   "fuzz cases run by facodegen and by FA2 on the same inputs, both criteria: a kernel bug or precision"),
    "backward-lse": ("backward_lse", "GPU",
                     "a failing backward case re-run on the forward's LSE, float64's LSE, float64's O: whose error"),
    "varlen-bwd-nonfinite": ("varlen_bwd_nonfinite", "GPU",
                             "a varlen backward fuzz case with non-finite gradients: where, the reference's size, "
                             "other knobs"),
    "mufu-rate": ("mufu_rate", "GPU",
                  "microbenchmark: MUFU.TANH against MUFU.EX2 per SM per clock, and a tanh from one EX2 and FMAs"),
    "bwd-patch-ab": ("bwd_patch_ab", "GPU",
                     "a patch of the backward's rendered kernels against the plain ones, in turns, the peer "
                     "beside: time what a step would cost without (or with another) part"),
    "sass-ab": ("sass_ab", "CPU",
                "another tree's templates against this one's, kernel SASS instruction for instruction: a refactor "
                "that must not change a kernel"),
    "experiments": ("experiments", "CPU",
                    "whether each docs/experiments record applies to this tree: after a template change"),
}


def usage() -> str:
    width = max(map(len, SUBCOMMANDS))
    lines = ["usage: python3 scripts/lab.py SUBCOMMAND [args]   (SUBCOMMAND --help: its options)", "",
             __doc__.strip().splitlines()[0], __doc__.strip().splitlines()[1], "", "subcommands:"]
    lines += [f"  {name:<{width}}  {where}  {what}" for name, (_, where, what) in SUBCOMMANDS.items()]
    lines += ["", "Each is a module of scripts/lab/ that also runs on its own: python3 scripts/lab/<module>.py."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage())
        return 0 if argv else 2
    name = argv[0].replace("_", "-")        # the module's name works too
    if name not in SUBCOMMANDS:
        close = difflib.get_close_matches(name, SUBCOMMANDS, n=1)
        print(f"lab.py: no subcommand {argv[0]!r}{f' (did you mean {close[0]}?)' if close else ''}; "
              "python3 scripts/lab.py --help lists them", file=sys.stderr)
        return 2
    sys.path.insert(0, LAB)                 # the probes import each other by module name (sweep, trace_steps)
    sys.argv = [f"{sys.argv[0]} {name}", *argv[1:]]     # so the probe's usage line names the subcommand
    code = importlib.import_module(SUBCOMMANDS[name][0]).main(argv[1:])
    return 0 if code is None else code


if __name__ == "__main__":
    raise SystemExit(main())
