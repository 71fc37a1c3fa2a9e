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
decode or prefill step), GQA/MQA on the KV heads as they are (no repeat_kv), ``scaling``.
Not supported yet, raising NotImplementedError: padded batches (an attention_mask that hides a
key), packed sequences (varlen kwargs, or position_ids that restart in a batch of one), dropout
in training, ``softcap``, attention sinks (``s_aux``), ``position_bias``, and a
``sliding_window`` narrower than the keys (a wider one hides nothing and is accepted, as
flash_attention_2 does). Training runs facodegen's generated backward through autograd (fp16/bf16;
see facodegen.attention).
"""

from __future__ import annotations

import facodegen

__all__ = ["register", "attention_forward", "NAME"]

NAME = "facodegen"

PADDED = ("padded batches need variable-length support (not yet): facodegen runs batches whose "
          "sequences have no padding tokens")


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
    _refuse_unsupported(module, seqlen_k, dropout, kwargs)
    is_causal = kwargs.get("is_causal")
    causal = (getattr(module, "is_causal", True) if is_causal is None else is_causal) and seqlen_q > 1
    causal = _causal_from_mask(attention_mask, seqlen_q, seqlen_k, causal)
    if attention_mask is None and query.shape[0] == 1 and seqlen_q > 1:
        _refuse_packed(kwargs.get("position_ids"))
    out = facodegen.attention(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), causal=causal,
                              softmax_scale=scaling)
    return out, None


def _refuse_unsupported(module, seqlen_k: int, dropout, kwargs: dict) -> None:
    if dropout:
        raise NotImplementedError(f"dropout={dropout!r}: attention dropout is not supported yet (the model is in "
                                  f"training mode with attention_dropout > 0; call model.eval())")
    if kwargs.get("softcap"):
        raise NotImplementedError(f"softcap={kwargs['softcap']!r}: logit softcapping is not supported yet")
    window = kwargs.get("sliding_window")
    if window is not None and seqlen_k > window:
        raise NotImplementedError(f"sliding_window={window}: a sliding window narrower than the keys "
                                  f"({seqlen_k}) is not supported yet")
    for name in ("s_aux", "position_bias"):
        if kwargs.get(name) is not None:
            raise NotImplementedError(f"{name} is not supported yet")
    if any(kwargs.get(name) is not None for name in ("cu_seq_lens_q", "cu_seq_lens_k")):
        raise NotImplementedError(f"cu_seq_lens_q/cu_seq_lens_k: packed sequences (varlen) are not supported yet; "
                                  f"{PADDED}")


def _causal_from_mask(mask, seqlen_q: int, seqlen_k: int, causal: bool) -> bool:
    """The causal flag to launch with, or NotImplementedError when the mask hides more than that."""
    if mask is None:
        return causal
    if mask.dim() == 2:   # (batch, keys), 1 = attend: flash attention's padding mask
        if mask.shape[-1] == seqlen_k and bool(mask.all()):
            return causal
        raise NotImplementedError(f"attention_mask: {PADDED}")
    if mask.dim() == 4 and mask.shape[-2:] == (seqlen_q, seqlen_k):
        # (batch, 1 or heads, q, k), bool (True = attend) or additive float (0 = attend). As in
        # sdpa, a 4-D mask is the whole truth: it decides causality, module.is_causal does not.
        attend = mask == 0 if mask.is_floating_point() else mask.bool()
        if bool(attend.all()):
            return False
        bottom_right = attend.new_ones((seqlen_q, seqlen_k)).tril(seqlen_k - seqlen_q)
        if bool((attend == bottom_right).all()):
            return True
        raise NotImplementedError(f"attention_mask: it hides more than the causal pattern; {PADDED}")
    raise NotImplementedError(f"attention_mask of shape {tuple(mask.shape)} (query {seqlen_q}, keys {seqlen_k}) "
                              f"is not supported; {PADDED}")


def _refuse_packed(position_ids) -> None:
    """Several sequences packed in one row (positions restart) would attend across each other."""
    if position_ids is None or position_ids.dim() != 2 or position_ids.shape[-1] < 2:
        return
    if bool((position_ids.diff(dim=-1) != 1).any()):
        raise NotImplementedError(f"position_ids restart inside the row: packed sequences are not supported yet; "
                                  f"{PADDED}")
