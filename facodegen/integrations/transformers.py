"""facodegen as a Hugging Face transformers attention backend.

    import facodegen.integrations.transformers as fa_tf
    fa_tf.register()                                   # once per process
    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="facodegen", dtype=torch.bfloat16)

:func:`attention_forward` is registered in ``transformers.AttentionInterface`` and, for the
mask, transformers' flash-attention mask builder is registered under the same name in
``transformers.masking_utils.AttentionMaskInterface`` (transformers >= 4.53): the model then
hands this backend what it hands flash_attention_2, None for an unpadded batch and the 2-D
padding mask otherwise, instead of building a 4-D mask per call. Without that registration
(older transformers, or a model that builds its own mask) a 4-D mask arrives; one that hides
nothing or is exactly the causal pattern is accepted.

Supported: causal and bidirectional attention (``module.is_causal`` or the ``is_causal`` kwarg),
causal aligned bottom-right (the query rows are the last rows of the keys, as in a KV-cached
decode or prefill step), GQA/MQA on the KV heads as they are (no repeat_kv), ``scaling``, the
attention variants the models pass as kwargs, as flash_attention_2 takes them (facodegen.attention's
``window_size``, ``softcap``, ``sinks``):

- ``sliding_window`` (Mistral, Gemma-2/3, gpt-oss' sliding layers): where the keys outnumber it, the
  window (sliding_window - 1, sliding_window - 1), flash_attention_2's, so a causal row sees itself and the
  sliding_window - 1 keys before it, as transformers' sliding-window mask has it;
- ``softcap`` (Gemma-2's attn_logit_softcapping): logits c * tanh(scaling * s / c);
- ``s_aux`` (gpt-oss' learned sinks, one logit per query head): facodegen's ``sinks`` (in float32);

and, as flash_attention_2 runs them, on facodegen.attention_varlen (the variants too):

- padded batches (the 2-D padding mask, 1 = a token): the tokens gathered into packed sequences,
  attended per sequence and scattered back, zeros at the padded query positions; the queries are
  the keys' tokens when as many, one per row in a decode step, else the keys' last ones (left padding);
- packed sequences in a batch of one: the ``cu_seq_lens_q`` / ``cu_seq_lens_k`` kwargs (with
  ``max_length_q`` / ``max_length_k``; transformers' padding-free collator), or position_ids that
  restart at 0 inside the row.

Like flash_attention_2's, those calls read the lengths on the host (a sync), but once per mask: the model
hands every layer the same mask tensor, and its gather is kept for the layers after the first. Not supported yet,
raising NotImplementedError: a 4-D mask that hides more than the causal pattern (transformers >=
4.53 with register() hands this backend the 2-D mask instead), dropout in training and ``position_bias``.
Training runs facodegen's generated backward through autograd (fp16/bf16; see facodegen.attention and
attention_varlen): the window, softcap and sinks take theirs, padded and packed batches too.
"""

from __future__ import annotations

import facodegen

__all__ = ["register", "attention_forward", "NAME"]

NAME = "facodegen"

MASK_4D = ("a 4-D attention mask that hides more than the causal pattern is not supported: register() on "
           "transformers >= 4.53 hands this backend the 2-D padding mask, which it runs on packed sequences")


def register(name: str = NAME) -> None:
    """Register facodegen under ``name`` so that ``attn_implementation=name`` selects it."""
    try:
        import transformers
    except ImportError as err:
        raise ImportError("facodegen.integrations.transformers.register() needs Hugging Face transformers "
                          "(pip install transformers)") from err
    transformers.AttentionInterface.register(name, attention_forward)
    try:
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    except ImportError:   # transformers < 4.53: the model builds a 4-D mask, which attention_forward reads
        return
    AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS["flash_attention_2"])


def attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """The AttentionInterface function: query (batch, heads_q, seqlen_q, head_dim), key/value
    (batch, heads_kv, seqlen_k, head_dim) -> (output (batch, seqlen_q, heads_q, head_dim), None)."""
    seqlen_q, seqlen_k = query.shape[2], key.shape[2]
    _refuse_unsupported(dropout, kwargs)
    variants = _variants(seqlen_k, kwargs)
    is_causal = kwargs.get("is_causal")
    causal = (getattr(module, "is_causal", True) if is_causal is None else is_causal) and seqlen_q > 1
    q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)   # (batch, seqlen, heads, d)
    packed = _packed_boundaries(kwargs, attention_mask, q.shape[0], seqlen_q, seqlen_k)
    if packed is not None:
        out = facodegen.attention_varlen(q[0], k[0], v[0], *packed, causal=causal, softmax_scale=scaling, **variants)
        return out[None], None
    if attention_mask is not None and attention_mask.dim() == 2 and attention_mask.shape[-1] == seqlen_k:
        gather = _gather_of(attention_mask, seqlen_q)
        if gather is not None:
            return _padded_attention(q, k, v, gather, causal, scaling, variants), None
        attention_mask = None       # (a mask that hides nothing)
    causal = _causal_from_mask(attention_mask, seqlen_q, seqlen_k, causal)
    out = facodegen.attention(q, k, v, causal=causal, softmax_scale=scaling, **variants)
    return out, None


def _refuse_unsupported(dropout, kwargs: dict) -> None:
    if dropout:
        raise NotImplementedError(f"dropout={dropout!r}: attention dropout is not supported yet (the model is in "
                                  f"training mode with attention_dropout > 0; call model.eval())")
    if kwargs.get("position_bias") is not None:
        raise NotImplementedError("position_bias is not supported yet")


def _variants(seqlen_k: int, kwargs: dict) -> dict:
    """facodegen's variant arguments for the ones transformers passed that are in effect (none: a plain call,
    which keeps attention()'s fast path): sliding_window as flash_attention_2 turns it into a window where the
    keys outnumber it, softcap where it is set (None or 0: off), and s_aux as float32 sinks."""
    variants = {}
    window = kwargs.get("sliding_window")
    if window is not None and seqlen_k > window:
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ValueError(f"sliding_window must be a positive integer (keys a row sees, itself included), "
                             f"got {window!r}")
        variants["window_size"] = (window - 1, window - 1)
    softcap = kwargs.get("softcap")
    if softcap:
        variants["softcap"] = softcap
    sinks = kwargs.get("s_aux")
    if sinks is not None:   # (a model's parameter in its dtype: facodegen takes float32, one per query head)
        variants["sinks"] = sinks.float().contiguous()
    return variants


def _causal_from_mask(mask, seqlen_q: int, seqlen_k: int, causal: bool) -> bool:
    """The causal flag to launch with, or NotImplementedError when the mask hides more than that."""
    if mask is None:
        return causal
    if mask.dim() == 2:   # (batch, keys), 1 = attend: flash attention's padding mask (one that hides: _padded_attention)
        if mask.shape[-1] == seqlen_k and bool(mask.all()):
            return causal
        raise ValueError(f"attention_mask of shape {tuple(mask.shape)}: a 2-D padding mask has one entry per key "
                         f"({seqlen_k})")
    if mask.dim() == 4 and mask.shape[-2:] == (seqlen_q, seqlen_k):
        # (batch, 1 or heads, q, k), bool (True = attend) or additive float (0 = attend). As in
        # sdpa, a 4-D mask is the whole truth: it decides causality, module.is_causal does not.
        attend = mask == 0 if mask.is_floating_point() else mask.bool()
        if bool(attend.all()):
            return False
        bottom_right = attend.new_ones((seqlen_q, seqlen_k)).tril(seqlen_k - seqlen_q)
        if bool((attend == bottom_right).all()):
            return True
        raise NotImplementedError(f"attention_mask: {MASK_4D}")
    raise NotImplementedError(f"attention_mask of shape {tuple(mask.shape)} (query {seqlen_q}, keys {seqlen_k}) "
                              f"is not supported; {MASK_4D}")


