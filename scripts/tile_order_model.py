#!/usr/bin/env python3
"""How evenly the sm90 backward's persistent CTAs finish, in a model of its tile draws (CPU only).

    python3 scripts/tile_order_model.py [--sms 132] [--overhead 1.5]

Each of ``--sms`` CTAs takes the next tile from the counter when it finishes its last; a tile costs its
steps (query blocks it sees: causal, block n sees every query block from its diagonal on) plus
``--overhead`` steps (its prologue and dK/dV epilogue). Printed per FA3-paper cell (16k tokens; head dims
64, 128, 256 at their shipped tiles): total work / (SMs x the last CTA's finish), for the default order
(each (kv head, batch) pair's key blocks in turn), lpt as shipped (key block first within groups of
lpt_group_pairs, the last group from lpt_tail_pair on), lpt with the remainder group alone last (before
lpt_tail_pair), and key block first over all pairs at once. A model, not a measurement: it knows nothing
of L2, the diagonal step's masking or the producer's prefetch.
"""

from __future__ import annotations

import argparse
import heapq
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from facodegen.ops.backward import lpt_group_pairs, lpt_tail_pair  # noqa: E402
from facodegen.spec.backward import SM90_TILES  # noqa: E402


def finish_efficiency(tile_steps: list[float], sms: int, overhead: float) -> float:
    """Total work over sms x the last CTA's finish when each CTA draws the next tile as it finishes."""
    free = [(0.0, i) for i in range(min(sms, len(tile_steps)))]
    heapq.heapify(free)
    for steps in tile_steps:
        t, i = heapq.heappop(free)
        heapq.heappush(free, (t + steps + overhead, i))
    work = sum(tile_steps) + overhead * len(tile_steps)
    return work / (sms * max(t for t, _ in free))


def tile_steps(n_block: int, m_blocks: int, block_m: int, block_n: int, causal: bool) -> int:
    return m_blocks - (n_block * block_n) // block_m if causal else m_blocks


def lpt_order(n_blocks: int, pairs: int, group: int, tail_pair: int) -> list[tuple[int, int]]:
    """(n_block, pair) of every tile in the lpt order: the template's bwd_tile (LPT) over all tiles."""
    order = []
    for tile in range(n_blocks * pairs):
        first = min(tile // (group * n_blocks) * group, tail_pair)
        width = pairs - first if first == tail_pair else group
        within = tile - first * n_blocks
        order.append((within // width, first + within % width))
    return order


def cell(head_dim: int, seqlen: int, causal: bool, sms: int, overhead: float) -> dict:
    block_m, block_n, _ = SM90_TILES[head_dim]
    heads = 2048 // head_dim
    batch = 16384 // seqlen
    pairs, n_blocks, m_blocks = batch * heads, seqlen // block_n, seqlen // block_m
    group = lpt_group_pairs(batch, heads, heads, seqlen, head_dim)
    remainder_last = (pairs - 1) // group * group       # the last group whatever is left of the pairs

    def steps(order):
        return [tile_steps(n, m_blocks, block_m, block_n, causal) for n, _ in order]

    default = [(n, p) for p in range(pairs) for n in range(n_blocks)]
    return {
        "default": finish_efficiency(steps(default), sms, overhead),
        "lpt": finish_efficiency(steps(lpt_order(n_blocks, pairs, group, lpt_tail_pair(pairs, group, n_blocks, sms))),
                                 sms, overhead),
        "lpt, remainder last": finish_efficiency(steps(lpt_order(n_blocks, pairs, group, remainder_last)), sms,
                                                 overhead),
        "block first, all pairs": finish_efficiency(steps(lpt_order(n_blocks, pairs, pairs, 0)), sms, overhead),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sms", type=int, default=132)
    p.add_argument("--overhead", type=float, default=1.5, help="steps a tile costs besides its own (default 1.5)")
    args = p.parse_args(argv)
    columns = None
    for head_dim in (64, 128, 256):
        for causal in (False, True):
            for seqlen in (512, 1024, 2048, 4096, 8192, 16384):
                row = cell(head_dim, seqlen, causal, args.sms, args.overhead)
                if columns is None:
                    columns = list(row)
                    print("| head_dim | causal | seqlen | " + " | ".join(columns) + " |")
                    print("|---" * (3 + len(columns)) + "|")
                print(f"| {head_dim} | {'yes' if causal else 'no'} | {seqlen} | "
                      + " | ".join(f"{row[c]:.3f}" for c in columns) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
