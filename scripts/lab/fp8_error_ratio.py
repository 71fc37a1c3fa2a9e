"""fp8 accuracy against FlashAttention-3's on the same inputs, per spec variant (GPU).

    python3 scripts/lab.py fp8-error-ratio --head-dim 128 --variant sm90: --variant sm90:block_n=128

For each variant (``arch:field=value,...``, bench.parse_variant; dtype fp8) and each shape of the GPU
test's FP8_SHAPES that has more than 1000 outputs (tests/gpu/test_numerics.py's test_fp8_default_spec,
which bounds this ratio by 1.1), prints the relative Frobenius error of O against the float64
reference divided by FlashAttention-3's error on the same e4m3 inputs and descales. It runs the GPU
test's own case builder (_fp8_case), so the inputs are exactly the test's. Needs torch, an sm90 GPU
and flash_attn_interface.
"""

from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests", "gpu"))
sys.path.insert(0, os.path.join(ROOT, "tests"))

from facodegen import bench  # noqa: E402
from facodegen.spec import KernelSpec  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--head-dim", type=int, required=True)
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--variant", action="append", default=[], help="arch:field=value,... (repeatable)")
    args = parser.parse_args(argv)
    import test_numerics as cases    # tests/gpu: the fp8 GPU test's inputs and error measure

    for text in args.variant or ["sm90:"]:
        arch, fields = bench.parse_variant(text)
        spec = KernelSpec(arch=arch, dtype="fp8", head_dim=args.head_dim, causal=args.causal, **fields)
        ratios = []
        for i, shape in enumerate(cases.FP8_SHAPES):
            o, _, o_ref, _, fa3 = cases._fp8_case(spec, shape, descale_per_head=(i == 1), seed=i)
            if fa3 is None:
                raise SystemExit("FlashAttention-3 (flash_attn_interface) with fp8 is not importable")
            if o_ref.size > 1000:
                ratios.append(f"{shape}: {cases._rel(o, o_ref) / cases._rel(fa3, o_ref):.3f}")
        print(f"{spec.variant}  " + "  ".join(ratios), flush=True)


if __name__ == "__main__":
    main()
