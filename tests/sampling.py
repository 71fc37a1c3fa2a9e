"""Seeded samples of compile sweeps (#36: the CPU suite stays under 5 minutes on 2 cores as kernels
are added): one config per group of configs whose code differs only in what the group leaves out
(the element type, a second SASS target of the same source), picked by a fixed seed so a failure
reproduces, while every group keeps one compile."""

from __future__ import annotations

import random


def one_per(items, key, seed: int = 2026) -> list:
    """One item of each group of ``items`` with equal ``key(item)``, chosen by ``seed``; in the
    groups' first-seen order."""
    groups: dict = {}
    for item in items:
        groups.setdefault(key(item), []).append(item)
    rng = random.Random(seed)
    return [rng.choice(members) for members in groups.values()]
