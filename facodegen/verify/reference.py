"""Float64 NumPy attention, the FlashAttention-1/-2 tiled algorithms, and error metrics.

Everything here follows the semantics of docs/design.md:

* Q (batch, seqlen_q, heads_q, d), K/V (batch, seqlen_k, heads_kv, d); heads_kv divides heads_q
  and q head ``h`` reads kv head ``h // (heads_q // heads_kv)`` (GQA; MQA when heads_kv = 1).
* Causal masks are bottom-right aligned: key ``j`` is visible to query ``i`` iff
  ``j <= i + seqlen_k - seqlen_q``.
* LSE is (batch, heads_q, seqlen_q), natural log of the sum of ``exp(scale * s_ij)`` over the
  visible keys. A row with no visible key has O = 0 and LSE = -inf.

:func:`attention_reference` is the direct formula (one row block at a time, so seqlen 16k with a
few heads fits in a few hundred MB). :func:`flash1_reference` and :func:`flash2_reference` are the
tiled algorithms of the FlashAttention papers, with the tile sizes as parameters; they agree with
the direct formula to about 1e-13 and exist to make the algorithms (and their corner cases:
masked blocks, empty rows, ragged last tiles) executable on a CPU.

:func:`compare`, :func:`check` and :func:`check_lse` turn a kernel's output into a verdict;
:func:`random_qkv` draws fresh random inputs (never zeros) for NumPy, CuPy or torch.
"""

from __future__ import annotations

import math

import numpy as np

# Relative Frobenius error allowed for O, per storage dtype of the inputs/outputs. The kernel sees
# the same rounded inputs as the float64 reference, so its error is the bf16/fp16 rounding of O
# (about 2e-3 bf16, 3e-4 fp16) plus fp32 accumulation: these bounds leave 5x headroom.
TOLERANCE = {"bf16": 1e-2, "fp16": 2e-3, "fp32": 1e-5, "fp64": 1e-12}

# Relative Frobenius error of an fp8 kernel's O against the float64 reference computed from the same
# (dequantised) e4m3 inputs: P is rounded to e4m3 inside the kernel (3 mantissa bits: ~2-3% per
# element, averaging down over the keys) and O to bf16. Issue 6's bound on randn inputs.
FP8_TOLERANCE = 3e-2

# LSE is float32 computed from the same inputs: only fp32 accumulation and exp2 rounding differ.
LSE_ATOL = 1e-3
LSE_RTOL = 1e-4

# Largest score block (rows x seqlen_k float64 elements) attention_reference materialises: 128 MB.
_CHUNK_ELEMENTS = 1 << 24


# ----------------------------------------------------------------------------------------------
# conversions
# ----------------------------------------------------------------------------------------------

def to_float64(x) -> np.ndarray:
    """A float64 NumPy copy of a NumPy array, CuPy array or torch tensor (any float dtype)."""
    if isinstance(x, np.ndarray):
        return x.astype(np.float64)
    module = type(x).__module__
    if module.startswith("torch"):
        return x.detach().to(dtype=_torch().float64).cpu().numpy()
    if module.startswith("cupy"):
        return x.astype("float64").get()
    return np.asarray(x, dtype=np.float64)


def dtype_name(dtype) -> str:
    """'bf16' | 'fp16' | 'fp32' | 'fp64' for a string, NumPy dtype or torch dtype."""
    s = str(dtype).lower().replace("torch.", "")
    names = {"bf16": "bf16", "bfloat16": "bf16", "fp16": "fp16", "float16": "fp16", "half": "fp16",
             "fp32": "fp32", "float32": "fp32", "float": "fp32", "fp64": "fp64", "float64": "fp64",
             "double": "fp64"}
    if s not in names:
        raise ValueError(f"dtype: {dtype!r} is not one of bf16, fp16, fp32, fp64")
    return names[s]


def _torch():
    import torch
    return torch


# ----------------------------------------------------------------------------------------------
# shapes and masks
# ----------------------------------------------------------------------------------------------

