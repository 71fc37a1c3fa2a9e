"""KernelSpec: the one input to rendering, and the budget model that validates it.

A spec is frozen, keyword-only and hashable. Fields left as ``None`` are filled in
``__post_init__`` from :func:`default_tiles` (a pure function of arch, head_dim, dtype,
causal and the target GPU), then every field is checked and each problem is reported
with its own message naming the knob to change.

Budget model
------------
Shared memory (bytes, per CTA; E = bytes per element):

* sm80 (FlashAttention-2 schedule): Q tile ``block_m*d*E`` (also reused for the O
  staging tile in the epilogue) plus a ``stages``-deep ring of K and V tiles,
  ``stages * 2 * block_n*d*E``. cp.async writes straight into the ring, so there is
  no extra staging buffer.
* sm90 (FlashAttention-3 schedule): Q tile ``block_m*d*E``, an O staging tile of the same
  size when ``separate_o`` (else O aliases Q), plus ``stages`` K tiles and ``stages`` V tiles
  (``stages * 2 * block_n*d*E``), plus 1 KB for mbarriers and the 1024-byte alignment of
  128B-swizzled tiles. ``separate_o`` defaults to on exactly when it fits: with its own O
  buffer the consumers release Q after their last Q K^T (the next tile's Q loads under the
  last P V and the epilogue) and the epilogue's TMA store runs under the next tile's GEMMs
  (it is waited for only before the O buffer is rewritten); with O aliasing Q the next Q
  waits for this tile's O store to leave shared memory (a bubble per tile; measured 18%
  behind FlashAttention-3 at seqlen 1k, docs/perf-notes.md). That trade is why the hdim128
  default is 128x160 (Q 32K + O 32K + 2x(K+V) of 160 rows = 224K) and not FA3's 128x176,
  which fits only with O aliased. hdim256 (Q 64K + O 64K + 2x(K+V) of 80 rows = 288K) cannot
  have its own O buffer.

With ``head_dim_v`` < ``head_dim`` (V and O narrower than Q and K) the sm90 V tiles and O tile are
``head_dim_v`` wide (``stages * block_n * (d + d_v) * E`` for the rings); sm80's V ring keeps K's rows
(only d_v columns of them loaded), so its terms are unchanged; O's registers count d_v columns.

The seed's ``compute_block_size`` compared an element count with a byte budget and
left out the pipeline stages; both mistakes are why the terms above are all in bytes
and all multiplied by what is really resident.

Registers (32-bit, per thread) are estimated from what each thread must hold live:
the O accumulator (``rows*d/threads`` floats), the S accumulator (``rows*block_n/threads``
floats), on sm90 P in 16-bit pairs (half of S: the whole P tile is the A operand of one
wgmma; sm80 converts P one k16 slice at a time; e4m3 P a quarter of S), Q fragments when
``q_in_regs``, and a per-kernel overhead for addresses, row statistics and loop state
(``REG_OVERHEAD``). The estimate
must stay under the per-thread cap (255 on sm80; the consumer's ``setmaxnreg`` value on
sm90), and on sm90 the register split must fit the 64K-register file.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from . import knobs as knob_registry
from .knobs import (ARCHS, DTYPES, FA1_CHOICES, FA1_SWITCHES, GPU_NAMES, HEAD_DIMS, INT_FIELDS, OUT_DTYPES,
                    SCHEDULES, TEXT_FIELDS, V_LAYOUTS, VARIANT_FEATURES, head_dim_problem, head_dim_v_problem,
                    tile_head_dim)

# The 16-bit input types every arch supports (and the shipped default_specs() cover); "fp8" is
# e4m3 on sm90 only (templates/sm90/flash_fwd_fp8.cu.j2), with its own knobs out_dtype and v_layout.
DTYPES_16 = ("fp16", "bf16")
ELEMENT_BYTES = {"fp16": 2, "bf16": 2, "fp8": 1}
# fp8 only: the type O is written in, and how the caller passes V.
#   v_layout  row:        V as given, (batch, seqlen_k, heads_kv, head_dim); the producer warpgroup
#                         transposes each V tile in shared memory (FP8 wgmma takes K-major B only)
#             transposed: the caller passes V^T, (batch, heads_kv, head_dim, seqlen_k) with the keys
#                         contiguous and a head_dim stride that is a multiple of 16 keys (pad seqlen_k)
# (OUT_DTYPES, V_LAYOUTS and SCHEDULES: facodegen/spec/knobs.py.)
# The finer switches of the fa1 template (templates/sm80/flash_fwd_fa1.cu.j2), each isolating one
# idea of FlashAttention-2 (kernel spec field -> choices, FA1's choice first):
#   loop_order  kv_outer: one CTA per (batch, head), K/V blocks outside, Q blocks inside, O/m/l in
#                         global memory between K/V blocks (FA1 Algorithm 1)
#               q_outer:  grid also over Q blocks, K/V blocks inside, O/m/l in registers (FA2's
#                         sequence parallelism)
#   warp_split  kv:       warps split the K/V columns of S; row max/sum and O combined across warps
#                         through shared memory (FA1's "split-K")
#               q:        warps split the Q rows; no cross-warp exchange (FA2)
#   rescale     every_step: O kept normalised, divided by the row sum after every K/V block (FA1)
#               once:       O unnormalised, divided by the row sum once at the end (FA2)
# schedule=fa1 takes FA1's choices unless told otherwise; schedule=fa2 (and sm90) is FA2's choices
# and rejects any other value. (FA1_SWITCHES: facodegen/spec/knobs.py.)
FA2_CHOICES = {name: choices[1] for name, choices in FA1_SWITCHES.items()}

# Per-GPU limits the budget model needs. smem_per_block is the opt-in maximum of
# dynamic shared memory for one block (cudaDevAttrMaxSharedMemoryPerBlockOptin).
@dataclass(frozen=True)
class GpuLimits:
    name: str
    smem_per_block: int
    regs_per_sm: int
    sms: int
    compute_capability: tuple[int, int]
    smem_per_sm: int = 0        # shared memory of one SM, all its CTAs together (0: not modelled)


GPUS = {
    # 163 KB: the A100's opt-in limit (CUDA programming guide, compute capability 8.0).
    "a100": GpuLimits("a100", 166912, 65536, 108, (8, 0)),
    # 227 KB: read off the H200 of this project (232448 bytes); the H100 has the same SM.
    # 228 KB per SM (CUDA programming guide, compute capability 9.0), 1 KB of it reserved per CTA.
    "h100": GpuLimits("h100", 232448, 65536, 132, (9, 0), 233472),
    "h200": GpuLimits("h200", 232448, 65536, 132, (9, 0), 233472),
    # 99 KB per block, 100 KB per SM (CUDA programming guide, compute capabilities 8.6 and 8.9):
    # A10, A40, RTX 30 (8.6); L4, L40, RTX 40 (8.9). The SM counts are the A10's and the L4's; the
    # launcher reads the real count off the device.
    "sm86": GpuLimits("sm86", 101376, 65536, 72, (8, 6), 102400),
    "sm89": GpuLimits("sm89", 101376, 65536, 58, (8, 9), 102400),
}
DEFAULT_GPU = {"sm80": "a100", "sm90": "h200"}

# Registers beyond the fragments: addresses, loop counters, row max/sum, masks. From ptxas
# reports: 40-60 on sm80 (q_in_regs specs under 48 spilled); the sm90 consumer fits in 32; the
# sm90 fp8 consumer in 28 (NVRTC 13.0, fragments + 28: head_dim 64 x block_n 160 = 160 fits 160
# and 256 x 96 = 212 fits 232 without spills; 64 x 192 = 180 spills 208 bytes at 160 and
# 256 x 128 = 236 spills 48-56 bytes at 232; 128 x 224 = 232 sits on the edge: clean with the
# looped V transposer, 16-20 bytes of spills with the unrolled one, so tune drops it).
# lazy_rescale's default (the fa2 schedule and sm90, 16-bit types; see common/softmax.cuh.j2): on
# for the sm80 head_dim 96/128 kernel (128x64, 4 warps) only. On the H200 (same-run sweeps and grids
# vs FlashAttention-2, 2026-11-29): sm80 d128 +2-4% (s8k 344 -> 356, causal s16k 321 -> 335 at
# 9f281b1), but sm80 d64 -8% (s16k 340 at 25ad51b, 311 at a420b8c; FA2 308 in both), sm80 d256 s1k
# 310 -> 308, and sm90 -1 to -5% in every cell tried (d256 s8k 688 -> 652). All of these ran with
# o_scale an ulp off 1 for a kept max (ptxas fuses take_row_max's exponent into one FFMA), so the vote
# multiplied O anyway; with an exact 1 (H200, 2026-12-01, docs/perf-notes.md session 16, not landed:
# the head_dim 128 causal kernel then spills) sm80 d128 +1.7-2.8%, and lazy vs exact: sm80 d64 s8k
# 306.8 / 335.1, d192 283.7 / 315.1, d256 322.0 / 317.9; sm90 level. Since 4f44596 (2026-12-03) the
# exponent is the difference of the raw maxima, an exact 1 for a kept max in every shipped kernel with
# no spill: the defaults above predate it (to re-measure: the numbers just quoted favour lazy at d64
# and d192 on sm80).
#
# fp8 (templates/sm90/fp8_softmax.cuh.j2: a row keeps its max while a step raises it by at most 0.75
# in log2 units, so p stays under e4m3's 448; a warp none of whose rows moved skips O's 128 FMULs,
# behind a vote between two straight-line exp2 paths): on at head_dim 256. H200, 2026-12-02
# (scripts/lab.py sweep, 8 groups, TFLOP/s lazy / exact, F = FlashAttention-3 fp8 in the same run): s16k
# 1194.2 / 1116.6 (F 1125.3), s8k 1163.2 / 1106.4 (1102.4), causal s16k 1139.6 / 1102.9 (1122.1), causal
# s8k 1075.5 / 1054.5 (1039.1); off at head_dim 128 (s16k 926.2 / 928.2, causal s16k 905.7 / 918.9) and
# 64 (s16k 680.0 / 673.1), where O's rescale is 64 / 32 FMULs a thread. A bound with O never rescaled
# (head_dim 256): +6% in all four cells. Warp steps that still rescale: 15% (s16k), 22% / 34% (causal
# s16k / s8k), against 33% / 44% / 61% with the exact max.
def lazy_rescale_default(arch: str, head_dim: int, dtype: str = "bf16") -> bool:
    if dtype == "fp8":
        return head_dim == 256
    return arch == "sm80" and 64 < head_dim <= 128

# rescale_under_qk's default (sm90 with intra_wg_overlap; FlashAttention-3's order, sm90/roles.cuh.j2):
# on for bf16/fp16 head_dim 128, whose default has no pingpong. On the H200 (scripts/lab.py sweep,
# 2026-11-29, TFLOP/s on vs off, same run): d128 causal s1k/2k/8k 446/562/644 vs 440/548/578
# (0391f98), s4k 638 vs 608 (175a467); but with pingpong (the non-causal d128 default then) s8k 615 vs
# 625, d256 690 vs 697, d64 causal 467 vs 484, and fp8 -2 to -7% (d256 s8k 995 vs 1070).
def rescale_under_qk_default(head_dim: int, dtype: str, causal: bool) -> bool:
    return dtype != "fp8" and head_dim == 128

# q_in_regs on sm90 fp8 (Q K^T with A from registers, Q's shared buffer freed after one ldmatrix
# pass per tile) stays off: it takes Q (64 rows x head_dim bytes per warpgroup) off the shared-memory reads of
# every step, but on the H200 (scripts/lab.py sweep, 2026-11-29, commit 2dcfa54, TFLOP/s off vs on, same
# run) d128 s2k 797 vs 790, s8k 877 vs 850, s16k 892 vs 856, causal s8k 846 vs 799, s16k 866 vs 838;
# d256 (block_n 64 to fit its 32 registers) s8k 1058 vs 917. So Q's shared-memory reads do not bound
# the step; the knob stays for experiments.
FP8_Q_IN_REGS_DEFAULT = False

# anchor_softmax's default (sm90; sm90/roles.cuh.j2). 16-bit: off. On the H200 (scripts/lab.py sweep,
# 2026-11-29, commit 43c5445, TFLOP/s anchored vs not, same run) it lost in 6 of 8 cells, e.g. d128
# causal s4k 578 vs 608, d256 s8k 666 vs 695; d128 s1k/s8k +1%.
# fp8 (exact max, af2d74d: the anchor holds the row max pass, not the whole softmax, ahead of the P V
# wait): on for head_dim 64 and head_dim 128 causal (whose default thus takes the exact max instead of
# the optimistic one). H200, 2026-12-01, variants taking turns (TFLOP/s default vs anchored; F = FA3
# fp8): d64 s2k 577.5 / 588.8 (F 545.1), causal s2k 466.3 / 478.1, s8k 635.7 / 645.7 and 643.8 /
# 668.4, s16k 650.9 / 665.2, causal s16k 635.1 / 644.9 and 646.3 / 648.0; d128 causal (optimistic vs
# exact + anchored) s2k 649.4 (its 128-key rule) / 675.4, s8k 812.5 / 844.6 (F 809.3), s16k 857.9 /
# 875.9 and 883.0 / 899.6 (F 865.2, 903.1). It loses at head_dim 256 (s8k 1103.6 / 1079.0 and 1110.4 /
# 1068.1, s16k 1117 / 1077, causal s16k 1107 / 1064; again 2026-12-01 at 9a25329, s16k 1123.6 / 1128.9,
# s8k 1105.0 / 1105.7, causal s16k 1088.9 / 1071.2). head_dim 128 non-causal (exact + anchored vs the
# optimistic step) lost in session 14 (s8k 887 / 857, s16k 901 / 858) but, with two softmax chains,
# wins since: 2026-12-01 at 9a25329 (scripts/lab.py sweep, 10 groups) s8k 876.1 / 930.7 (F 873.1), s16k
# 889.8 / 940.1 (F 879.6), s2k 786.6 / 848.3 (F 730.9); with the mask-free loop (ab_trees, two rounds
# each) s8k 879.9, 873.7 / 922.6, 919.9 (F 872.8), s16k 906.4, 899.9 / 931.9, 932.5 (F 900.6). So on
# for head_dim 64 and 128.
def anchor_softmax_default(head_dim: int, dtype: str, causal: bool) -> bool:
    return dtype == "fp8" and head_dim in (64, 128)

# softmax_chains' default (common/softmax.cuh.j2: independent FMNMX/FADD chains per row in the row
# max and row sum). On the H200 (scripts/lab.py sweep with the variants taking turns group by group,
# 2026-11-29, TFLOP/s 1 chain vs 4): sm90 bf16 d64 s2k 479 vs 486, s16k 511 vs 530, causal s16k 491
# vs 498; d128 s8k 634 (1) vs 632 (2) vs 618 (4), s2k 598 vs 589 (4); d256 s8k 707 vs 708, causal s8k
# 670 vs 658; fp8 d64 s8k 635 vs 646, causal 562 vs 583, fp8 d256 s8k 963 vs 1013, causal 904 vs 919,
# fp8 d128 s8k 818 vs 807, causal s2k 569 vs 576. 4 where it won in both runs (head_dim 64, and fp8
# head_dim 256); one chain elsewhere (sm80 was tuned against FlashAttention-2 with one; head_dim
# 96/192 unmeasured). fp8 head_dim 128 non-causal (its optimistic step): 2. H200, 2026-12-01, variants
# taking turns, TFLOP/s 1 vs 2 chains: s8k 862.2 / 869.8 and 853.5 / 866.1, s16k 869.3 / 880.3 and
# 872.7 / 882.1. Exact + anchored (its default since): 1 / 2 / 4 chains s8k 838.8 / 930.7 / 839.8,
# s16k 855.5 / 940.1 / 863.9 (H200, 2026-12-01, 9a25329, 10 groups). fp8 head_dim 128 causal (exact
# + anchored, with the mask-free loop): 1 / 2 / 4 chains s8k 854.3 / 887.9 / 871.2 (F 820.6), s16k
# 890.2 / 930.8 / 900.5 (F 870.5), s2k 688.7 / 716.3 / 701.3 (F 622.6); 2 at head_dim 128.
SOFTMAX_CHAINS = (1, 2, 4, 8)


def softmax_chains_default(arch: str, head_dim: int, dtype: str, causal: bool) -> int:
    if arch != "sm90":
        return 1
    if dtype == "fp8" and head_dim == 128:
        return 2
    return 4 if head_dim == 64 or (dtype == "fp8" and head_dim == 256) else 1


# poly_exp2_tiles' default (common/softmax.cuh.j2: n8 key tiles of each score fragment whose exp2 runs
# as a polynomial on the FMA pipe instead of MUFU.EX2, FlashAttention-4's emulation). MUFU does 16
# exp2 per clock per SM against 128 FMAs, but a polynomial exp2 is 8 instructions against 2, and the
# step is bound by instruction issue, not by MUFU: on the H200 (scripts/lab.py sweep, variants taking
# turns, 2026-11-29, 235d2ba + descriptors, TFLOP/s tiles 0 / 2 / 4) d128 s8k 622 / 616 / 584, causal
# s8k 602 / 563 / 545, d64 s8k 528 / 479 / 466 (8: 419), d256 s8k 678 / 659; fp8 d128 s8k 798 / 816 /
# 802, fp8 d64 s8k 641 / 616 / 593, fp8 d256 998 / 943 / 930. Off everywhere.
POLY_EXP2_TILES_DEFAULT = 0


# optimistic_max's default (sm90; common/softmax.cuh.j2's softmax_step_optimistic, the fp8 kernel's
# softmax_step_fp8_optimistic: the exp2s of a step start from the running max; the row sums, for
# fp8 the max pass beside them, decide whether the step needs the new max).
# On the H200 (scripts/lab.py sweep, variants taking turns, 2026-11-29, TFLOP/s exact vs optimistic, FA3
# in the same run): d128 s8k 592 vs 670 (FA3 652), s1k 602 vs 646, causal s8k 573 vs 624 (638),
# causal s2k 499 vs 528, causal s512 329 vs 333; d64 s8k 503 vs 566 (512); d256 s8k 669 vs 706 (703),
# s512 492 vs 501. d64 causal without pingpong s8k 464 vs 458, s1k 297 vs 288, with it (its default
# now) 530 (06b2daf). d256 causal: s2k 586 vs 573 in one run, 588 vs 601 (s8k 640 vs 669, s512
# 324 vs 333) in the next. head_dim 96/192 unmeasured: exact.
# fp8 (max pass beside the exp2s, P offset 2^6 instead of 2^8, 88cd2f4 + offset): d128 s8k 784 vs 868
# (F 969), causal s8k 747 vs 807; but d64 s8k 648 vs 591, d256 998 vs 907, causal 977 vs 929. With
# the offset of 2^8 (slack log2(448/256)) it lost 10-28% in all 18 fp8 cells: most steps redid.
# fp8 head_dim 128: exact and anchored, causal since af2d74d, non-causal since 2026-12-01
# (anchor_softmax_default), so no fp8 default takes the optimistic step.
def optimistic_max_default(head_dim: int, dtype: str, causal: bool) -> bool:
    if dtype == "fp8":
        return False
    return head_dim in (64, 128, 256)


# uniform_wg's default (sm90/roles.cuh.j2: the consumer warpgroup index broadcast from lane 0, so
# the Q descriptors stay in uniform registers). SASS at head_dim 128: the 16 R2UR per main-loop step
# go, but ptxas rebuilds the descriptors in uniform registers instead (706 vs 709 instructions per
# step). H200, variants taking turns (2026-11-29, TFLOP/s off vs on): d128 s8k 615 vs 617, causal s8k
# 588 vs 587, s2k 574 vs 578; d256 s8k 675 vs 659; d64 s16k 515 vs 499; fp8 d128 s8k 795 vs 787
# (again in session 8: fp8 d128 s8k 881 vs 877, causal 821 vs 813, fp8 d64 s8k 662 vs 628). On for
# fp8 head_dim 256 with the in-kernel V^T (128x128 at 24/240, see fp8_tiles): with the index in a
# uniform register its consumers fit 240 without spilling (44-60 bytes off), and on the H200
# (scripts/lab.py sweep, 2026-11-29, TFLOP/s 128x128 off vs on) s2k 1062 vs 1098, s8k 1072 vs 1094,
# s16k 1074 vs 1102, causal s2k 822 vs 889, s8k 992 vs 1050, s16k 1038 vs 1096. With the caller's V^T
# only where the consumers need it to fit: causal, since the fp8 mask-free loop (bde33cc; without it 4
# bytes of spills, NVRTC 13.0). The non-causal one fits without and runs faster so (H200, 2026-12-01,
# 8 groups, TFLOP/s uniform_wg on / off): s16k 1111.7 / 1129.3; causal s16k 1080.5 / 1105.3 (spilling).
# With a window (local) too: its third, masked loop (the left edge) spills 16 bytes without (40 with
# softcap and sinks beside it; NVRTC 13.0, 2026-12-05), none with.
def uniform_wg_default(head_dim: int, dtype: str, v_layout: str, causal: bool, local: bool = False) -> bool:
    return dtype == "fp8" and head_dim == 256 and (v_layout == "row" or causal or local)

# dynamic_scheduler's default (sm90, persistent: the tiles after each CTA's first are handed out by an
# atomic counter instead of every gridDim.x-th tile; sm90/scheduler.cuh.j2). Causal: on (its tiles differ
# in length). Non-causal tiles are equal, but the SMs are not quite: with the counter the ones that run
# ahead take the last wave's tiles. H200, scripts/lab.py ab-trees (old tree static, new dynamic, 8 groups x 2
# rounds, 2026-12-01, df44c17, new/old), fp8: head_dim 128 s2k 1.021, s8k 1.004 and 0.997, s16k 1.010
# and 1.007; head_dim 64 s2k 1.058, s16k 1.009; head_dim 256 s2k 1.007, s8k 0.997, s16k 1.000 and
# 0.989, so static there. 16-bit non-causal (same run, TFLOP/s static vs dynamic): d64 s2k 521.2 vs
# 523.4, s16k 581.0 vs 583.2; d128 s2k 655.2 vs 641.6, s8k 728.7 vs 720.9, s16k 728.2 vs 741.9; d256
# s8k 753.6 vs 754.0, s16k 768.9 vs 772.2: mixed, static.
def dynamic_scheduler_default(head_dim: int, dtype: str, causal: bool) -> bool:
    return causal or (dtype == "fp8" and head_dim <= 128)

# stream_k's default (sm90 fp8 non-causal, persistent with the static scheduler): on at head_dim 256,
# where 16k tokens make 1024 tiles, 7.76 waves on 132 SMs. H200, 2026-12-01, TFLOP/s default / stream_k
# (scripts/lab.py sweep, 10 groups, FA3 in the same run): s8k 1097.1 / 1103.3 (1114.2), s16k 1109.9 / 1127.5
# (1138.2); scripts/lab.py ab-trees (8 groups x 2 rounds): s8k 1076.0, 1080.6 / 1081.6, 1084.1 (1090.0), s16k
# 1084.1, 1087.4 / 1104.7, 1106.7 (1110.2). Gains short of the ~3% idle last wave: each share adds about
# two piece boundaries (a tile's pipeline fill and drain), which cost more at 8k than at 16k. Off at
# head_dim 128 (against the dynamic scheduler, its default: s8k 869.9 / 865.1, s16k 887.2 / 893.5) and
# 64 (s16k 678.4 / 653.5, s2k 612.5 / 554.5: short tiles, the counter's balance matters more). A split
# region of only the last T % G tiles (shares under one tile, three pieces to some tiles, a piece
# waiting for the one beside it) measured lower still: d256 s16k 0.990x, d128 0.97x, d64 0.956x of this.
def stream_k_default(head_dim: int, dtype: str, causal: bool) -> bool:
    return dtype == "fp8" and head_dim == 256 and not causal

# defer_o_store's default (sm90 fp8, the overlapped loop: a tile's O is stored under the next tile's
# first Q K^T instead of between the tiles, where both warpgroups drained 64 KB of O at ~16-30 B/cycle
# with nothing else to run; scripts/lab.py trace-steps, session 23). On at head_dim 256 non-causal with the
# in-kernel V^T. H200, 2026-12-02, scripts/lab.py sweep, TFLOP/s default / defer_o_store (F =
# FlashAttention-3 fp8 in the same run), 10-16 groups, first with O kept in o_reg (two runs), then
# packed to bf16 at the tile's end (the form here): s8k 1105.1 / 1109.0 (1113.5), 1123.4 / 1127.9
# (1127.4), 1113.8 / 1112.8 (1111.1); s16k 1125.2 / 1132.7 (1137.8), 1140.4 / 1145.1 (1148.5), 1126.3 /
# 1134.9 (1138.8). Off causal, where it moved by more than it gained: s16k 1092.4 / 1086.7 (1124.4),
# 1094.8 / 1106.3 (1112.3), 1100.1 / 1083.4 (1119.8); s8k 1063.9 / 1073.1 (1085.6), 1068.0 / 1056.3
# (1051.8). Off below 8k keys (seqlen_rule_fields: s2k 1052.1 / 1010.7) and at head_dim 128 (s8k 936.2
# / 928.1, causal s16k 935.1 / 849.4) and 64 (s8k 671.1 / 660.9). In the SASS ptxas puts some of the
# stores before the prologue's Q K^T wgmmas (with O in o_reg, between them); a store that waits for
# room in the memory pipe holds back the wgmmas after it. With the caller's V^T at head_dim 256 its
# consumers spill (4 bytes), and with Q in registers (126 bytes at 64 keys).
def defer_o_store_default(head_dim: int, dtype: str, v_layout: str | None, causal: bool, q_in_regs: bool) -> bool:
    return dtype == "fp8" and head_dim == 256 and v_layout in (None, "row") and not causal and not q_in_regs

# The fp8 K/V ring's depth with the caller's V^T (v_layout=transposed): three stages where they fit at
# head_dim 64 and 256 (at 256 x 128 keys: 224 KB with Q, the room the in-kernel transpose's row-major V
# ring takes at two). At head_dim 256 the V^T ring is the step's critical loop: a tile is released after
# the P V of its step and its TMA load takes ~3000 cycles, about a step (scripts/lab.py trace-steps, H200,
# 2026-12-01, session 19). H200, scripts/lab.py sweep, 8-10 groups (TFLOP/s two / three stages; F =
# FlashAttention-3 fp8 with row V, in the same run), head_dim 256 in three calls: s16k 1133.9 / 1161.9,
# - / 1153.3, 1126.8 / 1159.8 (F 1131.2, 1133.1, 1131.3); s8k 1086.9 / 1120.2, - / 1125.5, 1087.3 /
# 1121.2 (F 1106.1, 1113.1, 1107.3); causal s16k 1078.7 / 1102.9, - / 1106.9, 1087.6 / 1114.6 (F
# 1108.6, 1117.2, 1117.9); causal s8k 1018.3 / 1033.7, - / 1037.5 (F 1046.2, 1066.6); head_dim 64 s16k
# 605.6 / 650.2 (F 656.1), causal s8k 578.4 / 584.9 (F 611.1). Two at head_dim 128, where three lose:
# s8k 902.8 / 858.0 (F 881.9), causal s16k 897.4 / 873.4 (F 876.3); 96 and 192 unmeasured: two.
FP8_VT_THREE_STAGE_HEAD_DIMS = (64, 256)


# vt_in_place (V transposed in its own V^T slot, three stages) stays off: H200, 2026-12-02, scripts/lab.py sweep
# 8 groups (TFLOP/s default / vt_in_place, F = FlashAttention-3 fp8): d256 s16k 1123.5 / 1118.0 and 1117.9 /
# 1118.4 (F 1127.5, 1126.0), s8k 1096.5 / 1098.3 (1109.6), causal s16k 1095.2 / 1066.5 and 1087.1 / 1060.5
# (1111.8, 1106.9), causal s8k 1061.2 / 1026.3 (1046.6); d128 s8k 936.7 / 845.5 (888.2); d64 s16k 680.6 /
# 670.9 (654.6). Its V loads take 1472 cycles instead of 3102, but the step's period stays (2979 vs 2966,
# scripts/lab.py trace-steps; docs/perf-notes.md session 22).
def fp8_stages_default(head_dim: int, v_layout: str, block_m, block_n, q_stages: int, smem: int,
                       tile_stages: int, vt_in_place: bool = False) -> int:
    """vt_in_place (no row-major V ring): three stages wherever they fit, as the caller's V^T."""
    if ((vt_in_place or (v_layout == "transposed" and head_dim in FP8_VT_THREE_STAGE_HEAD_DIMS))
            and all(isinstance(x, int) for x in (block_m, block_n))):
        if fp8_smem(block_m, block_n, 3, head_dim, v_layout, q_stages, vt_in_place) <= smem:
            return 3
    return tile_stages


