"""Decode kernels (issue #39, slice 1): the specs, knobs, names, argument structs and defaults of
the split-KV decode kernel, its combine kernel and the KV-cache append kernel.

Three small frozen specs, each the only input to its template (templates/decode/):

* ``DecodeSpec``  -> ``flash_decode.cu.j2``: attention of a few query rows per sequence (seqlen_q
  1..16, GQA-packed: the query heads of one KV head share the M tile) over a contiguous or paged
  KV cache of per-sequence length, the keys of a sequence optionally split across CTAs (``split``:
  partial O and LSE in fp32 to a workspace). mma.sync + cp.async on both archs: decode is
  memory-bound, and the sm80 instruction set streams K/V at full bandwidth on an H200 too.
* ``CombineSpec`` -> ``flash_combine.cu.j2``: merges the splits' partial O by their LSE (or, with
  ``DecodeSpec.fused_combine``, the decode kernel's last split CTA of each work item merges them
  itself; both through ``decode/combine.cuh.j2``'s ``combine_row``).
* ``AppendSpec``  -> ``flash_append.cu.j2``: writes new k/v tokens into the cache in place.

Knobs are declared as data (``DECODE_KNOBS``, the registry's ``Knob`` type): type, values, flag,
variant-name token, one line of doc; the type checks, the variant name and the CLI flags of
``facodegen emit --kernel decode`` come from it. ``default_decode_spec`` (a pure function, one
comment per branch) and ``num_splits_heuristic`` choose what a call runs.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace

from .knobs import Knob, head_dim_problem
from ..runtime.params import Field, pack_fields, place, stride_fields
from . import SpecError, check_padded_tile, padded_tile

DECODE_ARCHS = ("sm80", "sm90")
DECODE_DTYPES = ("fp16", "bf16")
DECODE_HEAD_DIMS = (64, 96, 128, 192, 256)
MAX_SEQLEN_Q = 16                   # query tokens per sequence the decode path takes (issue #39)
MAX_SPLITS = 128                    # FA3's cap on num_splits
# A split call merges its partials in the decode kernel's last split CTA (one launch, not two: 1.14x
# at batch 1 / 32k keys on the H200, 1.01-1.03x on larger caches); fused_combine=False: the combine kernel.
FUSED_COMBINE_DEFAULT = True

# Shared memory a block may use, per arch (the A100's and the H100/H200's opt-in maxima).
SMEM_LIMIT = {"sm80": 166912, "sm90": 232448}
# Accumulator floats one thread may hold for O (M_SLABS x HEAD_DIM / 8 x 4): 128 leaves room for
# S, the fragments and the addresses under 255 registers with no spills (ptxas reports, tests).
MAX_O_FLOATS = 128
# S (this warp's keys) and O accumulator floats together: 160 compiles without spills (d64 x 64 rows x
# 16 keys a warp, d128 x 32 rows, d256 x 16 rows); d64 x 64 rows x 32 keys a warp (192) spilled.
MAX_ACC_FLOATS = 160
O_PAD_FLOATS = 8                    # row padding of the fp32 O exchange tile (bank-conflict-free float2 stores)


def _spec_error(message: str, field: str) -> SpecError:
    return SpecError(field, message)


def _tok(fmt):
    return lambda spec, value: fmt.format(value)


def _flag(token):
    return lambda spec, value: token if value else None


DECODE_KNOBS: tuple[Knob, ...] = (
    Knob("arch", "text", "Target: sm80 (compiled for sm_80) or sm90 (the same mma.sync kernel compiled for sm_90a).",
         choices=DECODE_ARCHS, flag="--arch", problem=True, token=_tok("flash_decode_{}")),
    Knob("dtype", "text", "Element type of q, the cache and O.", choices=DECODE_DTYPES, flag="--dtype",
         problem=True, token=_tok("{}")),
    Knob("head_dim", "int", "Head dimension d of the kernel's tiles: 64, 96, 128, 192, 256 (any other multiple of 8 "
         "in [8, 256] runs on the next one's tile: DecodeSpec(head_dim=80) is the 96 tile with head_dim_real=80).",
         choices=DECODE_HEAD_DIMS, flag="--head-dim", problem=True, flag_offers_choices=False, token=_tok("hd{}")),
    Knob("head_dim_real", "int", "The problem's head dimension d when below the tile's: q, K and V chunks past it "
         "load as zeros, O's (and the split partials') are never written.", flag="--head-dim-real", problem=True,
         flag_offers_choices=False, token=lambda s, v: f"d{v}" if v != s.head_dim else None),
    Knob("block_m", "int", "Packed query rows per CTA (seqlen_q x query heads of one KV head), a multiple of 16.",
         choices=(16, 32, 64), flag="--block-m", token=_tok("bm{}")),
    Knob("block_n", "int", "Keys per K/V ring stage; each warp takes block_n / num_warps of them.",
         choices=(32, 64, 128, 256), flag="--block-n", token=_tok("bn{}")),
    Knob("num_warps", "int", "Warps per CTA; they split the keys of a stage and merge through shared memory.",
         choices=(2, 4, 8), flag="--warps", token=_tok("w{}")),
    Knob("stages", "int", "Depth of the cp.async K/V ring (stages - 1 in flight under the math).",
         choices=(2, 3, 4, 5, 6), flag="--stages", token=_tok("st{}")),
    Knob("pack_gqa", "bool", "The query heads of one KV head share the M tile (each K/V byte read once per group).",
         flag="--pack-gqa/--no-pack-gqa", token=_flag("pack")),
    Knob("split", "bool", "Keys split across CTAs: fp32 partial O and LSE to a workspace, merged by the combine kernel.",
         flag="--split-kv/--no-split-kv", token=_flag("split")),
    Knob("fused_combine", "bool", "split: the last split CTA of each work item (an int32 counter per item) merges "
         "the splits itself, with no combine kernel.", flag="--fused-combine/--no-fused-combine",
         token=_flag("fused")),
    Knob("paged", "bool", "Paged KV cache (num_pages, page_size, heads_kv, d) read through a page table.",
         flag="--paged/--contiguous", problem=True, token=_flag("paged")),
    # The attention variants the decode takes (issue 40: the window combines with a paged cache): switches
    # of the kernel, their values (window sizes, the softcap c) run-time DecodeParams fields.
    Knob("local", "bool", "Sliding window: query i sees keys i' - window_left .. i' + window_right (i' on its "
         "bottom-right diagonal); blocks wholly left of every row's window are not read.", flag="--local/--no-local",
         problem=True, token=_flag("local")),
    Knob("softcap", "bool", "Logit softcap c*tanh(s*scale/c) before the softmax (c run-time).",
         flag="--softcap/--no-softcap", problem=True, token=_flag("softcap")),
    Knob("producer_warps", "int", "sm90: warps that only copy Q and the K/V stages (cp.async arriving on an mbarrier "
         "per stage) while the num_warps math warps compute; 0: every warp copies its share between steps. Default: "
         "default_producer_warps (4 at head_dim 256, 2 at 128 without a split).",
         choices=(0, 1, 2, 4), flag="--producer-warps", token=lambda spec, value: f"pw{value}" if value else None),
)
# Knobs that appear in a generated file's header and `facodegen emit` line only when on, so the
# kernels without them render as they did before the knob existed (byte for byte).
SHOWN_WHEN_ON = ("fused_combine", "local", "softcap", "producer_warps")
# The ring's mbarriers with producer warps (a full and an empty barrier per stage, 8 bytes each): static
# shared memory beside the dynamic Q tile and ring.
BARRIER_BYTES_PER_STAGE = 16


def _check_fields(spec, knobs) -> None:
    """Types and domains of every knob, each error naming the knob (the registry's values)."""
    for knob in knobs:
        value = getattr(spec, knob.name)
        if knob.kind == "bool":
            if value not in (True, False) or isinstance(value, float):
                raise _spec_error(f"{knob.name}={value!r}: must be True or False", knob.name)
            object.__setattr__(spec, knob.name, bool(value))
        elif knob.kind == "int":
            if isinstance(value, bool) or not isinstance(value, int):
                if hasattr(value, "__index__") and not isinstance(value, bool):
                    object.__setattr__(spec, knob.name, int(value))
                    value = int(value)
                else:
                    raise _spec_error(f"{knob.name}={value!r}: must be an integer", knob.name)
            if knob.choices and value not in knob.choices:
                raise _spec_error(f"{knob.name}={value}: choose one of {', '.join(map(str, knob.choices))}",
                                knob.name)
        elif value not in knob.choices:
            raise _spec_error(f"{knob.name}={value!r}: choose one of {', '.join(knob.choices)}", knob.name)


def _check_any_head_dim(head_dim: int) -> None:
    """A head dimension the combine and append kernels take: any multiple of 8 in [8, 256] (no tile)."""
    why = head_dim_problem(head_dim)
    if why is not None:
        raise _spec_error(f"head_dim {why}", "head_dim")


def _variant(spec, knobs) -> str:
    parts = [knob.token(spec, getattr(spec, knob.name)) for knob in knobs if knob.token]
    return "_".join(p for p in parts if p)


@dataclass(frozen=True, kw_only=True)
class DecodeSpec:
    """One decode kernel. Problem: arch, dtype, head_dim, paged. Knobs: block_m (packed query rows),
    block_n (keys per ring stage), num_warps (split the keys of a stage), stages (ring depth),
    pack_gqa, split, fused_combine (split only: the last split CTA of a work item merges the
    splits, no combine kernel). Constraints, each a SpecError naming the knob to change:
    block_n % (16 * num_warps) == 0 (a warp takes whole k16 slices of P V); block_m * head_dim / 32
    <= MAX_O_FLOATS (the O accumulator fits in registers); the Q tile plus the ring (or the O exchange
    after the loop) fits the arch's shared memory."""
    arch: str = "sm90"
    dtype: str = "bf16"
    head_dim: int = 128
    head_dim_real: int | None = None
    block_m: int = 16
    block_n: int = 64
    num_warps: int = 4
    stages: int = 3
    pack_gqa: bool = True
    split: bool = False
    fused_combine: bool = False
    paged: bool = False
    local: bool = False
    softcap: bool = False
    producer_warps: int = 0

    def __post_init__(self):
        if self.head_dim_real is None:   # head_dim=80: the 96 tile, padded (the forward's KernelSpec too)
            tile, real = padded_tile(self.head_dim)
            object.__setattr__(self, "head_dim", tile)
            object.__setattr__(self, "head_dim_real", real)
        _check_fields(self, DECODE_KNOBS)
        if self.padded:
            check_padded_tile(self.head_dim, self.head_dim_real)
        if self.producer_warps and self.padded:
            raise _spec_error(f"producer_warps at head_dim {self.head_dim_real} (the {self.head_dim} tile, padded): "
                              f"a producer warp copies whole rows of the tile; use producer_warps=0", "producer_warps")
        if self.producer_warps and self.arch != "sm90":
            raise _spec_error(f"producer_warps={self.producer_warps} on {self.arch}: the math warps wait for a stage "
                              f"with mbarrier.try_wait (sm90); use arch='sm90' or producer_warps=0", "producer_warps")
        if self.producer_warps and self.head_dim not in (64, 128, 256):
            raise _spec_error(f"producer_warps at head_dim {self.head_dim}: a producer warp copies whole rows of 16-byte "
                              f"chunks with every lane (head_dim 64, 128 or 256); use producer_warps=0",
                              "producer_warps")
        if self.fused_combine and not self.split:
            raise _spec_error("fused_combine=True without split: there are no splits to combine; set split=True "
                              "(--split-kv) or drop fused_combine", "fused_combine")
        if self.block_n % (16 * self.num_warps):
            raise _spec_error(f"block_n={self.block_n} with num_warps={self.num_warps}: each warp takes whole "
                            f"16-key slices, so block_n must be a multiple of {16 * self.num_warps}", "block_n")
        if self.block_m * self.head_dim // 32 > MAX_O_FLOATS:
            most = MAX_O_FLOATS * 32 // self.head_dim
            raise _spec_error(f"block_m={self.block_m} at head_dim {self.head_dim}: the O accumulator would take "
                            f"{self.block_m * self.head_dim // 32} floats per thread (at most {MAX_O_FLOATS}); "
                            f"use block_m <= {most}", "block_m")
        held = self.block_m // 16 * (self.block_n // self.num_warps + self.head_dim) // 2
        if held > MAX_ACC_FLOATS:
            raise _spec_error(f"block_m={self.block_m}, block_n={self.block_n}, num_warps={self.num_warps}: the S "
                              f"and O accumulators would take {held} floats per thread (at most {MAX_ACC_FLOATS}); "
                              f"lower block_n or block_m", "block_n")
        if self.smem_bytes + self.static_smem_bytes > SMEM_LIMIT[self.arch]:
            raise _spec_error(f"stages={self.stages}, block_n={self.block_n}: {self.smem_bytes} bytes of shared "
                            f"memory, more than {self.arch}'s {SMEM_LIMIT[self.arch]}; lower stages or block_n",
                            "stages")

    @property
    def kernel(self) -> str:
        return "decode"

    @property
    def padded(self) -> bool:
        """The problem's head dimension is below the tile's (head_dim_real < head_dim)."""
        return self.head_dim_real != self.head_dim

    # What common/softmax.cuh.j2 reads: the plain exact step (decode is bound by the K/V read, not
    # by the softmax, so none of the forward's softmax tricks is switched on).
    lazy_rescale = property(lambda self: False)
    optimistic_max = property(lambda self: False)
    softmax_chains = property(lambda self: 1)
    poly_exp2_tiles = property(lambda self: 0)

    @property
    def threads(self) -> int:
        return 32 * (self.num_warps + self.producer_warps)

    @property
    def static_smem_bytes(self) -> int:
        """The ring's mbarriers (producer_warps only), outside smem_bytes (the dynamic size a launch asks for)."""
        return BARRIER_BYTES_PER_STAGE * self.stages if self.producer_warps else 0

    @property
    def q_tile_bytes(self) -> int:
        return self.block_m * self.head_dim * 2

    @property
    def stage_bytes(self) -> int:
        """One ring stage: a K tile and a V tile of block_n rows."""
        return 2 * self.block_n * self.head_dim * 2

    @property
    def exchange_bytes(self) -> int:
        """After the loop, aliasing the ring: each warp's fp32 O (padded rows), row max and row sum."""
        return self.num_warps * self.block_m * (self.head_dim + O_PAD_FLOATS + 2) * 4

    @property
    def smem_bytes(self) -> int:
        return self.q_tile_bytes + max(self.stages * self.stage_bytes, self.exchange_bytes)

    # The forward's sinks switch, read by the shared templates (common/mask, common/softmax): off here
    # (flash_attn_with_kvcache has no sinks).
    sinks = False

    @property
    def variant(self) -> str:
        return _variant(self, DECODE_KNOBS)

    def as_dict(self) -> dict:
        return asdict(self)


COMBINE_KNOBS: tuple[Knob, ...] = (
    Knob("dtype", "text", "Element type of O.", choices=DECODE_DTYPES, flag="--dtype", problem=True,
         token=_tok("flash_combine_{}")),
    Knob("head_dim", "int", "Head dimension d (any multiple of 8 in [8, 256]: the partials are d wide).",
         flag="--head-dim", problem=True, flag_offers_choices=False, token=_tok("hd{}")),
    Knob("num_warps", "int", "Warps per CTA; one output row (batch, query, head) per warp.", choices=(4, 8),
         flag="--warps", token=lambda s, v: None if v == 4 else f"w{v}"),
)


@dataclass(frozen=True, kw_only=True)
class CombineSpec:
    """The split-KV combine: O = sum_s exp(lse_s - lse) O_s, lse = log sum_s exp(lse_s), per row.
    Arch-neutral code (plain loads and stores), compiled for the device's target."""
    dtype: str = "bf16"
    head_dim: int = 128
    num_warps: int = 4
    arch: str = "sm80"

    def __post_init__(self):
        _check_fields(self, COMBINE_KNOBS)
        _check_any_head_dim(self.head_dim)
        if self.arch not in DECODE_ARCHS:
            raise _spec_error(f"arch={self.arch!r}: choose one of {', '.join(DECODE_ARCHS)}", "arch")

    kernel = property(lambda self: "combine")
    threads = property(lambda self: 32 * self.num_warps)
    smem_bytes = property(lambda self: 0)
    variant = property(lambda self: _variant(self, COMBINE_KNOBS))

    def as_dict(self) -> dict:
        return asdict(self)


APPEND_KNOBS: tuple[Knob, ...] = (
    Knob("dtype", "text", "Element type of the cache.", choices=DECODE_DTYPES, flag="--dtype", problem=True,
         token=_tok("flash_append_{}")),
    Knob("head_dim", "int", "Head dimension d (any multiple of 8 in [8, 256]: rows of whole 16-byte chunks).",
         flag="--head-dim", problem=True, flag_offers_choices=False, token=_tok("hd{}")),
    Knob("paged", "bool", "Paged KV cache.", flag="--paged/--contiguous", problem=True, token=_flag("paged")),
)


@dataclass(frozen=True, kw_only=True)
class AppendSpec:
    """Writes k/v (batch, seqlen_new, heads_kv, d) into the cache at cache_seqlens[b] + i (16-byte
    copies; rows past the cache's capacity are dropped, never written out of bounds)."""
    dtype: str = "bf16"
    head_dim: int = 128
    paged: bool = False
    arch: str = "sm80"

    def __post_init__(self):
        _check_fields(self, APPEND_KNOBS)
        _check_any_head_dim(self.head_dim)
        if self.arch not in DECODE_ARCHS:
            raise _spec_error(f"arch={self.arch!r}: choose one of {', '.join(DECODE_ARCHS)}", "arch")

    kernel = property(lambda self: "append")
    threads = property(lambda self: 128)
    smem_bytes = property(lambda self: 0)
    variant = property(lambda self: _variant(self, APPEND_KNOBS))

    def as_dict(self) -> dict:
        return asdict(self)


# ------------------------------------------------------------------ defaults (pure functions)

def rows_per_tile(seqlen_q: int, group: int, pack_gqa: bool) -> int:
    """Packed query rows of one (batch, KV head) work item: seqlen_q x the query heads it packs."""
    return seqlen_q * (group if pack_gqa else 1)


def default_decode_spec(arch: str, dtype: str, head_dim: int, *, seqlen_q: int = 1, group: int = 1,
                        paged: bool = False, split: bool = False, pack_gqa: bool | None = None,
                        **knobs) -> DecodeSpec:
    """The decode kernel a call runs (the caller's knobs win).

    Bandwidth (Little's law): an H200 streams ~4.0 TB/s (measured copy) with a loaded DRAM latency of
    roughly 0.6-0.8 us, so ~4e12 B/s x 0.8e-6 s = 3.2 MB must be in flight, ~24 KB per SM over 132
    SMs. A CTA keeps stages - 1 ring stages of 2 x block_n x d x 2 bytes in flight while it computes
    on one; the defaults keep 64-96 KB in flight per CTA (96-128 KB rings: 2.5-5x the estimate, a
    margin for the combine, the tail of a split and latency spikes under load), two CTAs per SM
    wherever the ring is <= 96 KB, one where sm90 reads a contiguous cache at d64 and d128 (128 KB).
    16-byte cp.async per thread, rows read whole (coalesced).
    """
    if pack_gqa is None:
        pack_gqa = group > 1            # packing is free at group 1 and the point of GQA otherwise
    head_dim, real = padded_tile(head_dim)      # (a padded head_dim: the next tile's defaults)
    rows = rows_per_tile(seqlen_q, group, pack_gqa)
    most_m = MAX_O_FLOATS * 32 // head_dim
    block_m = 16
    while block_m < rows and block_m * 2 <= min(most_m, 64):
        block_m *= 2                    # one M tile per work item where the O registers allow
    # d <= 64: 128 keys a stage (a warp's 32 keys make two k16 P V slices); wider heads: 64 keys,
    # so a stage stays 32-64 KB and a ring of 2-4 stages fits twice per H200 SM (d <= 128).
    block_n = 128 if head_dim <= 64 and block_m <= 32 else 64   # (d64 x 64 rows: S and O would not fit)
    stage = 2 * knobs.get("block_n", block_n) * head_dim * 2    # (the ring of the caller's block_n)
    # sm90, a contiguous cache: ~128 KB of ring (d64 4, d96 4, d128 4, d192/d256 2 stages; split_stages
    # deepens d256's to 3 on long splits), so d64 and d128 hold one CTA per SM (the split heuristic
    # takes half the splits), whose 4 stages in flight read faster than two CTAs of 3 where the wave
    # is short. A paged cache (and sm80, not measured with more): ~96 KB (d64 3, d96 4, d128 3), two
    # CTAs per SM: its loads wait on page-table reads, and one CTA's producer issues too few.
    # H200, 2026-12-04 (session 35, calls 8-9, bench_decode, TB/s 3 stages -> 4): batch 1, 32k keys,
    # GQA 32/8, d128 3.34 -> 3.59 and 3.31 -> 3.42, d64 2.56 -> 2.87; the other contiguous cells of
    # batch 1/8 x 8k/32k/256k x GQA 32/8, MHA 32/32 at d128 0.97-1.03x (noise); paged 64 at d128
    # 3.27 -> 3.17 (b1 32k) down to 4.36 -> 3.30 (b1 256k MHA), 0.75-0.99x.
    stages = max(2, min(4, ((128 if arch == "sm90" and not paged else 96) * 1024) // stage))
    fields = {"arch": arch, "dtype": dtype, "head_dim": head_dim, "head_dim_real": real, "block_m": block_m,
              "block_n": block_n, "num_warps": 4, "stages": stages, "pack_gqa": pack_gqa, "split": split,
              "fused_combine": split and FUSED_COMBINE_DEFAULT, "paged": paged,
              "producer_warps": default_producer_warps(arch, real, split)}
    fields.update(knobs)
    return DecodeSpec(**fields)


def default_producer_warps(arch: str, head_dim: int, split: bool) -> int:
    """producer_warps' default: sm90 at head_dim 256, 4 warps; at head_dim 128 without a split, 2; else 0
    (``head_dim``: the problem's, so a padded one, whose tile rows a producer warp does not copy, takes none).
    H200, 2026-12-05 (session 43, `pending_gpu.sh producer`, bench_decode.py: batch 1/8/64, 32k keys, GQA
    32/8, pages of 16/64/256 and contiguous; each knob over the default of 0 warps, in the same run):
    - head_dim 256, 4 warps: 1.15-1.37x with pages of 16, 1.02-1.24x of 64, 1.00-1.17x of 256, 1.00-1.03x
      contiguous (one warp copies too few: 0.41-0.86x, and two 1.00-1.19x);
    - head_dim 128, 2 warps: 1.02-1.14x at batch 64 (no split), 0.98-1.01x where the keys are split
      (batch 1 and 8), where 4 warps run 0.86-0.96x with pages;
    - head_dim 64: 0.96-1.03x either way (two CTAs an SM already keep its loads in flight)."""
    if arch != "sm90":
        return 0
    if head_dim == 256:
        return 4
    return 2 if head_dim == 128 and not split else 0


def split_stages(spec: DecodeSpec, blocks_per_split: int, knobs: dict, page_size: int = 0) -> int:
    """The ring depth of a call whose splits each take ``blocks_per_split`` key blocks: the spec's, except
    sm90 at head_dim 256 (64 KB stages, so default_decode_spec's ring holds 2, one in flight), which takes
    3 (a 192 KB ring) where a split has at least 32 blocks (2k keys), the cache is contiguous or its
    pages hold whole blocks (``page_size`` >= block_n), and the caller set neither stages nor block_n.
    H200, 2026-12-04 (session 36, calls 3 and 4, `bench_decode.py --d 256` with a stages column, the
    full d256 grid, two versions of the paged loads; 3 stages over 2, geomean): under 16 blocks a split
    0.90-0.92x (the deeper prologue does not pay on a short split), 16-127 blocks 1.00-1.04x, over 1 GB
    of K+V contiguous 1.025x / 1.013x, pages of 64 1.075x / 1.038x, of 256 1.086x / 1.070x; pages of 16
    (4 pages a block) 1.049x / 0.941x, so they keep 2."""
    if (spec.arch == "sm90" and spec.head_dim == 256 and blocks_per_split >= 32
            and (not spec.paged or page_size >= spec.block_n)
            and "stages" not in knobs and "block_n" not in knobs):
        return 3
    return spec.stages


def ctas_per_sm(spec: DecodeSpec, smem_per_sm: int = 233472, regs_per_thread: int = 128) -> int:
    """Decode CTAs an SM holds (shared memory and registers; 1 KB reserved per CTA)."""
    by_smem = smem_per_sm // (spec.smem_bytes + spec.static_smem_bytes + 1024)
    by_regs = 65536 // (regs_per_thread * spec.threads)
    return max(1, min(by_smem, by_regs, 32 // spec.num_warps))


def num_splits_heuristic(work_items: int, n_blocks: int, sms: int, ctas_per_sm: int = 1,
                         max_splits: int = MAX_SPLITS) -> int:
    """Number of key splits for ``work_items`` = batch x KV heads (x M tiles) CTAs of ``n_blocks``
    key blocks each (from the cache's capacity: nothing data-dependent), on ``sms`` SMs holding
    ``ctas_per_sm`` decode CTAs each, over CTA slots:
    - enough work items to fill >= 0.8 of the slots already: no split (a split costs a combine);
    - work items for at most half the slots: the split count that fills one wave, floor(slots /
      work_items) (up to n_blocks and max_splits): each split's keys, and so the wave's time, shrink
      with every split added while the wave stays one. H200, 2026-12-04, batch 1, GQA 32/8, d128
      (8 work items, 264 slots): 33 splits 1.06-1.08x the 29 of the rule below at 8k, 32k and 256k keys;
    - otherwise FlashAttention-3's rule (hopper/heuristics.h): the smallest split count, up to
      min(max_splits, slots, n_blocks), whose wave efficiency (waves / ceil(waves)) is >= 0.85 of
      the best one's.
    FA3's "<= 4 key blocks: no split" rule is left out: it starves MQA and small-GQA decode of
    CTAs (flash-attention PR #2445); here a split only needs one key block."""
    if work_items < 1 or n_blocks < 1 or sms < 1:
        return 1
    slots = sms * max(1, ctas_per_sm)
    if work_items >= 0.8 * slots:
        return 1
    if slots // work_items >= 2:
        return max(1, min(slots // work_items, n_blocks, max_splits))
    most = max(1, min(max_splits, slots, n_blocks))
    efficiency = []
    for splits in range(1, most + 1):
        waves = work_items * splits / slots
        efficiency.append(waves / math.ceil(waves))
    best = max(efficiency)
    for splits, eff in enumerate(efficiency, start=1):
        if eff >= 0.85 * best:
            # keep every split non-empty for the longest sequence (n_blocks) as well
            return min(splits, n_blocks)
    return 1


# ------------------------------------------------------------------ kernel arguments

def _ptr(name, ctype, doc):
    return Field(name, "ptr", ctype, doc)


def _i64(name, doc):
    return Field(name, "i64", "long long", doc)


def _i32(name, doc):
    return Field(name, "i32", "int", doc)


# Pointers first (a launch patches them in place; DECODE_CALL_POINTERS is their order).
DECODE_FIELDS = [
    _ptr("q", "const elem_t*", "Q (batch, seqlen_q, heads_q, head_dim)"),
    _ptr("k_cache", "const elem_t*", "K cache (batch, capacity, heads_kv, d) or pages (num_pages, page_size, heads_kv, d)"),
    _ptr("v_cache", "const elem_t*", "V cache, as k_cache"),
    _ptr("o", "elem_t*", "O (batch, seqlen_q, heads_q, head_dim) (not split)"),
    _ptr("lse", "float*", "LSE (batch, heads_q, seqlen_q) float32 (not split)"),
    _ptr("o_partial", "float*", "split: fp32 O (num_splits, batch, seqlen_q, heads_q, d), normalised per split"),
    _ptr("lse_partial", "float*", "split: fp32 LSE (num_splits, batch, heads_q, seqlen_q)"),
    _ptr("cache_seqlens", "const int*", "keys already in the cache per sequence (batch,) int32"),
    _ptr("page_table", "const int*", "paged: (batch, max_pages) int32 page of each page_size keys"),
    *stride_fields("q"), *stride_fields("k", "page"), *stride_fields("v", "page"), *stride_fields("o"),
    _i64("page_table_stride", "page_table stride between sequences, in elements"),
    _i32("batch", "sequences"),
    _i32("seqlen_q", "query tokens per sequence"),
    _i32("heads_q", "query heads"),
    _i32("heads_kv", "key/value heads"),
    _i32("group", "heads_q / heads_kv"),
    _i32("causal", "1: bottom-right causal per sequence (query i sees keys <= seqlen_k - seqlen_q + i); 0: none"),
    _i32("rows_per_item", "packed query rows of one work item: seqlen_q x (group if PACK_GQA else 1)"),
    _i32("num_m_blocks", "ceil(rows_per_item / BLOCK_M)"),
    _i32("num_splits", "key splits per work item (1 without SPLIT)"),
    _i32("seqlen_new", "new tokens appended per sequence before attention (keys = cache_seqlens + seqlen_new)"),
    _i32("capacity", "keys the cache holds per sequence: seqlen of the cache, or max_pages x page_size"),
    _i32("num_pages", "pages in the paged cache (page indices are clamped into [0, num_pages))"),
    _i32("page_shift", "log2(page_size) (paged)"),
    Field("softmax_scale", "f32", "float", "scale applied to Q K^T"),
    Field("scale_log2", "f32", "float", "softmax_scale * log2(e)"),
]
# LOCAL / SOFTCAP kernels only, after the others (a kernel without them keeps its struct).
DECODE_VARIANT_FIELDS = [
    _i32("window_left", "LOCAL: query i sees keys from i + seqlen_k - seqlen_q - window_left"),
    _i32("window_right", "LOCAL: .. to i + seqlen_k - seqlen_q + window_right (0: causal)"),
    Field("softcap_scale", "f32", "float", "SOFTCAP: S = tanh(S * softcap_scale), softcap_scale = scale / c; "
          "softmax_scale is then c"),
]
DECODE_CALL_POINTERS = ("q", "k_cache", "v_cache", "o", "lse", "o_partial", "lse_partial", "cache_seqlens",
                        "page_table")
# fused_combine: one more call pointer, right after the others (a kernel without it keeps its struct).
DECODE_FUSED_FIELDS = [*DECODE_FIELDS[:len(DECODE_CALL_POINTERS)],
                       _ptr("split_counters", "int*", "fused_combine: int32 arrivals per work item (batch, heads, "
                            "M tile), 0 between launches"),
                       *DECODE_FIELDS[len(DECODE_CALL_POINTERS):]]
DECODE_FUSED_CALL_POINTERS = (*DECODE_CALL_POINTERS, "split_counters")

COMBINE_FIELDS = [
    _ptr("o_partial", "const float*", "fp32 O (num_splits, batch, seqlen_q, heads_q, d)"),
    _ptr("lse_partial", "const float*", "fp32 LSE (num_splits, batch, heads_q, seqlen_q)"),
    _ptr("o", "elem_t*", "O (batch, seqlen_q, heads_q, head_dim)"),
    _ptr("lse", "float*", "LSE (batch, heads_q, seqlen_q) float32"),
    *stride_fields("o"),
    _i32("batch", "sequences"),
    _i32("seqlen_q", "query tokens per sequence"),
    _i32("heads_q", "query heads"),
    _i32("num_splits", "splits to merge"),
]
COMBINE_CALL_POINTERS = ("o_partial", "lse_partial", "o", "lse")

APPEND_FIELDS = [
    _ptr("k_new", "const elem_t*", "new keys (batch, seqlen_new, heads_kv, d)"),
    _ptr("v_new", "const elem_t*", "new values, as k_new"),
    _ptr("k_cache", "elem_t*", "K cache, written in place"),
    _ptr("v_cache", "elem_t*", "V cache, written in place"),
    _ptr("cache_seqlens", "const int*", "keys already in the cache per sequence (batch,) int32"),
    _ptr("page_table", "const int*", "paged: (batch, max_pages) int32"),
    *stride_fields("kn"), *stride_fields("vn"), *stride_fields("k", "page"), *stride_fields("v", "page"),
    _i64("page_table_stride", "page_table stride between sequences, in elements"),
    _i32("batch", "sequences"),
    _i32("seqlen_new", "new tokens per sequence"),
    _i32("heads_kv", "key/value heads"),
    _i32("capacity", "keys the cache holds per sequence"),
    _i32("num_pages", "pages in the paged cache"),
    _i32("page_shift", "log2(page_size) (paged)"),
]
APPEND_CALL_POINTERS = ("k_new", "v_new", "k_cache", "v_cache", "cache_seqlens", "page_table")

# Argument structs by name: a kernel's (spec.kernel), "decode_fused" for a fused_combine decode, and
# either with "_variants" for a decode with a window or softcap.
FIELDS = {"decode": DECODE_FIELDS, "decode_fused": DECODE_FUSED_FIELDS,
          "decode_variants": DECODE_FIELDS + DECODE_VARIANT_FIELDS,
          "decode_fused_variants": DECODE_FUSED_FIELDS + DECODE_VARIANT_FIELDS,
          "combine": COMBINE_FIELDS, "append": APPEND_FIELDS}
CALL_POINTERS = {"decode": DECODE_CALL_POINTERS, "decode_fused": DECODE_FUSED_CALL_POINTERS,
                 "decode_variants": DECODE_CALL_POINTERS, "decode_fused_variants": DECODE_FUSED_CALL_POINTERS,
                 "combine": COMBINE_CALL_POINTERS, "append": APPEND_CALL_POINTERS}


def args_of(spec) -> str:
    """The argument struct (a key of FIELDS) of a spec's kernel."""
    name = "decode_fused" if getattr(spec, "fused_combine", False) else spec.kernel
    return name + "_variants" if getattr(spec, "local", False) or getattr(spec, "softcap", False) else name


def layout(kernel: str) -> tuple[tuple[tuple[Field, int], ...], int, int]:
    """[(field, offset)], size and alignment of an argument struct (a key of FIELDS; params.place)."""
    return place(FIELDS[kernel])


def pack(kernel: str, values: dict) -> bytes:
    return pack_fields(FIELDS[kernel], values, f"{kernel} arguments")


def _check_pointer_order() -> None:
    for kernel, names in CALL_POINTERS.items():
        offsets = {f.name: off for f, off in layout(kernel)[0]}
        assert [offsets[n] for n in names] == [8 * i for i in range(len(names))], f"{kernel}: pointer order"


_check_pointer_order()


# ------------------------------------------------------------------ render and compile

TEMPLATES = {"decode": "decode/flash_decode.cu.j2", "combine": "decode/flash_combine.cu.j2",
             "append": "decode/flash_append.cu.j2"}
KNOBS_OF = {"decode": DECODE_KNOBS, "combine": COMBINE_KNOBS, "append": APPEND_KNOBS}


def emit_command(spec) -> str:
    """The `facodegen emit --kernel ...` line that reproduces this spec (every knob spelt out)."""
    flags = [f"--kernel {spec.kernel}"]
    for knob in KNOBS_OF[spec.kernel]:
        value = getattr(spec, knob.name)
        if knob.name in SHOWN_WHEN_ON and not value:
            continue
        if knob.name == "head_dim_real":
            continue                    # (--head-dim says it: the problem's d, the tile follows)
        if knob.name == "head_dim" and spec.kernel == "decode":
            value = spec.head_dim_real
        flags.append(knob.command_text(value))
    if spec.kernel != "decode":
        flags.append(f"--arch {spec.arch}")
    return "facodegen emit " + " ".join(flags)


def render(spec) -> str:
    """The CUDA source of a decode, combine or append kernel (byte-identical for equal specs)."""
    from .. import __version__
    from ..codegen.render import render_template

    placed, size, align = layout(args_of(spec))
    items = sorted((k, v) for k, v in spec.as_dict().items() if (v or k not in SHOWN_WHEN_ON)
                   and (k != "head_dim_real" or spec.padded))
    context = {
        "spec": spec, "kernel_name": spec.variant, "version": __version__, "emit_command": emit_command(spec),
        "spec_items": items, "smem_bytes": spec.smem_bytes, "threads": spec.threads,
        "placed": placed, "size": size, "align": align, "log2e": repr(math.log2(math.e)),
        "o_pad": O_PAD_FLOATS, "max_o_floats": MAX_O_FLOATS,
    }
    return render_template(TEMPLATES[spec.kernel], context)


def compile_spec(spec, sm: str | None = None):
    """Render and NVRTC-compile (cached on disk by source): sm80 -> sm_80 (or ``sm``, the device's
    target), sm90 -> sm_90a."""
    from ..runtime.compiler import compile_source

    arch = spec.arch
    if spec.kernel != "decode" and sm is None:
        sm = None   # combine/append: arch-neutral code, compiled as sm80 code for the device's target
    return compile_source(render(spec), arch, spec.variant, sm=sm)


def compile_many(specs, sm_of=lambda spec: None, threads: int = 4) -> list:
    """Compile several specs in parallel threads (NVRTC releases the GIL); ``sm_of(spec)`` gives each
    its target. The first compile runs alone: NVRTC loads libnvrtc-builtins on its first use, and
    threads that all make that first call at once have failed to open it ("failed to open
    libnvrtc-builtins.so")."""
    from concurrent.futures import ThreadPoolExecutor

    specs = list(specs)
    if not specs:
        return []
    first = compile_spec(specs[0], sm=sm_of(specs[0]))
    with ThreadPoolExecutor(threads) as pool:
        rest = list(pool.map(lambda spec: compile_spec(spec, sm=sm_of(spec)), specs[1:]))
    return [first, *rest]


def shipped_specs() -> list:
    """The decode, combine and append configs the public call picks by default for every dtype,
    head_dim, paging, split and packing choice at seqlen_q x group <= 64 rows, on short and long
    splits (split_stages); tests compile all of them for sm_80 and sm_90a and check for spills."""
    out = []
    for arch in DECODE_ARCHS:
        for dtype in DECODE_DTYPES:
            for head_dim in DECODE_HEAD_DIMS:
                for rows in (1, 32, 64):
                    for paged in (False, True):
                        for split in (False, True):
                            spec = default_decode_spec(arch, dtype, head_dim, seqlen_q=rows, group=1,
                                                       paged=paged, split=split, pack_gqa=True)
                            long_split = replace(spec, stages=split_stages(spec, 1 << 30, {}, 1 << 30))
                            for chosen in (spec, long_split):    # (split_stages: deeper rings of long splits)
                                if chosen not in out:
                                    out.append(chosen)
    for dtype in DECODE_DTYPES:
        for head_dim in DECODE_HEAD_DIMS:
            out.append(CombineSpec(dtype=dtype, head_dim=head_dim))
            for paged in (False, True):
                out.append(AppendSpec(dtype=dtype, head_dim=head_dim, paged=paged))
    return out