def _shapes(q: np.ndarray, k: np.ndarray, v: np.ndarray, any_head_dim_v: bool = False):
    """(batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim) of checked q, k, v; with
    ``any_head_dim_v`` v's head_dim (head_dim_v, v.shape[3]) may differ from q's and k's."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.ndim != 4:
            raise ValueError(f"{name}: expected (batch, seqlen, heads, head_dim), got shape {x.shape}")
    b, sq, hq, d = q.shape
    bk, sk, hkv, dk = k.shape
    if (k.shape[:3] if any_head_dim_v else k.shape) != (v.shape[:3] if any_head_dim_v else v.shape):
        raise ValueError(f"v: shape {v.shape} does not match k's {k.shape}")
    if bk != b:
        raise ValueError(f"k: batch {bk} does not match q's {b}")
    if dk != d:
        raise ValueError(f"k: head_dim {dk} does not match q's {d}")
    if hkv == 0 or hq % hkv:
        raise ValueError(f"heads: heads_kv={hkv} must divide heads_q={hq}")
    return b, sq, sk, hq, hkv, d


def _scale(softmax_scale, d: int) -> float:
    return 1.0 / math.sqrt(d) if softmax_scale is None else float(softmax_scale)


def causal_mask(rows: np.ndarray, cols: np.ndarray, seqlen_q: int, seqlen_k: int) -> np.ndarray:
    """Boolean (len(rows), len(cols)), True where key ``col`` is HIDDEN from query ``row``
    (bottom-right aligned: visible iff col <= row + seqlen_k - seqlen_q)."""
    return cols[None, :] > rows[:, None] + (seqlen_k - seqlen_q)


def _exp_from(x: np.ndarray, m_new: np.ndarray) -> np.ndarray:
    """exp(x - m_new), 0 where x = -inf (including -inf - -inf, which would be NaN)."""
    m_safe = np.where(np.isneginf(m_new), 0.0, m_new)
    return np.where(np.isneginf(x), 0.0, np.exp(np.where(np.isneginf(x), 0.0, x - m_safe)))


# ----------------------------------------------------------------------------------------------
# the direct formula
# ----------------------------------------------------------------------------------------------

def window_mask(rows: np.ndarray, cols: np.ndarray, seqlen_q: int, seqlen_k: int, window_size=(-1, -1),
                causal: bool = False, top_left: bool = False) -> np.ndarray:
    """Boolean (len(rows), len(cols)), True where key ``col`` is HIDDEN from query ``row`` under
    FlashAttention's sliding window (left, right) (-1: unbounded): visible iff
    i' - left <= col <= i' + right with i' = row + seqlen_k - seqlen_q (i' = row when ``top_left``);
    ``causal`` makes right 0."""
    left, right = window_size
    if causal:
        right = 0
    diag = rows[:, None] + (0 if top_left else seqlen_k - seqlen_q)
    hidden = np.zeros((len(rows), len(cols)), dtype=bool)
    if left >= 0:
        hidden |= cols[None, :] < diag - left
    if right >= 0:
        hidden |= cols[None, :] > diag + right
    return hidden


def attention_reference(q, k, v, causal: bool = False, softmax_scale: float | None = None, *,
                        window_size=(-1, -1), softcap: float = 0.0, sinks=None, top_left: bool = False):
    """(O, LSE) in float64: O (batch, seqlen_q, heads_q, d_v), LSE (batch, heads_q, seqlen_q); d_v is
    v's head_dim (v.shape[3], head_dim_v), which may differ from q's and k's d; the default scale is
    1/sqrt(d).

    Inputs of any float dtype (NumPy, CuPy or torch) are upcast to float64. Loops over batch,
    heads and blocks of query rows, so at most 128 MB of scores are live at a time.

    Attention variants (facodegen.attention's): ``window_size`` (see window_mask; ``top_left``
    aligns it and causal to the top-left corner), ``softcap`` c > 0 (logits c tanh(scale s / c)),
    ``sinks`` (heads_q,) logits that join each head's denominator with no value; the LSE then
    includes the sink, and a row with no visible key has O = 0 and LSE = its sink."""
    q, k, v = to_float64(q), to_float64(k), to_float64(v)
    b, sq, sk, hq, hkv, d = _shapes(q, k, v, any_head_dim_v=True)
    scale = _scale(softmax_scale, d)
    sink = None if sinks is None else to_float64(sinks).reshape(-1)
    if sink is not None and sink.shape != (hq,):
        raise ValueError(f"sinks: expected shape ({hq},), got {sink.shape}")
    windowed = tuple(window_size) != (-1, -1) or top_left
    group = hq // hkv
    o = np.zeros((b, sq, hq, v.shape[3]))
    lse = np.full((b, hq, sq), -np.inf)
    if sq == 0 or sk == 0:
        if sink is not None:
            lse[:] = sink[None, :, None]        # no key at all: every row's LSE is its sink alone
        return o, lse
    chunk = max(1, min(sq, _CHUNK_ELEMENTS // sk))
    cols = np.arange(sk)
    for bi in range(b):
        for h in range(hq):
            kh = k[bi, :, h // group, :]
            vh = v[bi, :, h // group, :]
            for r0 in range(0, sq, chunk):
                r1 = min(sq, r0 + chunk)
                s = scale * (q[bi, r0:r1, h, :] @ kh.T)                       # S = scale Q K^T
                if softcap:
                    s = softcap * np.tanh(s / softcap)
                if windowed:
                    s[window_mask(np.arange(r0, r1), cols, sq, sk, window_size, causal, top_left)] = -np.inf
                elif causal:
                    s[causal_mask(np.arange(r0, r1), cols, sq, sk)] = -np.inf
                m = s.max(axis=1)
                if sink is not None:
                    m = np.maximum(m, sink[h])
                empty = np.isneginf(m)
                p = np.exp(s - np.where(empty, 0.0, m)[:, None])               # masked -> 0
                l = p.sum(axis=1)
                if sink is not None:
                    l = l + np.exp(sink[h] - np.where(empty, 0.0, m))
                o[bi, r0:r1, h, :] = (p @ vh) / np.where(empty, 1.0, l)[:, None]
                with np.errstate(divide="ignore"):
                    lse[bi, h, r0:r1] = np.where(empty, -np.inf, m + np.log(np.where(empty, 1.0, l)))
    return o, lse


def varlen_reference(q, k, v, cu_seqlens_q, cu_seqlens_k, causal: bool = False, softmax_scale: float | None = None,
                     *, window_size=(-1, -1), softcap: float = 0.0, sinks=None):
    """(O, LSE) in float64 of packed variable-length attention (FlashAttention's flash_attn_varlen_func):
    O (total_q, heads_q, d_v), LSE (heads_q, total_q).

    q (total_q, heads_q, d), k (total_k, heads_kv, d), v (total_k, heads_kv, d_v); sequence b is query tokens
    cu_seqlens_q[b] .. cu_seqlens_q[b+1]-1 against key tokens cu_seqlens_k[b] .. cu_seqlens_k[b+1]-1,
    causal aligned bottom-right within the sequence, and so is ``window_size`` (window_mask's, each
    sequence's own diagonal); ``softcap`` and ``sinks`` as attention_reference takes them. A row that
    sees no key (and every row of a sequence with no key) gets O = 0 and LSE = -inf (with sinks: its
    sink); tokens no sequence covers stay O = 0, LSE = -inf. All heads of a sequence at once (query
    head h reads key head h // (heads_q // heads_kv)), so this is a second derivation of what
    attention_reference computes per sequence."""
    q, k, v = to_float64(q), to_float64(k), to_float64(v)
    cu_q = np.asarray(to_float64(cu_seqlens_q), dtype=np.int64)
    cu_k = np.asarray(to_float64(cu_seqlens_k), dtype=np.int64)
    if q.ndim != 3 or k.ndim != 3 or v.ndim != 3 or k.shape[:2] != v.shape[:2] or cu_q.shape != cu_k.shape \
            or cu_q.ndim != 1:
        raise ValueError(f"varlen_reference: q (total_q, heads_q, d), k (total_k, heads_kv, d), v (total_k, heads_kv, "
                         f"d_v) and two (batch + 1,) cu_seqlens, got {q.shape}, {k.shape}, {v.shape}, {cu_q.shape}, "
                         f"{cu_k.shape}")
    total_q, heads_q, d = q.shape
    group = heads_q // k.shape[1]
    scale = _scale(softmax_scale, d)
    sink = None if sinks is None else to_float64(sinks).reshape(-1)
    if sink is not None and sink.shape != (heads_q,):
        raise ValueError(f"sinks: expected shape ({heads_q},), got {sink.shape}")
    o = np.zeros((total_q, heads_q, v.shape[2]))     # (V may be narrower than Q and K: O is as V)
    lse = np.full((heads_q, total_q), -np.inf)
    for b in range(len(cu_q) - 1):
        q0, q1, k0, k1 = cu_q[b], cu_q[b + 1], cu_k[b], cu_k[b + 1]
        seqlen_q, seqlen_k = q1 - q0, k1 - k0
        if seqlen_q <= 0:
            continue
        keys = np.repeat(k[k0:k1], group, axis=1).transpose(1, 0, 2)          # (heads_q, seqlen_k, d)
        values = np.repeat(v[k0:k1], group, axis=1).transpose(1, 0, 2)
        s = scale * (q[q0:q1].transpose(1, 0, 2) @ keys.transpose(0, 2, 1))     # (heads_q, seqlen_q, seqlen_k)
        if softcap:
            s = softcap * np.tanh(s / softcap)
        if tuple(window_size) != (-1, -1):
            s = np.where(window_mask(np.arange(seqlen_q), np.arange(seqlen_k), seqlen_q, seqlen_k, window_size,
                                     causal), -np.inf, s)
        elif causal:
            s = np.where(causal_mask(np.arange(seqlen_q), np.arange(seqlen_k), seqlen_q, seqlen_k), -np.inf, s)
        m = s.max(axis=2, initial=-np.inf)
        if sink is not None:
            m = np.maximum(m, sink[:, None])
        seen = np.isfinite(m)
        p = np.exp(s - np.where(seen, m, 0.0)[..., None])                      # hidden keys: exp(-inf) = 0
        l_sum = p.sum(axis=2)
        if sink is not None:
            l_sum = l_sum + np.exp(sink[:, None] - np.where(seen, m, 0.0))
        o[q0:q1] = np.where(seen[..., None], (p @ values) / np.where(seen, l_sum, 1.0)[..., None], 0.0).transpose(1, 0, 2)
        lse[:, q0:q1] = np.where(seen, m + np.log(np.where(seen, l_sum, 1.0)), -np.inf)
    return o, lse


def attention_backward_reference(do, q, k, v, causal: bool = False, softmax_scale: float | None = None, *,
                                 window_size=(-1, -1), top_left: bool = False, softcap: float = 0.0):
    """(dQ, dK, dV) in float64 of O = softmax(scale Q K^T [+ causal mask]) V given dO, with the
    layouts and masks of :func:`attention_reference` (``window_size``, ``top_left``: its sliding window, see
    window_mask; ``softcap``: logits c tanh(scale S / c)); dK, dV of a kv head are summed over the query heads
    that share it (GQA/MQA). A query row with no visible key contributes nothing. Computed from the scores
    directly (P = exp(scale S - LSE), D = rowsum(dO ∘ O), dS = P ∘ (dP - D), times 1 - tanh^2 under a softcap),
    one block of query rows at a time like attention_reference."""
    do, q, k, v = to_float64(do), to_float64(q), to_float64(k), to_float64(v)
    b, sq, sk, hq, hkv, d = _shapes(q, k, v)
    if do.shape != q.shape:
        raise ValueError(f"do: shape {do.shape} does not match q's {q.shape}")
    scale = _scale(softmax_scale, d)
    group = hq // hkv
    windowed = tuple(window_size) != (-1, -1) or top_left
    dq, dk, dv = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
    chunk = max(1, min(sq, _CHUNK_ELEMENTS // max(sk, 1)))
    cols = np.arange(sk)
    for bi in range(b):
        for h in range(hq):
            kh, vh = k[bi, :, h // group, :], v[bi, :, h // group, :]
            for r0 in range(0, sq, chunk):
                r1 = min(sq, r0 + chunk)
                s = scale * (q[bi, r0:r1, h, :] @ kh.T)                       # S = scale Q K^T
                if softcap:
                    t = np.tanh(s / softcap)
                    s = softcap * t                                            # the capped logits
                if windowed:
                    s[window_mask(np.arange(r0, r1), cols, sq, sk, window_size, causal, top_left)] = -np.inf
                elif causal:
                    s[causal_mask(np.arange(r0, r1), cols, sq, sk)] = -np.inf
                m = s.max(axis=1)
                empty = np.isneginf(m)
                p = np.exp(s - np.where(empty, 0.0, m)[:, None])               # masked -> 0
                p /= np.where(empty, 1.0, p.sum(axis=1))[:, None]              # P = softmax(S)
                g = do[bi, r0:r1, h, :]
                dp = g @ vh.T                                                  # dP = dO V^T
                o = p @ vh
                ds = p * (dp - (g * o).sum(axis=1)[:, None])                  # dS = P ∘ (dP - rowsum(dO ∘ O))
                if softcap:
                    ds *= 1.0 - t * t                                          # through c tanh(x / c)
                dq[bi, r0:r1, h, :] += scale * (ds @ kh)                       # dQ = scale dS K
                dk[bi, :, h // group, :] += scale * (ds.T @ q[bi, r0:r1, h, :])  # dK = scale dS^T Q
                dv[bi, :, h // group, :] += p.T @ g                            # dV = P^T dO
    return dq, dk, dv


def sinks_gradient_reference(do, out, lse, sinks) -> np.ndarray:
    """float64 (heads_q,) gradient of the sink logits given dO, the forward's O (batch, seqlen_q, heads_q, d) and
    its LSE (batch, heads_q, seqlen_q), which includes the sinks: each sink is a softmax column with no value, so
    dsink_h = sum_(b, i) P_sink (0 - D) = -sum_(b, i) exp(sink_h - LSE_bhi) D_bhi, D = rowsum(dO ∘ O) (what the
    backward's postprocess computes)."""
    do, out, lse, sink = to_float64(do), to_float64(out), to_float64(lse), to_float64(sinks).reshape(-1)
    d = np.einsum("bqhd,bqhd->bhq", do, out)
    return -(np.exp(sink[None, :, None] - lse) * d).sum(axis=(0, 2))


def varlen_backward_reference(do, q, k, v, cu_seqlens_q, cu_seqlens_k, causal: bool = False,
                              softmax_scale: float | None = None, *, window_size=(-1, -1), softcap: float = 0.0):
    """(dQ, dK, dV) in float64 of :func:`varlen_reference`'s O given dO, packed as q, k and v: each
    sequence's attention_backward_reference (causal and ``window_size`` on its own bottom-right diagonal,
    ``softcap``). Tokens no sequence covers get zero gradients."""
    do, q, k, v = to_float64(do), to_float64(q), to_float64(k), to_float64(v)
    cu_q = np.asarray(to_float64(cu_seqlens_q), dtype=np.int64)
    cu_k = np.asarray(to_float64(cu_seqlens_k), dtype=np.int64)
    if q.ndim != 3 or k.ndim != 3 or v.shape != k.shape or do.shape != q.shape or cu_q.shape != cu_k.shape:
        raise ValueError(f"varlen_backward_reference: do, q (total_q, heads_q, d), k, v (total_k, heads_kv, d) and two "
                         f"(batch + 1,) cu_seqlens, got {do.shape}, {q.shape}, {k.shape}, {v.shape}, {cu_q.shape}, "
                         f"{cu_k.shape}")
    scale = _scale(softmax_scale, q.shape[2])
    dq, dk, dv = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
    for b in range(len(cu_q) - 1):
        rows, keys = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        if rows.stop <= rows.start or keys.stop <= keys.start:
            continue    # no query, or no key: nothing is attended, every gradient is zero
        grads = attention_backward_reference(do[None, rows], q[None, rows], k[None, keys], v[None, keys], causal,
                                             scale, window_size=window_size, softcap=softcap)
        dq[rows], dk[keys], dv[keys] = (g[0] for g in grads)
    return dq, dk, dv


# ----------------------------------------------------------------------------------------------
# the tiled algorithms
# ----------------------------------------------------------------------------------------------

def _bhsd(q, k, v):
    """float64 (batch, heads_q, seqlen, d) views with K/V heads repeated for GQA (V's d: its own)."""
    q, k, v = to_float64(q), to_float64(k), to_float64(v)
    b, sq, sk, hq, hkv, d = _shapes(q, k, v, any_head_dim_v=True)
    group = hq // hkv
    qt = q.transpose(0, 2, 1, 3)
    kt = np.repeat(k.transpose(0, 2, 1, 3), group, axis=1)
    vt = np.repeat(v.transpose(0, 2, 1, 3), group, axis=1)
    return qt, kt, vt, (b, sq, sk, hq, hkv, d)


def _check_blocks(block_m: int, block_n: int) -> None:
    for name, value in (("block_m", block_m), ("block_n", block_n)):
        if not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name}: must be a positive integer, got {value!r}")


def flash1_reference(q, k, v, causal: bool = False, softmax_scale: float | None = None,
                     block_m: int = 64, block_n: int = 64):
    """FlashAttention-1 (Dao et al. 2022, Algorithm 1), in float64 NumPy.

    K/V blocks in the outer loop, Q blocks in the inner loop. The running row max ``m`` and row
    sum ``l`` live in "global memory" arrays between K/V blocks, and O is kept normalised:
    after every block ``O_i = diag(l_new)^-1 (diag(l_i) e^{m_i - m_new} O_i + e^{m~ - m_new} P~ V_j)``.
    Blocks that the causal mask hides entirely are skipped."""
    _check_blocks(block_m, block_n)
    qt, kt, vt, (b, sq, sk, hq, _, d) = _bhsd(q, k, v)
    scale = _scale(softmax_scale, d)
    o = np.zeros((b, hq, sq, vt.shape[3]))        # in "HBM" (V's head_dim)
    l = np.zeros((b, hq, sq))
    m = np.full((b, hq, sq), -np.inf)
    for j0 in range(0, sk, block_n):
        j1 = min(sk, j0 + block_n)
        kj, vj = kt[:, :, j0:j1], vt[:, :, j0:j1]                              # load K_j, V_j
        for i0 in range(0, sq, block_m):
            i1 = min(sq, i0 + block_m)
            if causal and j0 > (i1 - 1) + sk - sq:
                continue                                                      # block fully masked
            s = scale * (qt[:, :, i0:i1] @ kj.transpose(0, 1, 3, 2))          # S_ij = scale Q_i K_j^T
            if causal:
                s = np.where(causal_mask(np.arange(i0, i1), np.arange(j0, j1), sq, sk), -np.inf, s)
            m_tilde = s.max(axis=-1)                                          # m~_ij = rowmax(S_ij)
            p = _exp_from(s, m_tilde[..., None])                              # P~_ij = exp(S_ij - m~_ij)
            l_tilde = p.sum(axis=-1)                                          # l~_ij = rowsum(P~_ij)
            m_i, l_i = m[:, :, i0:i1], l[:, :, i0:i1]
            m_new = np.maximum(m_i, m_tilde)
            alpha = _exp_from(m_i, m_new)                                     # e^{m_i - m_new}
            beta = _exp_from(m_tilde, m_new)                                  # e^{m~_ij - m_new}
            l_new = alpha * l_i + beta * l_tilde
            o_i = (l_i * alpha)[..., None] * o[:, :, i0:i1] + beta[..., None] * (p @ vj)
            o[:, :, i0:i1] = o_i / np.where(l_new > 0, l_new, 1.0)[..., None]  # write O_i back
            l[:, :, i0:i1] = l_new
            m[:, :, i0:i1] = m_new
    with np.errstate(divide="ignore"):
        lse = np.where(l > 0, m + np.log(np.where(l > 0, l, 1.0)), -np.inf)
    return o.transpose(0, 2, 1, 3), lse


def n_block_max(m_block: int, block_m: int, block_n: int, seqlen_q: int, seqlen_k: int,
                causal: bool) -> int:
    """How many K/V blocks the Q block ``m_block`` reads (FlashAttention-2/3's n_block_max):
    all of them, or under the causal mask only those up to the last row's diagonal.
    Zero or less means every row of the block is empty (O = 0, LSE = -inf)."""
    n_blocks = -(-seqlen_k // block_n)
    if not causal:
        return n_blocks
    last_row_end = min(seqlen_q, (m_block + 1) * block_m)
    return min(n_blocks, -(-(last_row_end + seqlen_k - seqlen_q) // block_n))


def flash2_reference(q, k, v, causal: bool = False, softmax_scale: float | None = None,
                     block_m: int = 128, block_n: int = 64):
    """FlashAttention-2 (Dao 2023, Algorithm 1) as the kernels compute it, in float64 NumPy.

    Q blocks in the outer loop (one CTA each), K/V blocks in the inner loop from the last
    needed block down (masked blocks first, as FA2/FA3 do). The accumulator is unnormalised:
    when the row max moves it is rescaled by ``exp(m_old - m_new)`` only, and divided by ``l``
    once at the end; LSE = scale * m + log l. As in design.md the row max is kept on the
    unscaled scores and ``exp(scale (s - m))`` is computed as ``exp2(s * scale_log2 - m * scale_log2)``,
    which needs ``softmax_scale > 0``."""
    _check_blocks(block_m, block_n)
    qt, kt, vt, (b, sq, sk, hq, _, d) = _bhsd(q, k, v)
    scale = _scale(softmax_scale, d)
    if not scale > 0:
        raise ValueError(f"softmax_scale: the FA2 schedule keeps the row max unscaled and needs a "
                         f"positive scale, got {scale}")
    scale_log2 = scale * math.log2(math.e)
    o = np.zeros((b, hq, sq, vt.shape[3]))                                    # (V's head_dim)
    lse = np.full((b, hq, sq), -np.inf)
    for m_block in range(-(-sq // block_m)):
        i0, i1 = m_block * block_m, min(sq, (m_block + 1) * block_m)
        n_max = n_block_max(m_block, block_m, block_n, sq, sk, causal)
        if n_max <= 0:
            continue                                                          # all rows empty
        qi = qt[:, :, i0:i1]                                                  # Q_i stays on chip
        row_max = np.full((b, hq, i1 - i0), -np.inf)
        row_sum = np.zeros((b, hq, i1 - i0))
        acc = np.zeros((b, hq, i1 - i0, vt.shape[3]))
        for n_block in reversed(range(n_max)):
            j0, j1 = n_block * block_n, min(sk, (n_block + 1) * block_n)
            s = qi @ kt[:, :, j0:j1].transpose(0, 1, 3, 2)                    # S = Q K^T (unscaled)
            if causal:
                s = np.where(causal_mask(np.arange(i0, i1), np.arange(j0, j1), sq, sk), -np.inf, s)
            m_new = np.maximum(row_max, s.max(axis=-1))
            m_scaled = np.where(np.isneginf(m_new), 0.0, m_new * scale_log2)
            p = np.exp2(s * scale_log2 - m_scaled[..., None])                 # -inf -> 0
            alpha = np.where(np.isneginf(row_max), 0.0,
                             np.exp2(np.where(np.isneginf(row_max), 0.0, row_max * scale_log2) - m_scaled))
            row_sum = alpha * row_sum + p.sum(axis=-1)
            acc = alpha[..., None] * acc + p @ vt[:, :, j0:j1]                # O = diag(alpha) O + P V
            row_max = m_new
        visible = row_sum > 0
        o[:, :, i0:i1] = acc / np.where(visible, row_sum, 1.0)[..., None]     # divide by l once
        with np.errstate(divide="ignore"):
            lse[:, :, i0:i1] = np.where(visible, row_max * scale + np.log(np.where(visible, row_sum, 1.0)),
                                        -np.inf)
    return o.transpose(0, 2, 1, 3), lse


# ----------------------------------------------------------------------------------------------
# error metrics
# ----------------------------------------------------------------------------------------------

def compare(out, ref) -> dict:
    """rel_fro = ||out - ref||_F / ||ref||_F, max_abs = max |out - ref|, nan = any non-finite
    entry in out. With a non-finite entry both errors are inf, so no tolerance passes."""
    o, r = to_float64(out), to_float64(ref)
    if o.shape != r.shape:
        raise ValueError(f"out: shape {o.shape} does not match the reference's {r.shape}")
    nan = not bool(np.isfinite(o).all())
    if nan:
        return {"rel_fro": math.inf, "max_abs": math.inf, "nan": True}
    diff = o - r
    diff_norm = float(np.linalg.norm(diff.ravel()))
    ref_norm = float(np.linalg.norm(r.ravel()))
    if ref_norm > 0:
        rel = diff_norm / ref_norm
    else:
        rel = 0.0 if diff_norm == 0 else math.inf
    max_abs = float(np.abs(diff).max()) if diff.size else 0.0
    return {"rel_fro": rel, "max_abs": max_abs, "nan": False}


def check(out, ref, dtype) -> tuple[bool, str]:
    """(ok, message): O within TOLERANCE[dtype] in relative Frobenius norm (dtype "fp8": e4m3 inputs,
    FP8_TOLERANCE against the reference of their dequantised values), and never NaN/inf."""
    name = "fp8" if dtype == "fp8" else dtype_name(dtype)
    tol = FP8_TOLERANCE if name == "fp8" else TOLERANCE[name]
    c = compare(out, ref)
    ok = (not c["nan"]) and c["rel_fro"] <= tol
    msg = (f"{'ok' if ok else 'FAIL'}: rel_fro={c['rel_fro']:.3e} (tol {tol:.0e} {name}), "
           f"max_abs={c['max_abs']:.3e}" + (", non-finite values in the output" if c["nan"] else ""))
    return ok, msg


def check_lse(lse, lse_ref, atol: float = LSE_ATOL, rtol: float = LSE_RTOL) -> tuple[bool, str]:
    """(ok, message): -inf exactly where the reference is -inf (rows with no visible key), and
    elsewhere finite and within atol + rtol*|ref|."""
    x, r = to_float64(lse), to_float64(lse_ref)
    if x.shape != r.shape:
        return False, f"FAIL: lse shape {x.shape} does not match the reference's {r.shape}"
    empty = np.isneginf(r)
    problems = []
    bad_empty = int((~np.isneginf(x[empty])).sum())
    if bad_empty:
        problems.append(f"{bad_empty} of {int(empty.sum())} empty rows are not -inf")
    xf, rf = x[~empty], r[~empty]
    nonfinite = int((~np.isfinite(xf)).sum())
    if nonfinite:
        problems.append(f"{nonfinite} non-finite entries where the reference is finite")
    err = np.abs(np.where(np.isfinite(xf), xf, np.inf) - rf) if xf.size else np.zeros(0)
    worst = float(err.max()) if err.size else 0.0
    far = int((err > atol + rtol * np.abs(rf)).sum()) - nonfinite if err.size else 0
    if far > 0:
        problems.append(f"{far} entries off by more than {atol:g} + {rtol:g}*|ref|")
    ok = not problems
    msg = f"{'ok' if ok else 'FAIL'}: lse max_abs={worst:.3e}" + ("; " + "; ".join(problems) if problems else "")
    return ok, msg


# ----------------------------------------------------------------------------------------------
# inputs
# ----------------------------------------------------------------------------------------------

def _round_to_bf16(x: np.ndarray) -> np.ndarray:
    """float32 values rounded to the nearest bfloat16 (ties to even), kept as float32."""
    bits = x.astype(np.float32).view(np.uint32)
    rounded = (bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) & np.uint32(0xFFFF0000)
    return rounded.view(np.float32)


def random_qkv(batch: int, seqlen_q: int, seqlen_k: int, heads_q: int, heads_kv: int, head_dim: int,
               dtype="bf16", seed: int | None = None, xp=np, device=None, head_dim_v: int | None = None):
    """Fresh standard-normal (q, k, v) in (batch, seqlen, heads, head_dim) layout, never zeros
    (``head_dim_v``: v's head_dim where it differs from q's and k's).

    ``xp`` is numpy, cupy or torch (the module). torch tensors go to ``device`` (default "cuda").
    NumPy has no bfloat16: bf16 comes as ``ml_dtypes.bfloat16`` where that package is installed,
    else as float32 arrays holding bf16-rounded values. CuPy has no bfloat16 either: use torch."""
    name = dtype_name(dtype)
    shapes = [(batch, seqlen_q, heads_q, head_dim), (batch, seqlen_k, heads_kv, head_dim),
              (batch, seqlen_k, heads_kv, head_dim if head_dim_v is None else head_dim_v)]
    xp_name = getattr(xp, "__name__", str(xp))
    if xp_name.startswith("torch"):
        torch = xp
        tdtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32,
                  "fp64": torch.float64}[name]
        dev = torch.device(device if device is not None else "cuda")
        gen = torch.Generator(device=dev)
        if seed is None:
            gen.seed()
        else:
            gen.manual_seed(seed)
        return tuple(torch.randn(s, generator=gen, device=dev, dtype=tdtype) for s in shapes)
    if xp_name.startswith("cupy"):
        if name == "bf16":
            raise TypeError("dtype: CuPy has no bfloat16; draw bf16 inputs with xp=torch")
        rs = xp.random.RandomState(seed)
        return tuple(rs.standard_normal(s, dtype=xp.float32).astype(
            {"fp16": xp.float16, "fp32": xp.float32, "fp64": xp.float64}[name]) for s in shapes)
    rng = np.random.default_rng(seed)
    out = []
    for s in shapes:
        x = rng.standard_normal(s, dtype=np.float32)
        if name == "bf16":
            try:
                import ml_dtypes
                x = x.astype(ml_dtypes.bfloat16)
            except ImportError:
                x = _round_to_bf16(x)
        else:
            x = x.astype({"fp16": np.float16, "fp32": np.float32, "fp64": np.float64}[name])
        out.append(x)
    return tuple(out)


# ----------------------------------------------------------------------------------------------
# fp8 (e4m3) inputs
# ----------------------------------------------------------------------------------------------


def _descale_array(descale, batch: int, heads_kv: int, name: str) -> np.ndarray:
    """A descale (number, 0-d/1-element array or tensor, or (batch, heads_kv)) as (batch, heads_kv) float64."""
    d = to_float64(descale) if not isinstance(descale, (int, float)) else np.asarray(float(descale))
    if d.size == 1:
        return np.full((batch, heads_kv), float(d.reshape(())))
    if d.shape != (batch, heads_kv):
        raise ValueError(f"{name}: shape {d.shape}; expected a scalar or (batch, heads_kv) = {(batch, heads_kv)}")
    return d


def dequantize_fp8(x, descale=1.0, heads_kv: int | None = None, v_layout: str = "row") -> np.ndarray:
    """float64 (batch, seqlen, heads, d) values of an e4m3 tensor times its descale.

    ``x``: torch float8_e4m3fn tensor, NumPy uint8 bytes (decoded as e4m3) or float array of e4m3
    values. ``v_layout="transposed"``: x is V^T (batch, heads_kv, d, seqlen_k) and comes back as V.
    Per-(batch, kv head) descales apply to q head h as kv head h // (heads / heads_kv)."""
    from ..ops.quantize import e4m3_decode
    if isinstance(x, np.ndarray) and x.dtype == np.uint8:
        values = e4m3_decode(x)
    else:
        values = to_float64(x)
    if v_layout == "transposed":
        values = values.transpose(0, 3, 1, 2)
    batch, _, heads, _ = values.shape
    heads_kv = heads if heads_kv is None else heads_kv
    d = _descale_array(descale, batch, heads_kv, "descale")
    per_head = np.repeat(d, heads // heads_kv, axis=1)            # (batch, heads)
    return values * per_head[:, None, :, None]


def attention_reference_fp8(q, k, v, q_descale=1.0, k_descale=1.0, v_descale=1.0, causal: bool = False,
                            softmax_scale: float | None = None, v_layout: str = "row", **variants):
    """(O, LSE) in float64 of attention on e4m3 inputs: dequantise (value x descale), then
    :func:`attention_reference` (``variants``: its window_size, softcap, sinks, top_left; the softcap's
    tanh takes the dequantised scores). The descales are per tensor or (batch, heads_kv) as the kernel
    takes them."""
    kv_heads = to_float64(k).shape[2] if not (isinstance(k, np.ndarray) and k.dtype == np.uint8) else k.shape[2]
    qf = dequantize_fp8(q, q_descale, heads_kv=kv_heads)
    kf = dequantize_fp8(k, k_descale)
    vf = dequantize_fp8(v, v_descale, v_layout=v_layout)
    return attention_reference(qf, kf, vf, causal=causal, softmax_scale=softmax_scale, **variants)


# ----------------------------------------------------------------------------------------------
# KV-cache attention (decode): contiguous or paged cache, append, per-sequence lengths
# ----------------------------------------------------------------------------------------------

def kvcache_reference(q, k_cache, v_cache, cache_seqlens, *, page_table=None, k=None, v=None, causal: bool = True,
                      softmax_scale: float | None = None, window_size=(-1, -1), softcap: float = 0.0):
    """Float64 FlashAttention-3 ``flash_attn_with_kvcache``: returns (O, LSE, k_cache', v_cache').
    ``window_size`` (window_mask's, on each sequence's bottom-right diagonal) and ``softcap`` (logits
    c tanh(scale s / c)) as facodegen.attention_with_kvcache takes them.

    q (batch, seqlen_q, heads_q, d); caches (batch, capacity, heads_kv, d) or, with ``page_table``
    (batch, max_pages) int, pages (num_pages, page_size, heads_kv, d): key j of sequence b is row
    j % page_size of page page_table[b, j // page_size]. New tokens k/v (batch, seqlen_new, heads_kv,
    d) are written at cache_seqlens[b] + i first (into float64 copies of the caches, returned), then
    sequence b attends over its first cache_seqlens[b] + seqlen_new keys, bottom-right causal.
    Clamps as the kernels do: cache_seqlens to [0, capacity], positions past the capacity dropped,
    page indices into [0, num_pages). A row with no visible key: O = 0, LSE = -inf."""
    q = to_float64(q)
    kc, vc = to_float64(k_cache), to_float64(v_cache)       # copies: the append writes into them
    lengths = np.asarray(to_float64(cache_seqlens), dtype=np.int64)
    batch, seqlen_q, heads_q, d = q.shape
    heads_kv = kc.shape[2]
    group = heads_q // heads_kv
    scale = _scale(softmax_scale, d)
    if page_table is not None:
        table = np.asarray(to_float64(page_table), dtype=np.int64)
        page_size, num_pages = kc.shape[1], kc.shape[0]
        capacity = table.shape[1] * page_size

        def rows(b, positions):
            pages = np.clip(table[b, positions // page_size], 0, num_pages - 1)
            return pages, positions % page_size
    else:
        capacity = kc.shape[1]

        def rows(b, positions):
            return np.full_like(positions, b), positions
    seqlen_new = 0
    if k is not None:
        kn, vn = to_float64(k), to_float64(v)
        seqlen_new = kn.shape[1]
    o = np.zeros((batch, seqlen_q, heads_q, d))
    lse = np.full((batch, heads_q, seqlen_q), -np.inf)
    for b in range(batch):
        cached = int(np.clip(lengths[b], 0, capacity))
        if seqlen_new:
            positions = np.arange(cached, cached + seqlen_new)
            keep = positions < capacity
            pages, slots = rows(b, positions[keep])
            kc[pages, slots] = kn[b, :seqlen_new][keep]
            vc[pages, slots] = vn[b, :seqlen_new][keep]
        seqlen_k = min(cached + seqlen_new, capacity)
        pages, slots = rows(b, np.arange(seqlen_k))
        keys, values = kc[pages, slots], vc[pages, slots]          # (seqlen_k, heads_kv, d)
        # All heads at once: query head h reads key head h // group, so the queries reshape to
        # (heads_kv, group * seqlen_q) rows per key head.
        rows_q = q[b].reshape(seqlen_q, heads_kv, group, d).transpose(1, 2, 0, 3).reshape(heads_kv, group * seqlen_q, d)
        s = rows_q @ keys.transpose(1, 2, 0) * scale               # (heads_kv, group * seqlen_q, seqlen_k)
        if softcap:
            s = softcap * np.tanh(s / softcap)
        if causal or tuple(window_size) != (-1, -1):    # (rows: query i of each head in turn)
            hidden = window_mask(np.tile(np.arange(seqlen_q), group), np.arange(seqlen_k), seqlen_q, seqlen_k,
                                 window_size, causal)
            s = np.where(hidden, -np.inf, s)
        m = s.max(axis=2, initial=-np.inf)
        seen = np.isfinite(m)
        p = np.exp(s - np.where(seen, m, 0.0)[..., None])
        l_sum = p.sum(axis=2)
        rows_o = np.where(seen[..., None], (p @ values.transpose(1, 0, 2)) / np.where(seen, l_sum, 1.0)[..., None], 0.0)
        o[b] = rows_o.reshape(heads_kv, group, seqlen_q, d).transpose(2, 0, 1, 3).reshape(seqlen_q, heads_q, d)
        lse[b] = np.where(seen, m + np.log(np.where(seen, l_sum, 1.0)), -np.inf).reshape(heads_q, seqlen_q)
    return o, lse, kc, vc


def decode_tiled_reference(q, k_cache, v_cache, cache_seqlens, *, page_table=None, seqlen_new: int = 0,
                           causal: bool = True, softmax_scale: float | None = None, block_m: int = 16,
                           block_n: int = 64, num_warps: int = 4, num_splits: int = 1, pack_gqa: bool = True,
                           window: tuple[int, int] | None = None, softcap: float = 0.0):
    """The decode kernel's algorithm (templates/decode/flash_decode.cu.j2 + flash_combine.cu.j2) in
    float64 NumPy, with its index arithmetic: work items (M tile of packed rows, split, head block,
    sequence), the keys a tile sees (kv_end) and its split of the key blocks, each warp's share of a
    block with its own online softmax (base 2), the warps' merge, then the LSE combine of the splits.
    Caches as kvcache_reference's (already holding any appended tokens; seqlen_new counts them).
    ``window``: a LOCAL kernel's (window_left, window_right) as the host passes them (kvcache.DecodeWindow:
    causal as a right side of 0, unbounded sides as more keys than the cache holds): the tile's keys
    from its first row's first key's block on, split among the splits, each row's left edge masked;
    ``softcap`` c: S = tanh(S scale / c), the softmax then scaled by c. Returns (O, LSE); equals
    kvcache_reference up to rounding."""
    q = to_float64(q)
    kc, vc = to_float64(k_cache), to_float64(v_cache)
    lengths = np.asarray(to_float64(cache_seqlens), dtype=np.int64)
    batch, seqlen_q, heads_q, d = q.shape
    heads_kv = kc.shape[2]
    group = heads_q // heads_kv
    scale = _scale(softmax_scale, d)
    softcap_scale = scale / softcap if softcap else 0.0
    scale = softcap if softcap else scale          # (the kernel's softmax_scale)
    scale_log2 = scale * math.log2(math.e)
    paged = page_table is not None
    table = np.asarray(to_float64(page_table), dtype=np.int64) if paged else None
    capacity = table.shape[1] * kc.shape[1] if paged else kc.shape[1]
    per_cta = group if pack_gqa else 1
    rows_per_item = seqlen_q * per_cta
    m_blocks = -(-rows_per_item // block_m)
    keys_per_warp = block_n // num_warps
    o_part = np.zeros((num_splits, batch, seqlen_q, heads_q, d))
    lse_part = np.full((num_splits, batch, heads_q, seqlen_q), -np.inf)

    def limit(packed, seqlen_k):
        query = min(packed // per_cta, seqlen_q - 1)
        if window is not None:
            return min(max(seqlen_k - seqlen_q + query + 1 + window[1], 0), seqlen_k)
        return min(max(seqlen_k - seqlen_q + query + 1, 0), seqlen_k) if causal else seqlen_k

    def first(packed, seqlen_k):
        query = min(packed // per_cta, seqlen_q - 1)
        return 0 if window is None else min(max(seqlen_k - seqlen_q + query - window[0], 0), seqlen_k)

    def key_rows(b, keys, kv_end):
        valid = keys < kv_end
        if paged:
            pages = np.where(valid, table[b, np.minimum(keys, capacity - 1) // kc.shape[1]], 0)
            pages = np.clip(pages, 0, kc.shape[0] - 1)
            return pages, keys % kc.shape[1], valid
        return np.full_like(keys, b), np.minimum(keys, kc.shape[1] - 1), valid

    for b in range(batch):
        seqlen_k = min(int(np.clip(lengths[b], 0, capacity)) + seqlen_new, capacity)
        for hb in range(heads_q // per_cta):
            head0 = hb * per_cta
            kv_head = head0 // group
            for m_block in range(m_blocks):
                row_begin = m_block * block_m
                rows_valid = min(block_m, rows_per_item - row_begin)
                packed = row_begin + np.arange(block_m)
                query = np.minimum(packed // per_cta, seqlen_q - 1)
                head = head0 + packed % per_cta
                q_tile = np.where((packed < rows_per_item)[:, None], q[b, query, np.minimum(head, heads_q - 1)], 0.0)
                limits = np.array([limit(int(r), seqlen_k) for r in packed])
                firsts = np.array([first(int(r), seqlen_k) for r in packed])
                kv_end = limit(row_begin + rows_valid - 1, seqlen_k)
                first_block = first(row_begin, seqlen_k) // block_n
                n_blocks = max(-(-kv_end // block_n) - first_block, 0)
                per_split = -(-n_blocks // num_splits)
                for split in range(num_splits):
                    begin = first_block + min(split * per_split, n_blocks)
                    end = first_block + min(split * per_split + per_split, n_blocks)
                    m_w = np.full((num_warps, block_m), -np.inf)
                    l_w = np.zeros((num_warps, block_m))
                    o_w = np.zeros((num_warps, block_m, d))
                    for n in range(begin, end):
                        for w in range(num_warps):
                            keys = n * block_n + w * keys_per_warp + np.arange(keys_per_warp)
                            pages, slots, valid = key_rows(b, keys, kv_end)
                            kt = np.where(valid[:, None], kc[pages, slots, kv_head], 0.0)
                            vt = np.where(valid[:, None], vc[pages, slots, kv_head], 0.0)
                            s = q_tile @ kt.T
                            if softcap:
                                s = np.tanh(s * softcap_scale)
                            s = np.where((keys[None, :] < limits[:, None]) & (keys[None, :] >= firsts[:, None]), s,
                                         -np.inf)
                            m_new = np.maximum(m_w[w], s.max(axis=1))
                            shift = np.where(np.isneginf(m_new), 0.0, m_new * scale_log2)
                            p = np.exp2(s * scale_log2 - shift[:, None])
                            alpha = np.exp2(m_w[w] * scale_log2 - shift)
                            l_w[w] = alpha * l_w[w] + p.sum(axis=1)
                            o_w[w] = alpha[:, None] * o_w[w] + p @ vt
                            m_w[w] = m_new
                    m_all = m_w.max(axis=0)
                    shift = np.where(np.isneginf(m_all), 0.0, m_all * scale_log2)
                    weights = np.exp2(m_w * scale_log2 - shift[None, :])
                    l_all = (weights * l_w).sum(axis=0)
                    inv = np.where(l_all > 0, 1.0 / np.where(l_all > 0, l_all, 1.0), 0.0)
                    o_tile = (weights[:, :, None] * o_w).sum(axis=0) * inv[:, None]
                    lse_tile = np.where(l_all > 0, m_all * scale + np.log(np.where(l_all > 0, l_all, 1.0)), -np.inf)
                    for r in range(rows_valid):
                        o_part[split, b, query[r], head[r]] = o_tile[r]
                        lse_part[split, b, head[r], query[r]] = lse_tile[r]
    # the combine: lse = log sum_s exp(lse_s), O = sum_s exp(lse_s - lse) O_s
    lse_max = lse_part.max(axis=0)
    shift = np.where(np.isneginf(lse_max), 0.0, lse_max)
    w = np.exp(lse_part - shift[None])
    total = w.sum(axis=0)
    lse = np.where(total > 0, shift + np.log(np.where(total > 0, total, 1.0)), -np.inf)
    w_o = w.transpose(0, 1, 3, 2)[..., None]                            # (splits, batch, seqlen_q, heads, 1)
    inv_total = np.where(total > 0, 1.0 / np.where(total > 0, total, 1.0), 0.0).transpose(0, 2, 1)[..., None]
    o = (w_o * o_part).sum(axis=0) * inv_total
    return o, lse
