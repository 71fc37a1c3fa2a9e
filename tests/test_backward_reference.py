"""facodegen.verify.reference.attention_backward_reference against torch autograd in float64 (and a
finite difference), over causal/GQA/odd lengths: the float64 truth the GPU backward tests use."""

from __future__ import annotations

import numpy as np
import pytest

from facodegen.verify.reference import attention_backward_reference, attention_reference

torch = pytest.importorskip("torch")


def _torch_attention(q, k, v, causal, scale):
    """float64 torch attention with facodegen's layout and bottom-right causal mask."""
    b, sq, hq, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    kk = k.repeat_interleave(hq // hkv, dim=2)
    vv = v.repeat_interleave(hq // hkv, dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", q, kk) * scale
    if causal:
        hidden = torch.arange(sk)[None, :] > torch.arange(sq)[:, None] + (sk - sq)
        s = s.masked_fill(hidden, float("-inf"))
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)    # a row with no visible key: P = 0
    return torch.einsum("bhqk,bkhd->bqhd", p, vv)


@pytest.mark.parametrize("sq, sk, hq, hkv, causal", [
    (1, 1, 2, 2, False), (17, 17, 4, 2, True), (13, 29, 4, 1, True), (29, 13, 3, 3, True),
    (9, 1, 2, 1, False), (9, 1, 2, 2, True), (20, 31, 6, 2, False),
])
def test_backward_reference_matches_torch_autograd(sq, sk, hq, hkv, causal):
    rng = np.random.default_rng(sq * 100 + sk)
    d, scale = 16, 0.37
    q, do = rng.standard_normal((2, sq, hq, d)), rng.standard_normal((2, sq, hq, d))
    k, v = rng.standard_normal((2, sk, hkv, d)), rng.standard_normal((2, sk, hkv, d))
    tq, tk, tv = (torch.tensor(x, requires_grad=True) for x in (q, k, v))
    out = _torch_attention(tq, tk, tv, causal, scale)
    out.backward(torch.tensor(do))
    dq, dk, dv = attention_backward_reference(do, q, k, v, causal=causal, softmax_scale=scale)
    np.testing.assert_allclose(out.detach().numpy(), attention_reference(q, k, v, causal, scale)[0], atol=1e-12)
    for mine, theirs in ((dq, tq.grad), (dk, tk.grad), (dv, tv.grad)):
        np.testing.assert_allclose(mine, theirs.numpy(), rtol=1e-10, atol=1e-12)


def test_backward_reference_matches_a_finite_difference():
    rng = np.random.default_rng(5)
    q, k, v = rng.standard_normal((1, 5, 2, 8)), rng.standard_normal((1, 7, 1, 8)), rng.standard_normal((1, 7, 1, 8))
    do = rng.standard_normal(q.shape)
    dq, dk, dv = attention_backward_reference(do, q, k, v, causal=True)
    loss = lambda q_, k_, v_: float((attention_reference(q_, k_, v_, causal=True)[0] * do).sum())  # noqa: E731
    eps = 1e-6
    for grad, which in ((dq, 0), (dk, 1), (dv, 2)):
        args = [q, k, v]
        idx = tuple(rng.integers(0, n) for n in args[which].shape)
        plus, minus = [a.copy() for a in args], [a.copy() for a in args]
        plus[which][idx] += eps
        minus[which][idx] -= eps
        assert abs((loss(*plus) - loss(*minus)) / (2 * eps) - grad[idx]) < 1e-6


@pytest.mark.parametrize("causal, window_size", [(False, (-1, -1)), (True, (-1, -1)), (True, (3, -1))])
def test_sinks_gradient_reference_is_the_gradient_of_attention_reference(causal, window_size):
    """sinks_gradient_reference (the formula the backward's postprocess sums) against central differences of
    sum(dO ∘ O) in the sinks, through attention_reference with sinks (rows that see no key included)."""
    from facodegen.verify.reference import sinks_gradient_reference
    rng = np.random.default_rng(3)
    q, do = rng.standard_normal((2, 7, 4, 8)), rng.standard_normal((2, 7, 4, 8))
    k, v = rng.standard_normal((2, 5, 2, 8)), rng.standard_normal((2, 5, 2, 8))
    sinks = rng.standard_normal(4)
    out, lse = attention_reference(q, k, v, causal, 0.4, window_size=window_size, sinks=sinks)
    got = sinks_gradient_reference(do, out, lse, sinks)
    eps = 1e-6
    for h in range(4):
        up, down = sinks.copy(), sinks.copy()
        up[h] += eps
        down[h] -= eps
        loss = [(attention_reference(q, k, v, causal, 0.4, window_size=window_size, sinks=s)[0] * do).sum()
                for s in (up, down)]
        assert got[h] == pytest.approx((loss[0] - loss[1]) / (2 * eps), rel=1e-6, abs=1e-8)
