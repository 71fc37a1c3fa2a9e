#!/usr/bin/env python3
"""Hash the rendered CUDA of a wide corpus of sm90 specs, to prove a template refactor changes no byte.

    python3 scripts/render_digests.py save DIGESTS.json     # at the base commit
    python3 scripts/render_digests.py check DIGESTS.json    # after the change: exit 1 on any difference

The corpus (about 7,000 distinct kernels, 15 s): the sm90 defaults (16-bit and fp8, both V layouts),
every spec spec.seqlen_rule_fields picks over lengths 256..32k, each head_dim x dtype x causal base with
every sm90 knob set alone to each value of its domain, and with every pair of the structural knobs
(overlap, pingpong, scheduler, O placement, Q buffers, clusters, fp8's V/Q/O switches, the variants),
keeping what KernelSpec accepts; and the sm90 backward defaults (they include barriers/tma/load_tile).
Equal rendered source means equal NVRTC input: the SASS cannot change.
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from facodegen import KernelSpec  # noqa: E402
from facodegen.codegen.render import emit  # noqa: E402
from facodegen.ops import backward  # noqa: E402
from facodegen.spec import HEAD_DIMS, SpecError, default_fp8_specs, default_specs, seqlen_rule_fields  # noqa: E402
from facodegen.spec.backward import BackwardSpec, default_backward_specs  # noqa: E402
from facodegen.spec.knobs import KNOBS  # noqa: E402

_FIXED = ("arch", "dtype", "head_dim", "causal", "gpu", "v_layout")
_VALUES = {"block_n": (64, 80, 96, 112, 128, 144, 160, 176, 192, 224, 256), "stages": (1, 2, 3, 4),
           "l2_prefetch": (0, 1, 2)}
_PAIRS = {"intra_wg_overlap": (True, False), "pingpong": (True, False), "persistent": (True, False),
          "separate_o": (True, False), "o_in_v": (True, False), "q_stages": (1, 2), "cluster_m": (1, 2),
          "defer_o_store": (True, False), "vt_in_place": (True, False), "q_in_regs": (True, False),
          "stream_k": (True, False), "dynamic_scheduler": (True, False), "optimistic_max": (True, False),
          "p_buffers": (1, 2), "l2_prefetch": (0, 2), "local": (True, False), "softcap": (True, False),
          "sinks": (True, False), "lazy_rescale": (True, False), "l2_hints": (True, False),
          "consumer_warpgroups": (1, 2, 3), "uniform_wg": (True, False), "anchor_softmax": (True, False),
          "rescale_under_qk": (True, False), "rebuild_q_desc": (True, False), "varlen": (True, False)}


def corpus() -> list[KernelSpec]:
    found = {s.variant: s for s in default_specs() + default_fp8_specs() if s.arch == "sm90"}

    def add(fields: dict) -> None:
        try:
            spec = KernelSpec(arch="sm90", **fields)
        except (SpecError, ValueError, TypeError):
            return
        found.setdefault(spec.variant, spec)

    bases = [dict(head_dim=d, dtype=t, causal=c) for d in HEAD_DIMS for t in ("bf16", "fp16", "fp8")
             for c in (False, True)]
    bases += [dict(b, v_layout="transposed") for b in bases if b["dtype"] == "fp8"]
    for b in bases:
        for s in (256, 512, 1024, 2048, 4096, 8192, 16384, 32768):
            for sq, sk in ((s, s), (s, 2 * s), (2 * s, s)):
                add(dict(b, **seqlen_rule_fields("sm90", b["head_dim"], b["dtype"], b["causal"], sq, sk)))
        for knob in KNOBS:
            if "sm90" not in knob.archs or knob.name in _FIXED:
                continue
            values = _VALUES.get(knob.name) or knob.choices or ((True, False) if knob.kind == "bool" else ())
            for v in values:
                add(dict(b, **{knob.name: v}))
        for a, c in itertools.combinations(_PAIRS, 2):
            for va, vc in itertools.product(_PAIRS[a], _PAIRS[c]):
                add(dict(b, **{a: va, c: vc}))
    return [found[v] for v in sorted(found)]


def digests() -> dict[str, str]:
    out = {s.variant: hashlib.sha256(emit(s).encode()).hexdigest() for s in corpus()}
    for s in default_backward_specs():
        try:
            b = BackwardSpec(arch="sm90", head_dim=s.head_dim, dtype=s.dtype, causal=s.causal)
        except SpecError:                           # head dims the sm90 backward does not cover
            continue
        out["backward:" + b.variant] = hashlib.sha256(backward.emit(b).encode()).hexdigest()
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=("save", "check"))
    parser.add_argument("path", type=Path)
    args = parser.parse_args()
    now = digests()
    if args.mode == "save":
        args.path.write_text(json.dumps(now, indent=0, sort_keys=True))
        print(f"{len(now)} rendered sources hashed ({sum('fp8' in k for k in now)} fp8, "
              f"{sum(k.startswith('backward:') for k in now)} backward) -> {args.path}")
        return 0
    saved = json.loads(args.path.read_text())
    differ = sorted(k for k in saved if now.get(k) != saved[k])
    added = sorted(set(now) - set(saved))
    print(f"{len(saved)} compared: {len(differ)} differ, {len(added)} not in {args.path}")
    for k in differ[:20] + added[:20]:
        print("  ", k)
    return 1 if differ or added else 0


if __name__ == "__main__":
    sys.exit(main())
