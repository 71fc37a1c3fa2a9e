#!/usr/bin/env python3
"""The sm80 backward's step beside FlashAttention-2's, opcode by opcode, from the two SASS listings (no GPU).

    python3 scripts/sass_vs_fa2.py [--lib PATH/libtorch_cuda.so] [--head-dim 128] [--sm sm_90] [knob=value ...]

FA2 here is the copy inside PyTorch (torch SDPA's flash backend, the sm80 bar of issue 38): its
flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel for bf16, non-causal, no dropout, at the tile FA2's own
launcher picks on an H100/H200 (FA2_TRAITS, from its run_mha_bwd_hdim* for >= 144 KB of shared memory).
PATH: torch's lib/libtorch_cuda.so (default: the installed torch's, as on the device); without a CUDA build of
torch, unzip it from the wheel
(`unzip torch-*.whl 'torch/lib/libtorch_cuda.so'`, ~500 MB). cuobjdump finds the kernel by its mangled name.

Both counts are a warp's hot path through one step: FA2's step is its innermost loop (one query block), ours
the main loop (scripts/sass_step_count.py: without GEMM loops, the default k_unroll 0). Instructions an
unconditional forward branch jumps over are left out of both. MIO-bound opcodes (shared memory, MUFU,
barriers, global) are summed apart: at the same count, their placement in the step is what differs, so the
script also prints where each kind sits (instruction indices of the hot path) with --positions.
"""

from __future__ import annotations

import argparse
import collections
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from sass_step_count import hot_path, instructions, opcode  # noqa: E402

# head_dim: (kBlockM, kBlockN, kNWarps, AtomLayoutMSdP, AtomLayoutNdKV, AtomLayoutMdQ, Is_V_in_regs,
# No_double_buffer), and Is_even_MN of the instantiation that runs at 2k-8k tokens (FA2 builds the even-MN
# kernels up to head_dim 128 only).
FA2_TRAITS = {
    64: ((128, 128, 8, 4, 4, 4, False, False), True),
    96: ((64, 128, 8, 2, 4, 4, True, False), True),
    128: ((64, 128, 8, 2, 4, 2, False, False), True),
    192: ((64, 64, 8, 4, 2, 2, False, False), False),
    256: ((64, 64, 8, 4, 2, 2, False, False), False),
}
MIO = ("LDS", "STS", "LDSM", "MUFU", "BAR", "SHFL", "LDGSTS", "REDG", "LDG", "STG")


def fa2_kernel_name(head_dim: int) -> str:
    """The mangled name of FA2's bf16 backward kernel (Is_dropout, Is_causal, Is_local, Has_alibi false)."""
    (bm, bn, warps, msdp, ndkv, mdq, v_in_regs, no_double), even_mn = FA2_TRAITS[head_dim]
    b = lambda flag: f"Lb{int(flag)}E"     # noqa: E731
    traits = (f"23Flash_bwd_kernel_traitsILi{head_dim}ELi{bm}ELi{bn}ELi{warps}ELi{msdp}ELi{ndkv}ELi{mdq}E"
              f"{b(v_in_regs)}{b(no_double)}N7cutlass10bfloat16_tE19Flash_kernel_traitsILi{head_dim}ELi{bm}ELi{bn}"
              f"ELi{warps}ES3_EE")
    flags = "".join(b(f) for f in (False, False, False, False, even_mn, True, False))
    return f"_ZN13pytorch_flash44flash_bwd_dq_dk_dv_loop_seqk_parallel_kernelI{traits}{flags}EEvNS_16Flash_bwd_paramsE"


def installed_torch_cuda_lib() -> Path:
    """The installed torch's lib/libtorch_cuda.so (a CUDA build of torch: on the device, the FA2 it times)."""
    import importlib.util
    found = importlib.util.find_spec("torch")
    lib = Path(found.origin).parent / "lib" / "libtorch_cuda.so" if found and found.origin else None
    if lib is None or not lib.exists():
        raise SystemExit("no CUDA build of torch installed here: give --lib PATH/libtorch_cuda.so (see the docstring)")
    return lib


def fa2_sass(lib: Path, head_dim: int, sm: str) -> tuple[str, str]:
    from facodegen.runtime.compiler import cuobjdump_path
    name = fa2_kernel_name(head_dim)
    done = subprocess.run([cuobjdump_path(), "-sass", "-fun", name, "-arch", sm, str(lib)],
                          capture_output=True, text=True)
    if f"Function : {name}" not in done.stdout:
        raise SystemExit(f"{lib} has no {sm} SASS of FA2's kernel {name}: {done.stderr.strip()[:300]}")
    return done.stdout, name


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lib", type=Path, default=None,
                        help="libtorch_cuda.so of a CUDA build of torch (default: the installed torch's)")
    parser.add_argument("--head-dim", type=int, default=128, choices=sorted(FA2_TRAITS))
    parser.add_argument("--sm", default="sm_90", help="the real target of both listings (sm_90: H100/H200)")
    parser.add_argument("--positions", action="store_true", help="where each MIO opcode sits in the step")
    parser.add_argument("knobs", nargs="*", help="BackwardSpec fields of ours, knob=value")
    args = parser.parse_args()
    if args.lib is None:
        args.lib = installed_torch_cuda_lib()
    from facodegen.ops import backward
    from facodegen.spec.backward import BackwardSpec

    fields = {"head_dim": args.head_dim}
    for item in args.knobs:
        name, value = item.split("=", 1)
        fields[name] = {"true": True, "false": False}.get(value.lower(), int(value) if value.isdigit() else value)
    spec = BackwardSpec(arch="sm80", **fields)
    ours = backward.compile(spec, sm=args.sm)
    sass, fa2_name = fa2_sass(args.lib, args.head_dim, args.sm)
    steps = {"FA2": hot_path(instructions(sass, fa2_name), innermost=True),
             "ours": hot_path(instructions(ours.sass(), ours.name), innermost=False)}
    counts = {who: collections.Counter(opcode(*ins) for ins in step) for who, step in steps.items()}
    (bm, bn, warps, *_), _ = FA2_TRAITS[args.head_dim]
    print(f"FA2: bm{bm} bn{bn} w{warps} (torch's build, {args.sm}); ours: {ours.name}")
    print(f"| per warp per step | FA2 | ours |\n|---|---|---|\n| instructions | {len(steps['FA2'])} | "
          f"{len(steps['ours'])} |")
    mio = {who: sum(n for op, n in c.items() if op.split(".")[0] in MIO) for who, c in counts.items()}
    print(f"| MIO-bound (shared, MUFU, barriers, global) | {mio['FA2']} | {mio['ours']} |")
    for op in sorted(set(counts["FA2"]) | set(counts["ours"]), key=lambda o: -(counts["FA2"][o] + counts["ours"][o])):
        print(f"| {op} | {counts['FA2'][op]} | {counts['ours'][op]} |")
    if args.positions:
        for who, step in steps.items():
            for kind in ("LDSM", "STS", "MUFU", "REDG", "BAR", "LDGSTS"):
                at = [i for i, (op, _) in enumerate(step) if op == kind]
                print(f"{who} {kind} at {at}")


if __name__ == "__main__":
    main()
