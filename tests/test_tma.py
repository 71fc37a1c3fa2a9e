"""facodegen/runtime/tma.py: argument checks and map geometry (CPU; the driver call needs a GPU)."""

import pytest

from facodegen import KernelSpec
from facodegen.runtime import tma

PTR = 0x7F00_0000_0000
B, S, H, D = 2, 1000, 8, 128
STRIDES = (S * H * D, H * D, D)          # (batch, row, head) of a contiguous (B, S, H, D) tensor


def args(**changes):
    kw = dict(ptr=PTR, dtype="bf16", shape_bshd=(B, S, H, D), strides_elems=STRIDES, box_rows=128,
              box_cols=64, swizzle=128)
    kw.update(changes)
    return tma.tiled_args(**kw)


def test_contiguous_bshd_geometry():
    a = args()
    assert a.dims == (D, S, H, B)
    assert a.strides == (H * D * 2, D * 2, S * H * D * 2)       # {row, head, batch} in bytes
    assert a.box == (64, 128, 1, 1)
    assert a.swizzle_code == 3 and a.dtype_code == 9
    assert args(dtype="fp16").dtype_code == 6
    assert args(swizzle=64, box_cols=32).swizzle_code == 2


@pytest.mark.parametrize("change, argument", [
    (dict(ptr=PTR + 8), "ptr"),
    (dict(ptr=0), "ptr"),
    (dict(dtype="fp32"), "dtype"),
    (dict(dtype="e4m3"), "dtype"),
    (dict(strides_elems=(S * H * D, H * D + 4, D)), "strides_elems"),     # row stride 8 bytes off
    (dict(strides_elems=(S * H * D, H * D, 3)), "strides_elems"),         # head stride 6 bytes
    (dict(strides_elems=(1 << 40, H * D, D)), "strides_elems"),           # >= 2^40 bytes
    (dict(strides_elems=(S * H * D, H * D, D, 2)), "strides_elems"),      # head_dim not contiguous
    (dict(strides_elems=(S * H * D, H * D)), "strides_elems"),
    (dict(shape_bshd=(B, S, H)), "shape_bshd"),
    (dict(shape_bshd=(B, (1 << 32) + 1, H, D)), "shape_bshd"),
    (dict(shape_bshd=(B, 0, H, D)), "shape_bshd"),
    (dict(shape_bshd=(B, S, H, 36)), "shape_bshd"),                        # 72 bytes per row
    (dict(box_rows=0), "box_rows"),
    (dict(box_rows=257), "box_rows"),
    (dict(box_cols=128), "box_cols"),                                     # 256 B > 128B swizzle span
    (dict(box_cols=4), "box_cols"),                                       # 8 bytes, not a multiple of 16
    (dict(swizzle=64), "box_cols"),                                       # 64 cols = 128 B > 64 B span
    (dict(swizzle=96), "swizzle"),
])
def test_bad_arguments_raise_before_the_driver(change, argument):
    with pytest.raises(ValueError, match=argument):
        args(**change)
    # encode_tiled checks first too: ValueError, not the RuntimeError of a missing driver.
    with pytest.raises(ValueError, match=argument):
        kw = dict(ptr=PTR, dtype="bf16", shape_bshd=(B, S, H, D), strides_elems=STRIDES, box_rows=128)
        kw.update(change)
        tma.encode_tiled(**kw)


def test_size_one_dims_ignore_their_stride():
    # A (1, S, 1, D) view may carry any stride on its size-1 dims.
    a = args(shape_bshd=(1, S, 1, D), strides_elems=(0, D, 3))
    assert a.strides == (D * 2, D * 2, S * D * 2)


def test_strided_layouts_are_accepted():
    # (B, H, S, D) storage viewed as (B, S, H, D): row stride D, head stride S*D.
    a = args(strides_elems=(H * S * D, D, S * D))
    assert a.strides == (D * 2, S * D * 2, H * S * D * 2)


def test_slab_geometry_matches_the_kernel():
    assert tma.slab_geometry(64) == (128, 64)
    assert tma.slab_geometry(128) == (128, 64)
    assert tma.slab_geometry(256) == (128, 64)
    assert tma.slab_geometry(192) == (128, 64)
    assert tma.slab_geometry(96) == (64, 32)


def test_tensor_map_boxes_follow_the_spec():
    spec = KernelSpec(arch="sm90", head_dim=128)
    strides_q = (S * H * D, H * D, D)
    strides_kv = (S * 2 * D, 2 * D, D)
    maps = tma.tensor_map_args(spec, PTR, PTR + 1024, PTR + 2048, PTR + 4096, B, S, S, H, 2,
                               strides_q, strides_kv, strides_kv, strides_q)
    assert maps["tma_q"].box == (64, spec.block_m, 1, 1)
    assert maps["tma_k"].box == (64, spec.block_n, 1, 1)
    assert maps["tma_v"].box == (64, spec.block_n, 1, 1)
    assert maps["tma_o"].box == (64, 64, 1, 1)
    assert maps["tma_k"].dims == (D, S, 2, B)
    spec96 = KernelSpec(arch="sm90", head_dim=96)
    maps = tma.tensor_map_args(spec96, PTR, PTR, PTR, PTR, 1, 17, 17, 1, 1, (17 * 96, 96, 96), (17 * 96, 96, 96),
                               (17 * 96, 96, 96), (17 * 96, 96, 96))
    assert all(a.box[0] == 32 and a.swizzle_code == 2 for a in maps.values())


def test_in_place_v_map_lands_32_key_slabs_as_1kb_blocks():
    """fp8 vt_in_place: V's map is rank 5 {32, S, D/32, H, B}; the column-block dimension steps 32
    bytes (under the row stride), one box is 32 keys x the whole head_dim, 32B-swizzled, so block c of
    a slab lands at c KB: the bytes of V^T rows 32c..32c+31."""
    spec = KernelSpec(arch="sm90", dtype="fp8", head_dim=256, vt_in_place=True)
    strides = (S * 2 * 256, 2 * 256, 256)
    maps = tma.tensor_map_args(spec, PTR, PTR, PTR + 4096, PTR, B, S, S, 2, 2, strides, strides, strides, strides)
    v = maps["tma_v"]
    assert v.dims == (32, S, 8, 2, B) and v.strides == (512, 32, 256, S * 512) and v.box == (32, 32, 8, 1, 1)
    assert v.swizzle_code == tma.SWIZZLE_CODES[32] and v.ptr == PTR + 4096
    assert maps["tma_k"].dims == (256, S, 2, B)                 # K keeps its rank-4 slabs
    with pytest.raises(ValueError, match="head_dim"):
        tma.in_place_v_args(tma.tiled_args(PTR, "fp8", (1, 64, 1, 48), (64 * 48, 48, 48), 32, 48, 64))


def test_tensor_map_errors_name_the_tensor():
    spec = KernelSpec(arch="sm90", head_dim=128)
    good = (S * H * D, H * D, D)
    with pytest.raises(ValueError, match=r"^v: ptr"):
        tma.tensor_map_args(spec, PTR, PTR, PTR + 2, PTR, B, S, S, H, H, good, good, good, good)


def test_missing_driver_is_a_clear_runtime_error():
    try:
        import ctypes
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        with pytest.raises(RuntimeError, match="libcuda"):
            tma.encode_tiled(PTR, "bf16", (B, S, H, D), STRIDES, 128)
    else:
        pytest.skip("a GPU driver is installed here")
