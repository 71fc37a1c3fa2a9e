"""The backward kernel family's spec: ``BackwardSpec`` (problem + knobs), its knob registry, default
tiles and budget model. Rendering, compiling and launching it live in facodegen/ops/backward.py.

The sm80 backward is FlashAttention-2's algorithm (templates/sm80/flash_bwd.cu.j2): one CTA per
(key block of block_n keys, kv head, batch) holding K, V in shared memory and dK, dV in
registers, looping over the query blocks of block_m rows (and over the query heads of its GQA
group) that see its keys; dQ is accumulated in fp32 in global memory with atomics (deterministic:
in key-block order, one key block at a time per query block). The same sm80
code runs on sm90 GPUs (compiled for the device at hand).

The sm90 backward is FlashAttention-3's algorithm (templates/sm90/flash_bwd.cu.j2): the same CTA
per key block, with K, V loaded once by TMA, Q and dO (and the LSE, D rows) through TMA rings
``stages`` and ``do_stages`` deep filled by a producer warp, and two consumer warpgroups of 64 keys each
computing every GEMM with wgmma (P^T and dS^T stay in registers as the A operand of dV and dK; dS^T
goes through shared memory for dQ). head_dim 96 and 128: block_m 64; head_dim 64: block_m 128 (64 a knob
value: dQ in two m64 tiles of queries, one dS^T tile), block_n 128; head_dim 192
and 256: block_m 64, block_n 64, the two warpgroups sharing the 64 keys and splitting head_dim
(sm90_kv_split: P^T and dS^T through shared memory for dV and dK too; at 256 a 1-deep dO ring leaves
room for the dQ tiles). What it does not cover is
refused naming the field.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .knobs import HEAD_DIMS, Knob, head_dim_problem
from . import GPUS, SpecError, check_padded_tile, padded_tile

BACKWARD_ARCHS = ("sm80", "sm90")
BACKWARD_DTYPES = ("fp16", "bf16")
BACKWARD_GPUS = ("a100", "h100", "h200", "sm86", "sm89")
ELEMENT_BYTES = 2
# sm90 dq_tma_reduce: where one whole dQ tile per warpgroup does not fit (head_dim 256 with do_stages=1),
# each warpgroup stages its tile in 2 or 4 pieces per step (dq_pieces): a piece is the warpgroup's
# registers 4j..4j+3 for a run of j, a contiguous run of the tile's register order, so dq_accum's layout
# is the same.
SM90_DQ_PIECES_CHOICES = (1, 2, 4)


def _flag(token: str):
    return lambda spec, value: token if value else None


# The backward's knobs, declared once (the forward's registry style, its Knob type): the type check,
# the variant name, the emit line and docs derive from these.
BACKWARD_KNOBS: tuple[Knob, ...] = (
    Knob("arch", "text", "Target: sm80 (FA2 backward, mma.sync; the default below compute capability 9.0) or sm90 "
         "(FA3 backward: TMA, wgmma, a producer warp and two consumer warpgroups; the default on H100/H200).",
         choices=BACKWARD_ARCHS, flag="--arch", problem=True, token=lambda s, v: f"flash_bwd_{s.arch}"),
    Knob("dtype", "text", "Element type of Q, K, V, O, dO and the gradients: fp16 or bf16.",
         choices=BACKWARD_DTYPES, flag="--dtype", problem=True, token=lambda s, v: s.dtype),
    Knob("head_dim", "int", f"Head dimension d: {', '.join(map(str, HEAD_DIMS))}.", choices=HEAD_DIMS,
         flag="--head-dim", problem=True, flag_offers_choices=False, token=lambda s, v: f"hd{s.head_dim}"),
    Knob("head_dim_real", "int", "The problem's head dimension d when below the tile's head_dim (any multiple "
         "of 8 runs on the next tile, as the forward: BackwardSpec(head_dim=80) is the head_dim 96 tile with "
         "head_dim_real=80). Q, K, V, O and dO columns past d load as zeros, dQ, dK, dV's are never written.",
         flag="--head-dim-real", problem=True, flag_offers_choices=False,
         token=lambda s, v: f"d{v}" if v != s.head_dim else None),
    Knob("block_m", "int", "Query rows per step of a CTA's loop (BLOCK_M); sm90: 64, or 128 at head_dim 64 "
         "(its default).",
         flag="--block-m", choices=(32, 64, 128), search={"sm80": (64, 128)}, token=lambda s, v: f"bm{s.block_m}"),
    Knob("block_n", "int", "Keys per CTA (BLOCK_N): the CTA owns their dK, dV.", flag="--block-n",
         search={"sm80": (64, 128)}, flag_offers_choices=False, token=lambda s, v: f"bn{s.block_n}"),
    Knob("num_warps", "int", "Warps per CTA.", flag="--warps", choices=(4, 8), search={"sm80": (4, 8)},
         token=lambda s, v: f"w{s.num_warps}"),
    Knob("k_unroll", "int", "k16 steps of each warp GEMM unrolled together (more in flight, more registers); "
         "0: all of them (each warp GEMM straight-line code: no loop counter, every shared address an "
         "immediate offset of a few per-GEMM bases). Default: 0 on every head_dim's default tile but varlen "
         "(SM80_MEASURED_DEFAULTS), else 2.",
         flag="--k-unroll", choices=(0, 1, 2, 4), search={"sm80": (0, 1, 2)},
         token=lambda s, v: (f"ku{s.k_unroll}" if s.k_unroll else "kuall") if s.k_unroll != 2 else None),
    Knob("frag_prefetch", "bool", "sm80: each warp GEMM loads the next k16 step's ldmatrix fragments before it "
         "issues this step's mma.sync (two fragment sets in registers), so a warp keeps shared-memory reads in "
         "flight under its own MMAs instead of loading a step's fragments, then waiting on them.",
         flag="--frag-prefetch/--no-frag-prefetch", token=_flag("pf")),
    Knob("poly_exp2_tiles", "int", "sm80: of the S_TILES n8 query tiles of each warp's S^T fragment, how many take "
         "P's exp2 as a polynomial on the FMA pipe (the forward's poly_exp2) instead of MUFU.EX2, spread evenly: "
         "a warp-step's 32 MUFU ops at head_dim 128 come in one run, 8 per 25 instructions, beside the P^T stores "
         "(MIO ops too). 0 (the default) to S_TILES.", flag="--poly-exp2-tiles", flag_offers_choices=False,
         token=lambda s, v: f"px{v}" if v else None),
    Knob("key_warps", "int", "sm80: warps along the keys of the S^T, dP^T, dK and dV warp grids (the rest split "
         "the queries, and head_dim for dK, dV); each warp's GEMMs read its keys' slabs and its share of Q, dO "
         "from shared memory, so fewer warps along the keys read Q and dO fewer times (FlashAttention-2's d128 "
         "backward: 4 of 8). Default: FA2's on every head_dim's default tile (SM80_MEASURED_DEFAULTS: 4 at 64, 96 "
         "and 128, 2 at 192 and 256), else as many as "
         "block_n has 16-key slabs, up to num_warps.",
         flag="--key-warps", choices=(1, 2, 4, 8), search={"sm80": (2, 4, 8)},
         token=lambda s, v: f"kw{v}" if s.arch == "sm80" and v != sm80_key_warps_default(s.block_n, s.num_warps)
         else None),
    Knob("dq_row_warps", "int", "sm80: warps along the query rows of the dQ warp grid (the rest split head_dim): "
         "each reads its rows' dS and its columns' K (FlashAttention-2's d128 backward: 2 of 8). Default: FA2's on "
         "every head_dim's default tile (SM80_MEASURED_DEFAULTS: 2, 4 at head_dim 64 and 96), else as many as block_m "
         "has 16-row slabs, up to num_warps.", flag="--dq-row-warps", choices=(1, 2, 4, 8),
         search={"sm80": (2, 4)},
         token=lambda s, v: f"qw{v}" if s.arch == "sm80" and v != sm80_dq_row_warps_default(s.block_m, s.num_warps)
         else None),
    Knob("stages", "int", "Q buffers: sm80 1 (with dO; the next step's Q, dO load under the dQ GEMM) or 2 (with "
         "dO: the next step's Q, dO, LSE and D rows load from the top of each step, under all five GEMMs, and a "
         "barrier a step goes; the default on the tiles of head_dim 64, 128, 192 and 256 where it fits); sm90 2 (the TMA "
         "ring the producer warp fills; dO's: do_stages).", flag="--stages",
         choices=(1, 2), token=lambda s, v: f"st{s.stages}" if s.stages != 1 else None),
    Knob("do_stages", "int", "sm90: dO buffers (with their D rows), at most stages (None: as deep as fits, "
         "sm90_default_rings). Below it, a "
         "step releases its dO once dV has read it, and the shared memory of the dO tiles left out holds the dQ "
         "tiles of dq_tma_reduce (head_dim 256: a 2-deep Q ring beside them).", flag="--do-stages",
         choices=(1, 2), token=lambda s, v: f"dos{v}" if s.arch == "sm90" and v != sm90_default_rings(
             s.head_dim, s.dq_tma_reduce, s.gpu, s.stages)[1] else None),
    Knob("gpu", "text", "Whose shared-memory limit the budget model applies.", choices=BACKWARD_GPUS, flag="--gpu"),
    Knob("deterministic", "bool", "Bit-identical gradients across runs: the key blocks add into each query "
         "block's fp32 dQ in key-block order (a turn counter per query block) instead of in any order.",
         flag="--deterministic/--no-deterministic", token=_flag("det")),
    Knob("dq_tma_reduce", "bool", "sm90: each consumer warpgroup stages its dQ tile (fp32) in shared memory and one "
         "thread adds it into dq_accum with a TMA bulk reduce-add (FlashAttention-3's way), instead of every "
         "thread's fp32 vector reductions from registers; dq_accum is then tiled (BLOCK_M-row tiles in the "
         "warpgroups' register order, seqlen_q padded to BLOCK_M).",
         flag="--dq-tma-reduce/--no-dq-tma-reduce", token=_flag("dqtma")),
    Knob("dq_bulk_add", "bool", "sm80 compiled for sm_90 (an H100/H200): each warp stages a whole query block's dQ "
         "(fp32) in shared memory and each of its lanes adds one row of it into dq_accum with a bulk reduce-add "
         "(cp.reduce.async.bulk), in place of the run of vector reductions the step's ldmatrix waits behind (Nsight "
         "Compute's mio_throttle); dq_accum keeps its layout. Off by default (not timed yet).",
         flag="--dq-bulk-add/--no-dq-bulk-add", token=_flag("dqbulk")),
    Knob("dq_pieces", "int", "sm90 dq_tma_reduce: pieces each consumer warpgroup stages and bulk-adds its dQ tile "
         "in per step (None: the fewest that fit beside the rest), through two piece-sized buffers taking turns "
         "where they fit, else one; 1 without dq_tma_reduce.", flag="--dq-pieces", choices=SM90_DQ_PIECES_CHOICES,
         token=lambda s, v: f"dqp{v}" if v != sm90_fewest_dq_pieces(s) else None),
    Knob("s_lookahead", "bool", "sm90, head_dim 64, 96, 128: each consumer warpgroup issues the next step's S^T = K "
         "Q^T (software pipelining across steps) before the wait that retires this step's dK, so the tensor "
         "pipe runs it behind dK instead of idling while the warpgroup waits for dK, releases the stage and "
         "issues it at the top of the next step; that step then waits on an S^T already done or running.",
         flag="--s-lookahead/--no-s-lookahead", token=_flag("slook")),
    Knob("dp_lookahead", "bool", "With s_lookahead: the next step's dP^T = V dO^T is issued right after its S^T "
         "too, so the tensor pipe runs dK, S^T, dP^T back to back; each step then waits on both at its top "
         "(P^T's exponentials no longer run beside this warpgroup's own dP^T).",
         flag="--dp-lookahead/--no-dp-lookahead", token=_flag("dplook")),
    Knob("persistent", "bool", "sm90 (its default there, deterministic calls aside): min(tiles, SMs) CTAs, "
         "each taking key block after key block from a tile counter (in key-block order, as a grid starts them): the producer loads the next "
         "block's K and V while the consumers write the last one's dK and dV, instead of one CTA per key block, "
         "whose start (K, V and the first Q, dO in flight) and end (dK, dV out) nothing overlaps.",
         flag="--persistent/--no-persistent",
         token=lambda s, v: None if v == sm90_persistent_default(s.arch, s.deterministic, s.varlen) else "pers" if v else "np"),
    Knob("lpt", "bool", "sm90, causal: tiles in longest-first order within groups of (kv head, batch) whose Q "
         "and dO fit SM90_LPT_GROUP_BYTES of L2, the last group at least SM90_LPT_TAIL_WAVES x SMs / key blocks "
         "pairs wide (every key block 0 early, the launch ending on short blocks) instead of each (kv head, "
         "batch)'s key blocks in turn, whose last block 0 starts late. Default: on for persistent causal calls "
         "(neither deterministic nor varlen; sm90_lpt_default).",
         flag="--lpt/--no-lpt", token=_flag("lpt")),
    Knob("dq_lag", "bool", "sm90, head_dim 128 (dQ split by columns, both warpgroups' dS^T rows read): each step "
         "computes and writes out the previous step's dQ, after an mbarrier on which the other warpgroup arrived "
         "when it wrote that step's dS^T rows a step ago, instead of both warpgroups meeting at a named barrier "
         "every step before dQ; the warpgroups then need not run in step, one's exponentials beside the other's "
         "GEMMs. A tile's last step computes its own dQ too. Default: on where allowed without a causal mask, "
         "varlen or determinism (sm90_dq_lag_default).", flag="--dq-lag/--no-dq-lag", token=_flag("dqlag")),
    Knob("causal", "bool", "Bottom-right aligned causal mask.", flag="--causal/--no-causal", problem=True,
         token=_flag("causal")),
    Knob("varlen", "bool", "Packed variable-length sequences (attention_varlen's backward): a tile's sequence "
         "reads its first tokens and lengths from cu_seqlens_q / cu_seqlens_k. sm80: grid z is the sequence, the "
         "preprocess and postprocess see the packed rows as one batch; sm90: tiles (key block of max_seqlen_k's "
         "bound, kv head, sequence), a block past its sequence's keys skipped, TMA over the packed tokens, the "
         "LSE, D (and the tiled dq_accum) rows of each sequence padded to block_m at (first token + index x "
         "block_m) // block_m blocks (FlashAttention-3's; deterministic: its turn counters too); not lpt.",
         flag="--varlen/--no-varlen", problem=True, token=_flag("varlen")),
    Knob("local", "bool", "Sliding window (attention()'s window_size, and top-left causal): query i sees keys "
         "[i + seqlen_k - seqlen_q - window_left, i + seqlen_k - seqlen_q + window_right], the two values run-time "
         "arguments (BwdParams) in the bottom-right frame api.window_params folds the window into. A key block "
         "visits only the query blocks whose rows see one of its keys, and masks the steps a window edge crosses. "
         "sm80 (it runs on sm90 GPUs too), varlen and deterministic too (a query block's dQ turns counted from the "
         "first key block whose keys reach its first row's window).",
         flag="--local/--no-local", problem=True, token=_flag("local")),
    Knob("softcap", "bool", "Logit softcap (attention()'s softcap=c): P is recomputed from c tanh(scale s / c) "
         "(BwdParams' softcap_scale = scale / c and softcap_log2 = c log2(e), run-time) and dS carries tanh's "
         "derivative, 1 - tanh^2, recomputed from S^T (which P in elem_t pairs leaves in its registers). sm80 (it "
         "runs on sm90 GPUs too), varlen too.",
         flag="--softcap/--no-softcap", problem=True, token=_flag("softcap")),
    Knob("sinks", "bool", "Attention sinks (attention()'s sinks: one logit per query head in the forward's softmax "
         "denominator, included in its LSE): dQ, dK, dV are plain attention's of that LSE, and the postprocess also "
         "writes each head's sink gradient, -sum over (batch, row) of exp(sink - LSE) D, one CTA a head summing its "
         "rows in a fixed order (BwdParams' sinks, dsinks). Either arch; varlen on sm80's kernels.",
         flag="--sinks/--no-sinks", problem=True, token=_flag("sinks")),
)
BACKWARD_BY_NAME = {k.name: k for k in BACKWARD_KNOBS}

# Default tiles (block_m, block_n, num_warps) per head_dim: FlashAttention-2's sm80 backward uses
# 128x128 (d64), 64x128 (d96, d128), 64x80 (d192), 64x64 (d256), 8 warps. Ours, same budget rules:
#   d64  128x128: 2*16 KB (Q, dO) + 2*16 KB (K, V) + 2*32 KB (P^T, dS^T) = 128 KB; dK+dV 64 floats/thread
#   d96   64x128: 104 KB; dK+dV 96 floats/thread
#   d128  64x128: 128 KB; dK+dV 128 floats/thread (the most the 255 registers leave room for)
#   d192  64x64:  112 KB; 64 keys, not FA2's 80: 80 keys are 5 slabs of 16, which 8 warps do not split
#   d256  64x64:  144 KB; dK+dV 128 floats/thread
# All fit the A100's 163 KB (one CTA per SM: the kernel is register bound at 8 warps anyway).
# GPUs with 99 KB per block (sm86, sm89): 64x64 up to d128 (80 KB at d128); d192/256 do not fit.
DEFAULT_TILES = {64: (128, 128, 8), 96: (64, 128, 8), 128: (64, 128, 8), 192: (64, 64, 8), 256: (64, 64, 8)}
SMALL_GPU_TILES = {64: (64, 64, 8), 96: (64, 64, 8), 128: (64, 64, 8), 192: (64, 64, 8), 256: (64, 64, 8)}
DEFAULT_GPU = "a100"

# sm90 (FlashAttention-3's backward, templates/sm90/flash_bwd.cu.j2): (block_m, block_n, num_warps)
# per head_dim. FA3 uses 128x128 at d64 and 64x128 (causal) / 80x128 at d128 with two MMA
# warpgroups; we take 64x128 for both: each consumer warpgroup owns 64 keys (dK, dV: 2 x
# head_dim/2 floats per thread, 128 at d128, beside S^T and dP^T at 32 each under the 240 registers
# of setmaxnreg), and 64 queries are one m64 wgmma for dQ.
#   d64:  K, V 32 KB + 2 stages x (Q, dO 16 KB + rows) + dS^T 2 x 16 KB = 97 KB
#   d96:  K, V 48 KB + 2 stages x (Q, dO 24 KB + rows) + dS^T 2 x 16 KB = 130 KB (64-byte swizzle, as the forward)
#   d128: K, V 64 KB + 2 stages x (Q, dO 32 KB + rows) + dS^T 2 x 16 KB = 162 KB
# d192 and d256 (sm90_kv_split): 64 keys owning all of head_dim would hold dK + dV in 192 / 256
# registers per thread, over the 240. FA3 (hopper/flash_bwd_launch_template.h) runs d256 at 64x80 and
# d192 at 64x96 (3 MMA warpgroups at d_v 192), with S = Q K^T not swapped (keys along N, split between
# the warpgroups), dK^T, dV^T swapped (head_dim along M, split), P and dS through shared memory
# (Mma_dKV_is_RS off), 2 Q stages, 1 dO and 1 dS stage, dQ by atomics from registers at d256. Ours
# keeps keys along M (S^T = K Q^T, one m64), so 64 keys per CTA, shared by both warpgroups: each takes
# half of the 64 queries for S^T, dP^T (m64 n32: 16 + 16 registers) and half of head_dim for dV, dK
# and dQ (d256: 64 + 64 + 64 registers; d192: 48 + 48 + 48), P^T and dS^T through two 8 KB tiles each.
#   d192: K, V 48 KB + 2 stages x (Q, dO 48 KB + rows) + P^T, dS^T 4 x 8 KB = 178 KB; 64-byte swizzle
#         (each warpgroup's 96 columns are 3 whole 32-column slabs; 64-column slabs would split one);
#         dq_tma_reduce: + 2 x 24 KB (one dQ buffer per warpgroup, SM90_DQ_BUFS does not fit) = 226 KB
#   d256: K, V 64 KB + 2 stages x (Q, dO 64 KB + rows) + P^T, dS^T 4 x 8 KB = 226 KB (of 227) with
#         the vector reductions; dq_tma_reduce (the default) drops a dO stage for the dQ tiles: 2 Q stages
#         + 1 dO stage (32 KB + rows each) + P^T, dS^T 32 KB + 2 warpgroups x one half dQ tile (16 KB,
#         dq_pieces 2) = 226 KB (or 1 stage of both + 2 whole 32 KB tiles: no faster than the vector
#         reductions, H200 2026-12-04)
SM90_TILES = {64: (128, 128, 12), 96: (64, 128, 12), 128: (64, 128, 12), 192: (64, 64, 12), 256: (64, 64, 12)}
# block_m=128: head_dim 64 only (the default there; block_m=64 is a knob value), FA3's 128x128. H200,
# 2026-12-04, bf16 fa3-paper cells (seqlen 2k, 8k; full, causal): 376.4 / 447.0 / 271.7 / 383.5 TFLOP/s
# against block_m 64's 298.4 / 383.8 / 215.4 / 320.7 (1.16-1.26x), cuDNN 347.9 / 445.1 / 267.1 / 398.8.
# Keys stay along M (64 per consumer warpgroup), so S^T, dP^T grow to m64n128 and each
# step's GEMMs double while its fixed costs (barriers, waits, the dQ reduce, the LSE/D rows) do not.
# Registers per consumer thread (setmaxnreg 240):
#   S^T, dP^T: 64 + 64 (m64 n128 fp32); dV, dK: 32 + 32 (m64 n64); P^T, dS^T A fragments: 32 + 32
#   (packed pairs, built as S^T and dP^T die); dQ = dS K over the warpgroup's own 64 keys (split by
#   keys, sm90_dq_cols) as two m64 tiles of queries, 32 + 32, issued together after dV.
#   Peak while S^T, dP^T live: 128 + 64 = 192 + addresses and indices; at dQ: 64 (dK, dV) + 32 (dS^T,
#   dK's A in flight) + 64 (dQ) = 160 (P^T's registers are released at the wait that retires dV).
#   Measured (NVRTC 13, sm_90a): tests/test_backward.py test_sm90_block_m_128_compiles_clean.
#   head_dim 96 / 128: dV + dK alone are 96 / 128 registers, + 128 for S^T, dP^T: over 240, refused.
# Shared memory (head_dim 64, block_m 128):
#   K, V 32 KB + 2 stages x (Q, dO 32 KB + LSE, D rows 1 KB) + ONE dS^T tile of 128 keys x 128
#   queries 32 KB + 1 KB alignment = 131 KB; dq_tma_reduce: + 2 warpgroups x one 32 KB dQ tile
#   (128 x 64 fp32; two would be 259 KB) = 195 KB. One dS^T tile suffices where dQ is split by keys:
#   a warpgroup's dQ reads only its own 64 dS^T rows and has completed (the wait that retires dV, dQ)
#   before that warpgroup writes the next step's (the two tiles taking turns serve the split by
#   columns, where both warpgroups read all rows; block_m 64 keeps them so its code does not change).
# s_lookahead (the next step's S^T issued at the end of a step, in flight across the loop's back edge):
#   block_m 64: issued behind dK, before the wait that retires it; live then: dV, dK (2 x ACC_REGS), dK's
#   dS^T fragment (P_REGS) and S^T (S_REGS): d128 64 + 64 + 16 + 32 = 176 (P^T released at the wait that
#   retires dV; the dQ registers after the write-out, which comes first); dp_lookahead: + dP^T, 208.
#   block_m 128: issued after that wait (dV, dK 64 + S^T 64, dp_lookahead + 64): S^T beside dK and its
#   32-register fragment in flight made ptxas serialise every wgmma (C7512, insufficient registers).
#   Measured (NVRTC 13, sm_90a): tests/test_backward.py test_sm90_s_lookahead_compiles_clean_in_its_order.
SM90_BLOCK_MS = (64, 128)
SM90_WIDE_M_HEAD_DIMS = (64,)      # block_m=128
SM90_STAGES = 2
# setmaxnreg split (FlashAttention-3's for 2 MMA warpgroups): the producer warpgroup gives registers to
# the consumers, 128 x (24 + 2 x 240) = 64512 = the 168 per thread the 384-thread CTA starts with.
SM90_PRODUCER_REGS, SM90_CONSUMER_REGS = 24, 240
SM90_GPU = "h200"
SM90_CONSUMER_WGS = 2
# dq_tma_reduce: dQ tiles in shared memory per consumer warpgroup (step i writes tile i % 2 while the
# bulk reduce of step i - 1 may still be reading the other). 64 KB at every head_dim (d96: 96 KB):
# d128 162 + 64 = 226 KB, d96 130 + 96 = 226 KB, of the 227 KB an sm90 block may have.
SM90_DQ_BUFS = 2     # (where they fit, else 1: BackwardSpec.dq_bufs)
# (dq_pieces: SM90_DQ_PIECES_CHOICES, above the knobs)


# The sm80 backward's warp grid, Q/dO ring and k16 unrolling where they were measured faster than one warp per
# slab, one stage and two k16 steps a loop iteration, per (head_dim, block_m, block_n, num_warps) default tile,
# bf16 fa3-paper quick cells (2k/8k, full/causal), TFLOP/s against FlashAttention-2 (SDPA flash) in the same run.
# - head_dim 128, FA2's own grid (key_warps 4, dq_row_warps 2) with stages=2: H200, 2026-12-05 (session 46,
#   commit 0f7310b's kernel), 225 / 241 / 192 / 228 against the default grid's 198 / 213 / 171 / 201 (FA2 275 /
#   304 / 239 / 284).
# - k_unroll 0 (every k16 step unrolled): H100, 2026-12-05 (session 47, commit 8161a1e; pending_gpu.sh s47),
#   head_dim 128 259 / 281 / 211 / 266 against k_unroll 2's 249 / 271 / 208 / 259 (FA2 271 / 308 / 225 / 293);
#   head_dim 256 192 / 210 / 170 / 210 against 188 / 202 / 162 / 202 (FA2 237 / 261 / 201 / 249); head_dim 64
#   with FA2's d128 grid and stages=2, 223 / 247 / 191 / 235 against the default's 193 / 210 / 167 / 201 (FA2
#   260 / 290 / 212 / 264). At b3f29ef (dQ before dK, s47c): d128 259 / 284 / 211 / 265 (FA2 278 / 309 / 237 /
#   289), d64 232 / 249 / 191 / 237 (FA2 262 / 288 / 213 / 265), d256 196 / 210 / 167 / 209 (FA2 241 / 261 /
#   203 / 250).
# - head_dim 64 with one stage (b3f29ef, s47c's column): 233 / 248 / 195 / 234 against stages=2's 232 / 249 /
#   191 / 237, the same; so it takes one stage, whose registers let P^T stay in fp32 for dS^T (P_IN_FP32: 1236
#   -> 1183 instructions a warp-step; with two stages its fp16 causal kernel spilled 4 bytes on sm_90).
# - FA2's own grids at head_dim 96 (key_warps 4, dq_row_warps 4), 192 and 256 (2 and 2) with k_unroll 0: H100,
#   2026-12-05 (c848b01, pending_gpu.sh s47d), d96 232 / 257 / 196 / 242 against the old default's 199 / 215 /
#   169 / 205 (FA2 269 / 295 / 203 / 252), d192 199 / 214 / 172 / 210 against 184 / 197 / 162 / 197 (FA2 236 /
#   255 / 209 / 259), d256 201 / 217 / 173 / 214 against k_unroll 0 alone's 193 / 208 / 168 / 207 (FA2 234 /
#   255 / 199 / 246).
# Where stages=2 does not fit the GPU, stages stays 1; varlen kernels keep k_unroll 2 (head_dim 128's spills
# on sm_90 unrolled, NVRTC 13).
# - Two stages at head_dim 192 and 256, and at head_dim 64 with dq_row_warps 4 (FA2's AtomLayoutMdQ there): H100,
#   2026-12-05 (session 49, commit 6483ad7's kernels, pending_gpu.sh s48t), d64 232 / 256 / 203 / 252 against one
#   stage's 225 / 248 / 192 / 238 (FA2 260 / 286 / 212 / 262); d192 207 / 224 / 177 / 213 against 199 / 216 / 173
#   / 214 (FA2 229 / 251 / 210 / 261); d256 204 / 220 / 175 / 216 against 199 / 218 / 173 / 215 (FA2 236 / 258 /
#   197 / 248). At head_dim 96 two stages were no faster (243 / 260 / 203 / 244 against 238 / 264 / 201 / 250).
SM80_MEASURED_DEFAULTS = {(128, 64, 128, 8): {"key_warps": 4, "dq_row_warps": 2, "stages": 2, "k_unroll": 0},
                          (64, 128, 128, 8): {"key_warps": 4, "dq_row_warps": 4, "stages": 2, "k_unroll": 0},
                          (96, 64, 128, 8): {"key_warps": 4, "dq_row_warps": 4, "k_unroll": 0},
                          (192, 64, 64, 8): {"key_warps": 2, "dq_row_warps": 2, "stages": 2, "k_unroll": 0},
                          (256, 64, 64, 8): {"key_warps": 2, "dq_row_warps": 2, "stages": 2, "k_unroll": 0}}


def sm80_defaults(head_dim: int, block_m: int, block_n: int, num_warps: int, gpu: str, varlen: bool = False) -> dict:
    """The sm80 backward's stages, key_warps, dq_row_warps and k_unroll for a tile on ``gpu``: one stage, a warp
    per 16-row slab and k_unroll 2, but where SM80_MEASURED_DEFAULTS says otherwise (stages only where two
    stages fit the GPU; k_unroll not for varlen). BackwardSpec and the emit line both take them from here."""
    knobs = {"stages": 1, "key_warps": sm80_key_warps_default(block_n, num_warps),
             "dq_row_warps": sm80_dq_row_warps_default(block_m, num_warps), "k_unroll": 2}
    measured = dict(SM80_MEASURED_DEFAULTS.get((head_dim, block_m, block_n, num_warps), {}))
    if measured.get("stages", 1) > 1 and smem_bytes(block_m, block_n, head_dim, measured["stages"]) > \
            GPUS[gpu].smem_per_block:
        del measured["stages"]
    if varlen:
        measured.pop("k_unroll", None)
    return knobs | measured


def sm80_key_warps_default(block_n: int, num_warps: int) -> int:
    """key_warps' default: one warp per 16-key slab, up to num_warps (the grids before the knob)."""
    return min(block_n // 16, num_warps)


def sm80_dq_row_warps_default(block_m: int, num_warps: int) -> int:
    """dq_row_warps' default: one warp per 16-row slab of dQ, up to num_warps (the grid before the knob)."""
    return min(block_m // 16, num_warps)


def sm90_persistent_default(arch: str, deterministic: bool, varlen: bool = False) -> bool:
    """persistent's default: on sm90 but for deterministic calls. H200, 2026-12-04 (session 37), bf16
    fa3-paper grid, persistent against one CTA per tile in the same runs: 0.98-1.02x per cell (geomean
    1.004 at head_dim 64, 0.993 at 128, 0.985 at 256), so no faster, but a tile goes only to a running
    CTA (no reliance on the order the GPU starts CTAs in). Deterministic causal head_dim 128 with the
    next tile drawn ahead ran at 26 / 72 TFLOP/s (2k / 8k; one CTA per tile 143 / 181 in the next call):
    a CTA waiting for a turn held the tile other CTAs' turns waited on (the draw is now deferred there).
    Varlen: off (one CTA per tile, a tile past its sequence's keys exiting at once; the persistent producer's
    skipping of such tiles spilled its 24 registers at head_dim 64 and 256, NVRTC 13)."""
    return arch == "sm90" and not deterministic and not varlen


def sm90_kv_split(head_dim: int) -> bool:
    """head_dim 192, 256: both consumer warpgroups hold the same 64 keys (block_n 64) and each computes
    half of head_dim of dV, dK and dQ, and S^T, dP^T for half of the queries; P^T and dS^T go through
    shared memory (SS wgmma for dV and dK). Below: each warpgroup owns 64 keys and all of head_dim, P^T
    and dS^T stay in registers (RS wgmma). See SM90_TILES for why."""
    return head_dim > 128


def sm90_swizzle_bytes(head_dim: int) -> int:
    """The swizzle (and so the 16-bit slab width, swizzle / 2 columns) of the Q, K, V, dO tiles: 128
    bytes where each warpgroup's columns (sm90_kv_split: head_dim / 2, else head_dim) are whole
    64-column slabs, else 64 (d96; d192, whose 96-column halves are 3 slabs of 32)."""
    cols = head_dim // 2 if sm90_kv_split(head_dim) else head_dim
    return 128 if cols % 64 == 0 else 64


def sm90_dq_cols(head_dim: int) -> int:
    """head_dim columns of dQ = dS K that each sm90 consumer warpgroup computes. Split by columns when
    each half is whole swizzle slabs of the K tile (d128: 64 each, over all 128 keys, both
    warpgroups' dS^T rows; d192: 96, d256: 128, over the 64 keys both hold); else (d64, d96) by keys:
    each warpgroup the whole head_dim over its own 64 keys, both adding into dq_accum (FlashAttention-3
    instead loads K 64-byte swizzled at d64 so that 32 columns are whole slabs; a wgmma operand
    starting inside a 128-byte swizzle row is not a layout CUTLASS builds)."""
    slab_cols = sm90_swizzle_bytes(head_dim) // ELEMENT_BYTES
    return head_dim // 2 if (head_dim // 2) % slab_cols == 0 else head_dim


def sm90_ds_bufs(block_m: int) -> int:
    """dS^T tiles in shared memory (non-split head dims): 2 taking turns at block_m 64, 1 at 128
    (head_dim 64, dQ split by keys: see SM90_BLOCK_MS)."""
    return 1 if block_m == 128 else 2


def sm90_dq_m_tiles(block_m: int) -> int:
    """m64 wgmma tiles of queries in dQ = dS K per warpgroup: block_m / 64."""
    return block_m // 64


def sm90_dq_tma_default(arch: str, deterministic: bool) -> bool:
    """dq_tma_reduce's default: on sm90 at every head_dim, deterministic calls aside (their turns add by
    fp32 vector reductions unless asked). FlashAttention-3 adds dQ from registers at head_dim 256 (no
    room for the dQ tiles); cuDNN's kernel there bulk-reduces it (UTMAREDG in its SASS, ncu H200
    2026-12-04), and ours, with a 1-deep dO ring making the room (sm90_default_rings), ran 1.11-1.22x
    the register adds' TFLOP/s (H200, 2026-12-04, bf16 fa3-paper cells), whose fp32 reductions kept L2
    83.8% busy."""
    return arch == "sm90" and not deterministic


def sm90_lookahead_default(arch: str, head_dim: int, block_m: int, stages: int, dq_tma_reduce: bool,
                           s_lookahead: bool | None = None) -> tuple[bool, bool]:
    """(s_lookahead, dp_lookahead) defaults, dp_lookahead's given ``s_lookahead`` (the caller's, None:
    its default): s_lookahead on sm90 wherever it is allowed (head_dim 64, 96, 128 with the 2-deep
    ring; not block_m 128 with the vector reductions, which spills), dp_lookahead with it at head_dim
    128 only. H200, 2026-12-04, bf16 fa3-paper cells (2k, 8k; full, causal),
    facodegen.attention_backward timed in turns with its default and cuDNN: s_lookahead
    1.004-1.029x the default at head_dim 128 and 1.007-1.020x at 64; dp_lookahead on top
    1.007-1.025x at 128 but 0.95-0.99x at 64."""
    s = arch == "sm90" and head_dim in (64, 96, 128) and stages >= 2 and not (block_m == 128 and not dq_tma_reduce)
    on = s if s_lookahead is None else s_lookahead
    return s, on is True and s and head_dim == 128


def sm90_lpt_default(arch: str, causal: bool, deterministic: bool, varlen: bool, persistent: bool) -> bool:
    """lpt's default: on for sm90's causal, persistent backward (the only one it was timed on; persistent is
    the default but for deterministic and varlen calls). H200,
    2026-12-05 (session 43, `pending_gpu.sh bench` and `producer`, bf16 fa3-paper cells 2k and 8k, lpt=True
    beside the default in the same runs): head_dim 128 1.11x / 1.08x at 2k and 1.03x / 1.02x at 8k (two
    runs), 256 1.08x and 1.02x, 64 0.99x and 1.03x."""
    return arch == "sm90" and causal and persistent and not deterministic and not varlen


def sm90_dq_lag_default(spec: "BackwardSpec") -> bool:
    """dq_lag's default: on where it is allowed (sm90, head_dim 128, block_m 64, the bulk dQ reduce, not
    deterministic) for the non-causal, non-varlen backward. H200, 2026-12-05 (session 43, two runs, bf16
    fa3-paper cells at head_dim 128, beside the default in the same runs): full 1.04-1.06x at 2k and
    1.03-1.04x at 8k; causal 1.04-1.07x at 2k and 1.00-1.01x at 8k alone, but beside lpt (the causal
    default) 0.98x / 1.00x of lpt alone."""
    return (spec.arch == "sm90" and not spec.causal and not spec.varlen and not spec.deterministic
            and sm90_dq_cols(spec.head_dim) != spec.head_dim and not sm90_kv_split(spec.head_dim)
            and spec.block_m == 64 and spec.dq_tma_reduce is True)


SM90_GPUS = ("h100", "h200")
# lpt: (kv head, batch) pairs per group, as many as keep their Q and dO within this much of the 50 MB
# L2 (H100, H200), so a group's key blocks, run block-major, still find their Q and dO there.
SM90_LPT_GROUP_BYTES = 24 << 20
# lpt's last group: at least this many x SMs / key blocks pairs, so its work is at least half this many
# times a block-0 tile's steps per SM and the block-0 tiles it starts with end before it drains. A model of
# the tile draws (an SM takes the next tile when done; 1.5 steps of overhead a tile) puts the causal
# fa3-paper cells at 0.96-0.97 of ideal with the remainder group alone last, 0.99-1.0 with a last group
# of 2, 4 or 8 x SMs / key blocks pairs (and the default order, each pair's blocks in turn, at 0.94-0.95
# for head_dim 128/256 at 1k-8k). Timed against the default order: sm90_lpt_default.
SM90_LPT_TAIL_WAVES = 4

# k_unroll's default: 2 (two k16 steps of ldmatrix in flight per warp GEMM, no spills in any config, NVRTC 13:
# 195-255 registers), or 0 where SM80_MEASURED_DEFAULTS says so (every step unrolled, as FlashAttention-2's
# GEMMs are: no spills at any head_dim's default tile since session 47's leaner step, sm_80 and sm_90, but the
# head_dim 128 varlen kernel on sm_90; 11-16% fewer instructions a warp-step by scripts/sass_step_count.py, d128
# 986 against 1107); 4 (1093 at d128) spills at head_dim 64 and timed no faster than 2 at 128.

# dK and dV accumulators held in registers across the whole loop, floats per thread: above 128 the
# S^T / dP^T fragments, addresses and dQ pieces no longer fit in 255 registers without spills.
MAX_KV_ACC_FLOATS = 128


@dataclass(frozen=True, kw_only=True)
class BackwardSpec:
    """One backward kernel set (preprocess, main, postprocess).

    Problem: arch (sm80, or sm90), head_dim, dtype (fp16/bf16), causal.
    GQA/MQA does not change the code (the CTA loops over its group's query heads). Knobs: block_m,
    block_n, num_warps (None: the default for head_dim, see DEFAULT_TILES / SM90_TILES), stages and
    do_stages (the Q and dO rings; None: sm80 1, sm90 sm90_default_rings: 2 and 2, at head_dim 256 with
    dq_tma_reduce 2 and 1), gpu (the budget model's limits), deterministic (False: dQ's fp32 adds land in
    any order), dq_tma_reduce (None: True on sm90 unless deterministic, sm90_dq_tma_default; True: a
    shared-memory tile per consumer warpgroup, staged in dq_pieces pieces (None: the fewest that fit), and
    TMA bulk reduce-adds, dq_accum tiled and padded, see dq_accum_rows; False: each sm90 consumer thread
    adds its dQ registers into dq_accum with fp32 vector reductions, the sm80 backward's only way; H200
    2026-12-04, bf16 fa3-paper cells: the bulk reduce runs 1.12-1.30x the vector reductions' TFLOP/s at
    head_dim 128, 1.38-1.44x at 64, 1.11-1.22x at 256 with do_stages=1). Each field
    is checked on construction with a SpecError naming it; the template repeats the checks as
    static_asserts."""
    arch: str = "sm80"
    head_dim: int = 128
    head_dim_real: int | None = None
    dtype: str = "bf16"
    causal: bool = False
    block_m: int | None = None
    block_n: int | None = None
    num_warps: int | None = None
    k_unroll: int | None = None
    frag_prefetch: bool = False
    poly_exp2_tiles: int = 0
    dq_bulk_add: bool = False
    key_warps: int | None = None
    dq_row_warps: int | None = None
    stages: int | None = None
    do_stages: int | None = None
    gpu: str | None = None
    deterministic: bool = False
    dq_tma_reduce: bool | None = None
    dq_pieces: int | None = None
    s_lookahead: bool | None = None
    dp_lookahead: bool | None = None
    persistent: bool | None = None
    lpt: bool | None = None
    dq_lag: bool | None = None
    varlen: bool = False
    local: bool = False
    softcap: bool = False
    sinks: bool = False

    def __post_init__(self) -> None:
        _as_bool(self, "deterministic")     # (first: the defaults below follow it, deterministic=0 as False)
        if self.persistent is None:
            _as_bool(self, "varlen")
            object.__setattr__(self, "persistent", sm90_persistent_default(self.arch, self.deterministic, self.varlen))
        if self.dq_tma_reduce is None:     # the default: FlashAttention-3's dQ path wherever it runs
            object.__setattr__(self, "dq_tma_reduce", sm90_dq_tma_default(self.arch, self.deterministic))
        set_ = lambda name, value: object.__setattr__(self, name, value)
        if self.head_dim_real is None:   # head_dim=80: the head_dim 96 tile, padded (the forward's KernelSpec too)
            tile, real = padded_tile(self.head_dim)
            set_("head_dim", tile)
            set_("head_dim_real", real)
        _check_types(self)
        _choice("arch", self.arch, BACKWARD_ARCHS)
        _choice("dtype", self.dtype, BACKWARD_DTYPES)
        if self.head_dim not in HEAD_DIMS and head_dim_problem(self.head_dim) is not None:
            raise SpecError("head_dim", head_dim_problem(self.head_dim))
        _choice("head_dim", self.head_dim, HEAD_DIMS)
        if self.padded:
            check_padded_tile(self.head_dim, self.head_dim_real)
        if self.gpu is None:
            set_("gpu", SM90_GPU if self.arch == "sm90" else DEFAULT_GPU)
        _choice("gpu", self.gpu, BACKWARD_GPUS)
        if self.arch == "sm90":
            tile = SM90_TILES.get(self.head_dim)
            if tile is None:
                raise SpecError("head_dim", f"{self.head_dim}: the sm90 backward is written for head_dim "
                                            f"{', '.join(map(str, SM90_TILES))} so far (arch='sm80' has the others)")
            block_m, block_n, warps = tile
            if self.stages is None or self.do_stages is None:
                stages, do_stages = sm90_default_rings(self.head_dim, self.dq_tma_reduce, self.gpu, self.stages,
                                                       self.do_stages)
                set_("stages", stages)
                set_("do_stages", do_stages)
            if self.k_unroll is None:   # (an sm80 knob: wgmma has no k16 loop to unroll)
                set_("k_unroll", 2)
        else:
            table = SMALL_GPU_TILES if GPUS[self.gpu].smem_per_block < 128 * 1024 else DEFAULT_TILES
            block_m, block_n, warps = table[self.head_dim]
            if self.softcap is True and block_m == 128:
                # SOFTCAP keeps S^T beside P^T's pairs for dS's tanh derivative: the 128-query tile's 64 S^T floats
                # a thread spill at head_dim 64 (8 bytes, NVRTC 13 sm_90); 64 queries take 224 registers
                block_m = 64
            for name, value in sm80_defaults(self.head_dim, self.block_m or block_m, self.block_n or block_n,
                                             self.num_warps or warps, self.gpu, bool(self.varlen)).items():
                if getattr(self, name) is None:
                    set_(name, value)
        if self.do_stages is None:
            set_("do_stages", self.stages)
        for name, value in (("block_m", block_m), ("block_n", block_n), ("num_warps", warps)):
            if getattr(self, name) is None:
                set_(name, value)
        if self.dq_pieces is None:
            set_("dq_pieces", sm90_fewest_dq_pieces(self))
        if self.key_warps is None:       # (sm90: its consumer warpgroups own 64 keys each; the fields are sm80's)
            set_("key_warps", 0)
        if self.dq_row_warps is None:
            set_("dq_row_warps", 0)
        s_default, dp_default = sm90_lookahead_default(self.arch, self.head_dim, self.block_m, self.stages,
                                                       self.dq_tma_reduce, self.s_lookahead)
        if self.s_lookahead is None:
            set_("s_lookahead", s_default)
        if self.dp_lookahead is None:
            set_("dp_lookahead", dp_default)
        if self.lpt is None:
            set_("lpt", sm90_lpt_default(self.arch, self.causal, self.deterministic, self.varlen, self.persistent))
        if self.dq_lag is None:
            set_("dq_lag", sm90_dq_lag_default(self))
        (_validate_sm90 if self.arch == "sm90" else _validate)(self)

    @property
    def threads(self) -> int:
        return 32 * self.num_warps

    @property
    def padded(self) -> bool:
        """The problem's head dimension is below the tile's (head_dim_real < head_dim)."""
        return self.head_dim_real != self.head_dim

    @property
    def smem_bytes(self) -> int:
        if self.arch == "sm90":
            return sm90_smem_bytes(self.block_m, self.block_n, self.head_dim, self.stages, self.do_stages,
                                   self.dq_tma_reduce, self.dq_bufs, self.dq_pieces)
        return smem_bytes(self.block_m, self.block_n, self.head_dim, self.stages) + (
            sm80_dq_staging_bytes(self) if self.dq_bulk_add else 0)

    @property
    def dq_bufs(self) -> int:
        """sm90 dq_tma_reduce: buffers of one dQ piece per consumer warpgroup, SM90_DQ_BUFS taking turns where
        they fit the GPU beside the rest, else 1; 0 without dq_tma_reduce."""
        if not self.dq_tma_reduce:
            return 0
        fits = sm90_smem_bytes(self.block_m, self.block_n, self.head_dim, self.stages, self.do_stages, True,
                               SM90_DQ_BUFS, self.dq_pieces)
        return SM90_DQ_BUFS if fits <= GPUS[self.gpu].smem_per_block else 1

    @property
    def variant(self) -> str:
        """flash_bwd_sm80_bf16_hd128_bm64_bn128_w8_causal: the main kernel's symbol (the two others
        add _dot_do_o / _convert_dq), the emitted file's and the cache entry's name."""
        return "_".join(t for k in BACKWARD_KNOBS if k.token is not None and (t := k.token(self, getattr(self, k.name))))

    @property
    def kernel_names(self) -> tuple[str, str, str]:
        """(preprocess, main, postprocess) symbols, in launch order."""
        return f"{self.variant}_dot_do_o", self.variant, f"{self.variant}_convert_dq"

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)

    def replace(self, **changes) -> BackwardSpec:
        """This spec with ``changes``; the knobs whose default follows others (head_dim_real, do_stages, dq_pieces,
        lpt, dq_lag, key_warps, dq_row_warps) keep following them where this spec has their default."""
        fields = {**self.as_dict(), **changes}
        if "head_dim_real" not in changes and not self.padded:
            fields["head_dim_real"] = None     # (an unpadded spec's follows head_dim)
        for name in ("do_stages", "dq_pieces", "lpt", "dq_lag", "key_warps", "dq_row_warps"):
            if name not in changes and self._has_default(name):
                fields[name] = None
        return BackwardSpec(**fields)

    def _has_default(self, name: str) -> bool:
        try:
            return getattr(BackwardSpec(**{**self.as_dict(), name: None}), name) == getattr(self, name)
        except SpecError:     # (its default does not fit beside this spec's other knobs)
            return False


def smem_bytes(block_m: int, block_n: int, head_dim: int, stages: int = 1) -> int:
    """The sm80 backward: ``stages`` x (Q + dO tiles, LSE and D rows (float32)), K + V tiles, P^T + dS^T
    tiles (elem_t)."""
    e = ELEMENT_BYTES
    return stages * (2 * block_m * head_dim * e + 2 * block_m * 4) + 2 * block_n * head_dim * e + \
        2 * block_n * block_m * e


def sm80_s_tiles(spec) -> int:
    """The sm80 backward's S_TILES: n8 query tiles of a warp's S^T fragment, block_m over the warps left along the
    queries (num_warps / key_warps); poly_exp2_tiles takes 0 to this many."""
    return spec.block_m // (8 * (spec.num_warps // spec.key_warps))


def sm80_dq_stage_pitch(spec) -> int:
    """sm80 dq_bulk_add: bytes between the rows of a warp's dQ staging, its columns' bytes rounded up to 32 past a
    multiple of 128: a warp's 64-bit stores of rows g = 0..7 (32 bytes each) then start 8 banks apart, so rows 0-3
    and 4-7 each fill the 32 banks once (two wavefronts a store, the least), and each row stays 16-byte aligned
    for its bulk copy."""
    cols = spec.head_dim // (spec.num_warps // spec.dq_row_warps)
    return -(-(4 * cols - 32) // 128) * 128 + 32


def sm80_dq_staging_bytes(spec) -> int:
    """sm80 dq_bulk_add: every warp's staging of its dQ rows (block_m / dq_row_warps of them) at
    sm80_dq_stage_pitch."""
    return spec.num_warps * (spec.block_m // spec.dq_row_warps) * sm80_dq_stage_pitch(spec)


def sm90_smem_bytes(block_m: int, block_n: int, head_dim: int, stages: int, do_stages: int | None = None,
                    dq_tma_reduce: bool = False, dq_bufs: int = 1, dq_pieces: int = 1) -> int:
    """K + V tiles, ``stages`` x (Q tile and LSE row) and ``do_stages`` (None: stages) x (dO tile and D
    row), two dS^T tiles (taking turns between steps; block_m 128: one, sm90_ds_bufs; sm90_kv_split: two
    P^T tiles too), and 1 KB to align the tiles to 1024 bytes (the 128-byte swizzle's period);
    dq_tma_reduce: each consumer warpgroup's ``dq_bufs`` buffers of one of the ``dq_pieces`` pieces of
    its fp32 dQ tile (block_m x sm90_dq_cols)."""
    e = ELEMENT_BYTES
    do_stages = stages if do_stages is None else do_stages
    dq_tile = block_m * sm90_dq_cols(head_dim) * 4
    dq = SM90_CONSUMER_WGS * dq_bufs * dq_tile // dq_pieces if dq_tma_reduce else 0
    score_tiles = 4 if sm90_kv_split(head_dim) else sm90_ds_bufs(block_m)
    return (2 * block_n * head_dim * e + (stages + do_stages) * (block_m * head_dim * e + block_m * 4)
            + score_tiles * block_n * block_m * e + 1024 + dq)


def sm90_fewest_dq_pieces(spec: BackwardSpec) -> int:
    """dq_pieces' default: the fewest pieces whose one buffer per warpgroup fits the GPU beside the rest of
    the spec's tiles (1 where none does, or without dq_tma_reduce: the spec then refuses the shared memory).
    Fewest, not the most buffers: a piece's stores that wait on the previous piece's reduce reading its
    buffer stall the warpgroup (H200, 2026-12-04, head_dim 192: two half-tile buffers ran 0.84-0.94x one
    whole tile)."""
    if spec.arch != "sm90" or not spec.dq_tma_reduce:
        return 1
    limit = GPUS[spec.gpu].smem_per_block
    return next((n for n in SM90_DQ_PIECES_CHOICES if sm90_smem_bytes(
        spec.block_m, spec.block_n, spec.head_dim, spec.stages, spec.do_stages, True, 1, n) <= limit), 1)


def sm90_default_rings(head_dim: int, dq_tma_reduce: bool, gpu: str, stages: int | None = None,
                       do_stages: int | None = None) -> tuple[int, int]:
    """(stages, do_stages) where the caller left them None: the deepest rings whose tiles fit the GPU
    (the dQ tiles of dq_tma_reduce in their smallest pieces), the Q ring first: SM90_STAGES for both
    below head_dim 256; at 256 with dq_tma_reduce a 2-deep Q ring and a 1-deep dO ring (a Q ring of
    one stage, the other way to make room for the dQ tiles, ran no faster than the register adds)."""
    block_m, block_n, _ = SM90_TILES[head_dim]
    fits = lambda st, dos: sm90_smem_bytes(block_m, block_n, head_dim, st, dos, dq_tma_reduce, 1,   # noqa: E731
                                           SM90_DQ_PIECES_CHOICES[-1]) <= GPUS[gpu].smem_per_block
    pairs = [(st, dos) for st in (SM90_STAGES, 1) for dos in (SM90_STAGES, 1) if dos <= st
             and (stages is None or st == stages) and (do_stages is None or dos == do_stages)]
    return next((pair for pair in pairs if fits(*pair)), pairs[-1] if pairs else (stages, do_stages))


def preprocess_row_threads(head_dim: int) -> int:
    """Lanes per query row in the preprocess (D = rowsum(dO ∘ O), dq_accum zeroed): each lane loads 16
    bytes of O and of dO at a time, so a row's head_dim / 8 chunks, rounded up to a power of two: 8 lanes
    at head_dim 64 (4 rows a warp), 16 at 96 and 128, 32 at 192 and 256."""
    chunks = head_dim // 8
    return 8 if chunks <= 8 else 16 if chunks <= 16 else 32


def preprocess_rows_per_cta(spec: BackwardSpec) -> int:
    """Query rows one preprocess CTA covers (its grid's x is stat_rows over this)."""
    return spec.num_warps * (32 // preprocess_row_threads(spec.head_dim))


def _block_rows(spec: BackwardSpec, seqlen_q: int) -> int:
    """seqlen_q rounded up to whole query blocks of block_m rows."""
    return -(-seqlen_q // spec.block_m) * spec.block_m


def dq_accum_rows(spec: BackwardSpec, seqlen_q: int) -> int:
    """Rows of dq_accum per (batch, head_q): seqlen_q, or with dq_tma_reduce seqlen_q rounded up to
    block_m (the bulk reduce adds whole tiles; the rows past seqlen_q receive zeros)."""
    return _block_rows(spec, seqlen_q) if spec.dq_tma_reduce else seqlen_q


def stat_rows(spec: BackwardSpec, seqlen_q: int) -> int:
    """Rows per (batch, head) of the preprocess's D (and, sm90, LSE * log2(e)) arrays: sm90's
    producer bulk-copies a query block's values whole, so its rows are padded to block_m. Never
    fewer than dq_accum_rows (dq_tma_reduce is an sm90 knob)."""
    return _block_rows(spec, seqlen_q) if spec.arch == "sm90" else seqlen_q


def varlen_padded_blocks(spec: BackwardSpec, sequences: int, total_q: int) -> int:
    """Query blocks per head of a varlen backward's per-block arrays (sm80 deterministic: the turn counters;
    sm90: the LSE, D rows and the tiled dq_accum): sequence b's ceil(length / block_m) blocks from (its first
    token + b x block_m) // block_m on, which moves each sequence at least one whole block past the last
    one's (FlashAttention-3's padded offsets), so no two sequences share a block and ceil(total_q / block_m)
    + sequences hold them all."""
    return -(-total_q // spec.block_m) + sequences


def kv_acc_floats(spec: BackwardSpec) -> int:
    """dK + dV accumulator floats per thread."""
    return 2 * spec.block_n * spec.head_dim // spec.threads


def _choice(name: str, value, allowed) -> None:
    if value not in allowed:
        raise SpecError(name, f"{value!r} is not one of {', '.join(map(str, allowed))}")


def _check_types(spec: BackwardSpec) -> None:
    for k in BACKWARD_KNOBS:
        value = getattr(spec, k.name)
        if value is None and k.name in ("block_m", "block_n", "num_warps", "gpu", "stages", "do_stages", "dq_pieces",
                                        "s_lookahead", "dp_lookahead", "lpt", "dq_lag", "key_warps", "dq_row_warps",
                                        "k_unroll"):
            continue
        if k.kind == "text" and not isinstance(value, str):
            raise SpecError(k.name, f"must be text ({', '.join(k.choices)}), got {value!r}")
        if k.kind == "int":
            if hasattr(value, "item") and not isinstance(value, bool):
                value = value.item()
                object.__setattr__(spec, k.name, value)
            if isinstance(value, bool) or not isinstance(value, int):
                raise SpecError(k.name, f"must be an integer, got {value!r}")
        if k.kind == "bool":
            _as_bool(spec, k.name)


def _as_bool(spec: BackwardSpec, name: str) -> None:
    """spec.<name> as a bool: an integer 0 or 1 becomes False or True; anything else not a bool is a SpecError."""
    value = getattr(spec, name)
    if value in (0, 1) and not isinstance(value, bool) and isinstance(value, int):
        object.__setattr__(spec, name, bool(value))
    elif not isinstance(value, bool):
        raise SpecError(name, f"must be True or False, got {value!r}")


def _validate(spec: BackwardSpec) -> None:
    if spec.lpt:
        raise SpecError("lpt", "an sm90 knob (its tile numbering); the sm80 backward's grid is one CTA per key block")
    if spec.dq_lag:
        raise SpecError("dq_lag", "an sm90 knob (its consumer warpgroups' dS^T hand-over); the sm80 backward's warps "
                                  "meet at __syncthreads")
    if spec.persistent:
        raise SpecError("persistent", "an sm90 knob (a producer warp loads the next key block's K, V); the sm80 "
                                      "backward runs one CTA per key block")
    if spec.dp_lookahead:
        raise SpecError("dp_lookahead", "an sm90 knob (with s_lookahead); the sm80 backward has no asynchronous GEMMs")
    if spec.s_lookahead:
        raise SpecError("s_lookahead", "an sm90 knob (the next step's S^T wgmma issued early); the sm80 backward "
                                       "has no asynchronous GEMMs")
    if spec.dq_tma_reduce:
        raise SpecError("dq_tma_reduce", "an sm90 knob (TMA bulk reduce-add of tiles); the sm80 backward's own is "
                                         "dq_bulk_add")
    if spec.dq_bulk_add and spec.gpu not in SM90_GPUS:
        raise SpecError("dq_bulk_add", f"gpu={spec.gpu}: the bulk reduce-add (cp.reduce.async.bulk) needs sm_90, an "
                                       f"H100 or H200 (gpu=h100, h200)")
    if spec.dq_bulk_add and spec.deterministic:
        raise SpecError("dq_bulk_add", "with deterministic: a turn passes once a block's adds are complete, which "
                                       "bulk adds are not when their copies are issued")
    _choice("stages", spec.stages, (1, 2))
    if spec.dq_pieces != 1:
        raise SpecError("dq_pieces", f"{spec.dq_pieces}: an sm90 knob (pieces of dq_tma_reduce's dQ tile)")
    if spec.do_stages != spec.stages:
        raise SpecError("do_stages", f"{spec.do_stages}: an sm90 knob (the dO ring's depth); the sm80 backward's "
                                     f"buffers (stages) hold Q and dO together")
    _choice("num_warps", spec.num_warps, (4, 8))
    _choice("block_m", spec.block_m, (32, 64, 128))
    _choice("k_unroll", spec.k_unroll, (0, 1, 2, 4))
    if spec.frag_prefetch and spec.k_unroll % 2:
        raise SpecError("k_unroll", f"{spec.k_unroll} with frag_prefetch: its two fragment sets take turns over "
                                    f"pairs of k16 steps (k_unroll 2 or 4)")
    if spec.block_n % 16 or not 16 <= spec.block_n <= 256:
        raise SpecError("block_n", f"{spec.block_n}: a multiple of 16 from 16 to 256")
    warps = spec.num_warps
    warps_sn = spec.key_warps
    if warps_sn < 1 or spec.dq_row_warps < 1:
        raise SpecError("key_warps" if warps_sn < 1 else "dq_row_warps", "at least 1 warp")
    if warps % warps_sn or spec.block_n % (16 * warps_sn):
        raise SpecError("key_warps" if warps_sn != sm80_key_warps_default(spec.block_n, warps) else "block_n",
                        f"{spec.block_n} keys do not split into 16-key slabs over {warps_sn} of {warps} warps "
                        f"(key_warps, num_warps)")
    warps_sm = warps // warps_sn
    if spec.block_m % (16 * warps_sm):
        raise SpecError("block_m", f"{spec.block_m} query rows do not split into 16-column pieces over the "
                                   f"{warps_sm} warps left along the queries (raise block_n or key_warps, or lower "
                                   f"num_warps)")
    s_tiles = sm80_s_tiles(spec)
    if not 0 <= spec.poly_exp2_tiles <= s_tiles:
        raise SpecError("poly_exp2_tiles", f"{spec.poly_exp2_tiles}: from 0 to the {s_tiles} n8 query tiles of a warp's "
                                           f"S^T fragment (block_m {spec.block_m} over {warps_sm} warps)")
    warps_kd = warps // warps_sn
    if spec.head_dim % (16 * warps_kd):
        raise SpecError("num_warps", f"head_dim {spec.head_dim} does not split into 16-column pieces over "
                                     f"{warps_kd} warps (raise block_n or key_warps, or lower num_warps)")
    warps_qm = spec.dq_row_warps
    if warps % warps_qm or spec.block_m % (16 * warps_qm) or spec.head_dim % (16 * (warps // warps_qm)):
        raise SpecError("dq_row_warps" if warps_qm != sm80_dq_row_warps_default(spec.block_m, warps) else "block_m",
                        f"{spec.block_m} rows x head_dim {spec.head_dim} of dQ do not split over {warps_qm} x "
                        f"{warps // warps_qm} of {warps} warps (dq_row_warps, num_warps)")
    if spec.dq_bulk_add and spec.block_m // warps_qm > 32:
        raise SpecError("dq_row_warps", f"{warps_qm} with dq_bulk_add: a warp's {spec.block_m // warps_qm} dQ rows "
                                        f"are more than its 32 lanes, one bulk add a row (raise dq_row_warps)")
    floats = kv_acc_floats(spec)
    if floats > MAX_KV_ACC_FLOATS:
        raise SpecError("block_n", f"{spec.block_n} keys x head_dim {spec.head_dim}: dK and dV take {floats} "
                                   f"registers per thread at {warps} warps, more than {MAX_KV_ACC_FLOATS} "
                                   f"(lower block_n or raise num_warps)")
    limit = GPUS[spec.gpu].smem_per_block
    if spec.dq_bulk_add and spec.smem_bytes > limit >= spec.smem_bytes - sm80_dq_staging_bytes(spec):
        raise SpecError("dq_bulk_add", f"its dQ staging ({sm80_dq_staging_bytes(spec)} bytes) beside the rest needs "
                                         f"{spec.smem_bytes} bytes of shared memory, more than the {limit} of gpu="
                                         f"{spec.gpu} (stages=1)")
    if spec.smem_bytes > limit:
        raise SpecError("block_n", f"block_m {spec.block_m} x block_n {spec.block_n} at head_dim {spec.head_dim} "
                                   f"needs {spec.smem_bytes} bytes of shared memory, more than the {limit} of gpu="
                                   f"{spec.gpu} (lower block_m or block_n)")


def _validate_sm90(spec: BackwardSpec) -> None:
    """FA3's tiles as SM90_TILES gives them (block_m 128 too at head_dim 64, SM90_BLOCK_MS): two
    consumer warpgroups, a 2-deep Q/dO ring (1 or 2 at head_dim 192, 256)."""
    if spec.local:
        raise SpecError("local", "the sm90 backward has no sliding window yet; arch='sm80' runs it (on sm90 GPUs too)")
    if spec.softcap:
        raise SpecError("softcap", "the sm90 backward has no softcap yet; arch='sm80' runs it (on sm90 GPUs too)")
    if spec.sinks and spec.varlen:
        raise SpecError("sinks", "the sm90 varlen backward takes no sinks yet; arch='sm80' runs them (on sm90 GPUs "
                                 "too)")
    if spec.varlen and spec.persistent:
        raise SpecError("persistent", "the sm90 varlen backward runs one CTA per tile (a tile past its sequence's keys "
                                      "exits at once); persistent=False")
    if spec.varlen and spec.lpt:
        raise SpecError("lpt", "orders a batch's (kv head, batch) pairs; the varlen backward's tiles are "
                               "(key block, kv head, sequence)")
    if spec.gpu not in SM90_GPUS:
        raise SpecError("gpu", f"{spec.gpu}: the sm90 backward runs on {', '.join(SM90_GPUS)}")
    if spec.block_m not in SM90_BLOCK_MS:
        raise SpecError("block_m", f"{spec.block_m}: the sm90 backward takes block_m=64 (one m64 wgmma of "
                                   f"queries for dQ) or 128 (at head_dim 64)")
    if spec.block_m != 64 and spec.head_dim not in SM90_WIDE_M_HEAD_DIMS:
        raise SpecError("block_m", f"{spec.block_m} at head_dim {spec.head_dim}: the sm90 backward takes "
                                   f"block_m=128 at head_dim {', '.join(map(str, SM90_WIDE_M_HEAD_DIMS))} only "
                                   f"(S^T, dP^T of 128 queries beside dK, dV of {spec.head_dim} columns "
                                   f"exceed the consumers' 240 registers; block_m=64)")
    split = sm90_kv_split(spec.head_dim)
    if spec.block_n != (64 if split else 128):
        raise SpecError("block_n", f"{spec.block_n}: the sm90 backward takes block_n=128 (two consumer "
                                   f"warpgroups of 64 keys) at head_dim 64, 96, 128 and block_n=64 (both on "
                                   f"the same 64 keys, each half of head_dim) at 192, 256")
    if spec.num_warps != 12:
        raise SpecError("num_warps", f"{spec.num_warps}: the sm90 backward runs 12 warps (a producer "
                                     f"warpgroup and two consumer warpgroups)")
    if spec.stages not in ((1, SM90_STAGES) if split else (SM90_STAGES,)):
        raise SpecError("stages", f"{spec.stages}: the sm90 backward's Q/dO ring is {SM90_STAGES} deep (1 or "
                                  f"{SM90_STAGES} at head_dim 192, 256)")
    if spec.k_unroll != 2:
        raise SpecError("k_unroll", f"{spec.k_unroll}: k_unroll is an sm80 knob (wgmma has no such choice)")
    if spec.frag_prefetch:
        raise SpecError("frag_prefetch", "an sm80 knob (ldmatrix fragments; wgmma reads shared memory itself)")
    if spec.poly_exp2_tiles:
        raise SpecError("poly_exp2_tiles", "an sm80 knob (the sm90 backward's consumer softmax takes MUFU.EX2)")
    if spec.dq_bulk_add:
        raise SpecError("dq_bulk_add", "an sm80 knob (the sm90 backward's bulk adds are dq_tma_reduce)")
    for name in ("key_warps", "dq_row_warps"):
        if getattr(spec, name):
            raise SpecError(name, f"{getattr(spec, name)}: an sm80 knob (the sm90 backward's consumer warpgroups "
                                  f"own 64 keys each)")
    if spec.dq_pieces != 1 and not spec.dq_tma_reduce:
        raise SpecError("dq_pieces", f"{spec.dq_pieces}: pieces of the dQ tile dq_tma_reduce stages in shared memory "
                                     f"(set dq_tma_reduce=True)")
    if not 1 <= spec.do_stages <= spec.stages:
        raise SpecError("do_stages", f"{spec.do_stages}: the dO ring is 1 to stages={spec.stages} deep")
    if spec.do_stages < spec.stages and spec.dp_lookahead:
        raise SpecError("do_stages", "below stages with dp_lookahead: the next step's dP^T would read its dO before "
                                     "this step's dV released the one buffer (set dp_lookahead=False)")
    if spec.lpt and not spec.causal:
        raise SpecError("lpt", "orders causal tiles by their length (non-causal key blocks are all as long)")
    if spec.dq_lag and (sm90_dq_cols(spec.head_dim) == spec.head_dim or split or spec.block_m != 64
                        or not spec.dq_tma_reduce or spec.deterministic):
        raise SpecError("dq_lag", "lags dQ where both warpgroups read each other's dS^T rows (head_dim 128, "
                                  "block_m 64), through the bulk reduce (dq_tma_reduce=True), not deterministic")
    if spec.s_lookahead and (split or spec.stages < 2):
        raise SpecError("s_lookahead", f"head_dim {spec.head_dim}: the next step's S^T is issued early at head_dim "
                                       f"64, 96, 128 (2-stage ring, S^T from each warpgroup's own keys) only")
    if spec.dp_lookahead and not spec.s_lookahead:
        raise SpecError("dp_lookahead", "issues the next step's dP^T after its S^T: set s_lookahead=True too")
    if spec.s_lookahead and spec.block_m == 128 and not spec.dq_tma_reduce:
        raise SpecError("s_lookahead", "at block_m=128 with dq_tma_reduce=False the kernel spills (4 bytes, causal, "
                                       "NVRTC 13): take dq_tma_reduce=True (block_m 128's default) or block_m=64")
    limit = GPUS[spec.gpu].smem_per_block
    if spec.smem_bytes > limit:
        if spec.dq_tma_reduce and spec.do_stages > 1:
            raise SpecError("stages", f"{spec.smem_bytes} bytes of shared memory, more than the {limit} of gpu="
                                      f"{spec.gpu}: at head_dim {spec.head_dim} dq_tma_reduce's dQ tiles leave room "
                                      f"for stages=1 or do_stages=1 (or set dq_tma_reduce=False)")
        raise SpecError("block_n", f"{spec.smem_bytes} bytes of shared memory, more than the {limit} of gpu="
                                   f"{spec.gpu}")


def default_backward_specs() -> list[BackwardSpec]:
    """Every shipped backward config: each head_dim x dtype x causal with the default tiles."""
    return [BackwardSpec(head_dim=d, dtype=dt, causal=c) for d in HEAD_DIMS for dt in BACKWARD_DTYPES
            for c in (False, True)]
