"""The suites of `facodegen bench --suite`: each TFLOP/s suite's grid by name (SUITES), the peers a
suite times (SUITE_PEERS), the evolution suite's facodegen variants and timing, and the names of the
suites with runners of their own: overhead (overhead.py), decode (decode.py), variants
(variants_suite.py), varlen (varlen_suite.py). The backward of the fa3-paper grid is backward.py's."""

from __future__ import annotations

from .grids import GRIDS

# Each TFLOP/s suite times one of grids.GRIDS under the same name, but for the FA3 paper's ("fa3"),
# which is "fa3-paper" here.
SUITES = {"fa3-paper": GRIDS["fa3"], **{name: grid for name, grid in GRIDS.items() if name != "fa3"}}
SUITE_PEERS = ("fa3", "cudnn", "fa2", "efficient")
OVERHEAD_SUITE = "overhead"  # host microseconds per call: run_overhead, not a grid
DECODE_SUITE = "decode"      # TB/s of decode steps: decode.run_decode over decode.Cell's
VARIANTS_SUITE = "variants"  # windows, softcap, sinks (time ratios): variants_suite.run_variants
VARLEN_SUITE = "varlen"      # packed mixed lengths beside padded: varlen_suite.run_varlen
# Suites that are not a grid of forward TFLOP/s cells (their own runners); the forward grid
# "fa3-paper" also times the backward (backward.run_backward: `bench --suite fa3-paper --backward`).
OWN_RUNNER_SUITES = (OVERHEAD_SUITE, DECODE_SUITE, VARIANTS_SUITE, VARLEN_SUITE)


def suite_cells(suite: str, dtype: str = "bf16", head_dim: int | None = None,
                causal: bool | None = None) -> list[dict]:
    """The cells of a suite, optionally only one head_dim and/or one mask."""
    if suite == OVERHEAD_SUITE:
        raise ValueError(f"suite: {suite!r} times host microseconds per call (run_overhead), not a grid of cells")
    if suite in OWN_RUNNER_SUITES:
        module = suite if suite == DECODE_SUITE else f"{suite}_suite"
        raise ValueError(f"suite: {suite!r} has its own cells and runner (bench.{module})")
    if suite not in SUITES:
        raise ValueError(f"suite: {suite!r} is not one of {', '.join(SUITES)}")
    cells = SUITES[suite](dtype)
    if head_dim is not None:
        cells = [c for c in cells if c["head_dim"] == head_dim]
    if causal is not None:
        cells = [c for c in cells if c["causal"] == causal]
    return cells


# facodegen variants of the evolution suite (name -> variant, see parse_variant): FA1's schedule,
# each FA2 idea switched on alone, all of them in the fa1 template, the fa2 kernel, the sm90 (FA3)
# kernel. One table column (and plot bar) each.
EVOLUTION_VARIANTS = {
    "facodegen FA1": "sm80:schedule=fa1",
    "facodegen FA1 + seq. parallel": "sm80:schedule=fa1,loop_order=q_outer",
    "facodegen FA1 + split Q": "sm80:schedule=fa1,warp_split=q",
    "facodegen FA1 + rescale once": "sm80:schedule=fa1,rescale=once",
    "facodegen FA1 + all three": "sm80:schedule=fa1,loop_order=q_outer,warp_split=q,rescale=once",
    "facodegen FA2 (sm80)": "sm80:",
    "facodegen FA3 (sm90)": "sm90:",
    "facodegen FA3 fp8 (sm90)": "sm90:dtype=fp8",
}
# FA1 at batch 1 runs on 16 CTAs (~0.5 s a call at 16k): few calls per cell.
EVOLUTION_TIMING = {"warmup": 2, "groups": 3, "calls": 3}


def suite_names() -> tuple[str, ...]:
    """Every `facodegen bench --suite` name: the TFLOP/s grids (SUITES), the overhead, decode,
    variants and varlen suites."""
    return (*SUITES, *OWN_RUNNER_SUITES)
