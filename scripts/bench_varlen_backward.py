#!/usr/bin/env python3
"""The varlen backward's speed on a GPU beside FlashAttention-2's varlen backward and the padded backward: a
thin wrapper of facodegen.bench.varlen_backward_suite (the same as ``facodegen bench --suite varlen
--backward``), whose docstring says what each column times.

    python3 scripts/bench_varlen_backward.py [--quick] [--head-dim 128] [--causal|--no-causal] [--out DIR]
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from facodegen.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["bench", "--suite", "varlen", "--backward", *sys.argv[1:]]))
