"""Same-precision references with FlashAttention's rounding points (torch, any device).

FlashAttention-3's test criterion bounds a kernel's error by twice that of a same-precision
computation (fuzz.fa3_bound). Its reference, standard attention in the inputs' dtype, rounds P
*after* normalising it, so a one-hot row (a single visible key, or logits thousands apart) gets
P = 1 exactly and O = V with no error at all. FlashAttention (FA2, FA3, and these kernels) cannot
do that: it rounds the *unnormalised* P = exp2(s*scale*log2(e) - m*scale*log2(e)) to the dtype for
the P V matmul, with the exponent formed by one FFMA whose residual at the row maximum is the
rounding of m*scale*log2(e) (up to half a float32 ulp of the logit, ~1e-3 for logits in the
thousands), and divides by a row sum l of the float32 P. O then carries P's relative rounding
(fp16: 2^-11) times |V|; the backward builds D = rowsum(dO * O) from that rounded O and recomputes
P from the LSE the same way, so dS = P (dP - D) is no longer 0 where the reference's is.

attention_flash_rounding and attention_backward_flash_rounding compute attention with exactly
those rounding points (one key tile: no online rescaling) in a chosen summation order: a model of
the kernels. Their error on a one-hot row is one draw of P's rounding (the kernel's draw may be
twice as large: the H200 fuzz found such rows with three orders drawn), so the fuzz criterion
takes the bound of that rounding, per element, off each error (forward_floor, backward_floor:
fuzz.fa3_failure's ``floor``), with float32's noise where dS cancels; the backward model stays a
second same-precision computation of the gradients (D from the rounded O). The tests hold the
floors against the models in every order.
"""

from __future__ import annotations

import math

LOG2E = math.log2(math.e)


def _ffma_exponent(u, c: float, shift):
    """float32 fma(u, c, -shift) as FFMA forms it: u * c exactly (a float32 product fits a float64),
    one rounding to float32 (``shift`` is a float32 already)."""
    return (u.double() * float(c) - shift.double()).float()


def visible_keys(seqlen_q: int, seqlen_k: int, causal: bool, window_size, top_left: bool, device):
    """(seqlen_q, seqlen_k) bool: which keys each query sees (bottom-right aligned unless top_left)."""
    import torch
    left, right = window_size
    if causal:
        right = 0
    rows = torch.arange(seqlen_q, device=device)[:, None] + (0 if top_left else seqlen_k - seqlen_q)
    cols = torch.arange(seqlen_k, device=device)[None, :]
    hidden = torch.zeros((seqlen_q, seqlen_k), dtype=torch.bool, device=device)
    if left >= 0:
        hidden |= cols < rows - left
    if right >= 0:
        hidden |= cols > rows + right
    return ~hidden


# The order in which a kernel's tensor cores sum a score's head_dim products is not specified, and
# the one-hot rows' error (the FFMA residual's P rounding) depends on the score's last bits. So a
# reference error is one draw: ORDERS are three summation orders of the same products (torch's
# float32 einsum, correctly rounded from float64, the einsum over head_dim reversed), and
# fuzz.fa3_bound takes the largest error among them.
ORDERS = (0, 1, 2)


def _dot(q, k, order: int):
    import torch
    if order == 1:
        return torch.einsum("bqhd,bkhd->bhqk", q.double(), k.double()).float()
    if order == 2:
        q, k = q.flip(-1), k.flip(-1)
    return torch.einsum("bqhd,bkhd->bhqk", q.float(), k.float())


def _scores(q, k, causal, softmax_scale, window_size, softcap, top_left, order=0):
    """(u, c, visible): the float32 values the kernel's exponent multiplies (the raw dot products,
    or with softcap the capped scaled scores), their multiplier c (scale log2(e), or log2(e)), and
    the (seqlen_q, seqlen_k) visibility. Products of 16-bit floats are exact in float32, so only the
    sum's order differs from the tensor cores'."""
    import torch
    raw = _dot(q, k, order)
    if softcap:
        u, c = softcap * torch.tanh(raw * (softmax_scale / softcap)), LOG2E
    else:
        u, c = raw, softmax_scale * LOG2E
    c = float(torch.tensor(c, dtype=torch.float32))     # the kernel's multiplier is a float32
    visible = visible_keys(q.shape[1], k.shape[1], causal, window_size, top_left, q.device)
    return u.masked_fill(~visible, float("-inf")), c, visible


