"""Timing facodegen's kernels against their peers (a benchmark, not a test).

Method (the same as /work/shared/peers/h200-2026-11-29.md, so numbers compare):

* CUDA events on the current torch stream around groups of back-to-back calls: 5 warm-up calls,
  then 7 groups of 20 calls, and the median of the 7 group means. On one cell facodegen and
  every peer take turns group by group (A B C A B C ...): the H200 power-caps under long cells
  and its clock moves 10-15% within one, so timing them one after the other would put that drift
  into their ratio.
* Fresh randn inputs, never zeros. Where one input set is smaller than twice the L2 (60 MB on the
  H200) the calls rotate over several sets, so the timing is not of a warm cache; the FA3-paper
  grid (16k tokens, hidden 2048: 64 MB per tensor) needs one set.
* FLOPs = 4 * batch * heads * seqlen_q * seqlen_k * head_dim, half of that for causal (the papers'
  convention); TFLOP/s = FLOPs / time.
* Every implementation's output is checked against a float64 reference on a slice (batch 0, q heads
  0 and 1) before it is timed; a failing, missing or refusing implementation is reported with the
  reason and not timed.
* facodegen is timed as users call it, ``facodegen.attention(q, k, v, causal=..., **overrides)``
  with out allocated per call (column "facodegen-<arch>", the one with the ratio to the best peer),
  and beside it through a launcher prepared once, ``facodegen.prepare(...)`` then ``run()`` (column
  "facodegen-<arch> (prepared)": the kernel with the least host work). Both rotate over the same
  input sets and take turns with the peers; the peers are timed through their public calls.
* The ``overhead`` suite (run_overhead) times host microseconds per call on a tiny shape instead.

Peers: torch SDPA's FLASH_ATTENTION (FlashAttention-2), CUDNN_ATTENTION and EFFICIENT_ATTENTION
backends (through (b, h, s, d) transposed views of (b, s, h, d) tensors) and FlashAttention-3
(``flash_attn_interface.flash_attn_func``, (b, s, h, d)).

Everything that needs a GPU imports torch lazily; the grid, FLOP and table helpers run anywhere.

One module per job:

* grids: cells, the named grids, FLOPs and TFLOP/s.
* tables: implementation names, the best peer and the ratio to it, the markdown table and notes.
* timing: CUDA events in turns (time_cuda_interleaved, time_cuda), host microseconds per call
  (time_host_per_call), the GEMM and copy ceilings.
* inputs: how many input sets to rotate over, fresh randn sets, the float64 check on a slice.
* peers: torch SDPA's backends, FlashAttention-3, FlexAttention.
* variants: facodegen's variants (parse_variant) and its two callables, public call and prepared.
* runner: run_cell, run_grid, run_cli_bench.
* suites: the `--suite` names and their grids, peers, the evolution suite's variants.
* results: CSV records, the environment, write_results (.md, .csv, .json, .png).
* overhead: the overhead suite (host microseconds per call), cases to files.
* backward: the backward suite (`--suite fa3-paper --backward` / `--fwd-bwd`): facodegen.attention
  under autograd beside SDPA's cuDNN and flash backends, backward FLOPs = 2.5 x forward (3.5 x for
  forward + backward), timed with time_cuda, rows written by write_results.
* decode: the decode suite (`--suite decode`): effective K+V bandwidth of
  facodegen.attention_with_kvcache beside FlashAttention-3's flash_attn_with_kvcache and SDPA.
* variants_suite: the variants suite (`--suite variants`): windows, softcap and sinks (time ratios);
  not to be confused with variants (facodegen's spec variants as the forward suites time them).
* varlen_suite: the varlen suite (`--suite varlen`): facodegen.attention_varlen on mixed lengths beside
  FlashAttention-3's flash_attn_varlen_func, and the padded way (facodegen.attention, SDPA's cuDNN) on
  the same sequences padded to the longest; TFLOP/s of the real (unpadded) work.
* plot: the papers' style of figure (matplotlib, imported only when drawing).

The backward, decode, variants and varlen suites are used through their modules (``from facodegen.bench
import backward; backward.run_backward(...)``). The names below are the package's API (``from facodegen import bench; bench.run_grid(...)``); the
private helpers that tools reach for (``variants._facodegen_fn``, ``inputs._make_inputs``, ...) are
imported from their module.
"""