# q_stages' default (sm90: two Q buffers, so a tile's Q loads while the consumers run the tile before
# and each consumer warpgroup starts its next tile at once): on for 16-bit causal kernels where the
# second Q tile fits beside O's own place (its own buffer or the V ring). Causal tiles are short and
# many (1-16 blocks at 2k queries), so the Q load that follows the last Q K^T of a tile is on the path
# from one tile to the next. H200, scripts/lab.py sweep, variants taking turns, 15 groups (2026-12-01,
# 350f483, TFLOP/s q_stages 1 vs 2; two calls): d64 causal s512 241.7 vs 244.7 and 244.1 vs 246.3,
# s1k 324.8 vs 324.3, s2k 391.4 vs 400.1 and 394.7 vs 402.3, s8k 519.3 vs 525.2; d128 causal s512
# 341.6 vs 334.5, s1k 447.1 vs 452.9 and 443.8 vs 448.1, s2k 535.3 vs 545.1, s4k 594.1 vs 601.4, s8k
# 627.9 vs 637.7. Off for fp8 (d128 s8k 871 vs 832 and 876 vs 833, causal s8k 826 vs 795) and where
# the second Q tile does not fit (head_dim 256; head_dim 128 with 176 keys and O over V).
def q_stages_default(head_dim: int, dtype: str, causal: bool) -> int:
    return 2 if causal and dtype != "fp8" and head_dim <= 128 else 1