def attention_flash_rounding(q, k, v, causal: bool, softmax_scale: float, *, window_size=(-1, -1),
                             softcap: float = 0.0, sinks=None, top_left: bool = False, order: int = 0):
    """O (q's dtype) and the float32 natural-log LSE of (batch, seqlen, heads, head_dim) q, k, v as
    FlashAttention rounds them: unnormalised P in v's dtype, float32 row sums, the exponent by
    FFMA. GQA by repetition; the variants as fuzz.attention_torch takes them."""
    import torch
    group = q.shape[2] // k.shape[2]
    k, v = (x.repeat_interleave(group, dim=2) for x in (k, v))
    u, c, _ = _scores(q, k, causal, softmax_scale, window_size, softcap, top_left, order)
    row_max = u.amax(dim=-1, keepdim=True) if u.shape[-1] else u.new_full((*u.shape[:-1], 1), float("-inf"))
    seen = torch.isfinite(row_max)
    shift = torch.where(seen, row_max.double() * c, 0.0).float()
    p = torch.exp2(_ffma_exponent(u, c, shift))                     # -inf where hidden: 0
    row_sum = p.sum(dim=-1, keepdim=True)
    # natural-log LSE of the scaled scores: max (in those units) + log(sum)
    lse = shift.double() / LOG2E + torch.log(row_sum.double())
    if sinks is not None:       # the sink's logit joins the sum with no value
        sink = sinks.double()[None, :, None, None]
        row_sum = (row_sum.double() + torch.exp(sink - shift.double() / LOG2E)).float()
        lse = torch.logaddexp(lse, sink.expand_as(lse))
    out = torch.einsum("bhqk,bkhd->bqhd", p.to(v.dtype).float(), v.float())
    out = out / row_sum.transpose(1, 2).clamp_min(1e-30)
    out = torch.where(seen.transpose(1, 2), out, 0.0)
    return out.to(v.dtype), torch.where(seen, lse, float("-inf")).squeeze(-1).float()


def attention_backward_flash_rounding(q, k, v, do, causal: bool, softmax_scale: float, order: int = 0, *,
                                      window_size=(-1, -1), top_left: bool = False, softcap: float = 0.0,
                                      sinks=None):
    """(dQ, dK, dV) in the inputs' dtype as FlashAttention's backward rounds them, from this
    module's forward: D = rowsum(dO * O) of the dtype-rounded O, P recomputed from the LSE by FFMA
    (exp2(s scale log2(e) - LSE log2(e))), P and dS rounded to the dtype for their matmuls, float32
    accumulation, dK and dV summed over a GQA group in float32. ``window_size``, ``top_left``: a sliding
    window's, ``softcap`` the logits' cap (attention_flash_rounding's; dS then carries 1 - tanh^2), ``sinks`` the
    sink logits (in the LSE P is recomputed from)."""
    import torch
    out, lse = attention_flash_rounding(q, k, v, causal, softmax_scale, order=order, window_size=window_size,
                                        top_left=top_left, softcap=softcap, sinks=sinks)
    group = q.shape[2] // k.shape[2]
    kr, vr = (x.repeat_interleave(group, dim=2) for x in (k, v))
    u, c, visible = _scores(q, kr, causal, softmax_scale, window_size, softcap, top_left, order)   # as the forward summed S
    lse_log2 = torch.where(torch.isfinite(lse), lse.double() * LOG2E, float("inf")).float()[..., None]
    p = torch.exp2(_ffma_exponent(u, c, lse_log2)).masked_fill(~visible, 0.0)
    dt = q.dtype
    d_v = torch.einsum("bhqk,bqhd->bkhd", p.to(dt).float(), do.float())
    d_p = torch.einsum("bqhd,bkhd->bhqk", do.float(), vr.float())
    delta = (do.float() * out.float()).sum(dim=-1).transpose(1, 2)[..., None]
    d_s = p * (d_p - delta)
    if softcap:     # through c tanh(x / c): u is the capped logit where visible
        d_s = d_s * torch.where(visible, 1 - (u / softcap) ** 2, 0.0)
    d_s = d_s.to(dt).float()
    d_q = torch.einsum("bhqk,bkhd->bqhd", d_s, kr.float()) * softmax_scale
    d_k = torch.einsum("bhqk,bqhd->bkhd", d_s, q.float()) * softmax_scale

    def group_sum(x):
        return x.unflatten(2, (k.shape[2], group)).sum(dim=3)
    return d_q.to(dt), group_sum(d_k).to(dt), group_sum(d_v).to(dt)


# Relative rounding of P to the dtype (half an ulp at 1), and float32's unit roundoff. A float32 sum
# of n terms x errs by about sqrt(n) u |x|_2 (a random walk of roundings at the partial sums' size);
# the floor admits twice that, the criterion's own 2x. The kernels' measured noise on one-key rows is
# a quarter to a fifth of it (H200, 2026-12-03: sm80 backward d256 937 x 1 causal, inputs x16:
# dQ 7.3e-3 against a floor of 3.6e-2 on like inputs).
P_ROUNDING = {"float16": 2.0 ** -11, "bfloat16": 2.0 ** -8}
UNIT_ROUNDOFF_FP32 = 2.0 ** -24
ACCUMULATION_NOISE_FACTOR = 2.0


