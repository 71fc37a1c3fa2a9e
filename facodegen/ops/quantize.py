"""Per-tensor e4m3 quantisation for users who start from bf16/fp16 (dtype="fp8" inputs).

``quantize_e4m3(x)`` scales a torch tensor so that its largest magnitude maps to 448 (the largest
finite e4m3 value), rounds to ``torch.float8_e4m3fn`` and returns the descale factor (1/scale) as a
float32 device scalar, the form ``attention(..., q_descale=...)`` takes::

    q8, q_descale = quantize_e4m3(q)          # q ~= q8.float() * q_descale

The NumPy functions below are the same arithmetic on the CPU (e4m3 encode/decode by hand): the
tests check them without a GPU, and the float64 reference uses ``e4m3_decode`` for raw bytes.
"""

from __future__ import annotations

import numpy as np

E4M3_MAX = 448.0        # largest finite float8_e4m3fn (S.1111.110); S.1111.111 is NaN, no infinities
E4M3_MIN_NORMAL = 2.0 ** -6
E4M3_MIN_SUBNORMAL = 2.0 ** -9


def e4m3_decode(codes) -> np.ndarray:
    """float64 values of e4m3 (float8_e4m3fn) bytes: bias 7, 3 mantissa bits, subnormals, 0x7f/0xff NaN."""
    c = np.asarray(codes, dtype=np.uint8).astype(np.int64)
    sign = np.where(c & 0x80, -1.0, 1.0)
    exp = (c >> 3) & 0xF
    man = c & 0x7
    value = np.where(exp == 0, man / 8.0 * 2.0 ** -6, (1.0 + man / 8.0) * 2.0 ** (exp - 7.0))
    value = sign * value
    return np.where((c & 0x7F) == 0x7F, np.nan, value)


_ALL_VALUES = e4m3_decode(np.arange(128, dtype=np.uint8))          # 0 .. 448, then NaN at 0x7f
_FINITE = _ALL_VALUES[:127]                                         # ascending, codes 0..126


def e4m3_encode(x) -> np.ndarray:
    """e4m3 bytes of float values: round to nearest, ties to even code, saturate to +-448
    (cvt.rn.satfinite semantics); NaN -> 0x7f."""
    v = np.asarray(x, dtype=np.float64)
    mag = np.minimum(np.abs(v), E4M3_MAX)
    hi = np.clip(np.searchsorted(_FINITE, mag, side="left"), 0, 126)   # first value >= mag
    lo = np.maximum(hi - 1, 0)
    d_hi = _FINITE[hi] - mag
    d_lo = mag - _FINITE[lo]
    pick_lo = (d_lo < d_hi) | ((d_lo == d_hi) & (lo % 2 == 0))
    code = np.where(pick_lo, lo, hi).astype(np.uint8)
    code = np.where(np.signbit(v) & (code != 0), code | 0x80, code)
    return np.where(np.isnan(v), np.uint8(0x7F), code).astype(np.uint8)


def scale_for(amax: float) -> float:
    """The per-tensor scale that maps amax to E4M3_MAX (1 for an all-zero tensor)."""
    amax = float(amax)
    if not np.isfinite(amax):
        raise ValueError(f"x: amax is {amax}; a tensor with inf/NaN cannot be scaled to e4m3")
    return E4M3_MAX / amax if amax > 0 else 1.0


def quantize_e4m3_numpy(x, scale: float | None = None) -> tuple[np.ndarray, float]:
    """(e4m3 bytes of x * scale, descale = 1/scale); scale from amax when not given."""
    v = np.asarray(x, dtype=np.float64)
    if scale is None:
        scale = scale_for(np.max(np.abs(v)) if v.size else 0.0)
    if not (isinstance(scale, (int, float)) and np.isfinite(scale) and scale > 0):
        raise ValueError(f"scale must be a positive finite number, got {scale!r}")
    return e4m3_encode(v * scale), 1.0 / float(scale)


def quantize_e4m3(x, scale=None):
    """(x_fp8, descale) for a bf16/fp16/fp32 torch tensor: x_fp8 = e4m3(x * scale) with scale =
    448 / amax(|x|) unless given (a number or a float32 scalar tensor), descale = 1/scale as a float32
    scalar tensor on x's device (pass it as q_descale / k_descale / v_descale)."""
    import torch
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch tensor, got {type(x).__name__} (NumPy: quantize_e4m3_numpy)")
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise TypeError(f"x has dtype {x.dtype}; quantize_e4m3 takes bfloat16, float16 or float32")
    xf = x.float()
    if scale is None:
        amax = xf.abs().amax() if xf.numel() else torch.zeros((), device=x.device)
        if not bool(torch.isfinite(amax)):
            raise ValueError("x: amax is not finite; a tensor with inf/NaN cannot be scaled to e4m3")
        scale_t = torch.where(amax > 0, E4M3_MAX / amax, torch.ones_like(amax)).float()
    else:
        scale_t = torch.as_tensor(scale, dtype=torch.float32, device=x.device).reshape(())
        if not bool(scale_t > 0) or not bool(torch.isfinite(scale_t)):
            raise ValueError(f"scale must be a positive finite number, got {scale!r}")
    x8 = (xf * scale_t).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return x8, (1.0 / scale_t).to(torch.float32).reshape(())