REG_OVERHEAD = {"sm80": 48, "sm90": 32, "sm90-fp8": 28}
SM80_MAX_REGS = 255
SM90_REG_FILE = 65536
SM90_CTA_RESERVED_SMEM = 1024 + 256   # the system's 1 KB per CTA + the static SharedState
SM90_BARRIER_BYTES = 1024  # mbarriers + alignment slack for 1024-byte-aligned swizzled tiles


class SpecError(ValueError):
    """A KernelSpec field is invalid; ``field`` names the knob to change."""

    def __init__(self, field_name: str, message: str):
        super().__init__(f"{field_name}: {message}")
        self.field = field_name


@dataclass(frozen=True)
class Tiles:
    """A default tile choice; ``why`` says where it comes from."""
    block_m: int
    block_n: int
    num_warps: int
    stages: int
    q_in_regs: bool = False
    consumer_warpgroups: int = 0
    pingpong: bool = False
    intra_wg_overlap: bool = False
    o_in_v: bool = False
    why: str = ""


def default_tiles(arch: str, head_dim: int, dtype: str, causal: bool, gpu: str,
                  head_dim_v: int | None = None) -> Tiles:
    """The default tile choice for one problem family, with the reason for each branch."""
    smem = GPUS[gpu].smem_per_block
    if head_dim_v not in (None, head_dim) and dtype != "fp8":
        return split_v_tiles(arch, head_dim, head_dim_v, dtype, causal, gpu)
    if arch == "sm80":
        # FlashAttention-2's A100 table (kernel-facts 1.1): 4 warps stacked along M, each
        # owning 32 rows; block_n shrinks as head_dim grows to keep S+O in registers.
        if head_dim <= 64:
            return Tiles(128, 128, 4, 2, why="FA2 hdim64: 128x128, 4 warps")
        if head_dim <= 128:
            return Tiles(128, 64, 4, 2, why="FA2 hdim96/128: 128x64, 4 warps")
        # hdim256 where two 64x64 CTAs with one K/V stage fit an SM (96 KB each: H100/H200, not
        # the A100's 163 KB): FA2's H100 choice (kernel-facts 1.1), 64x64, 4 warps of 16 rows.
        # Two independent CTAs per SM keep one CTA's MMAs running through the other's softmax and
        # barriers; measured on the H200 (docs/perf-notes.md, sm80 v2) vs 128x64/8w/2 stages
        # (one 192 KB CTA per SM): causal s1k 255 vs 229, s4k 293 vs 275, non-causal s8k 323 vs 323.
        if head_dim == 256 and 2 * (64 + 2 * 64) * head_dim * 2 <= smem:
            return Tiles(64, 64, 4, 1, why="FA2 hdim256 on H100: 64x64, 4 warps, 2 CTAs/SM")
        # 99 KB GPUs (sm86, sm89): 128 rows of Q at hdim 256 (64 KB) leave no room for a K/V stage
        # (64 KB); 64 rows with one 64-key stage take 96 KB.
        if (128 + 2 * 64) * head_dim * 2 > smem:
            return Tiles(64, 64, 4, 1, why="hdim256 on a 99 KB GPU: 64x64, 4 warps, 1 stage")
        # hdim 192/256: 8 warps of 16 rows each, so the O accumulator (16 x d per warp, d/2
        # floats per thread) fits in 255 registers; 2 stages where the GPU has the room.
        stages = 2 if 128 * head_dim * 2 + 2 * 2 * 64 * head_dim * 2 <= smem else 1
        return Tiles(128, 64, 8, stages, why="FA2 hdim192/256: 128x64, 8 warps")
    if dtype == "fp8":
        return fp8_tiles(head_dim, causal)
    # sm90: FlashAttention-3's tile_size_fwd_sm90 (kernel-facts 2.1), 2-stage K/V rings.
    # Pingpong is off for causal: measured on the H200 (docs/perf-notes.md, v1 ablation) it
    # costs 6% at d128 s8k causal (572 vs 607 TFLOP/s) and 3% at s1k: the masked diagonal
    # blocks make the two warpgroups' softmax steps uneven, so each waits for the other's turn.
    # (On today's kernel head_dim 128 causal gains 5-8% from it up to 8k queries: the
    # sequence-length rule below turns it on there.)
    pingpong = not causal
    if head_dim <= 64:
        # 3 consumer warpgroups x 64 rows. FA3's 192x192 keeps P in shared memory (SS PV
        # GEMM); with P in registers 160 registers hold S and P only up to block_n=128.
        # Pingpong causal too since optimistic_max (the steps are even again): H200, variants taking
        # turns (2026-11-29, 06b2daf, TFLOP/s optimistic without vs with pingpong): causal s8k 463 vs
        # 530, s2k 359 vs 385, s512 (2 warpgroups) 220 vs 227.
        return Tiles(192, 128, 16, 2, consumer_warpgroups=3, pingpong=True,
                     intra_wg_overlap=True, why="FA3 hdim64 causal tile: 192x128")
    if head_dim <= 96:
        # FA3 uses 192x144 with P in shared memory; with P in registers 3 warpgroups of 160
        # registers are too few, so 2 warpgroups as for hdim128.
        return Tiles(128, 128, 12, 2, consumer_warpgroups=2, pingpong=pingpong,
                     intra_wg_overlap=True, why="hdim96: 128x128, 2 consumer warpgroups")
    if head_dim <= 128:
        # 128x160 with its own O buffer fills 225 KB (Q 32K + O 32K + 2x(K+V) of 160 rows);
        # FA3's 128x176 fits only with O aliasing Q (see the budget model above). No pingpong: with
        # O's rescale under Q K^T (rescale_under_qk) the two warpgroups overlap better on their own
        # (H200, scripts/lab.py sweep, 2026-11-29, commit 0391f98, non-causal TFLOP/s: s4k 686 without
        # pingpong vs 610 with it, s16k 637 vs 630; FA3 699 / 678).
        bn = 128 if causal else 160
        return Tiles(128, bn, 12, 2, consumer_warpgroups=2, pingpong=False,
                     intra_wg_overlap=True, why="hdim128: 128x160 + own O buffer / causal 128x128")
    if head_dim <= 192:
        return Tiles(128, 112, 12, 2, consumer_warpgroups=2, pingpong=False,
                     intra_wg_overlap=True, why="FA3 hdim192: 128x112")
    # hdim256: 128x80 "hits the limit of smem" (FA3): 64K Q + 2x(K+V) of 80 rows = 224K.
    return Tiles(128, 80, 12, 2, consumer_warpgroups=2, pingpong=False,
                 intra_wg_overlap=True, why="FA3 hdim256: 128x80")


def split_v_tiles(arch: str, head_dim: int, head_dim_v: int, dtype: str, causal: bool, gpu: str) -> Tiles:
    """Tiles of a V narrower than Q and K (head_dim_v < head_dim; not measured on a GPU yet)."""
    tiles = default_tiles(arch, head_dim, dtype, causal, gpu)
    if arch == "sm90" and (head_dim, head_dim_v) == (192, 128):
        # FA3's hdim 192 / hdimV 128 tile (hopper/tile_size.h: 128 x 128 where hdim 192 with V of 192
        # takes 112 keys), O over the V ring as FA3 lays it out: Q 48K + 2 x (K 48K + V 32K) = 208K; an
        # O buffer of its own (32K) would need 241K. Registers: O 64 + S 64 + P 32 (+32) = 192 of 240.
        return Tiles(128, 128, 12, 2, consumer_warpgroups=2, pingpong=False, intra_wg_overlap=True,
                     o_in_v=True, why="FA3 hdim192 hdimV128: 128x128, O over the V ring")
    # Elsewhere head_dim's own tile: V and O narrower than Q and K only take less shared memory and
    # fewer O registers than the tile was chosen for (sm80 hdim 128 / V 64: 128x64, 4 warps, O 64 + S
    # 64 floats a thread; sm90 128 / 64: 128x160 / causal 128x128 with its own O buffer, 168K / 144K).
    return dataclasses.replace(tiles, why=f"{tiles.why}; head_dim_v {head_dim_v}: head_dim {head_dim}'s tile")


def fp8_tiles(head_dim: int, causal: bool) -> Tiles:
    """sm90 e4m3 defaults: FlashAttention-3's tile_size_fwd_sm90 fp8 rows (kernel-facts 2.1; block_n
    adjusted below), 2 stages, intra-warpgroup overlap, no pingpong but at head_dim 64 causal (FA3
    pingpongs fp8 at head_dim >= 128; on the H200, scripts/lab.py sweep 2026-11-29, pingpong off vs on: d128 s8k 802 vs 782 and
    s2k 736 vs 724 at 9f281b1, d128 s2k 697 vs 678 and d256 causal s16k 912 vs 872 at 82f6f54, d256
    s8k 935 vs 948; with pingpong the causal consumers spill at hd128-256). Shared memory: Q + 2 x
    (K + V^T) + 2 x V (row V: the TMA lands V there and the producer transposes it into V^T); O goes
    from registers to global memory."""
    if head_dim <= 64:
        # 192x160: O 32 + S 80 + P 20 + 28 = 160 of 160 registers, no spills (ptxas); on the H200
        # 1-5% over 192x128 at seqlen 2k/16k (sweep, 2026-11-29, docs/perf-notes.md). Pingpong
        # causal: H200, variants taking turns with FA3 (2026-12-01, 1bdb322, TFLOP/s off vs on, FA3)
        # causal s8k 589.3 vs 612.8 (596.7), s16k 620.8 vs 644.7 (638.4); non-causal s16k 654.8 vs
        # 658.8 (658.7), so off there.
        return Tiles(192, 160, 16, 2, consumer_warpgroups=3, pingpong=causal, intra_wg_overlap=True,
                     why="FA3 fp8 hdim64: 192x160")
    if head_dim <= 96:
        return Tiles(192, 128, 16, 2, consumer_warpgroups=3, pingpong=False, intra_wg_overlap=True,
                     why="FA3 fp8 hdim96: 192x128")
    # block_n sets the V^T swizzle (the widest of 128/64/32 bytes dividing block_n): FA3's 224 (hd128)
    # and 160 (hd192) would put V^T in 32B swizzle, which no kernel here has run yet; 192 (FA3's choice
    # for a caller-transposed V) and 128 keep V^T in the 64B/128B swizzles the bf16 kernels use.
    if head_dim <= 128:
        # 128x192: Q 16K + 2 x (K 24K + V^T 24K) + 2 x V 24K = 160K; S 96 + P 24 + O 64 registers.
        return Tiles(128, 192, 12, 2, consumer_warpgroups=2, pingpong=False, intra_wg_overlap=True,
                     why="FA3 fp8 hdim128: 128x224 (192 with V col-major) -> 128x192")
    if head_dim <= 192:
        return Tiles(128, 128, 12, 2, consumer_warpgroups=2, pingpong=False, intra_wg_overlap=True,
                     why="FA3 fp8 hdim192: 128x160 -> 128x128")
    # 128x128 at 24/240: Q 32K + 2 x (K 32K + V^T 32K) (+ 2 x V 32K with the in-kernel V^T) = 160K
    # (224K). With the in-kernel V^T the transposers then have 24 registers and keep two ldmatrix in
    # flight, and the consumers need uniform_wg to fit 240. On the H200 (scripts/lab.py sweep, 2026-11-29,
    # TFLOP/s, 128x96 at 40/232 (the default before) vs 128x128 at 24/240 with uniform_wg,
    # FlashAttention-3 in the same run): s2k 996 / 1098 (F 1137), s8k 994 / 1094 (F 1149), s16k 1015 /
    # 1102 (F 1160), causal s2k 840 / 889 (F 898), s8k 985 / 1050 (F 1176), s16k 1009 / 1096 (F 1217).
    return Tiles(128, 128, 12, 2, consumer_warpgroups=2, pingpong=False, intra_wg_overlap=True,
                 why="FA3 fp8 hdim256: 128x128")


