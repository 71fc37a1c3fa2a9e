"""torch SDPA's call, run by facodegen: ``facodegen.torch.scaled_dot_product_attention``.

    import facodegen.torch
    out = facodegen.torch.scaled_dot_product_attention(q, k, v, is_causal=True)   # q: (batch, heads, seqlen, d)

Same signature, layout and semantics as ``torch.nn.functional.scaled_dot_product_attention``
for what it supports; the arguments it does not support raise before anything runs on the GPU.
A thin layer over :func:`facodegen.attention`: the inputs reach the kernel as transposed views
and the kernel writes the result in place, so nothing is copied.
"""

from __future__ import annotations

import math

import torch  # absolute: the real torch, not this module

import facodegen

__all__ = ["scaled_dot_product_attention"]


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, *,
                                 scale=None, enable_gqa=False):
    """torch.nn.functional.scaled_dot_product_attention on facodegen's kernels.

    query: (*batch, heads_q, seqlen_q, head_dim); key: (*batch, heads_kv, seqlen_k, head_dim); value:
    (*batch, heads_kv, seqlen_k, head_dim_v) (at least one batch dim, the same batch dims for all
    three), fp16 or bf16 torch CUDA tensors with contiguous head_dim; head_dim 64, 96, 128, 192 or 256
    (head_dim_v: head_dim, or as facodegen.attention takes it, e.g. 128 with head_dim 192). Returns a
    new contiguous (*batch, heads_q, seqlen_q, head_dim_v) tensor in query's dtype.

    Supported: ``is_causal`` (aligned top-left, as SDPA does: query row i sees keys 0..i),
    ``scale`` (default 1/sqrt(head_dim)), ``enable_gqa`` (heads_kv divides heads_q; K/V are read
    in place, never repeated). Not supported yet, and raising NotImplementedError: ``attn_mask``
    and ``dropout_p`` != 0. Shapes SDPA would broadcast (batch dims that differ between q and k/v)
    or leading batch dims that cannot be merged into one without a copy raise ValueError.
    Inputs that require grad (with grad mode on) record facodegen's generated backward (see
    facodegen.attention): the result is then a (*batch, heads_q, seqlen_q, head_dim_v) view of a
    (batch, seqlen_q, heads_q, head_dim_v) tensor, as SDPA's flash backend returns it.
    """
    if attn_mask is not None:
        raise NotImplementedError("attn_mask is not supported yet (facodegen runs causal or no mask; "
                                  "use is_causal=True)")
    if dropout_p != 0.0:
        raise NotImplementedError(f"dropout_p={dropout_p!r} is not supported yet (facodegen has no dropout; "
                                  f"pass dropout_p=0.0)")
    for name, x in (("query", query), ("key", key), ("value", value)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() < 4:
            raise ValueError(f"{name} must be (*batch, heads, seqlen, head_dim) with at least one batch dim, "
                             f"got shape {tuple(x.shape)}")
    batch = query.shape[:-3]
    if key.shape[:-3] != batch or value.shape[:-3] != batch:
        raise ValueError(f"query, key and value must have the same batch dims (no broadcasting), got "
                         f"{tuple(batch)}, {tuple(key.shape[:-3])}, {tuple(value.shape[:-3])}")
    heads_q, seqlen_q, head_dim = query.shape[-3:]
    heads_kv, seqlen_k = key.shape[-3:-1]
    head_dim_v = value.shape[-1]        # (SDPA's Ev: O takes value's head dim)
    if key.shape[-1] != head_dim:
        raise ValueError(f"key must have query's head_dim {head_dim}, got {key.shape[-1]}")
    if value.shape[-3:-1] != key.shape[-3:-1]:
        raise ValueError(f"value's (heads, seqlen) {tuple(value.shape[-3:-1])} must match key's "
                         f"{(heads_kv, seqlen_k)}")
    if heads_q != heads_kv:
        if not enable_gqa:
            raise ValueError(f"query has {heads_q} heads and key/value {heads_kv}: pass enable_gqa=True for "
                             f"grouped-query attention (SDPA requires it too)")
        if heads_kv == 0 or heads_q % heads_kv:
            raise ValueError(f"enable_gqa: key/value heads ({heads_kv}) must divide query heads ({heads_q})")
    q, k, v = (_as_bshd(name, x) for name, x in (("query", query), ("key", key), ("value", value)))

    if torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad):
        # (out= records no gradient: facodegen's output, seen as SDPA's layout)
        out = facodegen.attention(q, k, v, causal=bool(is_causal), softmax_scale=scale, causal_alignment="top_left")
        return out.transpose(1, 2).unflatten(0, batch)
    result = torch.empty((*batch, heads_q, seqlen_q, head_dim_v), dtype=query.dtype, device=query.device)
    facodegen.attention(q, k, v, causal=bool(is_causal), softmax_scale=scale, causal_alignment="top_left",
                        out=result.view(math.prod(batch), heads_q, seqlen_q, head_dim_v).transpose(1, 2))
    return result


def _as_bshd(name: str, x):
    """(batch, seqlen, heads, head_dim) view of a (*batch, heads, seqlen, head_dim) tensor."""
    try:
        x = x.view(math.prod(x.shape[:-3]), *x.shape[-3:])
    except RuntimeError as err:   # view() refuses exactly when merging the batch dims would need a copy
        raise ValueError(f"{name}: its batch dims {tuple(x.shape[:-3])} (strides {x.stride()[:-3]}) cannot be "
                         f"merged into one without a copy; make them contiguous or pass a 4-D tensor") from err
    return x.transpose(1, 2)
