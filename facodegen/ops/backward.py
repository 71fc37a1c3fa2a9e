"""The backward pass: render, compile and launch the generated backward kernels, and the public
``attention_backward(do, q, k, v, out, lse, ...) -> (dq, dk, dv)``.

One generated .cu (templates/sm80/flash_bwd.cu.j2) holds three kernels launched in order on the
caller's stream: ``<variant>_dot_do_o`` (D = rowsum(dO ∘ O), dq_accum = 0), ``<variant>`` (dK, dV
of a key block; dq_accum += dS K with fp32 atomics, in key-block order when the spec is
deterministic) and ``<variant>_convert_dq`` (dQ =
softmax_scale * dq_accum). Their one argument is ``BwdParams`` (BWD_FIELDS below, rendered into
the template and packed here, like FlashParams for the forward). The float32 dq_accum
(batch, heads_q, seqlen_q, head_dim) and D (batch, heads_q, seqlen_q) are the only extra memory:
kept per (plan, stream) up to CACHED_SCRATCH_BYTES (the preprocess kernel rewrites all of it each
call), else allocated per call in the caller's library (torch's caching allocator, CuPy's pool).
(sm90 with dq_tma_reduce: dq_accum has seqlen_q rounded up to block_m rows, tiled in the kernel's
order.)

Launches go through driver.Launcher (the forward's launcher) from a ``BackwardPlan`` cached in a
plan.PlanCache under the call's key (shapes, strides, dtypes, devices, the current device,
options), like the forward. A torch call builds its key and launches a hit in attention_backward's
own frame (``BackwardPlan.launch_plain``: one pack of the pointers, three bare launches).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import struct
import sys
import threading

from .. import __version__
from ..runtime import driver
from ..runtime import compiler as compile_mod
from ..spec.backward import (BACKWARD_KNOBS, DEFAULT_GPU, SM90_CONSUMER_REGS, SM90_GPU, SM90_LPT_GROUP_BYTES,
                              SM90_LPT_TAIL_WAVES, SM90_PRODUCER_REGS, BackwardSpec, dq_accum_rows,
                              preprocess_row_threads, preprocess_rows_per_cta, sm80_defaults, sm80_dq_stage_pitch,
                              sm90_default_rings, sm90_dq_cols,
                              sm90_dq_lag_default, sm90_dq_m_tiles, sm90_dq_tma_default, sm90_fewest_dq_pieces, sm90_kv_split,
                              sm90_lookahead_default, sm90_lpt_default, sm90_persistent_default, sm90_swizzle_bytes, stat_rows,
                              varlen_padded_blocks)
from ..runtime.params import (SCALE_FIELDS, SHAPE_FIELDS, TENSOR_MAP_ALIGN, Field, pack_placed,
                               place, stride_fields)
from ..runtime.plan import PlanCache, StreamScratch, _Image, add_image
from ..spec import SpecError

# ------------------------------------------------------------------ the kernel argument

_TENSORS = ("q", "k", "v", "o", "dout", "dq", "dk", "dv")
BWD_FIELDS = [
    Field("q", "ptr", "const elem_t*", "Q (batch, seqlen_q, heads_q, head_dim)"),
    Field("k", "ptr", "const elem_t*", "K (batch, seqlen_k, heads_kv, head_dim)"),
    Field("v", "ptr", "const elem_t*", "V (batch, seqlen_k, heads_kv, head_dim)"),
    Field("o", "ptr", "const elem_t*", "O of the forward (batch, seqlen_q, heads_q, head_dim)"),
    Field("dout", "ptr", "const elem_t*", "dO (batch, seqlen_q, heads_q, head_dim)"),
    Field("lse", "ptr", "const float*", "LSE of the forward, natural log, (batch, heads_q, seqlen_q) contiguous"),
    Field("dq", "ptr", "elem_t*", "dQ (batch, seqlen_q, heads_q, head_dim)"),
    Field("dk", "ptr", "elem_t*", "dK (batch, seqlen_k, heads_kv, head_dim): summed over the GQA group"),
    Field("dv", "ptr", "elem_t*", "dV (batch, seqlen_k, heads_kv, head_dim): summed over the GQA group"),
    Field("dq_accum", "ptr", "float*", "fp32 dQ / softmax_scale (batch, heads_q, seqlen_q, head_dim) contiguous"),
    Field("dpsum", "ptr", "float*", "D = rowsum(dO ∘ O), (batch, heads_q, stat_rows); sm90: then LSE * log2(e) likewise"),
    Field("dq_semaphore", "ptr", "int*", "deterministic: key blocks that have added into each (batch, heads_q, "
                                         "query block) of dq_accum; persistent: then the tile counter"),
    *(field for t in _TENSORS for field in stride_fields(t)),
    *SHAPE_FIELDS,
    *SCALE_FIELDS,
]
# sm90 only, after the others: the TMA maps of the tiles the producer loads (boxes of one swizzle
# slab of head_dim columns; Q and dO: block_m rows, K and V: block_n rows).
BWD_TMA_FIELDS = [
    Field("tma_q", "tmap", "CUtensorMap", "TMA descriptor of Q, box (64 cols, BLOCK_M rows)"),
    Field("tma_k", "tmap", "CUtensorMap", "TMA descriptor of K, box (64 cols, BLOCK_N rows)"),
    Field("tma_v", "tmap", "CUtensorMap", "TMA descriptor of V, box (64 cols, BLOCK_N rows)"),
    Field("tma_dout", "tmap", "CUtensorMap", "TMA descriptor of dO, box (64 cols, BLOCK_M rows)"),
]
# Which tensor each map describes (a launch points the maps at the call's tensors).
_MAP_OPERANDS = {"tma_q": "q", "tma_k": "k", "tma_v": "v", "tma_dout": "dout"}
_POINTERS = ("q", "k", "v", "o", "dout", "lse", "dq", "dk", "dv", "dq_accum", "dpsum", "dq_semaphore")
_PACK_POINTERS = struct.Struct(f"<{len(_POINTERS)}Q")


# sm90 only, after the maps: the lpt tile order's group width (lpt_group_pairs) and its last group's first
# pair (lpt_tail_pair), worked out on the host (a 64-bit division the producer warp, in 24 registers,
# spilled for).
BWD_SM90_FIELDS = [Field("lpt_pairs", "i32", "int", "lpt: (kv head, batch) pairs per group of the tile order"),
                   Field("lpt_tail_pair", "i32", "int", "lpt: the first pair of the last group, which runs to "
                                                        "the last pair")]


def lpt_group_pairs(batch: int, heads_q: int, heads_kv: int, seqlen_q: int, head_dim: int) -> int:
    """The lpt tile order's group: as many (kv head, batch) pairs as keep their Q and dO (16-bit) within
    SM90_LPT_GROUP_BYTES, at least one, at most all."""
    pair_bytes = 4 * seqlen_q * (heads_q // heads_kv) * head_dim
    return max(1, min(batch * heads_kv, SM90_LPT_GROUP_BYTES // max(1, pair_bytes)))


def lpt_tail_pair(pairs: int, group_pairs: int, n_blocks: int, sms: int) -> int:
    """The lpt tile order's last group's first pair: the last group holds at least
    SM90_LPT_TAIL_WAVES x ``sms`` / ``n_blocks`` of the ``pairs`` (causal work pairs x n_blocks^2 / 2 steps:
    SM90_LPT_TAIL_WAVES / 2 x n_blocks steps an SM), taking whole groups of ``group_pairs`` (the remainder
    group among them, however narrow)."""
    tail = -(-SM90_LPT_TAIL_WAVES * sms // max(1, n_blocks))
    return max(0, pairs - tail) // group_pairs * group_pairs


# varlen only, last: the sequence boundaries the main kernel reads (a call patches their addresses in).
# There batch is the number of sequences and seqlen_q / seqlen_k the packed totals (the rows of LSE, D
# and dq_accum per head: the preprocess and postprocess see the packed tokens as one batch).
BWD_VARLEN_FIELDS = [Field("cu_seqlens_q", "ptr", "const int*", "varlen: (sequences + 1,) prefix sums of the "
                                                                "query lengths"),
                     Field("cu_seqlens_k", "ptr", "const int*", "varlen: (sequences + 1,) prefix sums of the key "
                                                                "lengths"),
                     Field("zero_outside", "i32", "int", "varlen: the preprocess zeroes the rows no sequence "
                                                         "covers of dQ (bit 0), dK (bit 1), dV (bit 2)")]
# sm90 varlen, after them: the keys each sequence's key blocks are counted over (its tiles: n_blocks_of)
BWD_SM90_VARLEN_FIELDS = [Field("varlen_max_seqlen_k", "i32", "int", "varlen: keys per sequence the tiles cover "
                                                                     "(max_seqlen_k's plan bound)")]
_PACK_CU_SEQLENS = struct.Struct("<2Q")
_PACK_TOTALS = struct.Struct("<2i")     # seqlen_q, seqlen_k (adjacent in SHAPE_FIELDS): a varlen call's totals


# local (a sliding window) only, last: the window in the bottom-right frame (api.window_params), run-time values
# (a call with another window is another plan of the same kernels).
BWD_LOCAL_FIELDS = [Field("window_left", "i32", "int", "local: keys a row sees before its diagonal key "
                                                       "(i + seqlen_k - seqlen_q)"),
                    Field("window_right", "i32", "int", "local: keys a row sees after its diagonal key")]
# softcap only, after them: the cap c of the forward's logits c tanh(scale s / c), as the kernel multiplies
BWD_SOFTCAP_FIELDS = [Field("softcap_scale", "f32", "float", "softcap: softmax_scale / c (tanh's argument per "
                                                              "raw score)"),
                      Field("softcap_log2", "f32", "float", "softcap: c log2(e) (the capped logit in exp2's units)")]


# sinks only, last: the forward's sink logits and the gradient the postprocess writes, a call's own addresses
# (patched in per launch, after the twelve pointers: BackwardPlan.launch's ``sinks``)
BWD_SINKS_FIELDS = [Field("sinks", "ptr", "const float*", "sinks: (heads_q,) float32 sink logits of the forward"),
                    Field("dsinks", "ptr", "float*", "sinks: (heads_q,) float32 gradient of the sink logits")]
_PACK_SINKS = struct.Struct("<2Q")


def fields(arch: str = "sm80", varlen: bool = False, local: bool = False, softcap: bool = False,
           sinks: bool = False) -> list[Field]:
    return (BWD_FIELDS + (BWD_TMA_FIELDS + BWD_SM90_FIELDS if arch == "sm90" else [])
            + (BWD_VARLEN_FIELDS if varlen else []) + (BWD_SM90_VARLEN_FIELDS if varlen and arch == "sm90" else [])
            + (BWD_LOCAL_FIELDS if local else []) + (BWD_SOFTCAP_FIELDS if softcap else [])
            + (BWD_SINKS_FIELDS if sinks else []))


@functools.lru_cache(maxsize=None)
def layout(arch: str = "sm80", varlen: bool = False, local: bool = False, softcap: bool = False,
           sinks: bool = False) -> tuple[tuple[tuple[Field, int], ...], int, int]:
    """((field, offset), ...), size and alignment of BwdParams (params.place)."""
    return place(fields(arch, varlen, local, softcap, sinks))


def layout_of(spec: BackwardSpec) -> tuple[tuple[tuple[Field, int], ...], int, int]:
    """The BwdParams layout of ``spec``'s kernels."""
    return layout(spec.arch, spec.varlen, spec.local, spec.softcap, spec.sinks)