from __future__ import annotations

from .grids import (attention_flops, tflops, cell, TOKENS_PER_BATCH, HIDDEN, paper_cell, FA3_SEQLENS, fa3_paper_grid,
                    quick_grid, sm80_grid, fp8_grid, evolution_grid, GRIDS, make_grid)
from .inputs import (L2_BYTES_DEFAULT, MAX_INPUT_SETS, input_bytes, input_sets_needed, l2_bytes, reference_torch,
                     InputSet, quantized)
from .overhead import (OVERHEAD_SHAPE, OVERHEAD_CASES, OVERHEAD_OPTIONS, OVERHEAD_SDPA, OVERHEAD_FA3, OVERHEAD_IMPLS,
                       OVERHEAD_PEERS, OVERHEAD_TIMING, OVERHEAD_CSV_FIELDS, OVERHEAD_BUILDERS, overhead_row,
                       with_sdpa_ratios, format_overhead_table, format_overhead_notes, overhead_csv,
                       write_overhead_results, run_overhead)
from .peers import DEFAULT_PEERS, peer_available
from .results import CSV_FIELDS, csv_rows, to_csv, environment, write_results
from .runner import run_cell, run_grid, run_cli_bench
from .suites import (SUITES, SUITE_PEERS, OVERHEAD_SUITE, DECODE_SUITE, VARIANTS_SUITE, VARLEN_SUITE,
                     OWN_RUNNER_SUITES, EVOLUTION_VARIANTS, EVOLUTION_TIMING, suite_cells, suite_names)
from .tables import (PEER_TITLES, PREPARED_SUFFIX, facodegen_name, is_facodegen, prepared_name, is_prepared,
                     has_ratio, best_peer, ratio_to_best_peer, implementations, format_table, format_notes)
from .timing import (WARMUP, GROUPS, CALLS_PER_GROUP, time_cuda_interleaved, time_cuda, time_host_per_call,
                     gemm_ceiling, fp8_gemm_ceiling, copy_bandwidth)
from .variants import parse_variant

__all__ = [
    # grids
    "attention_flops", "tflops", "cell", "TOKENS_PER_BATCH", "HIDDEN", "paper_cell", "FA3_SEQLENS",
    "fa3_paper_grid", "quick_grid", "sm80_grid", "fp8_grid", "evolution_grid", "GRIDS", "make_grid",
    # inputs
    "L2_BYTES_DEFAULT", "MAX_INPUT_SETS", "input_bytes", "input_sets_needed", "l2_bytes", "reference_torch",
    "InputSet", "quantized",
    # overhead
    "OVERHEAD_SHAPE", "OVERHEAD_CASES", "OVERHEAD_OPTIONS", "OVERHEAD_SDPA", "OVERHEAD_FA3", "OVERHEAD_IMPLS",
    "OVERHEAD_PEERS", "OVERHEAD_TIMING", "OVERHEAD_CSV_FIELDS", "OVERHEAD_BUILDERS", "overhead_row",
    "with_sdpa_ratios", "format_overhead_table", "format_overhead_notes", "overhead_csv",
    "write_overhead_results", "run_overhead",
    # peers
    "DEFAULT_PEERS", "peer_available",
    # results
    "CSV_FIELDS", "csv_rows", "to_csv", "environment", "write_results",
    # runner
    "run_cell", "run_grid", "run_cli_bench",
    # suites
    "SUITES", "SUITE_PEERS", "OVERHEAD_SUITE", "DECODE_SUITE", "VARIANTS_SUITE", "VARLEN_SUITE", "OWN_RUNNER_SUITES",
    "EVOLUTION_VARIANTS", "EVOLUTION_TIMING", "suite_cells", "suite_names",
    # tables
    "PEER_TITLES", "PREPARED_SUFFIX", "facodegen_name", "is_facodegen", "prepared_name", "is_prepared",
    "has_ratio", "best_peer", "ratio_to_best_peer", "implementations", "format_table", "format_notes",
    # timing
    "WARMUP", "GROUPS", "CALLS_PER_GROUP", "time_cuda_interleaved", "time_cuda", "time_host_per_call",
    "gemm_ceiling", "fp8_gemm_ceiling", "copy_bandwidth",
    # variants
    "parse_variant",
]
