"""The kernel's one argument, ``FlashParams``, defined once for C and for Python.

The same field list renders the C struct (templates/common/params.cuh.j2) and packs
the host bytes passed to ``cuLaunchKernel``; the generated struct carries
``static_assert``s on every offset, so a layout mismatch fails at compile time.
"""

from __future__ import annotations

import functools
import struct
from dataclasses import dataclass

TENSOR_MAP_BYTES = 128
TENSOR_MAP_ALIGN = 64
_KIND_BYTES = {"ptr": 8, "i32": 4, "i64": 8, "f32": 4, "tmap": TENSOR_MAP_BYTES}
_KIND_ALIGN = {**_KIND_BYTES, "tmap": TENSOR_MAP_ALIGN}


@dataclass(frozen=True)
class Field:
    name: str
    kind: str      # "ptr", "i32", "i64", "f32", "tmap"
    ctype: str     # C spelling in the generated struct
    doc: str

    @property
    def size(self) -> int:
        return _KIND_BYTES[self.kind]

    @property
    def align(self) -> int:
        return _KIND_ALIGN[self.kind]


def stride_fields(tensor: str, first: str = "batch") -> list[Field]:
    """``tensor``'s three element strides, between ``first``s (batches, or a paged cache's pages),
    rows and heads: every kernel argument struct spells them so."""
    return [Field(f"{tensor}_{axis}_stride", "i64", "long long", f"{tensor} stride between {axis}s, in elements")
            for axis in (first, "row", "head")]


# The problem's shape, and the softmax scale in both forms: the forward's and the backward's structs
# (ops/backward.py BWD_FIELDS) both carry them.
SHAPE_FIELDS = [
    Field("batch", "i32", "int", "batch size"),
    Field("seqlen_q", "i32", "int", "query sequence length"),
    Field("seqlen_k", "i32", "int", "key/value sequence length"),
    Field("heads_q", "i32", "int", "query heads"),
    Field("heads_kv", "i32", "int", "key/value heads (divides heads_q: GQA/MQA)"),
]
SCALE_FIELDS = [
    Field("softmax_scale", "f32", "float", "scale applied to Q K^T (default 1/sqrt(head_dim))"),
    Field("scale_log2", "f32", "float", "softmax_scale * log2(e): exp(x*scale) = exp2(x*scale_log2)"),
]

COMMON_FIELDS = [
    Field("q", "ptr", "const elem_t*", "Q (batch, seqlen_q, heads_q, head_dim)"),
    Field("k", "ptr", "const elem_t*", "K (batch, seqlen_k, heads_kv, head_dim)"),
    Field("v", "ptr", "const elem_t*", "V (batch, seqlen_k, heads_kv, head_dim)"),
    Field("o", "ptr", "elem_t*", "O (batch, seqlen_q, heads_q, head_dim)"),
    Field("lse", "ptr", "float*", "row log-sum-exp, natural log, (batch, heads_q, seqlen_q) contiguous"),
    Field("tile_counter", "ptr", "int*", "work counter of the dynamic tile scheduler: zero at launch, and left at zero by the CTA that draws the last ticket"),
    Field("workspace", "ptr", "float*", "fp32 O, m, l between K/V blocks (sm80 schedule=fa1, loop_order=kv_outer) or of split tiles (sm90 stream_k); else 0"),
    *stride_fields("q"), *stride_fields("k"), *stride_fields("v"), *stride_fields("o"),
    *SHAPE_FIELDS,
    Field("num_m_blocks", "i32", "int", "ceil(seqlen_q / BLOCK_M), rounded up to whole clusters"),
    Field("num_tiles", "i32", "int", "num_m_blocks * heads_q * batch"),
    *SCALE_FIELDS,
]

TMA_FIELDS = [
    Field("tma_q", "tmap", "CUtensorMap", "TMA descriptor of Q, box (slab cols, BLOCK_M rows); slab = 64 cols (32 for d=96)"),
    Field("tma_k", "tmap", "CUtensorMap", "TMA descriptor of K, box (slab cols, BLOCK_N rows)"),
    Field("tma_v", "tmap", "CUtensorMap", "TMA descriptor of V, box (slab cols, BLOCK_N rows)"),
    Field("tma_o", "tmap", "CUtensorMap", "TMA descriptor of O, box (slab cols, 64 rows): one store per consumer warpgroup"),
]


# dtype=fp8 (sm90) only: the descale factors of the e4m3 inputs, float32 in device memory, read at
# [batch * <t>_descale_batch_stride + kv_head * <t>_descale_head_stride] (strides 0 and 0 for one
# per-tensor scalar; FlashAttention-3's (batch, heads_kv) tensors otherwise). q_descale * k_descale
# multiplies the scores (folded into the exp2 scale), v_descale multiplies O.
FP8_FIELDS = [
    *(Field(f"{t}_descale", "ptr", "const float*", f"{t.upper()} descale, float32 (per tensor or per (batch, kv head))")
      for t in ("q", "k", "v")),
    *(Field(f"{t}_descale_{axis}_stride", "i64", "long long", f"{t}_descale stride between {axis}es (0: shared)")
      for t in ("q", "k", "v") for axis in ("batch", "head")),
]