def pack(values: dict, arch: str = "sm80", varlen: bool = False, local: bool = False, softcap: bool = False,
         sinks: bool = False) -> bytes:
    """BwdParams' bytes; sm90's tensor maps are given as 128 bytes each."""
    return pack_placed(layout(arch, varlen, local, softcap, sinks), values, "BwdParams")


def pack_for(spec: BackwardSpec, values: dict) -> bytes:
    """BwdParams' bytes for ``spec``'s kernels (pack with its layout_of)."""
    return pack_placed(layout_of(spec), values, "BwdParams")


assert [off for f, off in layout()[0][:len(_POINTERS)]] == [8 * i for i in range(len(_POINTERS))]

# ------------------------------------------------------------------ render and compile


_EMIT_ALWAYS = ("arch", "dtype", "head_dim", "block_m", "block_n", "num_warps", "causal")
def _emit_defaults(spec: BackwardSpec) -> dict:
    """The knob values the emit line leaves out: the spec's defaults for its arch and head_dim, as a
    spec built from the line's other flags takes them (sm90: dq_tma_reduce's default is off where the
    line says --deterministic, as BackwardSpec makes it; the ring's depth for the dQ path)."""
    if spec.arch == "sm80":
        return {"head_dim_real": spec.head_dim, "gpu": DEFAULT_GPU, "frag_prefetch": False, "poly_exp2_tiles": 0,
                "dq_bulk_add": False,
                "deterministic": False,
                "dq_tma_reduce": False, "s_lookahead": False, "dp_lookahead": False, "persistent": False, "lpt": False,
                "do_stages": spec.stages, "dq_pieces": 1, "dq_lag": False, "varlen": False, "local": False,
                "softcap": False, "sinks": False,
                **sm80_defaults(spec.head_dim, spec.block_m, spec.block_n, spec.num_warps, spec.gpu, spec.varlen)}
    s_default, dp_default = sm90_lookahead_default(spec.arch, spec.head_dim, spec.block_m, spec.stages,
                                                   spec.dq_tma_reduce, spec.s_lookahead)
    stages, do_stages = sm90_default_rings(spec.head_dim, spec.dq_tma_reduce, SM90_GPU)
    return {"head_dim_real": spec.head_dim, "gpu": SM90_GPU, "stages": stages, "do_stages": do_stages,
            "dq_pieces": sm90_fewest_dq_pieces(spec), "k_unroll": 2, "frag_prefetch": False, "poly_exp2_tiles": 0,
            "dq_bulk_add": False,
            "deterministic": False,
            "s_lookahead": s_default, "dp_lookahead": dp_default,
            "dq_tma_reduce": sm90_dq_tma_default(spec.arch, spec.deterministic),
            "persistent": sm90_persistent_default(spec.arch, spec.deterministic, spec.varlen),
            "lpt": sm90_lpt_default(spec.arch, spec.causal, spec.deterministic, spec.varlen, spec.persistent),
            "dq_lag": sm90_dq_lag_default(spec), "varlen": False, "local": False, "softcap": False, "sinks": False,
            "key_warps": 0,
            "dq_row_warps": 0}
