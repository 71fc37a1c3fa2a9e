#!/usr/bin/env python3
"""How evenly the persistent sm90 varlen forward's CTAs finish causal tiles, in a model of their draws (CPU only).

    python3 scripts/varlen_order_model.py [--overhead 1.0]

Each CTA slot (132 SMs x the spec's ctas_per_sm) takes the next tile when it finishes its last (the
dynamic scheduler, the causal default); a tile costs the key blocks it visits (m_block m of block_m
rows sees ceil(min((m + 1) block_m, seqlen) / block_n) blocks) plus ``--overhead`` blocks (prologue,
epilogue). Printed per varlen-suite cell (bf16, heads 2048 / head_dim, the shipped causal tiles): total
work / (slots x the last finish) for the default order (each (sequence, head)'s m_blocks counting
down, head by head), varlen_lpt (each sequence's heads in L2-sized sections, m_block counting down
with the heads fastest), the padded kernel's order (sections of (batch, head) pairs; equal lengths
only) and every tile sorted longest first. A model, not a measurement: it knows nothing of L2 or of
the producer's prefetch.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from facodegen.bench.varlen_suite import draw_lengths  # noqa: E402
from facodegen.ops.api import spec_for_shape  # noqa: E402
from tile_order_model import finish_efficiency  # noqa: E402  (the backward's model: the same draws)

L2_SECTION_BYTES = 32 << 20        # scheduler.cuh.j2's
SMS = 132


def sectioned(lengths: list[int], heads: int, units: list[tuple[int, int]], cost, section_keys: int) -> list[int]:
    """Tiles of ``units`` (sequence length, count of its heads or pairs) in sections of
    section_keys // length, m_block counting down with the section's members fastest."""
    order = []
    for length, members in units:
        section = min(max(section_keys // max(length, 1), 1), members)
        for first in range(0, members, section):
            width = min(section, members - first)
            for m in reversed(range(math.ceil(length / cost.block_m))):
                order += [cost(length, m)] * width
    return order


def cell(lengths: list[int], head_dim: int, overhead: float) -> dict:
    heads = 2048 // head_dim
    spec = spec_for_shape("sm90", head_dim, "bf16", True, (len(lengths), max(lengths), max(lengths), heads),
                          varlen=True)

    def cost(length, m):
        return math.ceil(min((m + 1) * spec.block_m, length) / spec.block_n)
    cost.block_m = spec.block_m
    section_keys = L2_SECTION_BYTES // (2 * head_dim * 2)
    default = [cost(n, m) for n in lengths for _ in range(heads) for m in reversed(range(math.ceil(n / spec.block_m)))]
    row = {"tiles": f"{spec.block_m}x{spec.block_n}", "default": default,
           "varlen_lpt": sectioned(lengths, heads, [(n, heads) for n in lengths], cost, section_keys)}
    if len(set(lengths)) == 1:
        row["padded order"] = sectioned(lengths, heads, [(lengths[0], heads * len(lengths))], cost, section_keys)
    row["all longest first"] = sorted(default, reverse=True)
    slots = SMS * spec.ctas_per_sm
    return {k: v if isinstance(v, str) else finish_efficiency(v, slots, overhead) for k, v in row.items()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--overhead", type=float, default=1.0, help="key blocks a tile costs besides its own (default 1)")
    args = p.parse_args(argv)
    columns = ["tiles", "default", "varlen_lpt", "padded order", "all longest first"]
    print("| cell | head_dim | " + " | ".join(columns) + " |")
    print("|---" * (2 + len(columns)) + "|")
    for head_dim in (64, 128):
        for name, lengths in (("mixed", draw_lengths()), ("equal 8x4096", [4096] * 8), ("equal 32x1024", [1024] * 32)):
            row = cell(lengths, head_dim, args.overhead)
            print(f"| {name} | {head_dim} | " + " | ".join(
                "–" if c not in row else row[c] if isinstance(row[c], str) else f"{row[c]:.3f}" for c in columns) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
