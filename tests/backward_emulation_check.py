"""The check both backward emulations (tests/test_backward_emulation.py, sm80;
tests/test_backward_sm90_emulation.py, sm90) end with: a transliterated main kernel, fed the
preprocess's D and the reference LSE, gives dQ, dK, dV of the float64 reference."""

from __future__ import annotations

import numpy as np

from facodegen.verify.reference import attention_backward_reference, attention_reference

E = np.float16     # elem_t (fp16: the emulations round where the kernels convert)


def check_emulated_backward(run_main_kernel, spec, sq: int, sk: int, hq: int, hkv: int, causal: bool,
                            seed: int, window_size=None, softcap: float = 0.0) -> None:
    """run_main_kernel(spec, q, k, v, do, lse, dpsum, causal, scale[, window=..., softcap=...]) -> (dq_accum, dk,
    dv) against attention_backward_reference, within 2e-2 of the largest gradient (fp16 operands).
    ``window_size``: a sliding window (attention()'s, bottom-right), which the kernel gets as api.window_params
    folds it (window=(window_left, window_right) and its causal flag); ``softcap``: the logits' cap c."""
    from facodegen.ops.api import window_params
    rng = np.random.default_rng(seed)
    d = spec.head_dim
    q, do = (rng.standard_normal((1, sq, hq, d)).astype(E) for _ in range(2))
    k, v = (rng.standard_normal((1, sk, hkv, d)).astype(E) for _ in range(2))
    scale = 0.2
    windowed = ({} if window_size is None else {"window_size": window_size}) | ({"softcap": softcap} if softcap else {})
    out, lse = attention_reference(q, k, v, causal, scale, **windowed)
    out = out.astype(E)
    dpsum = np.einsum("bqhd,bqhd->bhq", do.astype(np.float64), out.astype(np.float64))     # the preprocess
    if window_size is None and not softcap:
        dq_accum, dk, dv = run_main_kernel(spec, q, k, v, do, lse, dpsum, causal, scale)
    else:
        local, kernel_causal, left, right = window_params(*(window_size or (-1, -1)), causal, sq, sk)
        assert local == spec.local and kernel_causal == spec.causal and bool(softcap) == spec.softcap, \
            "the spec must be the variant's kernel"
        dq_accum, dk, dv = run_main_kernel(spec, q, k, v, do, lse, dpsum, kernel_causal, scale,
                                           window=(left, right) if local else None, softcap=softcap)
    dq = (dq_accum * scale).transpose(0, 2, 1, 3)                                          # the postprocess
    rq, rk, rv = attention_backward_reference(do, q, k, v, causal, scale, **windowed)
    for name, got, ref in (("dq", dq, rq), ("dk", dk, rk), ("dv", dv, rv)):
        err = np.abs(got - ref).max()
        assert err <= 2e-2 * max(1.0, np.abs(ref).max()), (name, err)