def _packed_boundaries(kwargs: dict, mask, batch: int, seqlen_q: int, seqlen_k: int):
    """(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k) of packed sequences in a batch of one (the
    cu_seq_lens kwargs, or position_ids restarting at 0 inside the row), else None."""
    import torch
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    if cu_q is not None or cu_k is not None:
        if cu_q is None or cu_k is None or batch != 1 or mask is not None:
            raise ValueError("cu_seq_lens_q and cu_seq_lens_k come together, for packed sequences in a batch of one "
                             "with no attention_mask")
        cu_q, cu_k = (c.to(torch.int32).contiguous() for c in (cu_q, cu_k))
        max_q, max_k = (kwargs.get(name) for name in ("max_length_q", "max_length_k"))
        max_q = int(cu_q.diff().max()) if max_q is None else int(max_q)
        max_k = int(cu_k.diff().max()) if max_k is None else int(max_k)
        return cu_q, cu_k, max_q, max_k
    position_ids = kwargs.get("position_ids")
    if (mask is not None or batch != 1 or seqlen_q < 2 or position_ids is None or position_ids.dim() != 2
            or position_ids.shape[-1] != seqlen_q or not bool((position_ids.diff(dim=-1) != 1).any())):
        return None
    # several sequences in the row: each restarts at position 0 (transformers' padding-free batches)
    if seqlen_q != seqlen_k or int(position_ids[0, 0]) != 0:
        raise NotImplementedError("position_ids restart inside the row, but not from a first position 0 over as many "
                                  "keys as queries: not packed sequences this backend can split")
    starts = (position_ids[0] == 0).nonzero().flatten()
    cu = torch.cat([starts, starts.new_tensor([seqlen_q])]).to(torch.int32)
    longest = int(cu.diff().max())
    return cu, cu, longest, longest


# The gathers of the padding masks seen last (id -> (a weak reference to the mask, its version, seqlen_q,
# the gather)): the model hands every layer the same mask tensor, so only the first layer reads it on the
# host (each read a sync, which would also stall the launch queue at every layer).
_GATHERS: dict = {}
_GATHERS_KEPT = 8


def _gather_of(mask, seqlen_q: int):
    """What a (batch, seqlen_k) padding mask (1 = a token) asks of a call with ``seqlen_q`` queries: None where
    it hides nothing, else (rows_q, rows_k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k) of the
    gather. The query rows are the keys' tokens where there are as many, every row of a one-token decode
    step, else the keys' last seqlen_q (left padding). Worked out once per mask tensor and seqlen_q (an in-place
    change of the mask, which bumps its version, is read again)."""
    import torch
    import weakref
    found = _GATHERS.get(id(mask))
    if found is not None and found[0]() is mask and found[1:3] == (mask._version, seqlen_q):
        return found[3]
    keys = mask.bool()
    gather = None
    if not bool(keys.all()):
        batch, seqlen_k = keys.shape
        queries = keys if seqlen_q == seqlen_k else keys.new_ones(batch, 1) if seqlen_q == 1 else keys[:, -seqlen_q:]
        lengths_q, lengths_k = queries.sum(-1, dtype=torch.int32), keys.sum(-1, dtype=torch.int32)
        cu_q, cu_k = (torch.nn.functional.pad(n.cumsum(0, dtype=torch.int32), (1, 0)) for n in (lengths_q, lengths_k))
        gather = (queries.flatten().nonzero().flatten(), keys.flatten().nonzero().flatten(), cu_q, cu_k,
                  int(lengths_q.max()), int(lengths_k.max()))
    while len(_GATHERS) >= _GATHERS_KEPT:
        _GATHERS.pop(next(iter(_GATHERS)))
    _GATHERS[id(mask)] = (weakref.ref(mask), mask._version, seqlen_q, gather)
    return gather


def _padded_attention(q, k, v, gather, causal: bool, scaling, variants: dict):
    """Attention of a padded batch as flash_attention_2 runs it: each row's tokens gathered into packed
    sequences (``gather``: _gather_of's), attention_varlen (with ``variants``: _variants'), the outputs
    scattered back (zeros at padded query positions)."""
    batch, seqlen_q = q.shape[:2]
    seqlen_k = k.shape[1]
    rows_q, rows_k, cu_q, cu_k, max_q, max_k = gather
    out = facodegen.attention_varlen(q.reshape(batch * seqlen_q, *q.shape[2:]).index_select(0, rows_q),
                                     k.reshape(batch * seqlen_k, *k.shape[2:]).index_select(0, rows_k),
                                     v.reshape(batch * seqlen_k, *v.shape[2:]).index_select(0, rows_k),
                                     cu_q, cu_k, max_q, max_k, causal=causal, softmax_scale=scaling, **variants)
    full = out.new_zeros(batch * seqlen_q, *out.shape[1:]).index_copy(0, rows_q, out)
    return full.view(batch, seqlen_q, *out.shape[1:])