def forward_floor(q, k, v, causal: bool, softmax_scale: float, **variants):
    """Per-element floor (float64, O's shape) for the rounding FlashAttention adds to O: each P_ij
    rounded to the dtype *before* it is normalised, a relative error of up to P_ROUNDING, so O_id
    errs by sum_j e_ij P_ij V_jd with |e_ij| <= P_ROUNDING: P_ROUNDING |P_i o V_d|_2 (exact where a
    row is one-hot, where standard attention, which rounds P after normalising, is exact and no
    same-precision draw bounds FlashAttention's error; the roundings' random walk elsewhere). Then
    O's own rounding to the dtype, up to P_ROUNDING |O_id| more: on a one-hot row O = V (1 + e)
    lands up to a whole ulp from V, which standard attention returns exactly (H200, varlen
    2499 x 1 key: 26.5625 for 26.578125)."""
    import torch
    from .fuzz import attention_probabilities
    group = q.shape[2] // k.shape[2]
    p, _ = attention_probabilities(q, k, causal, softmax_scale, True, **variants)
    vr = v.double().repeat_interleave(group, dim=2)
    walk = torch.einsum("bhqk,bkhd->bqhd", p ** 2, vr ** 2).sqrt()
    return P_ROUNDING[str(v.dtype).removeprefix("torch.")] * (walk + torch.einsum("bhqk,bkhd->bqhd", p, vr).abs())


def backward_floor(q, k, v, do, causal: bool, softmax_scale: float, **variant):
    """Per-element floors (float64, the shapes of dQ and dK) for what FlashAttention's dS = P (dP - D)
    carries beyond a same-precision reference's:
    - D = rowsum(dO o O) from the kernel's O, whose P roundings (forward_floor) move D_i by
      sum_j e_ij P_ij dP_ij: P_ROUNDING |P_i o dP_i|_2 (O's own rounding to the dtype, a random
      walk over head_dim, is in attention_backward_flash_rounding, which the criterion takes as a
      second same-precision computation);
    - dP_ij = dO_i . V_j and D_i are float32 sums of exact products: where a row sees one key (P = 1,
      O = V) they are the same products in two orders, and dS is pure rounding noise, known in size:
      ACCUMULATION_NOISE_FACTOR sqrt(d) u (|dO_i o V_j|_2 + |dO_i o O_i|_2);
    - O's own rounding where a row is one-hot: O = V_j (P / l), and P = 2^r is off 1 by the forward's
      FFMA residual r at the row max (eps = |r| ln 2 <= 2^-24 |m| for the row's largest logit m, natural
      units), so each O_id lands on V_jd or, with probability ~ eps |O_id| / ulp, an ulp away; D moves
      by sum_d dO_id (O_id - V_jd): 2 sqrt(2 P_ROUNDING eps_i) |dO_i o O_i|_2 (a random walk over
      head_dim), weighted by the row's largest P (1 where one-hot). The same-precision model draws its
      own r and often none (its O is then V exactly), so no draw of it bounds this: with logits in the
      thousands (inputs x16, one key) the model's own dQ error spans 0.15 to 24 from one summation order
      to another, and without this term the criterion failed the model against itself in 2 of 24 such
      draws (and the H200 fuzz's sm80 d192 586 x 1 case, 2026-12-04).
    Each per P_ij, carried through dQ = dS K and dK = dS^T Q in absolute values (logits in the
    thousands: 1e-2)."""
    import torch
    from .fuzz import attention_probabilities
    group = q.shape[2] // k.shape[2]
    kr, vr = (x.repeat_interleave(group, dim=2).double() for x in (k, v))
    qd, dod = q.double(), do.double()
    p, lse = attention_probabilities(q, k, causal, softmax_scale, True, **variant)   # (window_size, top_left, softcap)
    out = torch.einsum("bhqk,bkhd->bqhd", p, vr)
    d_p = torch.einsum("bqhd,bkhd->bhqk", dod, vr)
    d_p_norm = torch.einsum("bqhd,bkhd->bhqk", dod ** 2, vr ** 2).sqrt()
    delta_norm = (dod * out).norm(dim=-1).transpose(1, 2)[..., None]
    p_rounding = P_ROUNDING[str(q.dtype).removeprefix("torch.")]
    d_rounding = p_rounding * (p * d_p).norm(dim=-1, keepdim=True)
    accumulation = ACCUMULATION_NOISE_FACTOR * q.shape[-1] ** 0.5 * UNIT_ROUNDOFF_FP32 * (d_p_norm + delta_norm)
    # (the LSE bounds the row's largest logit from above where the row is one-hot, where the term matters)
    eps = 2.0 ** -24 * torch.where(torch.isfinite(lse), lse.abs(), 0.0)[..., None]
    o_rounding = 2 * p.amax(dim=-1, keepdim=True) * (2 * p_rounding * eps).sqrt() * delta_norm
    noise = p * (accumulation + d_rounding + o_rounding)
    floor_dq = torch.einsum("bhqk,bkhd->bqhd", noise, kr.abs()) * softmax_scale
    floor_dk = torch.einsum("bhqk,bqhd->bkhd", noise, qd.abs()) * softmax_scale
    return floor_dq, floor_dk.unflatten(2, (k.shape[2], group)).sum(dim=3)