# sm90 knobs the rendered sm80 header leaves out (always off there; its source is as before they existed).
_SM90_ONLY = ("do_stages", "dq_pieces", "dq_tma_reduce", "s_lookahead", "dp_lookahead", "persistent", "lpt",
              "dq_lag")
# and the sm80 warp grids' knobs, which the sm90 header leaves out (0 there: its warpgroups own 64 keys each)
_SM80_ONLY = ("key_warps", "dq_row_warps", "frag_prefetch", "poly_exp2_tiles", "dq_bulk_add")
# and knobs the header lists only when on (so the sources from before them are unchanged)
_LISTED_WHEN_ON = ("dq_bulk_add", "local", "softcap", "sinks")


def emit_command(spec: BackwardSpec) -> str:
    """The `facodegen emit` line that reproduces this spec's source: the problem and its tile, then
    the knobs away from their defaults, spelt by BACKWARD_KNOBS' flags."""
    flags = ["--kernel backward"]
    defaults = _emit_defaults(spec)
    for knob in BACKWARD_KNOBS:
        value = getattr(spec, knob.name)
        if knob.name not in _EMIT_ALWAYS and value == defaults.get(knob.name):
            continue
        if knob.name == "head_dim" and spec.padded:
            value = spec.head_dim_real      # --head-dim 80 (the tile of 96 follows)
        elif knob.name == "head_dim_real":
            continue
        flags.append(knob.command_text(value))
    return "facodegen emit " + " ".join(flags)


