"""Host-side TMA tensor maps for the sm90 kernel (``cuTensorMapEncodeTiled`` through ctypes).

A tensor of shape (batch, seqlen, heads, head_dim) with any batch/row/head strides and a
contiguous head_dim is described to the TMA unit as a rank-4 tiled map, innermost first::

    globalDim     = {D, S, H, B}                      elements
    globalStrides = {row, head, batch} * elem_bytes   bytes (dims 1..3; dim 0 is contiguous)
    boxDim        = {box_cols, box_rows, 1, 1}        one box = box_rows rows x box_cols columns
    swizzle       = 128B (or 64B), no interleave, out-of-range elements read as zero

Kernel coordinates are {column, row, head, batch}. head_dim is split into slabs of
``box_cols`` columns, one TMA box per slab (``slab_geometry``).

All argument checks run in Python and raise ``ValueError`` naming the argument before the
driver is called; libcuda is loaded only when a map is really encoded (``RuntimeError`` if
it is missing, e.g. on a machine without a GPU driver).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

TENSOR_MAP_BYTES = 128
_TENSOR_MAP_ALIGN = 64

# CUtensorMapDataType (kernel-facts 4.1).
# fp8 (e4m3) moves as UINT8: the TMA unit copies bytes and has no float8 type.
DTYPE_CODES = {"fp16": 6, "bf16": 9, "fp8": 0}
ELEMENT_BYTES = {"fp16": 2, "bf16": 2, "fp8": 1}
# CUtensorMapSwizzle: bytes of the swizzle span -> enum.
SWIZZLE_CODES = {0: 0, 32: 1, 64: 2, 128: 3}
_INTERLEAVE_NONE = 0
_L2_PROMOTION_128B = 2
_OOB_FILL_ZERO = 0          # CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE: out-of-range elements are zeros

_MAX_STRIDE = 1 << 40
_MAX_DIM = 1 << 32
_MAX_BOX = 256


def slab_geometry(head_dim: int, elem_bytes: int = 2) -> tuple[int, int]:
    """(swizzle bytes, box columns) the sm90 kernel uses for a head_dim.

    The widest swizzle (128B, else 64B, else 32B) that divides a row of head_dim elements; one slab
    is one swizzle span of columns. 16-bit: 128B / 64 columns for head_dim 64, 128, 192, 256 and
    64B / 32 columns for 96. fp8 (1 byte): 128 columns for 128 and 256, 64B / 64 columns for 64 and
    192, 32B / 32 columns for 96. Must match SWIZZLE_BYTES / SLAB_COLS in templates/sm90/."""
    row = head_dim * elem_bytes
    swizzle = 128 if row % 128 == 0 else 64 if row % 64 == 0 else 32
    return swizzle, swizzle // elem_bytes


def vt_geometry(block_n: int) -> tuple[int, int]:
    """(swizzle bytes, box keys) of a transposed fp8 V tile (rows = head_dim, keys contiguous): the
    widest swizzle dividing block_n bytes. Must match VT_SWIZZLE_BYTES in flash_fwd_fp8.cu.j2."""
    swizzle = 128 if block_n % 128 == 0 else 64 if block_n % 64 == 0 else 32
    return swizzle, swizzle


@dataclass(frozen=True)
class TiledArgs:
    """The checked arguments of one cuTensorMapEncodeTiled call."""
    ptr: int
    dtype_code: int
    dims: tuple[int, ...]                      # {D, S, H, B}, elements (rank 5: in_place_v_args)
    strides: tuple[int, ...]                   # {row, head, batch}, bytes
    box: tuple[int, ...]                       # {box_cols, box_rows, 1, 1}
    swizzle_code: int


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _stride_of(size: int, stride: int, contiguous: int) -> int:
    """A dimension's stride in the map: a dimension of size 1 is only ever addressed at coordinate 0, so its
    stride is free and takes the contiguous value (views of size-1 dims may carry any stride, even 0 or odd)."""
    return contiguous if size == 1 else stride


def tiled_args(ptr: int, dtype: str, shape_bshd, strides_elems, box_rows: int, box_cols: int = 64,
               swizzle: int = 128) -> TiledArgs:
    """Check everything cuTensorMapEncodeTiled would reject (and what the kernel assumes).

    ``strides_elems`` is (batch, row, head) or (batch, row, head, col) in elements; a
    4th entry must be 1 (head_dim contiguous)."""
    if dtype not in DTYPE_CODES:
        raise ValueError(f"dtype: {dtype!r} is not supported by the TMA encoder; choose one of "
                         f"{', '.join(DTYPE_CODES)}")
    e = ELEMENT_BYTES[dtype]
    if not _is_int(ptr) or ptr <= 0:
        raise ValueError(f"ptr: must be a positive integer device address, got {ptr!r}")
    if ptr % 16:
        raise ValueError(f"ptr: TMA needs a 16-byte aligned global address, got {ptr:#x} "
                         f"({ptr % 16} bytes past a 16-byte boundary)")
    shape = tuple(shape_bshd)
    if len(shape) != 4 or not all(_is_int(s) for s in shape):
        raise ValueError(f"shape_bshd: must be 4 integers (batch, seqlen, heads, head_dim), got {shape_bshd!r}")
    for name, size in zip(("batch", "seqlen", "heads", "head_dim"), shape):
        if not 1 <= size <= _MAX_DIM:
            raise ValueError(f"shape_bshd: {name}={size} must be in [1, 2^32]")
    batch, seqlen, heads, head_dim = shape
    strides = tuple(strides_elems)
    if len(strides) not in (3, 4) or not all(_is_int(s) for s in strides):
        raise ValueError(f"strides_elems: must be 3 integers (batch, row, head) in elements, got {strides_elems!r}")
    if len(strides) == 4:
        if strides[3] != 1 and head_dim > 1:
            raise ValueError(f"strides_elems: head_dim must be contiguous (stride 1), got stride {strides[3]}")
        strides = strides[:3]
    if (head_dim * e) % 16:
        raise ValueError(f"shape_bshd: head_dim={head_dim} x {e} bytes must be a multiple of 16 bytes")
    contiguous = {"batch": seqlen * heads * head_dim, "row": heads * head_dim, "head": head_dim}
    sizes = {"batch": batch, "row": seqlen, "head": heads}
    stride_bytes = {}
    for name, stride in zip(("batch", "row", "head"), strides):
        stride = _stride_of(sizes[name], stride, contiguous[name])
        nbytes = stride * e
        if nbytes <= 0 or nbytes % 16:
            raise ValueError(f"strides_elems: {name} stride {stride} elements = {nbytes} bytes must be a "
                             f"positive multiple of 16 bytes")
        if nbytes >= _MAX_STRIDE:
            raise ValueError(f"strides_elems: {name} stride {nbytes} bytes must be below 2^40")
        stride_bytes[name] = nbytes
    if swizzle not in SWIZZLE_CODES:
        raise ValueError(f"swizzle: {swizzle!r} must be one of {', '.join(map(str, SWIZZLE_CODES))} (bytes)")
    if not _is_int(box_rows) or not 1 <= box_rows <= _MAX_BOX:
        raise ValueError(f"box_rows: {box_rows!r} must be an integer in [1, {_MAX_BOX}]")
    if not _is_int(box_cols) or not 1 <= box_cols <= _MAX_BOX:
        raise ValueError(f"box_cols: {box_cols!r} must be an integer in [1, {_MAX_BOX}]")
    if (box_cols * e) % 16:
        raise ValueError(f"box_cols: {box_cols} x {e} bytes must be a multiple of 16 bytes")
    if swizzle and box_cols * e > swizzle:
        raise ValueError(f"box_cols: {box_cols} x {e} bytes exceed the {swizzle}-byte swizzle span "
                         f"(at most {swizzle // e} columns)")
    # box_cols may exceed head_dim: a kernel whose tile is wider than the tensor's rows (head_dim 80 on
    # the 96-column tile) loads zeros past head_dim and its stores are clipped there (issue 40).
    return TiledArgs(ptr=ptr, dtype_code=DTYPE_CODES[dtype], dims=(head_dim, seqlen, heads, batch),
                     strides=(stride_bytes["row"], stride_bytes["head"], stride_bytes["batch"]),
                     box=(box_cols, box_rows, 1, 1), swizzle_code=SWIZZLE_CODES[swizzle])


def with_rows(args: TiledArgs, ptr: int, seqlen: int, row_stride_bytes: int) -> TiledArgs:
    """tiled_args' ``args`` of a one-batch tensor (a varlen call's packed tokens) for the same layout at ``ptr``
    with ``seqlen`` rows (``row_stride_bytes``: the tensor's row stride), as tiled_args makes them without
    checking again (its _stride_of: the batch's stride follows seqlen). ``ptr`` must be 16-byte aligned (the
    callers check)."""
    head_dim, _, heads, batch = args.dims
    if batch != 1:
        raise ValueError(f"args: a one-batch tensor's map (batch {batch})")
    contiguous_row = head_dim * heads * _CODE_BYTES[args.dtype_code]
    return TiledArgs(ptr=ptr, dtype_code=args.dtype_code, dims=(head_dim, seqlen, heads, 1),
                     strides=(_stride_of(seqlen, row_stride_bytes, contiguous_row), args.strides[1],
                              _stride_of(1, 0, seqlen * contiguous_row)), box=args.box,
                     swizzle_code=args.swizzle_code)


_CODE_BYTES = {code: ELEMENT_BYTES[name] for name, code in DTYPE_CODES.items()}
_ENCODE = None


def libcuda() -> ctypes.CDLL:
    """libcuda.so.1 (facodegen.runtime.driver loads it and runs cuInit once)."""
    from .driver import lib
    return lib()


def _driver_encode():
    """cuTensorMapEncodeTiled from libcuda.so.1, loaded once on first use."""
    global _ENCODE
    if _ENCODE is None:
        fn = libcuda().cuTensorMapEncodeTiled
        fn.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p,
                       ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_uint64),
                       ctypes.POINTER(ctypes.c_uint32), ctypes.POINTER(ctypes.c_uint32),
                       ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int]
        fn.restype = ctypes.c_int
        _ENCODE = fn
    return _ENCODE


def encode(args: TiledArgs) -> bytes:
    """Run cuTensorMapEncodeTiled on checked arguments; the 128 bytes of the CUtensorMap."""
    fn = _driver_encode()
    # 64-byte aligned 128-byte output buffer (a ctypes array is not guaranteed to be aligned).
    raw = (ctypes.c_uint8 * (TENSOR_MAP_BYTES + _TENSOR_MAP_ALIGN))()
    offset = (-ctypes.addressof(raw)) % _TENSOR_MAP_ALIGN
    out = ctypes.addressof(raw) + offset
    rank = len(args.dims)
    dims = (ctypes.c_uint64 * rank)(*args.dims)
    strides = (ctypes.c_uint64 * (rank - 1))(*args.strides)
    box = (ctypes.c_uint32 * rank)(*args.box)
    element_strides = (ctypes.c_uint32 * rank)(*([1] * rank))
    result = fn(out, args.dtype_code, rank, ctypes.c_void_p(args.ptr), dims, strides, box, element_strides,
                _INTERLEAVE_NONE, args.swizzle_code, _L2_PROMOTION_128B, _OOB_FILL_ZERO)
    if result != 0:
        raise RuntimeError(f"cuTensorMapEncodeTiled failed with CUresult {result} for {args}")
    return bytes(raw[offset:offset + TENSOR_MAP_BYTES])


def encode_tiled(ptr: int, dtype: str, shape_bshd, strides_elems, box_rows: int, box_cols: int = 64,
                 swizzle: int = 128) -> bytes:
    """The 128-byte CUtensorMap of a (B, S, H, D) tensor, boxes of box_rows x box_cols.

    strides_elems: (batch, row, head) in elements (head_dim is contiguous)."""
    return encode(tiled_args(ptr, dtype, shape_bshd, strides_elems, box_rows, box_cols, swizzle))


def transposed_v_args(ptr: int, shape_bhds, strides_elems, box_rows: int, box_keys: int,
                      swizzle: int) -> TiledArgs:
    """Checked map of a pre-transposed fp8 V, shape (batch, heads_kv, head_dim, seqlen_k) with the
    keys contiguous and strides (batch, head, dim) in elements (bytes). Rank 4, innermost first:
    {seqlen_k, head_dim, heads_kv, batch}; one box = box_rows (head_dim) rows x box_keys keys.
    Keys past seqlen_k read as zeros (the box may be wider than seqlen_k)."""
    if not _is_int(ptr) or ptr <= 0 or ptr % 16:
        raise ValueError(f"ptr: must be a 16-byte aligned device address, got {ptr!r}")
    shape = tuple(shape_bhds)
    if len(shape) != 4 or not all(_is_int(x) and 1 <= x <= _MAX_DIM for x in shape):
        raise ValueError(f"shape: must be 4 positive integers (batch, heads_kv, head_dim, seqlen_k), got {shape_bhds!r}")
    batch, heads, dim, seqlen = shape
    strides = tuple(strides_elems)
    if len(strides) != 3 or not all(_is_int(x) for x in strides):
        raise ValueError(f"strides_elems: must be 3 integers (batch, head, dim) in elements, got {strides_elems!r}")
    sizes = {"batch": batch, "head": heads, "dim": dim}
    contiguous = {"batch": heads * dim * seqlen, "head": dim * seqlen, "dim": seqlen}
    out = {}
    for name, stride in zip(("batch", "head", "dim"), strides):
        if sizes[name] == 1:
            stride = max(contiguous[name] + (-contiguous[name]) % 16, 16)
        if stride <= 0 or stride % 16 or stride >= _MAX_STRIDE:
            raise ValueError(f"strides_elems: {name} stride {stride} bytes must be a positive multiple of 16 "
                             f"below 2^40 (pad seqlen_k of the transposed V to a multiple of 16)")
        out[name] = stride
    if swizzle not in (32, 64, 128) or box_keys != swizzle:
        raise ValueError(f"box_keys: {box_keys} must equal the swizzle span {swizzle} (bytes)")
    if not _is_int(box_rows) or not 1 <= box_rows <= _MAX_BOX:
        raise ValueError(f"box_rows: {box_rows!r} must be an integer in [1, {_MAX_BOX}]")
    return TiledArgs(ptr=ptr, dtype_code=DTYPE_CODES["fp8"], dims=(seqlen, dim, heads, batch),
                     strides=(out["dim"], out["head"], out["batch"]), box=(box_keys, box_rows, 1, 1),
                     swizzle_code=SWIZZLE_CODES[swizzle])


# vt_in_place: V moves in boxes of VT_SLAB_KEYS keys x head_dim, VT_SLAB_KEYS bytes per smem row.
VT_SLAB_KEYS = 32


def in_place_v_args(row_v: TiledArgs) -> TiledArgs:
    """fp8 with vt_in_place: the row-major V of ``row_v`` (checked by tiled_args) as a rank-5 map
    {32, S, D/32, H, B} with strides {row, 32, head, batch} bytes (the column-block dimension's stride
    is smaller than the row's: TMA takes non-monotonic strides, kernel-facts 4.1), one box = 32 keys
    x the whole head_dim, 32B-swizzled. The box lands as [D/32][32 keys][32 bytes]: block c (columns
    32c..32c+31) of the slab is 1 KB at c x 1 KB, the very bytes where the slab's V^T rows 32c..32c+31
    go (32 keys = 32 bytes per V^T row), so each 1 KB block is transposed in place. Kernel
    coordinates: {0, key, 0, head, batch}."""
    head_dim, seqlen, heads, batch = row_v.dims
    row, head, batch_stride = row_v.strides
    if head_dim % VT_SLAB_KEYS:
        raise ValueError(f"head_dim: {head_dim} must be a multiple of {VT_SLAB_KEYS} to move V in 32-column blocks")
    return TiledArgs(ptr=row_v.ptr, dtype_code=row_v.dtype_code,
                     dims=(VT_SLAB_KEYS, seqlen, head_dim // VT_SLAB_KEYS, heads, batch),
                     strides=(row, VT_SLAB_KEYS, head, batch_stride),
                     box=(VT_SLAB_KEYS, VT_SLAB_KEYS, head_dim // VT_SLAB_KEYS, 1, 1),
                     swizzle_code=SWIZZLE_CODES[32])


def tensor_map_args(spec, q_ptr: int, k_ptr: int, v_ptr: int, o_ptr: int, batch: int, seqlen_q: int,
                    seqlen_k: int, heads_q: int, heads_kv: int, q_strides, k_strides, v_strides,
                    o_strides) -> dict[str, TiledArgs]:
    """Checked arguments of the four maps of one call (see ``tensor_maps``). The maps' innermost
    dimension is the problem's head dimension (spec.head_dim_real; V's and O's: spec.head_dim_v), the boxes
    slabs of the tile's (spec.head_dim): where d < D the loads fill columns d..D-1 with zeros and the O
    store skips them."""
    d = spec.head_dim_real
    swizzle, box_cols = slab_geometry(spec.head_dim, ELEMENT_BYTES[spec.dtype])
    wg_rows = 64        # the epilogue stores O one consumer warpgroup (64 rows) at a time
    if spec.dtype == "fp8":
        return _fp8_map_args(spec, q_ptr, k_ptr, v_ptr, batch, seqlen_q, seqlen_k, heads_q, heads_kv,
                             q_strides, k_strides, v_strides, swizzle, box_cols)
    # V and O: head_dim_v columns where they have their own (the same slab boxes: both head dims are
    # whole 64-column slabs then); else the problem's d as Q and K
    d_v = spec.head_dim_v if spec.split_v else d
    plan = {
        "tma_q": (q_ptr, (batch, seqlen_q, heads_q, d), q_strides, spec.block_m),
        "tma_k": (k_ptr, (batch, seqlen_k, heads_kv, d), k_strides, spec.block_n // spec.cluster_m),
        "tma_v": (v_ptr, (batch, seqlen_k, heads_kv, d_v), v_strides, spec.block_n // spec.cluster_m),
        "tma_o": (o_ptr, (batch, seqlen_q, heads_q, d_v), o_strides, wg_rows),
    }
    out = {}
    for name, (ptr, shape, strides, rows) in plan.items():
        try:
            out[name] = tiled_args(ptr, spec.dtype, shape, strides, rows, box_cols, swizzle)
        except ValueError as err:
            raise ValueError(f"{name[4:]}: {err}") from None
    return out


def _fp8_map_args(spec, q_ptr, k_ptr, v_ptr, batch, seqlen_q, seqlen_k, heads_q, heads_kv, q_strides,
                  k_strides, v_strides, swizzle, box_cols) -> dict[str, TiledArgs]:
    """fp8: Q, K (and row-major V) as e4m3 bytes in head_dim slabs; V^T (v_layout=transposed) with
    v_strides = (batch, head, dim) of the (batch, heads_kv, head_dim, seqlen_k) tensor, boxes of the tile's
    head_dim rows. O is written from registers (tma_o is unused: it gets Q's map so the bytes are a valid
    descriptor). The global head_dim is spec.head_dim_real (zeros past it, as tensor_map_args')."""
    d = spec.head_dim_real
    plan = {
        "tma_q": (q_ptr, (batch, seqlen_q, heads_q, d), q_strides, spec.block_m),
        "tma_k": (k_ptr, (batch, seqlen_k, heads_kv, d), k_strides, spec.block_n),
    }
    if spec.v_layout == "row":
        plan["tma_v"] = (v_ptr, (batch, seqlen_k, heads_kv, d), v_strides, spec.block_n)
    out = {}
    for name, (ptr, shape, strides, rows) in plan.items():
        try:
            out[name] = tiled_args(ptr, "fp8", shape, strides, rows, box_cols, swizzle)
        except ValueError as err:
            raise ValueError(f"{name[4:]}: {err}") from None
    if spec.vt_in_place:
        out["tma_v"] = in_place_v_args(out["tma_v"])
    if spec.v_layout == "transposed":
        vt_swizzle, box_keys = vt_geometry(spec.block_n)
        try:
            out["tma_v"] = transposed_v_args(v_ptr, (batch, heads_kv, d, seqlen_k), v_strides, spec.head_dim, box_keys,
                                             vt_swizzle)
        except ValueError as err:
            raise ValueError(f"v: {err}") from None
    out["tma_o"] = out["tma_q"]
    return out


def map_operands(spec) -> dict[str, str]:
    """Which operand's address each FlashParams map holds (fp8's tma_o is Q's map: O is stored
    from registers), so a launch can move a map to the call's tensor. (A varlen kernel's maps span the
    packed tokens, so a call with other totals encodes them anew: ops/varlen.py; its tma_o is O's over
    the packed tokens, read only with varlen_tma_store.)"""
    return {"tma_q": "q", "tma_k": "k", "tma_v": "v", "tma_o": "q" if spec.dtype == "fp8" else "o"}


def tensor_maps(spec, q_ptr: int, k_ptr: int, v_ptr: int, o_ptr: int, batch: int, seqlen_q: int, seqlen_k: int,
                heads_q: int, heads_kv: int, q_strides, k_strides, v_strides, o_strides) -> dict[str, bytes]:
    """The FlashParams tensor maps of one sm90 call: {"tma_q", "tma_k", "tma_v", "tma_o"} -> 128 bytes.

    Strides are (batch, row, head) in elements. Boxes (columns x rows), columns = one swizzle
    slab of head_dim (``slab_geometry``: 64, or 32 for head_dim 96):
    Q: slab x block_m (loaded once per tile), K and V: slab x block_n (one ring stage; with
    cluster_m=2 slab x block_n/2, each CTA's share of the stage),
    O: slab x 64 (each consumer warpgroup stores its own 64 rows). The global head_dim is
    spec.head_dim_real: a padded kernel's last slab reaches past it (zeros in, nothing out)."""
    args = tensor_map_args(spec, q_ptr, k_ptr, v_ptr, o_ptr, batch, seqlen_q, seqlen_k, heads_q, heads_kv,
                           q_strides, k_strides, v_strides, o_strides)
    return {name: encode(a) for name, a in args.items()}
