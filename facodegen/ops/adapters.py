"""Drop-in entry points with other libraries' signatures, as thin layers over facodegen.attention.

``flash_attn_func`` is FlashAttention-2's (flash_attn.flash_attn_func), exported as
``facodegen.flash_attn_func``. torch SDPA's call is ``facodegen.torch.scaled_dot_product_attention``
(a module of its own, since it imports torch) and the Hugging Face transformers backend is
``facodegen.integrations.transformers``.

Nothing here imports torch or CuPy: ``import facodegen`` keeps working without them.
"""

from __future__ import annotations

import facodegen

__all__ = ["flash_attn_func", "flash_attn_varlen_func"]


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                    alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """FlashAttention-2's ``flash_attn_func`` (same parameters, order and defaults) on facodegen's kernels.

    q: (batch, seqlen_q, heads_q, head_dim); k, v: (batch, seqlen_k, heads_kv, head_dim), fp16 or
    bf16 torch CUDA tensors (or CuPy arrays), any batch/seq/head strides with contiguous head_dim;
    heads_kv divides heads_q (GQA/MQA read in place); head_dim any multiple of 8 in [8, 256] (the
    backward: 64, 96, 128, 192 or 256); v may be narrower, (batch, seqlen_k, heads_kv, head_dim_v)
    (FlashAttention-3's hdim_v, e.g. 192 / 128; forward only, as facodegen.attention). ``causal``
    is aligned bottom-right as in FlashAttention (seqlen_q=2, seqlen_k=5: row 0 sees keys 0..3);
    a row with no visible key gives zeros. Returns out (batch, seqlen_q, heads_q, head_dim_v) in q's
    dtype.

    Supported: ``softmax_scale`` (default 1/sqrt(head_dim)), ``causal``, ``window_size=(left, right)``
    (FlashAttention's sliding window, -1 = unbounded on that side, on the causal diagonal; with
    ``causal`` the right side is 0), ``softcap`` (> 0: logits c * tanh(scale * s / c); <= 0 is off, as
    in FlashAttention), ``deterministic`` (FlashAttention's: the backward's bit-identical gradients, dQ
    added in a fixed order; the forward is deterministic either way). ``return_attn_probs=True``
    returns ``(out, softmax_lse, None)``: softmax_lse is float32 (batch, heads_q, seqlen_q), natural
    log, as FlashAttention's; the third item, FlashAttention's S_dmask (the probabilities, for
    testing), is never computed and is None.

    Not supported yet, and raising NotImplementedError: ``dropout_p`` != 0, ``alibi_slopes``.
    """
    _refuse_unsupported(dropout_p, alibi_slopes)
    variants = _variant_kwargs(window_size, softcap)
    if return_attn_probs:
        out, lse = facodegen.attention(q, k, v, causal=bool(causal), softmax_scale=softmax_scale, return_lse=True,
                                       deterministic=bool(deterministic), **variants)
        return out, lse, None
    return facodegen.attention(q, k, v, causal=bool(causal), softmax_scale=softmax_scale,
                               deterministic=bool(deterministic), **variants)


def _variant_kwargs(window_size, softcap) -> dict:
    """FlashAttention's window_size and softcap as facodegen's keyword arguments: only those that are
    on (a window with a bounded side; softcap > 0, FlashAttention's <= 0 being off)."""
    window = _window(window_size)
    variants = {}
    if window != (-1, -1):
        variants["window_size"] = window
    if softcap > 0.0:
        variants["softcap"] = softcap
    return variants


def _refuse_unsupported(dropout_p, alibi_slopes) -> None:
    """FlashAttention's arguments no facodegen kernel supports yet: NotImplementedError naming them."""
    if dropout_p != 0.0:
        raise NotImplementedError(f"dropout_p={dropout_p!r} is not supported yet (facodegen has no dropout; "
                                  f"pass dropout_p=0.0)")
    if alibi_slopes is not None:
        raise NotImplementedError("alibi_slopes is not supported yet (pass alibi_slopes=None)")


def _window(window_size) -> tuple:
    """FlashAttention's window_size with any negative side as -1 (unbounded)."""
    return tuple(-1 if isinstance(w, int) and not isinstance(w, bool) and w < 0 else w for w in window_size)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, block_table=None):
    """FlashAttention-2's ``flash_attn_varlen_func`` (same parameters, order and defaults) on facodegen's
    varlen kernel (facodegen.attention_varlen).

    q: (total_q, heads_q, head_dim); k, v: (total_k, heads_kv, head_dim), fp16 or bf16, packed one
    sequence after another; cu_seqlens_q, cu_seqlens_k: int32 (batch + 1,) prefix sums on the same
    device; max_seqlen_q, max_seqlen_k: host ints. ``causal`` is aligned bottom-right per sequence.
    Returns out (total_q, heads_q, head_dim); ``return_attn_probs=True`` returns ``(out,
    softmax_lse, None)`` with softmax_lse float32 (heads_q, total_q), as FlashAttention-2's varlen.

    Supported: ``softmax_scale``, ``causal``, ``window_size=(left, right)`` and ``softcap`` as
    flash_attn_func takes them (per sequence, on its bottom-right diagonal), ``deterministic`` (the
    backward's, as FlashAttention's: bit-identical gradients; the forward is deterministic either way).
    Gradients: fp16/bf16 tensors that require grad record attention_varlen's backward (head_dim 64, 96,
    128, 192 or 256, no window or softcap). Not supported yet, and raising NotImplementedError:
    ``dropout_p`` != 0, ``alibi_slopes``, ``block_table`` (paged K/V).
    """
    _refuse_unsupported(dropout_p, alibi_slopes)
    variants = _variant_kwargs(window_size, softcap)
    if block_table is not None:
        raise NotImplementedError("block_table (paged K/V) is not supported by facodegen's varlen kernel yet (pass "
                                  "block_table=None; for decoding over a paged cache see "
                                  "facodegen.flash_attn_with_kvcache)")
    if return_attn_probs:
        out, lse = facodegen.attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                              causal=bool(causal), softmax_scale=softmax_scale, return_lse=True,
                                              deterministic=bool(deterministic), **variants)
        return out, lse, None
    return facodegen.attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                      causal=bool(causal), softmax_scale=softmax_scale,
                                      deterministic=bool(deterministic), **variants)
