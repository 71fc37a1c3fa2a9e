"""poly_exp2 (common/ptx.cuh.j2): 2^x on the FMA pipe for spec.poly_exp2_tiles of the softmax's
exp2s. CPU checks: the template's constants, evaluated step by step in float32 as the device does,
stay within 1e-4 of 2^x over the softmax's range; and the generated SASS trades exactly those
MUFU.EX2 for the polynomial. (tests/gpu/test_numerics.py runs the device function itself.)"""

import re

import numpy as np
import pytest

from facodegen import KernelSpec
from facodegen.codegen.render import template_dir

compile_mod = pytest.importorskip("facodegen.runtime.compiler")


def _template_poly():
    text = (template_dir() / "common" / "ptx.cuh.j2").read_text()
    body = text[text.index("float poly_exp2(float x)"):]
    body = body[:body.index("\n}\n")]
    clamp = float(re.search(r"fmaxf\(x, (-[\d.]+)f\)", body).group(1))
    magic = float(re.search(r"ROUND_MAGIC = ([\d.]+)f", body).group(1))
    c3, c2, c1, c0 = (float(c) for c in re.search(
        r"fmaf\(fmaf\(fmaf\(([\d.]+)f, f, ([\d.]+)f\), f, ([\d.]+)f\), f, ([\d.]+)f\)", body).groups())
    return clamp, magic, (c3, c2, c1, c0)


def poly_exp2_float32(x: np.ndarray) -> np.ndarray:
    """The device function's steps in float32 (fmaf: the product and sum exact, rounded once; the
    FTZ arithmetic downstream reads a denormal result as 0, so denormals come back as 0 here)."""
    clamp, magic, (c3, c2, c1, c0) = _template_poly()
    f32 = np.float32
    x = np.maximum(x.astype(f32), f32(clamp))
    floored = (np.floor(x.astype(np.float64)) + magic).astype(f32)      # x + magic rounded down
    f = (x - (floored - f32(magic)).astype(f32)).astype(f32)

    def fma(a, b, c):
        return (a.astype(np.float64) * b.astype(np.float64) + np.float64(c)).astype(f32)

    p = fma(fma(fma(np.full_like(f, c3), f, c2), f, c1), f, c0)
    bits = p.view(np.int32).astype(np.int64) + (floored.view(np.int32).astype(np.int64) << 23)
    y = (bits & 0xFFFFFFFF).astype(np.uint32).view(np.float32)
    return np.where(np.abs(y) < np.finfo(np.float32).tiny, np.float32(0), y)


def test_template_polynomial_is_within_1e_4_of_exp2():
    """Over the softmax's range (x <= 8: lazy rescale's slack, fp8's offset) to -126: relative error
    under 1e-4, rounding boundaries included; below that 0 (the clamp), -inf exactly 0."""
    rng = np.random.default_rng()
    j = np.arange(-126, 9, dtype=np.float64)
    x = np.concatenate([rng.uniform(-126.0, 8.0, 100_000), j, j[1:] - 2.0 ** -20, j + 0.5]).astype(np.float32)
    y = poly_exp2_float32(x).astype(np.float64)
    assert np.isfinite(y).all() and (y > 0).all()
    assert np.abs(y / np.exp2(x.astype(np.float64)) - 1.0).max() < 1e-4
    low = np.array([-np.inf, -1e30, -200.0, -127.0, -126.5], dtype=np.float32)
    assert (poly_exp2_float32(low) == 0).all()


def test_the_clamp_is_what_keeps_masked_scores_at_zero():
    """Without the clamp, x < -127 wraps the exponent field into the sign bit: -140 would come out
    as a large negative number, not 0 (the reason the clamp exists)."""
    f32 = np.float32
    floored = (np.floor(np.float64(-140.0)) + 12582912.0).astype(f32).reshape(1)
    bits = f32(1.0).reshape(1).view(np.int32).astype(np.int64) + (floored.view(np.int32).astype(np.int64) << 23)
    wrapped = (bits & 0xFFFFFFFF).astype(np.uint32).view(np.float32)
    assert wrapped[0] < -1e30


def _mufu_and_clamps(spec):
    sass = compile_mod.compile(spec).sass()
    mufu = sass.count("MUFU.EX2")
    clamps = len(re.findall(r"FMNMX(?:\.FTZ)? R\d+, R\d+, -127, !PT", sass))
    return mufu, clamps


@pytest.mark.parametrize("spec", [KernelSpec(arch="sm90", head_dim=128, poly_exp2_tiles=4),
                                  KernelSpec(arch="sm90", head_dim=64, dtype="fp8", causal=True, poly_exp2_tiles=2),
                                  KernelSpec(arch="sm80", head_dim=128, poly_exp2_tiles=2)],
                         ids=lambda s: s.variant)
def test_sass_trades_mufu_for_the_polynomial(spec):
    """Every poly element is one clamp (FMNMX with -127) and one MUFU.EX2 fewer, and the count is a
    whole number of softmax steps of 4 * poly_exp2_tiles elements (per fragment row block)."""
    mufu0, clamps0 = _mufu_and_clamps(spec.replace(poly_exp2_tiles=0))
    mufu, clamps = _mufu_and_clamps(spec)
    assert clamps0 == 0
    assert clamps == mufu0 - mufu > 0
    assert clamps % (4 * spec.poly_exp2_tiles) == 0