# Sequence-length rules on sm90: tiles that suit the call's length better than the per-head_dim
# defaults (applied by facodegen.ops.api.resolve_spec when the call's shape is known, no tuned entry
# exists and the caller chose none of the rule's fields). First match wins. Each rule's `evidence`
# is a phrase of docs/seqlen-rules.md, where its measurement is (a test finds each one there).
_ANY_LENGTH = 1 << 62


@dataclass(frozen=True)
class SeqlenRule:
    dtypes: tuple[str, ...]
    head_dims: tuple[int, ...]
    causal: bool | None             # None: either
    length: str                     # "seqlen_q" or "seqlen_k": which length the bounds apply to
    low: int                        # the rule applies for low <= length <= high
    high: int
    fields: dict
    evidence: str
    padded: bool | None = None      # True: only head dims that run on a wider tile (112 on 128); None: any

    def matches(self, dtype: str, head_dim: int, causal: bool, seqlen_q: int, seqlen_k: int,
                real_head_dim: int | None = None) -> bool:
        """``head_dim``: the tile's; ``real_head_dim``: the call's (None: the tile's own)."""
        length = seqlen_q if self.length == "seqlen_q" else seqlen_k
        padded = real_head_dim not in (None, head_dim)
        return (dtype in self.dtypes and head_dim in self.head_dims and self.causal in (None, causal)
                and self.padded in (None, padded) and self.low <= length <= self.high)


_16 = ("bf16", "fp16")
_D256 = {"o_in_v": True, "uniform_wg": True, "p_buffers": 2, "rebuild_q_desc": True}
SEQLEN_RULES = (
    SeqlenRule(_16, (128,), None, "seqlen_k", 16384, _ANY_LENGTH, {"block_n": 176},
               "padded head dims on the 128 tile from 16k keys, block_n 176", padded=True),
    SeqlenRule(_16, (96,), None, "seqlen_k", 16384, _ANY_LENGTH, {"block_n": 176},
               "the 96 tile from 16k keys, block_n 176"),
    SeqlenRule(("fp8",), (256,), False, "seqlen_k", 0, 8191, {"stream_k": False, "defer_o_store": False},
               "head_dim 256 non-causal below 8k keys, stream_k off"),
    SeqlenRule(_16, (128,), False, "seqlen_k", 0, 1024, {"block_n": 128},
               "head_dim 128 non-causal, block_n 160 -> 128"),
    SeqlenRule(_16, (128,), False, "seqlen_k", 1025, 4096, {"block_n": 128, "uniform_wg": True, "p_buffers": 2},
               "head_dim 128 non-causal 128 keys from 2k, 144 from 8k"),
    SeqlenRule(_16, (128,), False, "seqlen_k", 4097, _ANY_LENGTH, {"block_n": 144, "uniform_wg": True, "p_buffers": 2},
               "head_dim 128 non-causal 128 keys from 2k, 144 from 8k"),
    SeqlenRule(_16, (128,), True, "seqlen_k", 16384, _ANY_LENGTH, {"block_n": 144, "uniform_wg": True, "p_buffers": 2},
               "head_dim 128 causal from 16k, the non-causal long tile"),
    SeqlenRule(_16, (64,), True, "seqlen_q", 0, 1024, {"consumer_warpgroups": 1, "ctas_per_sm": 3, "block_n": 64},
               "head_dim 64 causal up to 4k queries, three CTAs of one consumer warpgroup per SM"),
    SeqlenRule(_16, (64,), True, "seqlen_q", 1025, 4096, {"consumer_warpgroups": 1, "ctas_per_sm": 3, "block_n": 96},
               "head_dim 64 causal up to 4k queries, three CTAs of one consumer warpgroup per SM"),
    SeqlenRule(_16, (128,), True, "seqlen_q", 0, 1024, {"pingpong": True, "uniform_wg": True},
               "head_dim 128 causal, pingpong on"),
    SeqlenRule(_16, (128,), True, "seqlen_q", 1025, 8192, {"block_n": 128, "pingpong": True, "uniform_wg": True,
                                                            "p_buffers": 2},
               "head_dim 128 causal 2k-8k, pingpong + uniform_wg + p2 at 128 keys"),
    SeqlenRule(_16, (256,), True, "seqlen_q", 0, 1024, {**_D256, "block_n": 64},
               "head_dim 256 causal, block_n 80 -> 64"),
    SeqlenRule(_16, (256,), False, "seqlen_k", 0, 512, {**_D256, "block_n": 64},
               "head_dim 256 non-causal, block_n 80 -> 64"),
    SeqlenRule(_16, (256,), None, "seqlen_k", 0, _ANY_LENGTH, _D256,
               "head_dim 256 everywhere, Q's descriptors rebuilt at each Q K^T"),
)
SEQLEN_RULE_FIELDS = ("block_m", "block_n", "num_warps", "consumer_warpgroups", "o_in_v", "stream_k",
                      "defer_o_store")


def seqlen_rule_fields(arch: str, head_dim: int, dtype: str, causal: bool, seqlen_q: int, seqlen_k: int,
                       real_head_dim: int | None = None) -> dict:
    """The fields of the first SEQLEN_RULES row that matches a call of this shape ({} = the defaults);
    ``head_dim`` is the tile's, ``real_head_dim`` the call's where it runs padded on that tile."""
    if arch != "sm90":
        return {}
    for rule in SEQLEN_RULES:
        if rule.matches(dtype, head_dim, causal, seqlen_q, seqlen_k, real_head_dim):
            return dict(rule.fields)
    return {}


