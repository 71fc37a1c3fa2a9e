"""CPU tests of facodegen.verify.reference: the float64 reference, the FA1/FA2 tiled algorithms, metrics."""

import math

import numpy as np
import pytest

from facodegen.verify.reference import (TOLERANCE, attention_reference, check, check_lse, compare, flash1_reference,
                                        flash2_reference, n_block_max, random_qkv)


def naive(q, k, v, causal, scale):
    """The formula written out with Python loops and math.exp: independent of the module."""
    b, sq, hq, d = q.shape
    _, sk, hkv, _ = k.shape
    group = hq // hkv
    o = np.zeros((b, sq, hq, d))
    lse = np.full((b, hq, sq), -math.inf)
    for bi in range(b):
        for h in range(hq):
            for i in range(sq):
                keys = [j for j in range(sk) if not causal or j <= i + sk - sq]
                if not keys:
                    continue
                s = [scale * float(np.dot(q[bi, i, h], k[bi, j, h // group])) for j in keys]
                mx = max(s)
                w = [math.exp(x - mx) for x in s]
                total = sum(w)
                o[bi, i, h] = sum(wj * v[bi, j, h // group] for wj, j in zip(w, keys)) / total
                lse[bi, h, i] = mx + math.log(total)
    return o, lse


def assert_close(out, lse, ref_out, ref_lse, tol):
    assert out.shape == ref_out.shape and lse.shape == ref_lse.shape
    assert np.isfinite(out).all()
    assert np.abs(out - ref_out).max() <= tol
    empty = np.isneginf(ref_lse)
    assert (np.isneginf(lse) == empty).all()
    assert np.isfinite(lse[~empty]).all()
    if (~empty).any():
        assert np.abs(lse[~empty] - ref_lse[~empty]).max() <= tol
    assert (out.transpose(0, 2, 1, 3)[empty] == 0).all()   # empty rows: O = 0


TINY = [
    # batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, causal
    (1, 1, 1, 1, 1, 4, False),
    (1, 1, 1, 1, 1, 4, True),
    (2, 5, 5, 2, 2, 8, True),
    (1, 7, 3, 4, 2, 8, True),     # seqlen_q > seqlen_k: empty rows, GQA
    (1, 3, 7, 3, 1, 8, True),     # seqlen_q < seqlen_k, MQA
    (2, 6, 9, 2, 1, 4, False),
]


@pytest.mark.parametrize("shape", TINY, ids=str)
@pytest.mark.parametrize("scale", [None, 0.37])
def test_reference_matches_naive_formula(shape, scale):
    b, sq, sk, hq, hkv, d, causal = shape
    q, k, v = random_qkv(b, sq, sk, hq, hkv, d, "fp64", seed=hash(shape) % 1000)
    out, lse = attention_reference(q, k, v, causal, scale)
    ref_out, ref_lse = naive(q, k, v, causal, 1 / math.sqrt(d) if scale is None else scale)
    assert_close(out, lse, ref_out, ref_lse, 1e-12)


def test_reference_row_chunking(monkeypatch):
    """The row-block loop gives the same answer as one block."""
    import facodegen.verify.reference as ref
    q, k, v = random_qkv(1, 50, 40, 2, 1, 16, "fp64", seed=3)
    whole = attention_reference(q, k, v, True)
    monkeypatch.setattr(ref, "_CHUNK_ELEMENTS", 40 * 7)   # 7 rows at a time
    chunked = attention_reference(q, k, v, True)
    assert_close(*chunked, *whole, 1e-14)


def test_reference_empty_rows_and_lse_values():
    q, k, v = random_qkv(1, 6, 2, 1, 1, 4, "fp64", seed=1)
    out, lse = attention_reference(q, k, v, causal=True)
    # keys visible to row i: j <= i + 2 - 6 = i - 4 -> rows 0..3 see nothing, row 4 sees key 0.
    assert np.isneginf(lse[0, 0, :4]).all() and (out[0, :4] == 0).all()
    s = (q[0, 4, 0] @ k[0, 0, 0]) / 2.0
    assert lse[0, 0, 4] == pytest.approx(s, abs=1e-14)
    assert np.allclose(out[0, 4, 0], v[0, 0, 0], atol=1e-14)   # a single visible key: O = V_0


def test_reference_upcasts_low_precision_and_rejects_bad_shapes():
    q, k, v = random_qkv(1, 8, 8, 2, 2, 16, "fp16", seed=0)
    assert q.dtype == np.float16
    out, _ = attention_reference(q, k, v)
    assert out.dtype == np.float64
    with pytest.raises(ValueError, match="heads"):
        attention_reference(*random_qkv(1, 4, 4, 3, 2, 8, "fp64", seed=0))
    q, k, v = random_qkv(1, 4, 4, 2, 2, 8, "fp64", seed=0)
    with pytest.raises(ValueError, match="v"):
        attention_reference(q, k, v[:, :3])
    with pytest.raises(ValueError, match="head_dim"):
        attention_reference(q, k[..., :4], v[..., :4])


RANDOM_SHAPES = [
    # batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim
    (1, 1, 1, 2, 2, 16),
    (2, 17, 17, 4, 2, 32),      # GQA
    (1, 127, 127, 3, 1, 16),    # MQA
    (1, 127, 40, 2, 2, 8),      # seqlen_q > seqlen_k: empty rows under causal
    (2, 40, 127, 2, 1, 8),      # seqlen_q < seqlen_k
    (1, 17, 1, 2, 2, 8),
    (1, 1, 17, 2, 2, 8),
    (1, 200, 130, 2, 2, 8),
]
BLOCKS = [(16, 16), (64, 32), (128, 64), (7, 5), (32, 128)]


@pytest.mark.parametrize("algo", [flash1_reference, flash2_reference], ids=["fa1", "fa2"])
@pytest.mark.parametrize("shape", RANDOM_SHAPES, ids=str)
@pytest.mark.parametrize("causal", [False, True])
def test_tiled_algorithms_match_reference(algo, shape, causal):
    b, sq, sk, hq, hkv, d = shape
    rng = np.random.default_rng(sum(shape) + causal)
    q, k, v = random_qkv(b, sq, sk, hq, hkv, d, "fp64", seed=int(rng.integers(1 << 30)))
    q = q * 3.0   # large scores: the row max moves a lot between blocks
    scale = float(rng.uniform(0.05, 0.5))
    ref = attention_reference(q, k, v, causal, scale)
    for bm, bn in BLOCKS:
        assert_close(*algo(q, k, v, causal, scale, block_m=bm, block_n=bn), *ref, 1e-12)


def test_tiled_algorithms_default_scale_and_low_precision_inputs():
    q, k, v = random_qkv(2, 33, 65, 4, 2, 16, "bf16", seed=5)
    ref = attention_reference(q, k, v, True)
    assert_close(*flash1_reference(q, k, v, True), *ref, 1e-12)
    assert_close(*flash2_reference(q, k, v, True), *ref, 1e-12)


def test_flash2_needs_positive_scale_and_blocks():
    q, k, v = random_qkv(1, 4, 4, 1, 1, 8, "fp64", seed=0)
    with pytest.raises(ValueError, match="softmax_scale"):
        flash2_reference(q, k, v, softmax_scale=-1.0)
    with pytest.raises(ValueError, match="block_n"):
        flash2_reference(q, k, v, block_n=0)


def test_n_block_max():
    # non-causal: every block
    assert n_block_max(0, 128, 64, 1000, 1000, False) == 16
    # causal, square: the first Q block of 128 rows reads keys 0..127 -> 2 blocks of 64
    assert n_block_max(0, 128, 64, 1000, 1000, True) == 2
    # last Q block (rows 896..999) reads everything
    assert n_block_max(7, 128, 64, 1000, 1000, True) == 16
    # seqlen_q > seqlen_k: the first block of 128 rows sees keys j <= 127 + 100 - 300 < 0
    assert n_block_max(0, 128, 64, 300, 100, True) <= 0
    # seqlen_q < seqlen_k: shifted right by seqlen_k - seqlen_q
    assert n_block_max(0, 64, 64, 64, 1000, True) == 16


def test_compare_and_check():
    q, k, v = random_qkv(1, 64, 64, 2, 2, 32, "fp64", seed=2)
    ref, ref_lse = attention_reference(q, k, v)
    assert compare(ref, ref) == {"rel_fro": 0.0, "max_abs": 0.0, "nan": False}
    ok, msg = check(ref.astype(np.float16), ref, "fp16")
    assert ok, msg
    ok, _ = check(ref.astype(np.float32), ref, "bf16")
    assert ok

    bad = ref.copy()
    bad[0, 5, 1, :] += 1.0            # one wrong row
    c = compare(bad, ref)
    assert c["max_abs"] == pytest.approx(1.0) and c["rel_fro"] > TOLERANCE["bf16"]
    ok, msg = check(bad, ref, "bf16")
    assert not ok and "FAIL" in msg

    perturbed = ref * (1 + 5e-3)       # 5e-3 relative: passes bf16, fails fp16
    assert check(perturbed, ref, "bf16")[0]
    assert not check(perturbed, ref, "fp16")[0]
    # fp8 (e4m3 inputs): FP8_TOLERANCE = 3e-2 against the dequantised inputs' reference
    ok, msg = check(ref * (1 + 2e-2), ref, "fp8")
    assert ok and "fp8" in msg
    assert not check(ref * (1 + 4e-2), ref, "fp8")[0]

    nan = ref.copy()
    nan[0, 0, 0, 0] = np.nan
    c = compare(nan, ref)
    assert c["nan"] and c["rel_fro"] == math.inf
    ok, msg = check(nan, ref, "bf16")
    assert not ok and "non-finite" in msg
    inf = ref.copy()
    inf[0, 1, 0, 0] = np.inf
    assert not check(inf, ref, "bf16")[0]

    assert not check(np.zeros_like(ref), ref, "bf16")[0]   # an unwritten output fails
    with pytest.raises(ValueError, match="shape"):
        compare(ref[:, :3], ref)
    with pytest.raises(ValueError, match="dtype"):
        check(ref, ref, "int8")
    assert compare(np.zeros(3), np.zeros(3))["rel_fro"] == 0.0
    assert compare(np.ones(3), np.zeros(3))["rel_fro"] == math.inf


def test_check_lse():
    q, k, v = random_qkv(1, 10, 4, 2, 2, 8, "fp64", seed=4)
    _, lse = attention_reference(q, k, v, causal=True)    # rows 0..5 are empty
    assert np.isneginf(lse).sum() == 2 * 6
    assert check_lse(lse.astype(np.float32), lse)[0]
    shifted = lse + 1e-2
    ok, msg = check_lse(shifted, lse)
    assert not ok and "entries off" in msg
    nan = lse.copy()
    nan[0, 0, 9] = np.nan
    ok, msg = check_lse(nan, lse)
    assert not ok and "non-finite" in msg
    not_inf = lse.copy()
    not_inf[0, 1, 0] = 0.0             # an empty row written as finite
    ok, msg = check_lse(not_inf, lse)
    assert not ok and "empty rows" in msg
    poisoned = np.full_like(lse, np.nan)
    assert not check_lse(poisoned, lse)[0]
    assert not check_lse(lse[:, :1], lse)[0]


def test_random_qkv():
    q, k, v = random_qkv(2, 5, 7, 4, 2, 16, "fp16", seed=1)
    assert q.shape == (2, 5, 4, 16) and k.shape == v.shape == (2, 7, 2, 16)
    assert q.dtype == k.dtype == np.float16
    for x in (q, k, v):
        assert (x != 0).mean() > 0.99 and 0.7 < float(np.std(x.astype(np.float64))) < 1.3
    again = random_qkv(2, 5, 7, 4, 2, 16, "fp16", seed=1)
    assert all(np.array_equal(a, b) for a, b in zip((q, k, v), again))
    fresh1 = random_qkv(1, 8, 8, 1, 1, 8, "fp16")
    fresh2 = random_qkv(1, 8, 8, 1, 1, 8, "fp16")
    assert not np.array_equal(fresh1[0], fresh2[0])   # seed=None draws fresh inputs
    qb, _, _ = random_qkv(1, 8, 8, 1, 1, 64, "bf16", seed=0)
    x = qb.astype(np.float32).view(np.uint32) if qb.dtype == np.float32 else None
    if x is not None:                                 # float32 holding bf16-rounded values
        assert (x & 0xFFFF == 0).all()
    with pytest.raises(ValueError, match="dtype"):
        random_qkv(1, 1, 1, 1, 1, 8, "int4")