def emit(spec: BackwardSpec) -> str:
    """The CUDA source of the spec's three kernels: byte-identical for equal specs."""
    from ..codegen.render import render_template

    placed, size, align = layout_of(spec)
    return render_template(f"{spec.arch}/flash_bwd.cu.j2", dict(
        spec=spec, arch=spec.arch, kernel_name=spec.variant, version=__version__, emit_command=emit_command(spec),
        spec_items=sorted((k, v) for k, v in spec.as_dict().items()
                          if (k not in (_SM80_ONLY if spec.arch == "sm90" else _SM90_ONLY)) and (k != "varlen" or v)
                          and (k not in _LISTED_WHEN_ON or v)
                          and (k != "head_dim_real" or spec.padded)),
        smem_bytes=spec.smem_bytes, threads=spec.threads,
        dq_stage_pitch=sm80_dq_stage_pitch(spec) if spec.arch == "sm80" else 0,
        log2e=repr(math.log2(math.e)), placed=placed, size=size, align=align, tmap_align=TENSOR_MAP_ALIGN,
        producer_regs=SM90_PRODUCER_REGS, consumer_regs=SM90_CONSUMER_REGS, dq_cols=sm90_dq_cols(spec.head_dim),
        dq_bufs=spec.dq_bufs, dq_pieces=spec.dq_pieces, kv_split=sm90_kv_split(spec.head_dim),
        row_threads=preprocess_row_threads(spec.head_dim),
        dq_m_tiles=sm90_dq_m_tiles(spec.block_m) if spec.arch == "sm90" else 1,
        sdp_n=spec.block_m // 2 if sm90_kv_split(spec.head_dim) else spec.block_m,
        kv_cols=spec.head_dim // 2 if sm90_kv_split(spec.head_dim) else spec.head_dim))


_compiled: dict = {}


def compile(spec: BackwardSpec, *, sm: str | None = None, verbose: bool | None = None):
    """Render and compile (NVRTC; cached on disk by source and options like the forward's):
    a compiler.CompiledKernel whose ``resources`` are the main kernel's; ``resources_of(kernel)``
    has all three. ``sm``: another real target (the device's, e.g. sm_90 on an H200)."""
    hit = _compiled.get((spec, sm))
    if hit is None:
        try:
            hit = compile_mod.compile_source(emit(spec), spec.arch, spec.variant, sm=sm, verbose=verbose)
        except compile_mod.CompileError as err:
            hint = f"the whole generated file: `{emit_command(spec)} -o {spec.variant}.cu`"
            raise compile_mod.CompileError(err.name, err.arch, err.log, err.source, hint=hint) from None
        _compiled[(spec, sm)] = hit
    return hit


def resources_of(kernel) -> dict:
    """{kernel symbol: compiler.Resources} of the three kernels (from ptxas's report)."""
    return compile_mod.parse_ptxas_log(kernel.log)


# ------------------------------------------------------------------ launch plans

def row_stat_floats(spec: BackwardSpec, batch: int, heads_q: int, seqlen_q: int) -> int:
    """fp32 values of the preprocess's row statistics: D, and on sm90 LSE * log2(e) after it."""
    return (2 if spec.arch == "sm90" else 1) * batch * heads_q * stat_rows(spec, seqlen_q)


def grids(spec: BackwardSpec, batch: int, heads_q: int, heads_kv: int, seqlen_q: int, seqlen_k: int,
          sms: int | None = None):
    """(preprocess, main, postprocess) grids: preprocess_row_threads lanes per query row for the first
    (every stat row, which covers every row of dq_accum: with dq_tma_reduce the preprocess zeroes its
    padding too); for the main kernel one CTA per (key block, kv head, batch), on sm90 numbered along
    x (bwd_tile), persistent there min(tiles, ``sms``) CTAs; for the last one warp per query row, or
    with dq_tma_reduce one CTA per query block (a tile of dq_accum)."""
    pre = (-(-stat_rows(spec, seqlen_q) // preprocess_rows_per_cta(spec)), heads_q, batch)
    post = ((-(-seqlen_q // spec.block_m) if spec.dq_tma_reduce else -(-seqlen_q // spec.num_warps)),
            heads_q, batch)
    n_blocks = -(-seqlen_k // spec.block_n)
    if spec.arch == "sm80":
        return pre, (n_blocks, heads_kv, batch), post
    if spec.persistent and sms is None:
        raise ValueError("a persistent backward's grid needs the GPU's SM count (sms)")
    tiles = n_blocks * heads_kv * batch
    return pre, (min(tiles, sms) if spec.persistent else tiles, 1, 1), post


def semaphore_ints(spec: BackwardSpec, batch: int, heads_q: int, seqlen_q: int) -> int:
    """int32 counters beside dq_accum (dq_semaphore): deterministic, one turn counter per (batch, heads_q,
    query block); persistent, then the tile counter (tile_counter_of in the templates). varlen: ``batch``
    sequences of ``seqlen_q`` packed query tokens in all, whose query blocks' counters per head are
    ceil(seqlen_q / block_m) + batch (spec/backward.py varlen_padded_blocks)."""
    if spec.varlen:
        turns = heads_q * varlen_padded_blocks(spec, batch, seqlen_q) if spec.deterministic else 0
        return turns + int(spec.persistent)
    return (batch * heads_q * -(-seqlen_q // spec.block_m) if spec.deterministic else 0) + int(spec.persistent)


def varlen_grids(spec: BackwardSpec, sequences: int, heads_q: int, heads_kv: int, total_q: int, max_seqlen_q: int,
                 max_seqlen_k: int, sms: int | None = None):
    """grids() of a varlen backward (``max_seqlen_q``, ``max_seqlen_k``: the plan's bounds). sm80: the
    preprocess and postprocess over the packed query rows as one batch (the preprocess over the turn counters
    too where they outnumber the rows); the main kernel one CTA per (key block of max_seqlen_k's, kv head,
    sequence). sm90: the preprocess and postprocess per sequence (grid z) over max_seqlen_q's rows rounded up to
    block_m (each sequence's padded stat rows); the main kernel's tiles (key block of max_seqlen_k's, kv head,
    sequence) one CTA each, or persistent min(tiles, ``sms``) CTAs."""
    n_blocks = -(-max_seqlen_k // spec.block_n)
    if spec.arch == "sm80":
        pre, _, post = grids(spec, 1, heads_q, heads_kv, total_q, 1)
        if spec.deterministic:
            rows = max(total_q, varlen_padded_blocks(spec, sequences, total_q))
            pre = (-(-rows // preprocess_rows_per_cta(spec)), heads_q, 1)
        return pre, (n_blocks, heads_kv, sequences), post
    pre, _, post = grids(spec, sequences, heads_q, heads_kv, max_seqlen_q, 1)
    if spec.persistent and sms is None:
        raise ValueError("a persistent backward's grid needs the GPU's SM count (sms)")
    tiles = n_blocks * heads_kv * sequences
    return pre, (min(tiles, sms) if spec.persistent else tiles, 1, 1), post


def varlen_scratch(spec: BackwardSpec, sequences: int, heads_q: int, total_q: int) -> tuple[int, int]:
    """(dq_accum floats, row-stat floats) of a varlen backward: sm80 one batch of total_q rows; sm90 its
    LSE * log2(e) and D in varlen_padded_blocks per head, and dq_accum there too where tiled (dq_tma_reduce),
    else a row per packed token."""
    if spec.arch == "sm80":
        return heads_q * total_q * spec.head_dim, row_stat_floats(spec, 1, heads_q, total_q)
    padded_rows = varlen_padded_blocks(spec, sequences, total_q) * spec.block_m
    return heads_q * (padded_rows if spec.dq_tma_reduce else total_q) * spec.head_dim, 2 * heads_q * padded_rows


class VarlenTotals:
    """What a varlen backward plan works out per call from the packed token totals, which its key leaves out (a
    training step packs other totals each step): the grids (sm80's preprocess and postprocess run over the
    total_q rows; sm90's over max_seqlen_q's bound), the scratch (dq_accum, the row stats, the turn counters:
    varlen_scratch, semaphore_ints) and, sm90, the TMA maps over the packed tokens (``encode_maps(targets,
    total_q, total_k)`` -> {BwdParams field: 128 bytes}, targets the q, k, v, dout addresses). BwdParams'
    seqlen_q and seqlen_k take the totals (BackwardPlan.launch)."""

    def __init__(self, spec: BackwardSpec, sequences: int, heads_q: int, heads_kv: int, max_seqlen_q: int,
                 max_seqlen_k: int, sms: int | None, encode_maps=None):
        self.spec, self.sequences, self.heads_q, self.heads_kv = spec, sequences, heads_q, heads_kv
        self.max_seqlen_q, self.max_seqlen_k, self.sms = max_seqlen_q, max_seqlen_k, sms
        self.encode_maps = encode_maps
        self._per_total: dict[int, tuple] = {}     # total_q -> (grids, scratch), the last MAX_LAUNCHER_SETS
        self._lock = threading.Lock()              # (calls on several threads share a plan)

    def of(self, total_q: int) -> tuple:
        """(grids, (dq_accum floats, row-stat floats, turn-counter ints)) of a call with ``total_q`` query tokens."""
        found = self._per_total.get(total_q)
        if found is None:
            accum, stats = varlen_scratch(self.spec, self.sequences, self.heads_q, total_q)
            found = (varlen_grids(self.spec, self.sequences, self.heads_q, self.heads_kv, total_q, self.max_seqlen_q,
                                  self.max_seqlen_k, self.sms),
                     (accum, stats, semaphore_ints(self.spec, self.sequences, self.heads_q, total_q)))
            with self._lock:
                while len(self._per_total) >= MAX_LAUNCHER_SETS:
                    del self._per_total[next(iter(self._per_total))]
                self._per_total[total_q] = found
        return found


# A plan keeps its dq_accum, D and turn counters per stream (plan.StreamScratch) up to this many
# bytes; a larger call allocates them per call in the caller's library, as every call did before
# (its kernels run long enough that the allocation is noise, and a plan does not hold that memory).
CACHED_SCRATCH_BYTES = 16 << 20
# A varlen plan keeps the launchers of at most this many grids (sm80's change with the token totals).
MAX_LAUNCHER_SETS = 8


class BackwardPlan:
    """One resolved backward call: the three loaded kernels, their grids and a BwdParams image;
    ``launch`` writes the call's pointers into the image and launches the three in order.

    The scratch (fp32 dq_accum, D, the deterministic turn counters) lives per (plan, stream) where
    it is at most CACHED_SCRATCH_BYTES: launches on one stream run in order, and each call's
    preprocess kernel rewrites all of it before the main kernel reads it (every dq_accum row below
    seqlen_q, which is all of it, or with dq_tma_reduce every row of its padded tiles, every D, the
    counter of every query block), so calls on one
    stream can share it; calls on two streams never do. The plan's lock is held across the three
    launches, so two threads on one stream cannot interleave theirs around a shared scratch.

    sm90 keeps one image per (q, k, v, dout) addresses seen, as plan.LaunchPlan does: a model's
    layers of one shape share a plan, and their tensors' addresses recur from step to step, so a
    launch finds an image whose TMA maps point there already (cuTensorMapReplaceAddress: ~1 µs a map).

    A varlen plan (``varlen``: its VarlenTotals; ``totals``: the (total_q, total_k) it was built for) serves
    any token totals: each launch takes its call's, which set BwdParams' seqlen_q and seqlen_k, the grids
    (a set of launchers per grid seen), the scratch's size and, sm90, its image (one per addresses and
    totals, the maps encoded anew for new ones)."""

    def __init__(self, spec: BackwardSpec, functions, grid3, param_bytes: bytes, *, device: int, accum_floats: int,
                 dpsum_floats: int, semaphore_ints: int = 0, switch_context: bool, allocate=None, map_targets=None,
                 outputs=None, keep_scratch: bool = True, varlen: VarlenTotals | None = None, totals: tuple = ()):
        self.spec = spec
        self.grids = grid3
        self.outputs = outputs
        self.device = device
        self.accum_floats, self.dpsum_floats = accum_floats, dpsum_floats
        self.semaphore_ints = semaphore_ints     # turn counters and the tile counter (semaphore_ints())
        self._switch_context = switch_context
        self._allocate = allocate
        self._functions = functions
        self._launchers = self._make_launchers(grid3) if functions[0] is not None else []
        self._varlen = varlen
        self._launcher_sets = {tuple(grid3): self._launchers}     # varlen: the launchers of each grid seen
        # launch_plain calls the bindings themselves (driver.Launcher.bare), saving the Launchers' frames
        self._bares = tuple(launcher.bare for launcher in self._launchers)
        self._bare_error = self._launchers[0].error if self._launchers else ()
        self._lock = threading.Lock()
        nbytes = 4 * (accum_floats + dpsum_floats + semaphore_ints)
        self._scratch = StreamScratch({"accum": 4 * accum_floats, "dpsum": 4 * dpsum_floats,
                                       "semaphore": 4 * semaphore_ints}, allocate) \
            if allocate is not None and keep_scratch and nbytes <= CACHED_SCRATCH_BYTES else None
        # sm90: (offset of a TMA map in BwdParams, index of its tensor in ``pointers``) per map
        offsets = {f.name: off for f, off in layout_of(spec)[0]}
        self._cu_seqlens_at = offsets.get("cu_seqlens_q")     # varlen: where a call's boundaries go
        self._sinks_at = offsets.get("sinks")                 # sinks: where a call's sinks and dsinks go
        self._totals_at = offsets["seqlen_q"]                 # varlen: where its totals go (seqlen_q, seqlen_k)
        self._maps = [(offsets[name], _POINTERS.index(operand)) for name, operand in _MAP_OPERANDS.items()] \
            if spec.arch == "sm90" else []
        self._map_offsets = {name: offsets[name] for name in _MAP_OPERANDS} if self._maps else {}
        first = _Image(param_bytes)
        first_key = (tuple(map_targets) if map_targets is not None else None) if self._maps else None
        self._images = {first_key + tuple(totals) if self._maps and varlen is not None else first_key: first}
        self._last = first
        # launch_plain serves this plan: the scratch is the plan's, no context to switch (and no boundaries
        # to patch in: varlen plans launch through launch)
        self.plain = self._scratch is not None and not switch_context and not spec.varlen and not spec.sinks

    def _make_launchers(self, grid3) -> list:
        smem = (0, self.spec.smem_bytes, 0)
        return [driver.Launcher(f, g, self.spec.threads, s) for f, g, s in zip(self._functions, grid3, smem)]

    def _launchers_for(self, grid3) -> list:
        """The launchers of ``grid3`` (a varlen call's; lock held), made on first use; at most
        MAX_LAUNCHER_SETS kept, the oldest going first (the built plan's stays)."""
        key = tuple(grid3)
        found = self._launcher_sets.get(key)
        if found is None:
            while len(self._launcher_sets) >= MAX_LAUNCHER_SETS:
                del self._launcher_sets[next(k for k in self._launcher_sets if k != tuple(self.grids))]
            found = self._launcher_sets[key] = self._make_launchers(grid3)
        return found

    def _image(self, key: tuple) -> _Image:
        """The image of ``key``: the q, k, v, dout addresses its TMA maps point at, then a varlen plan's totals
        (whose maps are encoded whole for them); made from the last one, lock held."""
        if self._varlen is not None:
            encoded = self._varlen.encode_maps(key[:len(self._maps)], *key[len(self._maps):])
            return add_image(self._images, key, self._last, [],
                             [(self._map_offsets[name], data) for name, data in encoded.items()])
        return add_image(self._images, key, self._last, [(offset, ptr) for (offset, _), ptr in zip(self._maps, key)])

    def launch(self, stream: int, pointers: tuple, cu_seqlens: tuple[int, int] | None = None,
               totals: tuple[int, int] | None = None, sinks: tuple[int, int] | None = None) -> None:
        """``pointers``: q, k, v, o, dout, lse, dq, dk, dv device addresses (the scratch is the
        plan's, or, too large to keep or without an ``allocate``, made for this call); a varlen plan's
        ``cu_seqlens``: the cu_seqlens_q and cu_seqlens_k addresses, and ``totals``: the call's packed
        (total_q, total_k); a sinks plan's ``sinks``: the sinks and dsinks addresses."""
        held = None
        varlen = self._varlen
        if varlen is not None:
            grid3, (accum, dpsum, semaphores) = varlen.of(totals[0])
        else:
            accum, dpsum, semaphores = self.accum_floats, self.dpsum_floats, self.semaphore_ints
        if self._scratch is not None:
            scratch = self._scratch.get(stream)
            tail = (scratch.accum, scratch.dpsum, scratch.semaphore)
        else:
            # The scratch goes back to the caller's allocator when ``held`` dies; both allocators (torch's
            # caching allocator, CuPy's pool) reuse a block only in stream order, after these launches.
            held, base = self._allocate(4 * (accum + dpsum + semaphores))
            tail = (base, base + 4 * accum, base + 4 * (accum + dpsum) if semaphores else 0)
        pointers = tuple(pointers) + tail
        with self._lock:
            launchers = self._launchers_for(grid3) if varlen is not None and self._launchers else self._launchers
            if self._maps:
                key = tuple(pointers[i] for _, i in self._maps) + (tuple(totals) if varlen is not None else ())
                image = self._images.get(key) or self._image(key)
            else:
                image = self._last
            _PACK_POINTERS.pack_into(image.storage, image.base, *pointers)
            if self._cu_seqlens_at is not None:
                _PACK_CU_SEQLENS.pack_into(image.storage, image.base + self._cu_seqlens_at, *cu_seqlens)
            if self._sinks_at is not None:
                _PACK_SINKS.pack_into(image.storage, image.base + self._sinks_at, *sinks)
            if varlen is not None:
                _PACK_TOTALS.pack_into(image.storage, image.base + self._totals_at, *totals)
            self._last = image
            arg = driver.stream_arg(stream)
            if self._switch_context:
                with driver.on_device(self.device):
                    for launcher in launchers:
                        launcher(arg, image.kernel_params)
            else:
                for launcher in launchers:
                    launcher(arg, image.kernel_params)
        del held

    def launch_plain(self, stream: int, q: int, k: int, v: int, o: int, dout: int, lse: int, dq: int, dk: int,
                     dv: int) -> None:
        """``launch`` of a ``plain`` plan (its scratch kept per stream, no context to switch): the hit
        path of attention_backward. One pack of the twelve pointers, three launches."""
        found = self._scratch._streams.get(stream)
        scratch = found if found is not None else self._scratch.get(stream)
        lock = self._lock
        lock.acquire()      # (cheaper than `with`)
        try:
            if self._maps:
                targets = (q, k, v, dout)
                image = self._images.get(targets) or self._image(targets)
            else:
                image = self._last      # (the one image of a plan without maps)
            _PACK_POINTERS.pack_into(image.storage, image.base, q, k, v, o, dout, lse, dq, dk, dv, scratch.accum,
                                     scratch.dpsum, scratch.semaphore)
            self._last = image
            params, arg = image.kernel_params, scratch.stream
            for i, bare in enumerate(self._bares):
                try:
                    bare(arg, params, 0)
                except self._bare_error as err:
                    self._launchers[i].failed(err, arg, params)
        finally:
            lock.release()

    def scratch(self, stream: int):
        """This plan's scratch on ``stream`` (accum, dpsum, semaphore addresses), made on first use;
        None where the plan allocates it per call."""
        return None if self._scratch is None else self._scratch.get(stream)

    def param_bytes(self) -> bytes:
        return self._last.data()


def compile_for_device(spec: BackwardSpec, device: int = 0):
    """The spec's kernels as attention_backward compiles them for ``device`` (its real target), from
    the compile cache when they are there."""
    from .api import device_info, device_target
    return compile(spec, sm=device_target(spec.arch, device_info(device)))


def choose(head_dim: int, dtype: str, causal: bool, info, knobs: dict, arch: str | None = None) -> BackwardSpec:
    """The backward spec of a call on the device ``info`` describes: ``arch`` (None: default_arch's
    pick for the call), the default tiles for its GPU with the caller's knobs, refused (naming
    block_n) where its shared memory does not fit."""
    arch = arch or default_arch(info, head_dim, dtype, causal, knobs)
    try:
        spec = _spec(arch, head_dim, dtype, causal, tuple({"gpu": info.budget_gpu, **knobs}.items()))
    except TypeError as err:
        raise TypeError(f"attention_backward: {err} (knobs are BackwardSpec fields)") from None
    if info.smem_per_block_optin and spec.smem_bytes > info.smem_per_block_optin:
        raise SpecError("block_n", f"the kernel needs {spec.smem_bytes} bytes of shared memory but {info.name} "
                                   f"allows {info.smem_per_block_optin} per block")
    return spec


@functools.lru_cache(maxsize=256)
def _spec(arch: str, head_dim: int, dtype: str, causal: bool, knob_items: tuple) -> BackwardSpec:
    """BackwardSpec(arch=..., **dict(knob_items)), remembered: a miss of the backward's plan cache (in
    training, the varlen backward's at every new token total) asks for its spec twice (default_arch,
    choose), ~10 µs a construction; specs are frozen, and a refused one is not remembered."""
    return BackwardSpec(arch=arch, head_dim=head_dim, dtype=dtype, causal=causal, **dict(knob_items))


@functools.lru_cache(maxsize=128)
def _load(spec: BackwardSpec, device: int):
    """The spec's three kernels loaded on ``device`` (compiled first, or read from the cache)."""
    kernel = compile_for_device(spec, device)
    return tuple(driver.load_function(kernel.cubin, name, device, max_dynamic_smem=spec.smem_bytes if i == 1 else 0)
                 for i, name in enumerate(spec.kernel_names))


# ------------------------------------------------------------------ the public call

_PLANS = PlanCache()


def attention_backward(do, q, k, v, out, lse, *, causal: bool = False, softmax_scale: float | None = None,
                       window_size=(-1, -1), causal_alignment: str = "bottom_right", softcap: float = 0.0, sinks=None,
                       dq=None, dk=None, dv=None, arch: str | None = None, **knobs):
    """Gradients of attention: (dq, dk, dv) given dO = ``do`` and the forward's ``out`` and ``lse``.

    q, out, do: (batch, seqlen_q, heads_q, head_dim); k, v: (batch, seqlen_k, heads_kv, head_dim),
    fp16 or bf16 CuPy arrays or torch CUDA tensors with attention()'s layout rules (any
    batch/seq/head strides that are multiples of 8 elements, contiguous head_dim); lse: the
    forward's float32 natural-log LSE, contiguous (batch, heads_q, seqlen_q) (attention(...,
    return_lse=True)). ``causal`` and ``softmax_scale`` must be the forward's (bottom-right
    causal), and so must ``window_size``, ``causal_alignment`` and ``softcap`` (attention()'s sliding window,
    top-left causal and logit cap: the sm80 backward's LOCAL and SOFTCAP kernels, on every GPU; the sm90 backward
    has neither yet), and so must ``sinks`` (the forward's sink logits, whose LSE includes them): the call then
    returns (dq, dk, dv, dsinks), dsinks a new float32 (heads_q,) array, summed in a fixed order. dK and dV of a kv head are summed over the query heads that share it (GQA/MQA).
    dq, dk, dv: arrays to write the gradients into (default: new contiguous ones).
    head_dim: 64, 96, 128, 192, 256, or any other multiple of 8 in [8, 256] (the next one's tile, padded
    inside the kernels as the forward's: BackwardSpec(head_dim=80) is the 96 tile with head_dim_real=80).
    ``arch``: None or sm80 (FlashAttention-2's backward, mma.sync: the default on every GPU for now),
    or sm90 (FlashAttention-3's backward, TMA + wgmma: every head_dim, H100/H200 only; the default on
    sm90 GPUs where it covers the call: default_arch). ``knobs``: BackwardSpec fields (block_m, block_n, num_warps, ...). Runs on the caller's
    current stream; the first call with given shapes/strides/options builds a launch plan.
    """
    from . import api

    window_size = hashable_window(window_size)
    torch = api._TORCH or api._torch()
    if torch is not None and q.__class__ is torch.Tensor:
        # torch: the key in this frame (meta of every array, one tuple), and a hit of a plain plan launched here
        try:
            key = (do.dtype, do.shape, do.stride(), do.get_device(), q.dtype, q.shape, q.stride(), q.get_device(),
                   k.dtype, k.shape, k.stride(), k.get_device(), v.dtype, v.shape, v.stride(), v.get_device(),
                   out.dtype, out.shape, out.stride(), out.get_device(), lse.dtype, lse.shape, lse.stride(),
                   lse.get_device(),
                   None if dq is None else (dq.dtype, dq.shape, dq.stride(), dq.get_device()),
                   None if dk is None else (dk.dtype, dk.shape, dk.stride(), dk.get_device()),
                   None if dv is None else (dv.dtype, dv.shape, dv.stride(), dv.get_device()),
                   causal.__class__, causal, softmax_scale.__class__, softmax_scale, window_size, causal_alignment,
                   softcap.__class__, softcap, None if sinks is None else (sinks.dtype, sinks.shape, sinks.stride(),
                                                                           sinks.get_device()),
                   arch, tuple(sorted(knobs.items())) if knobs else (), torch._C._cuda_getDevice())
            plan = _PLANS._plans.get(key)
        except (AttributeError, TypeError):   # not all torch tensors, an unhashable knob: the checked path says
            plan = key = None
        if plan is not None and plan.plain:
            if dq is None:  # contiguous, q's shape and dtype: the plan's dq strides (its key says q's shape)
                dq = torch.empty_like(q, memory_format=torch.contiguous_format)
            if dk is None:
                dk = torch.empty_like(k, memory_format=torch.contiguous_format)
            if dv is None:
                dv = torch.empty_like(v, memory_format=torch.contiguous_format)
            qp, kp, vp, op, dop, dqp, dkp, dvp = (q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(),
                                                  do.data_ptr(), dq.data_ptr(), dk.data_ptr(), dv.data_ptr())
            if not (qp | kp | vp | op | dop | dqp | dkp | dvp) & 15:     # (else the checked path says which)
                plan.launch_plain(torch._C._cuda_getCurrentRawStream(plan.device), qp, kp, vp, op, dop,
                                  lse.data_ptr(), dqp, dkp, dvp)
                return dq, dk, dv
        kind = "torch"
    else:
        kind = api._kind(q)
        plan = key = None
        if kind != "other":
            try:
                key = call_key(kind, (do, q, k, v, out, lse, dq, dk, dv, sinks), (
                    causal.__class__, causal, softmax_scale.__class__, softmax_scale, window_size, causal_alignment,
                    softcap.__class__, softcap, arch, tuple(sorted(knobs.items()))))
                plan = _PLANS.get(key)
            except (AttributeError, TypeError, ValueError):   # not arrays of one library, an unhashable knob
                plan = key = None
    if plan is None:
        plan = _resolve(do, q, k, v, out, lse, causal, softmax_scale, dq, dk, dv, arch, knobs, window_size,
                        causal_alignment, softcap, sinks)
        if key is not None:
            _PLANS.put(key, plan)
    device = plan.device
    dq = _new_like(kind, device, q) if dq is None else dq
    dk = _new_like(kind, device, k) if dk is None else dk
    dv = _new_like(kind, device, v) if dv is None else dv
    pointers = call_pointers(kind, (q, k, v, out, do, lse, dq, dk, dv))
    if sinks is None:
        plan.launch(api._current_stream(kind, device), pointers)
        return dq, dk, dv
    dsinks = _zeros_like(kind, device, sinks)
    ptr = api.ARRAY_PTR[kind]
    plan.launch(api._current_stream(kind, device), pointers, sinks=(ptr(sinks), ptr(dsinks)))
    return dq, dk, dv, dsinks


def call_pointers(kind: str, arrays: tuple) -> tuple:
    """The addresses of a backward call's q, k, v, out, do, lse, dq, dk, dv (``kind`` arrays: torch or CuPy, as
    the checked path let through), each but the LSE's checked to be 16-byte aligned."""
    from . import api
    ptr = api.ARRAY_PTR[kind]
    pointers = tuple(ptr(x) for x in arrays)
    if any(p % 16 for p in pointers[:5] + pointers[6:9]):
        raise ValueError("do, q, k, v, out, dq, dk, dv: data pointers must be 16-byte aligned")
    return pointers


def call_key(kind: str, arrays: tuple, options: tuple) -> tuple:
    """The plan key of a backward call on ``kind`` arrays outside attention_backward's torch frame (CuPy):
    each array's meta (None: not given), the ``options`` and the current device. (The varlen backward keys
    without the token totals: varlen_backward._call_key.)"""
    from . import api
    meta = api.ARRAY_META[kind]
    return (kind, *(meta(x) for x in arrays), *options, api._current_device(kind))


def _new_like(kind: str, device: int, x):
    """A new contiguous array of x's shape and dtype on ``device`` (x's: the plan's key holds it)."""
    if kind == "torch":
        # empty_like: no device string to parse; 1.9 against 4.5 µs per call for torch.empty(shape,
        # dtype=, device="...") (CPU tensors, 2026-12-03), three times per backward call
        torch = sys.modules["torch"]
        return torch.empty_like(x, memory_format=torch.contiguous_format)
    import cupy
    with cupy.cuda.Device(device):
        return cupy.empty(x.shape, dtype=x.dtype)


def hashable_window(window_size):
    """A backward call's window_size as its plan key holds it: a tuple (a list given as FlashAttention's callers
    do becomes one); anything else as it is, for the checked path to name."""
    if window_size.__class__ is tuple:
        return window_size
    try:
        return tuple(window_size)
    except TypeError:
        return window_size


def _zeros_like(kind: str, device: int, x):
    """A new zeroed array of x's shape and dtype on ``device`` (the sink gradient)."""
    if kind == "torch":
        return sys.modules["torch"].zeros_like(x, memory_format=sys.modules["torch"].contiguous_format)
    import cupy
    with cupy.cuda.Device(device):
        return cupy.zeros(x.shape, dtype=x.dtype)


def _contiguous_strides(shape) -> tuple:
    strides, n = [], 1
    for size in reversed(shape):
        strides.append(n)
        n *= size
    return tuple(reversed(strides))


def _resolve(do, q, k, v, out, lse, causal, softmax_scale, dq, dk, dv, arch, knobs, window_size=(-1, -1),
             causal_alignment="bottom_right", softcap=0.0, sinks=None) -> BackwardPlan:
    """Check every argument (errors name it), pick and load the kernels, build the plan."""
    from . import api

    qv, kv, vv = api._view("q", q), api._view("k", k), api._view("v", v)
    api._check_inputs(qv, kv, vv, any_head_dim=True, what="attention_backward")   # (a padded d: the next tile's)
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be True or False, got {causal!r}")
    batch, seqlen_q, heads_q, head_dim = qv.shape
    seqlen_k, heads_kv = kv.shape[1], kv.shape[2]
    views = {"q": qv, "k": kv, "v": vv}
    for name, x, like in (("do", do, qv), ("out", out, qv)):
        view = api._view(name, x)
        _check_like(view, like, name)
        views["dout" if name == "do" else "o"] = view
    lsev = api._view("lse", lse)
    want = (batch, heads_q, seqlen_q)
    if lsev.kind != qv.kind or lsev.dtype != "float32" or lsev.device != qv.device:
        raise TypeError(f"lse must be a float32 {qv.kind} array on cuda:{qv.device} (the forward's return_lse), "
                        f"got a {lsev.kind} {lsev.dtype} array on cuda:{lsev.device}")
    if lsev.shape != want or lsev.strides != (heads_q * seqlen_q, seqlen_q, 1):
        raise ValueError(f"lse must be a contiguous (batch, heads_q, seqlen_q) = {want} array, got shape "
                         f"{lsev.shape} strides {lsev.strides}")
    gradient_views(views, dq, dk, dv)
    scale = api._check_scale(softmax_scale, head_dim)
    causal, knobs, variant_values = variant_knobs(window_size, causal_alignment, softcap,
                                                  api._check_sinks(sinks, qv) is not None, causal, seqlen_q, seqlen_k,
                                                  scale, knobs)
    info, spec, functions = spec_of_call(qv, head_dim, causal, knobs, arch)
    values = stride_values(views)
    values.update(variant_values)
    values.update(batch=batch, seqlen_q=seqlen_q, seqlen_k=seqlen_k, heads_q=heads_q, heads_kv=heads_kv,
                  softmax_scale=scale, scale_log2=scale * math.log2(math.e))
    if spec.arch == "sm90":
        driver.ensure_context(qv.device)     # (the autograd engine's thread may have none yet)
        group = lpt_group_pairs(batch, heads_q, heads_kv, seqlen_q, head_dim)
        values.update(tensor_maps(spec, views, batch, seqlen_q, seqlen_k, heads_q, heads_kv), lpt_pairs=group,
                      lpt_tail_pair=lpt_tail_pair(batch * heads_kv, group, -(-seqlen_k // spec.block_n), info.sms))
    return BackwardPlan(spec, functions, grids(spec, batch, heads_q, heads_kv, seqlen_q, seqlen_k, info.sms),
                        pack_for(spec, values), allocate=functools.partial(api._allocate, qv.kind, qv.device),
                        map_targets=tuple(views[operand].ptr for operand in _MAP_OPERANDS.values()),
                        device=qv.device, accum_floats=batch * heads_q * dq_accum_rows(spec, seqlen_q) * spec.head_dim,
                        dpsum_floats=row_stat_floats(spec, batch, heads_q, seqlen_q),
                        semaphore_ints=semaphore_ints(spec, batch, heads_q, seqlen_q),
                        switch_context=qv.device != api._current_device(qv.kind))


def variant_knobs(window_size, causal_alignment, softcap, sinks: bool, causal: bool, seqlen_q: int, seqlen_k: int,
                  scale: float, knobs: dict) -> tuple[bool, dict, dict]:
    """(the spec's causal flag, the knobs, BwdParams' variant values) of a backward call's window_size,
    causal_alignment, softcap and ``sinks`` (whether it gives them), as the forward folds them
    (api.window_params: a window that cuts nothing is no window, top-left causal on a square problem is causal):
    LOCAL kernels (local=True) where a window remains, SOFTCAP ones (softcap=True) where the cap is on, SINKS
    ones (sinks=True) with sinks, whose addresses each launch patches in."""
    from . import api
    left, right = api._check_window(window_size)
    api._check_alignment(causal_alignment)
    cap = api._check_softcap(softcap)
    if "local" in knobs:
        raise TypeError("local: set by window_size and causal_alignment (the forward's), not a knob of this call")
    local, causal, window_left, window_right = api.window_params(left, right, causal, seqlen_q, seqlen_k,
                                                                 causal_alignment == "top_left")
    values = {}
    if local:
        knobs = {**knobs, "local": True}
        values.update(window_left=window_left, window_right=window_right)
    if cap:
        knobs = {**knobs, "softcap": True}
        values.update(softcap_scale=scale / cap, softcap_log2=cap * math.log2(math.e))
    if sinks:
        knobs = {**knobs, "sinks": True}
        values.update(sinks=0, dsinks=0)
    return causal, knobs, values


def gradient_views(views: dict, dq, dk, dv, checked=lambda view: view) -> None:
    """views["dq"], ["dk"], ["dv"] of a backward call: each given array's view, checked to be like q's, k's,
    v's (``checked``: the form both are compared in, the varlen backward's one batch of packed tokens), or,
    for one the call makes (None), a new contiguous array's (_new_like)."""
    from . import api
    for name, x, like in (("dq", dq, views["q"]), ("dk", dk, views["k"]), ("dv", dv, views["v"])):
        if x is not None:
            views[name] = api._view(name, x)
            _check_like(checked(views[name]), checked(like), name)
        else:
            views[name] = dataclasses.replace(like, name=name, strides=_contiguous_strides(like.shape))


def spec_of_call(qv, head_dim: int, causal: bool, knobs: dict, arch: str | None):
    """(the device's info, the spec, its loaded kernels) of a backward call on q's view ``qv``: ``arch`` checked
    (None: default_arch's pick), then the GPU's, then the spec's (choose)."""
    from . import api
    if arch not in (None, "sm80", "sm90"):
        raise ValueError(f"arch must be 'sm80', 'sm90' or None, got {arch!r}")
    info = api.device_info(qv.device)
    dtype = api.DTYPE_NAMES[qv.dtype]
    arch = arch or default_arch(info, head_dim, dtype, causal, knobs)
    api._check_arch(arch, info)     # before the spec's own checks: the clearer error for a GPU without it
    spec = choose(head_dim, dtype, causal, info, knobs, arch)
    return info, spec, _load(spec, qv.device)


def stride_values(views: dict) -> dict:
    """BwdParams values of a plan: every pointer 0 (each launch writes its call's) and each tensor's batch, row
    and head strides from ``views``."""
    values = {name: 0 for name in _POINTERS}
    for t in _TENSORS:
        values.update(zip((f"{t}_batch_stride", f"{t}_row_stride", f"{t}_head_stride"), views[t].strides[:3]))
    return values


def tensor_map_args(spec: BackwardSpec, views: dict, batch: int, seqlen_q: int, seqlen_k: int, heads_q: int,
                    heads_kv: int) -> dict:
    """Checked cuTensorMapEncodeTiled arguments of the sm90 kernel's four maps (BWD_TMA_FIELDS):
    boxes of one swizzle slab of head_dim columns x block_m rows (Q, dO) or block_n rows (K, V)."""
    from ..runtime import tma
    swizzle = sm90_swizzle_bytes(spec.head_dim)     # (tma.slab_geometry's but at head_dim 192: 64)
    box_cols = swizzle // 2
    out = {}
    for name, operand in _MAP_OPERANDS.items():
        view = views[operand]
        seqlen, heads, rows = (seqlen_k, heads_kv, spec.block_n) if operand in ("k", "v") else \
            (seqlen_q, heads_q, spec.block_m)
        try:
            out[name] = tma.tiled_args(view.ptr, spec.dtype, (batch, seqlen, heads, spec.head_dim_real),
                                       view.strides[:3], rows, box_cols, swizzle)   # (d wide: zeros past it)
        except ValueError as err:
            raise ValueError(f"{'do' if operand == 'dout' else operand}: {err}") from None
    return out


def tensor_maps(spec: BackwardSpec, views: dict, batch: int, seqlen_q: int, seqlen_k: int, heads_q: int,
                heads_kv: int) -> dict[str, bytes]:
    """The sm90 kernel's four TMA maps (128 bytes each) for the call's tensors; a launch with other
    tensors of the same layout points them there (BackwardPlan.launch)."""
    from ..runtime import tma
    args = tensor_map_args(spec, views, batch, seqlen_q, seqlen_k, heads_q, heads_kv)
    return {name: tma.encode(a) for name, a in args.items()}


def default_arch(info, head_dim: int, dtype: str, causal: bool, knobs: dict) -> str:
    """attention_backward's arch when the caller gives none, and so what facodegen.attention's
    autograd runs: sm90 on a compute capability 9.0 GPU where the sm90 backward takes this call's
    head_dim and knobs (H200, 2026-12-03: at head_dim 128 it runs 2.5-2.7x the sm80 backward's TFLOP/s;
    every head_dim since 2026-12-04, tests/gpu/test_backward_gpu.py passing at 64, 96, 128, 192, 256),
    else sm80 (knobs it refuses); deterministic calls too."""
    if info.compute_capability == (9, 0):
        try:
            _spec("sm90", head_dim, dtype, causal, tuple({"gpu": info.budget_gpu, **knobs}.items()))
            return "sm90"
        except (SpecError, TypeError):
            pass
    return "sm80"


def autograd_arch(forward_arch: str | None) -> str | None:
    """The arch facodegen.attention(..., arch=A)'s autograd asks attention_backward for: the sm80 code
    for an sm80 forward, else the default (default_arch), so that the forward's arch never forces a
    backward that does not cover the call."""
    return "sm80" if forward_arch == "sm80" else None


def _check_like(view, like, name: str) -> None:
    """``name`` has ``like``'s library, dtype, device and shape, and a layout the kernels take."""
    from . import api
    if view.kind != like.kind or view.dtype != like.dtype or view.device != like.device:
        raise TypeError(f"{name} must be a {like.kind} {like.dtype} array on cuda:{like.device} (like "
                        f"{like.name}), got a {view.kind} {view.dtype} array on cuda:{view.device}")
    if tuple(view.shape) != tuple(like.shape):
        raise ValueError(f"{name} has shape {tuple(view.shape)}; expected {like.name}'s {tuple(like.shape)}")
    api._check_layout(view)


__all__ = ["BackwardPlan", "attention_backward", "choose", "compile", "compile_for_device", "emit", "grids", "layout", "pack", "resources_of"]