def sm90_cta_register_pool(threads: int, ctas_per_sm: int = 1) -> int:
    """Registers a CTA of ``threads`` owns, the pool setmaxnreg moves registers within: ptxas gives
    a __launch_bounds__(threads, ctas_per_sm) kernel that uses setmaxnreg the most registers per
    thread that ctas_per_sm CTAs leave in the 65536-register file, in steps of 8 (384 threads, one
    CTA: 168, so 64512, not 65536; 256 threads, two CTAs: 128, so 32768)."""
    return min(256, SM90_REG_FILE // (threads * ctas_per_sm) // 8 * 8) * threads


# ctas_per_sm=2 (two CTAs of one consumer warpgroup on an SM: independent tiles, so one CTA's
# prologue and epilogue run under the other's GEMMs) is a knob, default 1. H200, variants taking turns
# (2026-11-29, TFLOP/s default vs 2 CTAs): d64 causal s512 225 vs 221, s1k 299 vs 308, s2k 381 vs 378,
# d64 s512 396 vs 378; d128 causal s512 319 vs 273 (block_n 128, 1 stage, O in Q: what fits twice);
# fp8 d64 causal s2k 411 vs 379. head_dim 256 does not compile (ptxas holds the 128-register launch
# bound at the O wgmma).
# cluster_m's default (sm90 16-bit non-causal: two CTAs of a cluster share each K/V tile, each loading
# half and multicasting it; FlashAttention-3 does this for bf16 head_dim >= 128 non-causal). Off: on the
# H200 (scripts/lab.py sweep, variants taking turns, 2026-11-29, TFLOP/s default vs cluster_m=2; 66 clusters
# resident, all 132 SMs) d128 s512 544 / 536, s2k 690 / 684, s8k 686 / 674 and 682 / 664, s16k 697 /
# 679; d256 s2k 698 / 668 and 673 / 634, s4k 716 / 675, s8k 735 / 683 and 733 / 681 (non-persistent
# 722), s16k 756 / 694. The kernels read K/V at half the L2 traffic but each CTA then waits for the
# slower of the pair at every ring stage.
def register_split(consumer_warpgroups: int, ctas_per_sm: int = 1) -> tuple[int, int]:
    """(producer, consumer) setmaxnreg values, FA3's and ThunderKittens' choices; CTAs sharing an SM
    share the register file: the producer keeps 24 and the consumers split the rest of the CTA's
    pool (two CTAs of one consumer warpgroup: 24 + 232 = 256 x 128 threads; three: 24 + 136)."""
    if ctas_per_sm > 1:
        per_wg = sm90_cta_register_pool(128 * (consumer_warpgroups + 1), ctas_per_sm) // 128
        return 24, (per_wg - 24) // consumer_warpgroups // 8 * 8
    return {1: (56, 256), 2: (24, 240), 3: (32, 160)}[consumer_warpgroups]


@dataclass(frozen=True, kw_only=True)
class KernelSpec:
    """Everything that determines one generated kernel.

    Common knobs: ``arch`` (sm80 | sm90), ``head_dim``, ``dtype`` (fp16 | bf16), ``causal``,
    ``block_m`` x ``block_n`` (the Q and K/V tile heights), ``num_warps`` (warps per CTA),
    ``stages`` (depth of the K/V shared-memory ring), ``gpu`` (whose limits the budget
    model applies: a100, h100, h200), ``lazy_rescale`` (rescale O only when a row max grows by
    more than 2^8; fp8: by more than 2^0.75, the room e4m3 leaves above FlashAttention-3's offset),
    ``softmax_chains`` (independent FMNMX/FADD chains per row in the softmax's row
    max and row sum: shorter dependent chains for a few more instructions), ``poly_exp2_tiles`` (n8
    key tiles of each score fragment, 0 to block_n/8, whose exp2 is a polynomial on the FMA pipe
    instead of MUFU.EX2).

    sm80 (and sm90 with dtype=fp8): ``q_in_regs`` (keep Q fragments in registers instead of
    re-reading shared memory every K/V step; sm90 fp8: Q K^T as a register-A wgmma; off by
    default: FP8_Q_IN_REGS_DEFAULT), ``schedule`` (fa2 | fa1: FlashAttention-1's schedule, in its own
    template), and for schedule=fa1 the switches that each flip one FA1 choice to FA2's:
    ``loop_order`` (kv_outer | q_outer), ``warp_split`` (kv | q), ``rescale`` (every_step | once);
    see FA1_SWITCHES.

    sm90 only: ``consumer_warpgroups`` (block_m = 64 x this), ``pingpong`` (named-barrier
    scheduling between consumer warpgroups), ``intra_wg_overlap`` (issue the next QK^T
    before this step's softmax), ``producer_regs``/``consumer_regs`` (setmaxnreg split),
    ``persistent`` (one CTA per SM with a tile scheduler), ``separate_o`` (the epilogue's O
    staging tile has its own shared-memory buffer instead of aliasing Q; default: on when it
    fits), ``l2_hints`` (TMA loads carry L2 eviction hints: K/V evict-last, Q evict-first),
    ``anchor_softmax`` (keep the softmax, for fp8 its row max pass, ahead of the P V wait),
    ``rescale_under_qk`` (O's rescale between the next Q K^T and P V issues), ``uniform_wg`` (the
    consumer warpgroup index in uniform registers), ``dynamic_scheduler`` (persistent CTAs take their
    tiles after the first from an atomic counter instead of every gridDim.x-th; default: causal, and
    fp8 up to head_dim 128), ``stream_k`` (fp8, persistent with the static scheduler, non-causal:
    the whole waves but one run tile by tile, the rest is cut along the keys into equal shares, one
    per CTA, and a tile split between two CTAs meets in a workspace: no last wave with idle SMs),
    ``ctas_per_sm`` (1 | 2 | 3: CTAs of one consumer
    warpgroup sharing an SM),
    ``optimistic_max`` (a step's exp2s start from the running row max without waiting for a max
    pass; the row sums, for fp8 the max beside them, show when a step must be redone with the true
    max), ``cluster_m`` (1 | 2: two CTAs of a cluster run neighbouring m-blocks of one head and each
    loads half of every K/V tile, multicast to both; 16-bit, non-causal), ``o_in_v`` (16-bit with
    separate_o=False: the O staging tile aliases the V ring instead of Q, FlashAttention-3's
    head_dim-256 layout, so Q is released after the tile's last Q K^T and the next tile's first
    Q K^T runs while the O store reads shared memory; its first V load waits for that store),
    ``q_stages`` (1 | 2 Q buffers: with 2 the producer loads a tile's Q while the consumers still run
    the tile before, so a consumer warpgroup starts its next tile without waiting for that load),
    ``p_buffers`` (1 | 2 P register buffers: with 2 the optimistic softmax writes P into the one the
    running P V does not read), ``rebuild_q_desc`` (Q's wgmma descriptors derived afresh at every
    Q K^T instead of held in registers across the K/V loop: frees ~14-32 registers at head_dim 256),
    ``l2_prefetch`` (0-4: after loading K/V block n the loader asks L2 for block n - l2_prefetch of
    the same tile, a TMA prefetch with no shared memory behind it, so that load finds its lines in L2;
    0 = off).

    dtype=fp8 only (e4m3 Q, K, V; sm90): ``out_dtype`` (bf16 | fp16: the type of O) and ``v_layout``
    (row | transposed: V as (batch, seqlen_k, heads_kv, d), transposed in shared memory by the kernel,
    or V^T as (batch, heads_kv, d, seqlen_k) from the caller), ``vt_in_place`` (v_layout=row: the TMA
    lands each V tile in its V^T ring slot, 32 keys x head_dim at a time in 32-byte rows, and the
    transposers turn every 1 KB block of 32 keys x 32 columns into V^T's 32B-swizzled 32-key slabs in
    place, so no row-major V ring takes shared memory and the K/V ring gets three stages where they
    fit), ``defer_o_store`` (with intra_wg_overlap: a tile's O and LSE stay in registers until the
    next tile's first Q K^T is issued, so the O stores drain while the tensor pipe runs it instead of
    between the two tiles). fp8 stores O from registers, so ``separate_o`` is always False there.
    """

    arch: str = "sm80"
    head_dim: int = 128
    # The problem's head dimension where it is below the tile's (issue 40): KernelSpec(head_dim=80) is
    # head_dim=96 (the tile: shared memory, MMAs, registers) with head_dim_real=80 (columns 80..95 of
    # Q, K, V load as zeros, O's are not stored). Default: head_dim.
    head_dim_real: int | None = None
    # V's and O's head dimension where it differs from Q's and K's (issue 40, part 2; DeepSeek MLA
    # prefill: 192 / 128): the O accumulator, the N of O += P V, the V tiles, the O tile and its stores
    # are head_dim_v wide; S = Q K^T is head_dim deep. Default (None): head_dim.
    head_dim_v: int | None = None
    dtype: str = "bf16"
    causal: bool = False
    block_m: int | None = None
    block_n: int | None = None
    num_warps: int | None = None
    stages: int | None = None
    gpu: str | None = None
    q_in_regs: bool | None = None
    schedule: str = "fa2"
    loop_order: str | None = None
    warp_split: str | None = None
    rescale: str | None = None
    consumer_warpgroups: int | None = None
    pingpong: bool | None = None
    intra_wg_overlap: bool | None = None
    producer_regs: int | None = None
    consumer_regs: int | None = None
    persistent: bool | None = None
    separate_o: bool | None = None
    l2_hints: bool | None = None
    out_dtype: str | None = None
    v_layout: str | None = None
    lazy_rescale: bool | None = None
    anchor_softmax: bool | None = None
    rescale_under_qk: bool | None = None
    softmax_chains: int | None = None
    uniform_wg: bool | None = None
    ctas_per_sm: int | None = None
    poly_exp2_tiles: int | None = None
    optimistic_max: bool | None = None
    cluster_m: int | None = None
    o_in_v: bool | None = None
    q_stages: int | None = None
    p_buffers: int | None = None
    rebuild_q_desc: bool | None = None
    dynamic_scheduler: bool | None = None
    stream_k: bool | None = None
    l2_prefetch: int | None = None
    vt_in_place: bool | None = None
    defer_o_store: bool | None = None
    # Attention variants (problem fields; the values are run-time FlashParams fields): ``local``
    # (sliding window: window_left/window_right), ``softcap`` (c * tanh(s * scale / c), c in
    # softcap_scale), ``sinks`` (one fp32 logit per query head in the softmax denominator).
    local: bool = False
    softcap: bool = False
    sinks: bool = False
    # Packed variable-length sequences (attention_varlen): each tile reads its sequence's first token
    # and length from cu_seqlens (FlashParams' VARLEN_FIELDS); sm80 and sm90 with persistent=False:
    # the grid's z is the sequence; sm90 persistent: the CTAs find the sequences by a warp scan.
    varlen: bool = False
    # sm90 varlen: O of a consumer warpgroup whose 64 rows all lie inside its sequence leaves by a TMA
    # store (the padded kernel's) over the packed tokens; the rows of a sequence's last partial
    # block, row by row (False: every row by row, the store before issue 39's A/B). Default: on.
    varlen_tma_store: bool | None = None
    # sm90 persistent causal varlen: each sequence's tiles longest first over L2-sized groups of its
    # heads (the padded kernel's causal order, per sequence) instead of head by head. Off by default
    # until measured (issue 39).
    varlen_lpt: bool = False

    def __post_init__(self) -> None:
        _check_types(self)
        _check_choice("arch", self.arch, ARCHS)
        _resolve_head_dim(self)
        _check_choice("head_dim", self.head_dim, HEAD_DIMS)
        _check_choice("dtype", self.dtype, DTYPES)
        _check_choice("schedule", self.schedule, SCHEDULES)
        _resolve_fp8(self)
        _resolve_schedule(self)
        if not isinstance(self.causal, bool):
            raise SpecError("causal", f"must be True or False, got {self.causal!r}")
        gpu = self.gpu if self.gpu is not None else DEFAULT_GPU[self.arch]
        _check_choice("gpu", gpu, tuple(GPUS))
        if self.schedule == "fa1":
            tiles = fa1_tiles(self.head_dim, self.warp_split)
        else:
            tiles = default_tiles(self.arch, self.head_dim, self.dtype, self.causal, gpu, self.head_dim_v)
            if self.arch == "sm80" and self.softcap is True and (
                    tiles.block_m * tiles.block_n // tiles.num_warps > 2048
                    or (self.head_dim == 256 and tiles.num_warps == 4 and self.causal)):
                # the tanh pass over 128 S floats a thread (head_dim 64's 128x128, 4 warps, at 254
                # registers without it) spills 20-40 bytes (ptxas, NVRTC 13.0), and so does head_dim
                # 256's causal 64x64 on 4 warps (the H200 budget's tile; 24 bytes, 128 O floats a
                # thread beside the mask and the tanh; 64x32: 242 registers): half the keys per step
                tiles = dataclasses.replace(tiles, block_n=tiles.block_n // 2,
                                            why=tiles.why + "; softcap: block_n halved (no spills)")
        fill = {"gpu": gpu}
        if self.arch == "sm80":
            fill.update(block_m=tiles.block_m, block_n=tiles.block_n, num_warps=tiles.num_warps,
                        stages=tiles.stages, q_in_regs=tiles.q_in_regs, consumer_warpgroups=0,
                        pingpong=False, intra_wg_overlap=False, producer_regs=0,
                        consumer_regs=0, persistent=False, separate_o=False, l2_hints=False, q_stages=1,
                        p_buffers=1, rebuild_q_desc=False)
            fill["anchor_softmax"] = False
            fill["rescale_under_qk"] = False
            fill["uniform_wg"] = False
            fill["optimistic_max"] = False
            fill["dynamic_scheduler"] = False
            fill["stream_k"] = False
            fill["ctas_per_sm"] = 1
            fill["cluster_m"] = 1
            fill["o_in_v"] = False
            fill["l2_prefetch"] = 0
            fill["vt_in_place"] = False
            fill["defer_o_store"] = False
            fill["varlen_tma_store"] = False
            if self.o_in_v not in (None, False, 0):
                raise SpecError("o_in_v", "is an sm90 knob; arch=sm80 writes O from registers")
            if self.cluster_m not in (None, 1):
                raise SpecError("cluster_m", "is an sm90 knob (TMA multicast); arch=sm80 has no clusters")
            if self.ctas_per_sm not in (None, 1):
                raise SpecError("ctas_per_sm", "is an sm90 knob; arch=sm80 runs as many CTAs per SM as fit")
            for name in ("uniform_wg", "consumer_warpgroups", "pingpong", "intra_wg_overlap",
                         "producer_regs", "consumer_regs", "persistent", "separate_o", "l2_hints",
                         "anchor_softmax", "rescale_under_qk", "optimistic_max", "rebuild_q_desc",
                         "dynamic_scheduler", "stream_k", "l2_prefetch", "vt_in_place", "defer_o_store",
                         "varlen_tma_store"):
                if getattr(self, name) not in (None, 0, False):
                    raise SpecError(name, "is an sm90 knob; arch=sm80 does not use it")
        else:
            cwg = self.consumer_warpgroups
            if cwg is None:
                cwg = self.block_m // 64 if self.block_m is not None else tiles.consumer_warpgroups
            _check_choice("consumer_warpgroups", cwg, (1, 2, 3))
            ctas = self.ctas_per_sm if self.ctas_per_sm is not None else 1
            _check_choice("ctas_per_sm", ctas, (1, 2, 3))
            producer, consumer = register_split(cwg, ctas)
            # setmaxnreg moves registers inside the CTA's pool, which holds what the CTA launched
            # with (ptxas: 168 per thread x 384 = 64512 for two consumer warpgroups), not the 65536
            # of the SM: 32 + 2 x 240 asked 1024 more and the second consumer warpgroup's
            # setmaxnreg.inc waited forever. The V transposers (fp8, v_layout=row) keep four
            # ldmatrix in flight with 40 registers and two with 24, so
            # where the consumers fit in 232 the split is 40 + 2 x 232 = 64512 too; head_dim 256 x
            # 128 keys (fp8_tiles) needs 24/240.
            # varlen too: its persistent CTAs number the tiles densely over the sequences in the kernel
            # (scheduler.cuh.j2's warp scan of cu_seqlens_q); persistent=False keeps one CTA per tile
            persistent = True
            if self.dtype == "fp8" and self.v_layout == "row" and cwg == 2:
                block_n = self.block_n if self.block_n is not None else tiles.block_n
                if sm90_consumer_registers(self.head_dim, block_n, self.dtype, bool(self.q_in_regs)) <= 232:
                    producer, consumer = 40, 232
            fill.update(block_m=64 * cwg, block_n=tiles.block_n, num_warps=4 * (cwg + 1),
                        stages=tiles.stages, q_in_regs=self.dtype == "fp8" and FP8_Q_IN_REGS_DEFAULT,
                        consumer_warpgroups=cwg,
                        pingpong=tiles.pingpong and cwg >= 2, intra_wg_overlap=tiles.intra_wg_overlap,
                        producer_regs=producer, consumer_regs=consumer, persistent=persistent,
                        l2_hints=True,
                        # these two defaults give way to each other and to two P buffers (which
                        # need the optimistic step): an explicit value wins
                        anchor_softmax=(anchor_softmax_default(self.head_dim, self.dtype, self.causal)
                                        and not self.optimistic_max and self.p_buffers in (None, 1)),
                        uniform_wg=uniform_wg_default(self.head_dim, self.dtype, self.v_layout, self.causal,
                                                      bool(self.local)),
                        ctas_per_sm=1, cluster_m=1, o_in_v=tiles.o_in_v and self.separate_o is not True,
                        q_stages=1, p_buffers=1,
                        rebuild_q_desc=False, l2_prefetch=0, vt_in_place=False,
                        optimistic_max=((optimistic_max_default(self.head_dim, self.dtype, self.causal)
                                         or self.p_buffers == 2)
                                        and not self.anchor_softmax))
            _coerce_bools(self, ("separate_o", "o_in_v", "l2_hints", "anchor_softmax", "rescale_under_qk", "intra_wg_overlap",
                                 "uniform_wg", "optimistic_max", "rebuild_q_desc", "dynamic_scheduler",
                                 "stream_k", "vt_in_place", "defer_o_store", "varlen_tma_store"))
            overlap = self.intra_wg_overlap if self.intra_wg_overlap is not None else tiles.intra_wg_overlap
            fill["rescale_under_qk"] = bool(overlap) and rescale_under_qk_default(self.head_dim, self.dtype,
                                                                                  self.causal)
            def resolved(name):                              # the caller's value, else the default so far
                return getattr(self, name) if getattr(self, name) is not None else fill.get(name)
            fill["dynamic_scheduler"] = (bool(resolved("persistent")) and not self.stream_k
                                         and dynamic_scheduler_default(self.head_dim, self.dtype, self.causal))
            fill["stream_k"] = (bool(resolved("persistent")) and not resolved("dynamic_scheduler")
                                and self.varlen is not True and not self.local  # (their tiles differ in length)
                                and stream_k_default(self.head_dim, self.dtype, self.causal))
            fill["varlen_tma_store"] = self.varlen is True and self.dtype != "fp8"
            fill["defer_o_store"] = (bool(overlap) and self.varlen is not True     # (varlen stores O at once)
                                     and defer_o_store_default(self.head_dim, self.dtype, self.v_layout, self.causal,
                                                               bool(resolved("q_in_regs"))))
            if self.stages is None and self.dtype == "fp8":
                fill["stages"] = fp8_stages_default(self.head_dim, self.v_layout, resolved("block_m"),
                                                    resolved("block_n"), resolved("q_stages"),
                                                    GPUS[gpu].smem_per_block, tiles.stages,
                                                    bool(self.vt_in_place))
            dims = (resolved("block_m"), resolved("block_n"), resolved("stages"))
            dims_known = all(isinstance(x, int) for x in dims)
            if self.dtype == "fp8":
                if self.separate_o:
                    raise SpecError("separate_o", "dtype=fp8 stores O from registers straight to global "
                                                  "memory (no O tile in shared memory): use separate_o=False")
                fill["separate_o"] = False
            elif self.separate_o is None and (self.o_in_v or (self.o_in_v is None and fill["o_in_v"])):
                fill["separate_o"] = False                  # O has its place in the V ring
            elif self.separate_o is None:
                # Own O buffer exactly when it fits the budget with the other knobs as resolved.
                q_tiles = resolved("q_stages")
                fill["separate_o"] = dims_known and isinstance(q_tiles, int) and _sm90_smem(
                    *dims, self.head_dim, ELEMENT_BYTES[self.dtype], True, q_tiles,
                    self.head_dim_v) <= GPUS[gpu].smem_per_block
            # (varlen with persistent=False: one tile per CTA, no next tile's Q to load early)
            if self.q_stages is None and q_stages_default(self.head_dim, self.dtype, self.causal) == 2 \
                    and not (self.varlen and not resolved("persistent")):
                # two Q tiles where O has a place of its own and both fit, else one
                separate_o = resolved("separate_o") is True
                need = _sm90_smem(*dims, self.head_dim, ELEMENT_BYTES[self.dtype], separate_o, 2,
                                  self.head_dim_v) if dims_known else None
                ctas = resolved("ctas_per_sm") if resolved("ctas_per_sm") in (1, 2, 3) else 1
                fill["q_stages"] = 2 if (need is not None and (separate_o or resolved("o_in_v") is True)
                                         and need <= GPUS[gpu].smem_per_block
                                         and ctas * (need + SM90_CTA_RESERVED_SMEM) <= GPUS[gpu].smem_per_sm) else 1
            if self.q_in_regs and self.dtype != "fp8":
                raise SpecError("q_in_regs", "on sm90 only dtype=fp8 keeps Q in registers (the Q K^T wgmma "
                                             "reads A from registers); the 16-bit kernel reads Q from shared memory")
        # fp8: the lazy max is an exact-max knob (the optimistic step has its own slack), and its
        # skipped rescale is the one after the P V wait (not rescale_under_qk's)
        fp8_exact_after_pv = self.dtype != "fp8" or not (
            (self.optimistic_max if self.optimistic_max is not None else fill.get("optimistic_max"))
            or (self.rescale_under_qk if self.rescale_under_qk is not None else fill.get("rescale_under_qk")))
        fill["lazy_rescale"] = (self.schedule == "fa2" and fp8_exact_after_pv
                                and lazy_rescale_default(self.arch, self.head_dim, self.dtype))
        _coerce_bools(self, ("lazy_rescale",))
        fill["softmax_chains"] = softmax_chains_default(self.arch, self.head_dim, self.dtype, self.causal)
        fill["poly_exp2_tiles"] = POLY_EXP2_TILES_DEFAULT
        for name, value in fill.items():
            if getattr(self, name) is None:
                object.__setattr__(self, name, value)
        _validate(self)

    # ---- derived quantities (computed once, used by templates and the launcher) ----
    @property
    def element_bytes(self) -> int:
        return ELEMENT_BYTES[self.dtype]

    @property
    def threads(self) -> int:
        return 32 * self.num_warps

    @property
    def smem_bytes(self) -> int:
        return smem_bytes(self)

    @property
    def padded(self) -> bool:
        """The problem's head dimension (head_dim_real) is below the tile's (head_dim)."""
        return self.head_dim_real != self.head_dim

    @property
    def split_v(self) -> bool:
        """V and O have a head dimension of their own (head_dim_v != head_dim)."""
        return self.head_dim_v != self.head_dim

    @property
    def variant(self) -> str:
        """Stable readable name: kernel symbol, emitted file and cache entry (knobs.variant)."""
        return knob_registry.variant(self)

    def replace(self, **changes) -> "KernelSpec":
        """A new spec with some knobs changed; defaults are re-derived for the rest.

        Knobs that were only defaults (not given by the caller) are dropped so that a
        change of head_dim, say, picks that head_dim's default tiles."""
        given = {k: v for k, v in self.as_dict().items()
                 if k in ("arch", "head_dim", "dtype", "causal", "gpu", "schedule", "out_dtype", "v_layout",
                          "local", "softcap", "sinks", "varlen")}
        if changes.get("dtype", self.dtype) != "fp8":
            given.pop("out_dtype", None)     # fp8 knobs go when the dtype changes away from fp8
            given.pop("v_layout", None)
        if self.padded and "head_dim" not in changes:
            given["head_dim_real"] = self.head_dim_real     # a new head_dim is a new problem: its own d
        if self.split_v and "head_dim" not in changes:
            given["head_dim_v"] = self.head_dim_v           # (likewise its own d_v)
        given.update(changes)
        if self.schedule == "fa1" and given.get("schedule") == "fa1":
            for name in FA1_SWITCHES:   # the schedule's switches go with it
                given.setdefault(name, getattr(self, name))
        return KernelSpec(**given)

    def as_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def launch_fields(self) -> dict:
        """The spec overrides with which attention() or prepare() runs exactly this spec: every field
        but those the call reads off its tensors and arguments (head_dim, head_dim_real and head_dim_v, dtype,
        causal) and the
        variant switches that are off (window_size, softcap and sinks turn them on, with the sizes and
        values the kernel needs; a switch that is on stays, and the call says what to pass)."""
        return {k: v for k, v in self.as_dict().items()
                if k not in ("head_dim", "head_dim_real", "head_dim_v", "dtype", "causal")
                and not (k in VARIANT_FEATURES and not v)}


# The type of every field (facodegen/spec/knobs.py: TEXT_FIELDS, INT_FIELDS, the rest bools), checked
# first, before any rule reads a field: a value of another type is a SpecError naming the field.
# Text fields take one of their listed values only, so no text a caller (or a tuning-database
# entry) passes reaches the generated source unless the registry lists it.
_REQUIRED = ("arch", "head_dim", "dtype", "causal", "schedule", "local", "softcap", "sinks", "varlen")
assert tuple(GPUS) == GPU_NAMES, "the registry's gpu choices are the budget model's GPUs"


def _check_types(spec: "KernelSpec") -> None:
    """Each field None (a default is chosen; not for the problem fields) or of its type: a listed
    text, an int (not a bool; NumPy integers become ints), a bool (0 and 1, from command lines and
    scripts, become False and True)."""
    import numbers

    for f in dataclasses.fields(spec):
        name, value = f.name, getattr(spec, f.name)
        if value is None:
            if name in _REQUIRED:
                raise SpecError(name, "must be given (it has no default)")
            continue
        if name in TEXT_FIELDS:
            allowed = TEXT_FIELDS[name]
            if type(value) is not str or value not in allowed:
                raise SpecError(name, f"{value!r} is not supported; choose one of {', '.join(allowed)}")
        elif name in INT_FIELDS:
            if isinstance(value, bool) or not isinstance(value, numbers.Integral):
                raise SpecError(name, f"must be an integer, got {value!r} ({type(value).__name__})")
            object.__setattr__(spec, name, int(value))
        elif type(value) is not bool:
            if isinstance(value, numbers.Integral) and not isinstance(value, bool) and value in (0, 1):
                object.__setattr__(spec, name, bool(value))
            else:
                raise SpecError(name, f"must be True or False, got {value!r} ({type(value).__name__})")


def _coerce_bools(spec: "KernelSpec", names) -> None:
    """0/1 (from command lines and scripts) -> False/True for these switches; anything else is left
    for _validate to reject."""
    for name in names:
        value = getattr(spec, name)
        if type(value) is int and value in (0, 1):
            object.__setattr__(spec, name, bool(value))


def fa1_tiles(head_dim: int, warp_split: str) -> Tiles:
    """Default tiles of the fa1 template (one K/V buffer, no ring: stages=1).

    warp_split=kv is FlashAttention-1's own choice (its fmha kernel traits for d<=128: 128 keys
    per K/V block split over 4 warps, Q in 16-row steps): every warp holds all 16 rows, so its O
    partial is 16 x d (d/2 floats a thread). block_n drops to 64 for d>=192 so K, V and the fp32
    exchange buffer fit the A100's 163 KB. warp_split=q: 4 warps x 16 rows, block_n 128 (32 for
    d>=192, where each warp's 16 x d O accumulator already takes d/2 registers)."""
    if warp_split == "kv":
        block_n = 128 if head_dim <= 128 else 64
        return Tiles(16, block_n, 4, 1, why="FA1 fmha: 16-row Q steps, K/V split over 4 warps")
    # d>=192: block_n=64 spills (ptxas, hd256 q_outer); 32 keeps the same 16 keys per warp as kv
    block_n = 128 if head_dim <= 128 else 32
    return Tiles(64, block_n, 4, 1, why="fa1 template, warps split Q: 4 warps x 16 rows")


def _resolve_schedule(spec: "KernelSpec") -> None:
    """Check schedule and the fa1 switches; fill the switches (FA1's choices for schedule=fa1,
    FA2's for schedule=fa2 and for sm90, which accept nothing else)."""
    if spec.arch != "sm80" and spec.schedule != "fa2":
        raise SpecError("schedule", f"schedule={spec.schedule} is an sm80 schedule; arch={spec.arch} runs "
                                    f"its own (FlashAttention-3) schedule: use schedule=fa2 or arch=sm80")
    for name, choices in FA1_SWITCHES.items():
        value = getattr(spec, name)
        if value is not None:
            _check_choice(name, value, choices)
        if spec.schedule == "fa1":
            fill = FA1_CHOICES[name]
        else:
            fill = FA2_CHOICES[name]
            if value is not None and value != fill:
                where = "arch=sm90" if spec.arch != "sm80" else "schedule=fa2"
                raise SpecError(name, f"{name}={value} is a knob of the fa1 schedule; {where} always uses "
                                      f"{name}={fill}: set schedule=fa1 (arch=sm80) to flip it")
        if value is None:
            object.__setattr__(spec, name, fill)
    if spec.schedule == "fa1":
        if spec.stages not in (None, 1):
            raise SpecError("stages", f"stages={spec.stages}: the fa1 template has one K and one V buffer "
                                      f"(no ring); use stages=1")
        if spec.q_in_regs:
            raise SpecError("q_in_regs", "the fa1 template reads Q from shared memory; use q_in_regs=False")


def fa1_exchange_bytes(spec: "KernelSpec") -> int:
    """fp32 shared memory of warp_split=kv: per warp a BLOCK_M x d O partial plus the row max and
    row sum of its keys, and two per-row factors (the O update of loop_order=kv_outer)."""
    if spec.schedule != "fa1" or spec.warp_split != "kv":
        return 0
    return 4 * (spec.num_warps * spec.block_m * (spec.head_dim + 2) + 2 * spec.block_m)


def _resolve_fp8(spec: "KernelSpec") -> None:
    """dtype=fp8 needs arch=sm90 and takes out_dtype / v_layout (defaults bf16 / row); the 16-bit
    types resolve them to their only values (O in the input dtype, V row-major), and their kernels
    do not mention them (render.context leaves them out of the header)."""
    if spec.dtype != "fp8":
        for name, only in (("out_dtype", spec.dtype), ("v_layout", "row")):
            value = getattr(spec, name)
            if value is not None and value != only:
                raise SpecError(name, f"{name}={value!r} is an fp8 knob (dtype=fp8); dtype={spec.dtype} writes O "
                                      f"in {spec.dtype} and takes V as (batch, seqlen_k, heads_kv, head_dim)")
            object.__setattr__(spec, name, only)
        return
    if spec.arch != "sm90":
        raise SpecError("dtype", f"dtype=fp8 (e4m3) runs on the FP8 tensor cores of sm90 (H100/H200) only; "
                                 f"arch={spec.arch} has none: use arch=sm90 or dtype=bf16")
    if spec.out_dtype is None:
        object.__setattr__(spec, "out_dtype", "bf16")
    if spec.v_layout is None:
        object.__setattr__(spec, "v_layout", "row")
    _check_choice("out_dtype", spec.out_dtype, OUT_DTYPES)
    _check_choice("v_layout", spec.v_layout, V_LAYOUTS)


def _resolve_head_dim(spec: "KernelSpec") -> None:
    """head_dim, head_dim_real and head_dim_v (_resolve_head_dim_tile, then _resolve_head_dim_v)."""
    _resolve_head_dim_tile(spec)
    _resolve_head_dim_v(spec)


def _resolve_head_dim_v(spec: "KernelSpec") -> None:
    """head_dim_v: None, or the problem's head dimension (head_dim_real), is head_dim (the same); any
    other value must be one the kernels take with this head_dim (knobs.head_dim_v_problem)."""
    value = spec.head_dim_v
    if value is None or value in (spec.head_dim, spec.head_dim_real):
        object.__setattr__(spec, "head_dim_v", spec.head_dim)
        return
    why = head_dim_v_problem(value, spec.head_dim, spec.head_dim_real)
    if why is not None:
        raise SpecError("head_dim_v", why)


def _resolve_head_dim_tile(spec: "KernelSpec") -> None:
    """head_dim and head_dim_real: a head_dim outside HEAD_DIMS (a multiple of 8 in [8, 256]) becomes
    head_dim_real on the tile of tile_head_dim(head_dim); head_dim_real defaults to head_dim and may
    not exceed it."""
    head_dim, real = spec.head_dim, spec.head_dim_real
    if real is None or (real == head_dim and head_dim not in HEAD_DIMS):
        why = head_dim_problem(head_dim)
        if why is not None:
            raise SpecError("head_dim", why)
        object.__setattr__(spec, "head_dim_real", head_dim)
        object.__setattr__(spec, "head_dim", tile_head_dim(head_dim))
        return
    why = head_dim_problem(real)
    if why is not None:
        raise SpecError("head_dim_real", why)
    if head_dim in HEAD_DIMS and real > head_dim:
        raise SpecError("head_dim_real", f"head_dim_real={real} exceeds the tile's head_dim={head_dim}: use "
                                         f"head_dim={tile_head_dim(real)} (or leave head_dim_real out)")


def padded_tile(head_dim) -> tuple:
    """(head_dim, head_dim_real) of a spec given ``head_dim`` and no head_dim_real (the backward's and the
    decode's; KernelSpec's _resolve_head_dim_tile also refuses what is no head dim): a multiple of 8 in
    [8, 256] outside HEAD_DIMS is head_dim_real on tile_head_dim's tile; anything else stays as given (the
    spec's own checks name what is wrong with it)."""
    if (isinstance(head_dim, int) and not isinstance(head_dim, bool) and head_dim not in HEAD_DIMS
            and head_dim_problem(head_dim) is None):
        return tile_head_dim(head_dim), head_dim
    return head_dim, head_dim


def check_padded_tile(head_dim: int, head_dim_real: int) -> None:
    """A head_dim_real below the tile's head_dim (the backward's and the decode's): a head dim of its own
    whose tile is head_dim, else a SpecError naming head_dim_real."""
    why = head_dim_problem(head_dim_real)
    if why is not None or tile_head_dim(head_dim_real) != head_dim:
        raise SpecError("head_dim_real", why or f"{head_dim_real} runs on the head_dim {tile_head_dim(head_dim_real)} "
                                                f"tile, not {head_dim}")


def _check_split_v(spec: "KernelSpec") -> None:
    """head_dim_v != head_dim: the 16-bit fa2 forward (sm80, sm90; varlen too)."""
    if not spec.split_v:
        return
    what = f"head_dim_v={spec.head_dim_v} (head_dim={spec.head_dim})"
    if spec.dtype == "fp8":
        raise SpecError("head_dim_v", f"{what}: the fp8 kernel takes V and O of head_dim columns only; use "
                                      f"dtype=bf16/fp16 or head_dim_v=head_dim")
    if spec.schedule == "fa1":
        raise SpecError("head_dim_v", f"{what}: schedule=fa1 takes V and O of head_dim columns only; use schedule=fa2")


def _check_padded(spec: "KernelSpec") -> None:
    """head_dim_real < head_dim: the fa2 forward (sm80, sm90; fp8 on sm90; varlen too) pads its tiles."""
    if not spec.padded:
        return
    what = f"head_dim={spec.head_dim_real} (on the head_dim {spec.head_dim} tile)"
    if spec.dtype == "fp8" and spec.head_dim_real % 16:
        raise SpecError("head_dim", f"{what}: an e4m3 row is head_dim bytes and TMA moves whole 16-byte chunks; "
                                    "fp8 takes a multiple of 16 (or dtype=bf16/fp16)")
    if spec.vt_in_place:
        raise SpecError("vt_in_place", f"{what}: the in-place V^T boxes are whole 32-column blocks of the tile; "
                                       "use vt_in_place=False")
    if spec.schedule == "fa1":
        raise SpecError("head_dim", f"{what}: schedule=fa1 takes head_dim {', '.join(map(str, HEAD_DIMS))} only; "
                                    f"use schedule=fa2")


def _check_choice(name: str, value, allowed) -> None:
    if value not in allowed or isinstance(value, bool) != isinstance(allowed[0], bool):
        raise SpecError(name, f"{value!r} is not supported; choose one of {', '.join(map(str, allowed))}")


def smem_bytes(spec: KernelSpec) -> int:
    """Dynamic shared memory one CTA needs, in bytes (see the module docstring)."""
    e = spec.element_bytes
    q_tile = spec.block_m * spec.head_dim * e
    # (sm80: a V tile keeps K's rows of head_dim columns, of which head_dim_v are loaded)
    kv_ring = spec.stages * 2 * spec.block_n * spec.head_dim * e
    if spec.arch == "sm80":
        return q_tile + kv_ring + fa1_exchange_bytes(spec)
    if spec.dtype == "fp8":
        return fp8_smem(spec.block_m, spec.block_n, spec.stages, spec.head_dim, spec.v_layout, spec.q_stages,
                        spec.vt_in_place)
    return _sm90_smem(spec.block_m, spec.block_n, spec.stages, spec.head_dim, e, spec.separate_o, spec.q_stages,
                      spec.head_dim_v)


def _sm90_smem(block_m: int, block_n: int, stages: int, head_dim: int, e: int, separate_o: bool,
               q_stages: int = 1, head_dim_v: int | None = None) -> int:
    """sm90: ``q_stages`` Q tiles, O tile when separate_o, K and V rings, barriers + alignment slack
    (V and O ``head_dim_v`` wide, default head_dim)."""
    head_dim_v = head_dim if head_dim_v is None else head_dim_v
    q_tile = block_m * head_dim * e
    o_tile = block_m * head_dim_v * e if separate_o else 0
    return q_stages * q_tile + o_tile + stages * block_n * (head_dim + head_dim_v) * e + SM90_BARRIER_BYTES


def fp8_smem(block_m: int, block_n: int, stages: int, head_dim: int, v_layout: str, q_stages: int = 1,
             vt_in_place: bool = False) -> int:
    """sm90 fp8 (1 byte/element): ``q_stages`` Q tiles, ``stages`` K and V^T tiles, with v_layout=row
    also ``stages`` V tiles as the TMA writes them (the producer transposes each into V^T; not with
    vt_in_place, where V lands in its V^T slot), barriers + alignment. O has no tile: it goes from
    registers to global memory."""
    tile = block_n * head_dim
    v_raw = stages * tile if v_layout == "row" and not vt_in_place else 0
    return q_stages * block_m * head_dim + stages * 2 * tile + v_raw + SM90_BARRIER_BYTES


def register_estimate(spec: KernelSpec) -> int:
    """Live 32-bit registers per (consumer) thread; see the module docstring."""
    if spec.arch == "sm80" and spec.schedule == "fa1" and spec.warp_split == "kv":
        # every warp holds all block_m rows of its block_n/num_warps keys
        o_acc = spec.block_m * spec.head_dim // 32
        s_acc = spec.block_m * (spec.block_n // spec.num_warps) // 32
        return o_acc + s_acc + REG_OVERHEAD["sm80"]
    if spec.arch == "sm90":
        return sm90_consumer_registers(spec.head_dim, spec.block_n, spec.dtype, spec.q_in_regs, spec.p_buffers,
                                       spec.head_dim_v)
    threads, rows = spec.threads, spec.block_m
    o_acc = rows * spec.head_dim_v // threads
    s_acc = rows * spec.block_n // threads
    q_frag = rows * spec.head_dim // threads // 2 if spec.q_in_regs else 0
    return o_acc + s_acc + q_frag + REG_OVERHEAD["sm80"]


def sm90_consumer_registers(head_dim: int, block_n: int, dtype: str, q_in_regs: bool = False,
                            p_buffers: int = 1, head_dim_v: int | None = None) -> int:
    """register_estimate for an sm90 consumer thread (a warpgroup of 128 threads owns 64 rows):
    O (head_dim_v wide, default head_dim) and S accumulators, ``p_buffers`` x P (16-bit pairs: half
    of S; e4m3: a quarter), with q_in_regs (fp8) Q's A fragments (64 rows x head_dim bytes over 128
    threads), and the overhead."""
    o_acc = 64 * (head_dim if head_dim_v is None else head_dim_v) // 128
    s_acc = 64 * block_n // 128
    p_frag = s_acc // 4 if dtype == "fp8" else s_acc // 2
    q_frag = head_dim // 8 if q_in_regs else 0
    return o_acc + s_acc + p_buffers * p_frag + q_frag + REG_OVERHEAD["sm90-fp8" if dtype == "fp8" else "sm90"]


def _check_variants(spec: KernelSpec) -> None:
    """local / softcap / sinks: the fa2 schedule of sm80 and the sm90 kernels (16-bit and fp8) have them."""
    for name in ("local", "softcap", "sinks"):
        if not getattr(spec, name):
            continue
        if spec.schedule == "fa1":
            raise SpecError(name, f"schedule=fa1 has no attention variants: use schedule=fa2 or {name}=False")
    if spec.local and spec.cluster_m != 1:
        raise SpecError("cluster_m", "local (sliding window) m-blocks see different key ranges, so two CTAs "
                                     "cannot share their K/V loads: use cluster_m=1")


def _check_varlen(spec: KernelSpec) -> None:
    """varlen: the fa2 schedule of sm80 and the 16-bit sm90 kernel, with the attention variants too
    (window, softcap, sinks: the window in each sequence's own bottom-right frame, as the kernels take
    each tile's lengths from cu_seqlens). sm90: persistent (the default:
    one CTA per SM, the tiles numbered densely over (sequence, head, m_block) by a warp scan of
    cu_seqlens_q in the kernel, scheduler.cuh.j2) or not (the grid is sequences x heads x
    max_seqlen_q's m-blocks and a tile past its sequence's end leaves at once); no stream-K and no
    cluster (two m-blocks of a cluster may belong to sequences of other lengths); O is stored by TMA
    where a consumer warpgroup's 64 rows lie inside the sequence (varlen_tma_store, the default), else
    row by row (a TMA box would run into the next sequence)."""
    if not spec.varlen:
        return
    if spec.arch == "sm80" and spec.schedule != "fa2":
        raise SpecError("varlen", "schedule=fa1 has no varlen kernel: use schedule=fa2")
    if spec.arch == "sm90":
        if spec.dtype == "fp8":
            # fp8: V as given (row-major, transposed in shared memory), O stored at once from registers
            if spec.v_layout != "row" or spec.vt_in_place:
                raise SpecError("v_layout", "fp8 varlen takes V as the packed (total_k, heads_kv, head_dim) tokens: "
                                            "use v_layout='row' and vt_in_place=False")
            if spec.defer_o_store:
                raise SpecError("defer_o_store", "fp8 varlen stores each tile's O at its end: use "
                                                 "defer_o_store=False")
            if spec.l2_prefetch:
                raise SpecError("l2_prefetch", "the fp8 varlen kernel has no L2 prefetch: use l2_prefetch=0")
        if spec.stream_k:
            raise SpecError("stream_k", "varlen tiles differ in length (stream-K cuts equal shares of equal "
                                        "tiles): use stream_k=False")
        if spec.cluster_m != 1:
            raise SpecError("cluster_m", "varlen: the two m-blocks of a cluster may lie in sequences of other "
                                         "lengths, so they cannot share K/V loads: use cluster_m=1")


def _check_varlen_lpt(spec: KernelSpec) -> None:
    """varlen_lpt reorders the tiles the persistent sm90 varlen kernel numbers by its warp scan, and
    only causal tiles differ in length."""
    if not spec.varlen_lpt:
        return
    if spec.arch != "sm90" or not spec.varlen or not spec.persistent:
        raise SpecError("varlen_lpt", "orders the tiles of the persistent sm90 varlen kernel (its warp scan): "
                                      "it needs arch=sm90, varlen=True and persistent=True")
    if not spec.causal:
        raise SpecError("varlen_lpt", "orders causal tiles by their length (non-causal tiles of a sequence are "
                                      "all as long): it needs causal=True")


def _validate(spec: KernelSpec) -> None:
    limits = GPUS[spec.gpu]
    _check_padded(spec)
    _check_split_v(spec)
    _check_variants(spec)
    _check_varlen(spec)
    _check_varlen_lpt(spec)
    if not isinstance(spec.lazy_rescale, bool):
        raise SpecError("lazy_rescale", f"must be True or False, got {spec.lazy_rescale!r}")
    if spec.lazy_rescale and spec.dtype == "fp8" and (spec.optimistic_max or spec.rescale_under_qk):
        raise SpecError("lazy_rescale", "dtype=fp8 keeps a stale row max within 2^0.75 of the true one on the exact "
                                        "step, with O rescaled after the P V wait: it needs optimistic_max=False "
                                        "and rescale_under_qk=False")
    if spec.lazy_rescale and spec.schedule == "fa1":
        raise SpecError("lazy_rescale", "schedule=fa1 rescales by its own rule (the rescale switch): "
                                        "use lazy_rescale=False")
    if spec.softmax_chains not in SOFTMAX_CHAINS or isinstance(spec.softmax_chains, bool):
        raise SpecError("softmax_chains", f"must be one of {', '.join(map(str, SOFTMAX_CHAINS))}, "
                                          f"got {spec.softmax_chains!r}")
    for name in ("block_m", "block_n", "num_warps", "stages"):
        value = getattr(spec, name)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise SpecError(name, f"must be a positive integer, got {value!r}")
    tiles = spec.block_n // 8
    if not isinstance(spec.poly_exp2_tiles, int) or isinstance(spec.poly_exp2_tiles, bool) \
            or not 0 <= spec.poly_exp2_tiles <= tiles:
        raise SpecError("poly_exp2_tiles", f"must be an integer from 0 to block_n/8 = {tiles} (n8 key tiles of "
                                           f"a score fragment), got {spec.poly_exp2_tiles!r}")
    if spec.poly_exp2_tiles and spec.schedule == "fa1":
        raise SpecError("poly_exp2_tiles", "schedule=fa1 has its own softmax (MUFU.EX2 only): use poly_exp2_tiles=0")
    if spec.arch == "sm80":
        if spec.num_warps not in (1, 2, 4, 8, 16):
            raise SpecError("num_warps", f"num_warps={spec.num_warps} must be 1, 2, 4, 8 or 16")
        if spec.schedule == "fa1" and spec.warp_split == "kv":
            # every warp owns all rows and block_n/num_warps keys (whole k16 slabs of P V)
            if spec.block_m % 16:
                raise SpecError("block_m", f"block_m={spec.block_m} must be a multiple of 16 (warp_split=kv)")
            keys = 16 * spec.num_warps
            if spec.block_n % keys or not 16 <= spec.block_n <= 256:
                raise SpecError("block_n", f"block_n={spec.block_n} must be a multiple of 16*num_warps={keys} "
                                           f"in [16, 256] (warp_split=kv: each warp takes whole 16-key slabs)")
        else:
            rows = 16 * spec.num_warps
            if spec.block_m % rows:
                raise SpecError("block_m", f"block_m={spec.block_m} must be a multiple of 16*num_warps={rows}")
        if spec.block_n % 16 or not 16 <= spec.block_n <= 256:
            raise SpecError("block_n", f"block_n={spec.block_n} must be a multiple of 16 in [16, 256]")
        if spec.block_m > 256:
            raise SpecError("block_m", f"block_m={spec.block_m} must be at most 256")
        if not 1 <= spec.stages <= 4:
            raise SpecError("stages", f"stages={spec.stages} must be 1 to 4")
        regs = register_estimate(spec)
        if regs > SM80_MAX_REGS:
            raise SpecError("block_m", (
                f"block_m={spec.block_m} x block_n={spec.block_n} with {spec.num_warps} warps needs about "
                f"{regs} registers per thread (O, S, P{' and Q' if spec.q_in_regs else ''} fragments), over "
                f"the {SM80_MAX_REGS} limit: lower block_m or block_n, or raise num_warps"))
    else:
        if spec.block_m != 64 * spec.consumer_warpgroups:
            raise SpecError("block_m", (
                f"block_m={spec.block_m} must be 64*consumer_warpgroups={64 * spec.consumer_warpgroups} "
                f"(each consumer warpgroup owns 64 rows of the Q tile)"))
        if spec.num_warps != 4 * (spec.consumer_warpgroups + 1):
            raise SpecError("num_warps", (
                f"num_warps={spec.num_warps} must be 4*(consumer_warpgroups+1)={4 * (spec.consumer_warpgroups + 1)} "
                f"on sm90 (one producer warpgroup plus the consumers)"))
        if spec.block_n % 16 or not 16 <= spec.block_n <= 256:
            raise SpecError("block_n", f"block_n={spec.block_n} must be a multiple of 16 in [16, 256] (wgmma N, TMA box)")
        if spec.dtype == "fp8" and spec.block_n % 32:
            raise SpecError("block_n", f"block_n={spec.block_n} must be a multiple of 32 for dtype=fp8 (the P V "
                                       f"wgmma reduces over keys in k32 steps)")
        if not 1 <= spec.stages <= 4:
            raise SpecError("stages", f"stages={spec.stages} must be 1 to 4")
        for name in ("separate_o", "o_in_v", "l2_hints", "anchor_softmax", "rescale_under_qk", "uniform_wg",
                     "optimistic_max", "rebuild_q_desc", "dynamic_scheduler", "stream_k", "vt_in_place",
                     "defer_o_store", "varlen_tma_store"):
            if not isinstance(getattr(spec, name), bool):
                raise SpecError(name, f"must be True or False, got {getattr(spec, name)!r}")
        if spec.dynamic_scheduler and not spec.persistent:
            raise SpecError("dynamic_scheduler", "hands tiles to persistent CTAs: it needs persistent=True")
        _check_stream_k(spec)
        if spec.vt_in_place and (spec.dtype != "fp8" or spec.v_layout != "row"):
            raise SpecError("vt_in_place", "transposes a row-major V tile in its own V^T slot: it needs "
                                           "dtype=fp8 and v_layout=row")
        if spec.varlen_tma_store and not spec.varlen:
            raise SpecError("varlen_tma_store", "stores the O rows of a varlen kernel's whole blocks by TMA: it needs "
                                                "varlen=True (the padded kernel stores all of O by TMA anyway)")
        if spec.defer_o_store and (spec.dtype != "fp8" or not spec.intra_wg_overlap):
            raise SpecError("defer_o_store", "keeps O in registers until the next tile's first Q K^T of the "
                                             "overlapped loop is issued: it needs dtype=fp8 (O stored from "
                                             "registers) and intra_wg_overlap=True")
        if not isinstance(spec.l2_prefetch, int) or isinstance(spec.l2_prefetch, bool) \
                or not 0 <= spec.l2_prefetch <= 4:
            raise SpecError("l2_prefetch", f"must be an integer from 0 (off) to 4 K/V blocks ahead, "
                                           f"got {spec.l2_prefetch!r}")
        if spec.optimistic_max and spec.anchor_softmax:
            raise SpecError("optimistic_max", "writes P while no P V is in flight, so there is no wait for "
                                              "anchor_softmax to hold back: use anchor_softmax=False")
        if spec.rescale_under_qk and not spec.intra_wg_overlap:
            raise SpecError("rescale_under_qk", "moves O's rescale under the next Q K^T of the overlapped loop: "
                                                "it needs intra_wg_overlap=True")
        if spec.pingpong and spec.consumer_warpgroups < 2:
            raise SpecError("pingpong", "pingpong needs consumer_warpgroups >= 2")
        for name in ("producer_regs", "consumer_regs"):
            value = getattr(spec, name)
            if value % 8 or not 24 <= value <= 256:
                raise SpecError(name, f"{name}={value} must be a multiple of 8 in [24, 256] (setmaxnreg)")
        total = 128 * (spec.producer_regs + spec.consumer_warpgroups * spec.consumer_regs)
        pool = sm90_cta_register_pool(spec.num_warps * 32, spec.ctas_per_sm)
        if total > pool:
            raise SpecError("consumer_regs", (
                f"128*(producer_regs={spec.producer_regs} + {spec.consumer_warpgroups}*consumer_regs="
                f"{spec.consumer_regs}) = {total} registers exceed the CTA's setmaxnreg pool of {pool} "
                f"({spec.num_warps * 32} threads launched with {pool // (spec.num_warps * 32)} registers each"
                f"{f', {spec.ctas_per_sm} CTAs per SM' if spec.ctas_per_sm > 1 else ''}): "
                f"setmaxnreg.inc would wait forever"))
        _check_cluster(spec)
        _check_o_in_v(spec)
        _check_q_stages(spec)
        _check_p_buffers(spec)
        if spec.rebuild_q_desc and spec.q_in_regs:
            raise SpecError("rebuild_q_desc", "with q_in_regs=True Q K^T reads Q from registers (no Q descriptor): "
                                              "use rebuild_q_desc=False")
        regs = register_estimate(spec)
        if regs > spec.consumer_regs:
            raise SpecError("block_n", (
                f"block_n={spec.block_n} with head_dim={spec.head_dim} needs about {regs} registers per "
                f"consumer thread, over consumer_regs={spec.consumer_regs}: lower block_n"))
    if spec.arch == "sm80" and spec.q_stages != 1:
        raise SpecError("q_stages", f"sm80 kernels keep one Q tile: use q_stages=1, got {spec.q_stages!r}")
    if spec.arch == "sm80" and spec.p_buffers != 1:
        raise SpecError("p_buffers", f"is an sm90 knob (the wgmma P V reads P from registers); use p_buffers=1, "
                                     f"got {spec.p_buffers!r}")
    need = smem_bytes(spec)
    if need > limits.smem_per_block:
        raise SpecError("stages", (
            f"the tiles need {need} bytes of shared memory (block_m={spec.block_m}, block_n={spec.block_n}, "
            f"stages={spec.stages}, head_dim={spec.head_dim}"
            f"{f', head_dim_v={spec.head_dim_v}' if spec.split_v else ''}), over the {limits.smem_per_block} bytes one block "
            f"may use on {spec.gpu}: lower stages, block_n or block_m"
            + (", or set separate_o=False (O aliases Q)" if spec.arch == "sm90" and spec.separate_o else "")
            + (", or use q_stages=1" if spec.q_stages == 2 else "") + ")"))
    if spec.arch == "sm90" and spec.ctas_per_sm > 1:
        per_sm = spec.ctas_per_sm * (need + SM90_CTA_RESERVED_SMEM)
        if per_sm > limits.smem_per_sm:
            raise SpecError("ctas_per_sm", (
                f"{spec.ctas_per_sm} CTAs per SM need {spec.ctas_per_sm} x ({need} + {SM90_CTA_RESERVED_SMEM} reserved) = {per_sm} bytes of "
                f"shared memory, over the {limits.smem_per_sm} of an SM on {spec.gpu}: lower stages or "
                f"block_n{', set separate_o=False' if spec.separate_o else ''}, or use ctas_per_sm=1"))


def _check_stream_k(spec: KernelSpec) -> None:
    """stream_k: each persistent CTA computes its share of the last waves itself (static order)."""
    if not spec.stream_k:
        return
    if spec.dtype != "fp8":
        raise SpecError("stream_k", "splits tiles in the fp8 kernel only (the 16-bit epilogue stores O through "
                                    "shared memory): use stream_k=False")
    if spec.causal or spec.local:
        raise SpecError("stream_k", f"cuts equal shares of equal tiles; {'causal' if spec.causal else 'window'} "
                                    "tiles differ in length: use stream_k=False")
    if not spec.persistent or spec.dynamic_scheduler:
        raise SpecError("stream_k", "needs persistent=True with the static scheduler (dynamic_scheduler=False): "
                                    "each CTA computes its share from its index")


def _check_o_in_v(spec: KernelSpec) -> None:
    """o_in_v: the O staging tile (block_m x head_dim) lies over the V ring's stages."""
    if not spec.o_in_v:
        return
    if spec.dtype == "fp8":
        raise SpecError("o_in_v", "the fp8 kernel stores O from registers (no O tile): use o_in_v=False")
    if spec.separate_o:
        raise SpecError("o_in_v", "O has its own buffer with separate_o=True: use one of the two")
    if spec.stages * spec.block_n < spec.block_m:
        raise SpecError("o_in_v", f"the O tile ({spec.block_m} rows) does not fit in the V ring ({spec.stages} "
                                  f"stages x {spec.block_n} rows): raise stages or block_n, or use o_in_v=False")


def _check_p_buffers(spec: KernelSpec) -> None:
    """p_buffers=2: the optimistic softmax of the overlapped loop writes P into the buffer the running
    P V does not read, so it runs under that P V instead of after it."""
    _check_choice("p_buffers", spec.p_buffers, (1, 2))
    if spec.p_buffers == 2 and not (spec.intra_wg_overlap and spec.optimistic_max):
        raise SpecError("p_buffers", "a second P buffer lets the optimistic softmax run under the P V of the "
                                     "overlapped loop: it needs intra_wg_overlap=True and optimistic_max=True")


def _check_q_stages(spec: KernelSpec) -> None:
    """q_stages=2: two Q buffers taking turns by tile, so O cannot alias Q (16-bit: separate_o or o_in_v)."""
    _check_choice("q_stages", spec.q_stages, (1, 2))
    if spec.q_stages == 2 and spec.dtype != "fp8" and not (spec.separate_o or spec.o_in_v):
        raise SpecError("q_stages", "with two Q buffers the O staging tile cannot alias Q: set separate_o=True "
                                    "or o_in_v=True, or use q_stages=1")


def _check_cluster(spec: KernelSpec) -> None:
    """cluster_m=2: both CTAs of a cluster must visit the same K/V blocks in the same order (so not
    causal, whose m-blocks see different key ranges) and each loads half of a tile's rows, which must
    start on the 8-row (1024-byte) period of the swizzle."""
    _check_choice("cluster_m", spec.cluster_m, (1, 2))
    if spec.cluster_m == 1:
        return
    if spec.dtype == "fp8":
        raise SpecError("cluster_m", "the fp8 kernel has no multicast K/V loads: use cluster_m=1")
    if spec.causal:
        raise SpecError("cluster_m", "causal m-blocks see different key ranges, so two CTAs cannot share their "
                                     "K/V loads: use cluster_m=1")
    if spec.ctas_per_sm != 1:
        raise SpecError("cluster_m", "cluster_m=2 runs one CTA per SM: use ctas_per_sm=1")
    if (spec.block_n // spec.cluster_m) % 8:
        raise SpecError("block_n", f"block_n={spec.block_n} must be a multiple of {8 * spec.cluster_m} with "
                                   f"cluster_m={spec.cluster_m} (each CTA loads block_n/{spec.cluster_m} rows, a whole "
                                   f"number of 8-row swizzle periods)")


def default_spec(arch: str = "sm80", head_dim: int = 128, dtype: str = "bf16", causal: bool = False,
                 gpu: str | None = None) -> KernelSpec:
    return KernelSpec(arch=arch, head_dim=head_dim, dtype=dtype, causal=causal, gpu=gpu)


def default_specs() -> list[KernelSpec]:
    """Every shipped default: the set generated/ holds and CI compiles."""
    return [KernelSpec(arch=a, head_dim=d, dtype=t, causal=c)
            for a in ARCHS for d in HEAD_DIMS for t in DTYPES_16 for c in (False, True)]


def default_fp8_specs() -> list[KernelSpec]:
    """The sm90 e4m3 defaults (both V layouts, O in bf16): what tests/test_fp8.py compiles."""
    return [KernelSpec(arch="sm90", head_dim=d, dtype="fp8", causal=c, v_layout=layout)
            for d in HEAD_DIMS for c in (False, True) for layout in V_LAYOUTS]