# Kernels with an attention variant (spec.local, spec.softcap or spec.sinks; one set of fields for
# all three, after the others, so the default kernels' struct is unchanged): the run-time values of
# the variants. The window is in the bottom-right frame of the causal mask, key j visible to query
# i iff i + seqlen_k - seqlen_q - window_left <= j <= i + seqlen_k - seqlen_q + window_right; the
# host folds top-left alignment and "unbounded" (-1) into them (api._window_params), so the
# values may be negative or exceed the sequence (kept within +-(seqlen_q + seqlen_k + 1)).
VARIANT_FIELDS = [
    Field("window_left", "i32", "int", "local: keys a row sees before its diagonal key (run-time window size)"),
    Field("window_right", "i32", "int", "local: keys a row sees after its diagonal key"),
    Field("softcap_scale", "f32", "float", "softcap: softmax_scale / c, so the score is c * tanh(s * softcap_scale); "
                                           "softmax_scale and scale_log2 then hold c and c * log2(e)"),
    Field("sinks", "ptr", "const float*", "sinks: fp32 logit per query head (heads_q,), natural-log units; else 0"),
]


# Varlen kernels (spec.varlen) only, last, so the other kernels' struct is unchanged: the packed
# tensors' sequence boundaries. Sequence b's rows are tokens cu_seqlens_q[b] .. cu_seqlens_q[b+1]-1
# of q and o (cu_seqlens_k: of k and v); each tensor's row stride is its token stride (batch strides
# are unused). batch, seqlen_q, seqlen_k and num_m_blocks then hold the sequence count and the
# caller's max_seqlen_q/max_seqlen_k (the grid's bounds); the LSE is (heads_q, total_q).
VARLEN_FIELDS = [
    Field("cu_seqlens_q", "ptr", "const int*", "varlen: int32 (batch + 1,) prefix sums of the query lengths"),
    Field("cu_seqlens_k", "ptr", "const int*", "varlen: int32 (batch + 1,) prefix sums of the key lengths"),
    Field("total_q", "i32", "int", "varlen: query tokens of all sequences (the LSE's head stride)"),
    Field("total_k", "i32", "int", "varlen: key tokens of all sequences (the kernels clamp each sequence's "
                                   "keys into them)"),
]


def fields(arch: str, dtype: str | None = None, variants: bool = False, varlen: bool = False) -> list[Field]:
    return COMMON_FIELDS + (TMA_FIELDS if arch == "sm90" else []) + (FP8_FIELDS if dtype == "fp8" else []) \
        + (VARIANT_FIELDS if variants else []) + (VARLEN_FIELDS if varlen else [])


def has_variants(spec) -> bool:
    """Does the spec's FlashParams carry VARIANT_FIELDS (any of local, softcap, sinks)?"""
    return bool(spec.local or spec.softcap or spec.sinks)


def layout(arch: str, dtype: str | None = None, variants: bool = False,
           varlen: bool = False) -> tuple[tuple[tuple[Field, int], ...], int, int]:
    """((field, offset), ...), total size and alignment of FlashParams (place)."""
    return place(fields(arch, dtype, variants, varlen))


def spec_layout(spec) -> tuple[tuple[tuple[Field, int], ...], int, int]:
    """layout() of the FlashParams that ``spec``'s kernel takes."""
    return layout(spec.arch, spec.dtype, has_variants(spec), spec.varlen)


def place(field_list) -> tuple[tuple[tuple[Field, int], ...], int, int]:
    """((field, offset), ...), total size and alignment of a C struct of these fields in this order, with
    C's natural-alignment rules: one layout rule for every kernel's argument struct (FlashParams,
    the backward's, the decode family's). Remembered per field tuple: a plan-cache miss packs its
    struct, and working the layout out again took ~45 µs of it (the backward's 53 fields)."""
    return _place(tuple(field_list))


@functools.lru_cache(maxsize=256)
def _place(field_list: tuple) -> tuple[tuple[tuple[Field, int], ...], int, int]:
    offset, max_align, placed = 0, 1, []
    for f in field_list:
        offset = (offset + f.align - 1) // f.align * f.align
        placed.append((f, offset))
        offset += f.size
        max_align = max(max_align, f.align)
    size = (offset + max_align - 1) // max_align * max_align
    return tuple(placed), size, max_align


_SCALAR_FORMATS = {"ptr": "<Q", "i32": "<i", "i64": "<q", "f32": "<f"}


def pack_fields(field_list, values: dict, struct_name: str) -> bytes:
    """The bytes of a struct of these fields (place's layout) holding ``values`` (every field; tensor
    maps as TENSOR_MAP_BYTES bytes each): every kernel's argument struct is packed here."""
    return pack_placed(place(field_list), values, struct_name)


def pack_placed(layout: tuple, values: dict, struct_name: str) -> bytes:
    """pack_fields of a struct whose place() ``layout`` the caller holds."""
    placed, size, _ = layout
    missing = [f.name for f, _ in placed if f.name not in values]
    if missing:
        raise KeyError(f"{struct_name} fields missing: {', '.join(missing)}")
    buf = bytearray(size)
    for f, off in placed:
        value = values[f.name]
        if f.kind == "tmap":
            if len(value) != TENSOR_MAP_BYTES:
                raise ValueError(f"{f.name} must be {TENSOR_MAP_BYTES} bytes, got {len(value)}")
            buf[off:off + TENSOR_MAP_BYTES] = value
        else:
            struct.pack_into(_SCALAR_FORMATS[f.kind], buf, off, value)
    return bytes(buf)


def pack(arch: str, values: dict, dtype: str | None = None, variants: bool = False, varlen: bool = False) -> bytes:
    """Host bytes of FlashParams; every field must be given (tensor maps as 128 bytes)."""
    return pack_fields(fields(arch, dtype, variants, varlen), values, "FlashParams")
