"""facodegen's forward as PyTorch operators, so torch.compile, torch.export and CUDA graphs see it.

    torch.ops.facodegen.attention(q, k, v, causal, softmax_scale, arch, q_descale, k_descale,
                                  v_descale, knobs, window_size, softcap, sinks,
                                  causal_alignment) -> (out, lse)
    torch.ops.facodegen.attention_out(q, k, v, out!, lse!, causal, ...)   -> ()   (writes out, lse)

    torch.ops.facodegen.attention_with_kvcache(q, k_cache!, v_cache!, cache_seqlens, page_table, k, v,
                                               causal, softmax_scale, num_splits, arch, knobs,
                                               check_inputs) -> (out, lse)   (appends k, v to the caches)
    torch.ops.facodegen.attention_with_kvcache_out(q, k_cache!, v_cache!, cache_seqlens, page_table, k, v,
                                                   out!, lse!, causal, ...) -> ()   (writes out, lse too)

``facodegen.attention`` calls them on torch tensors while Dynamo traces it; an eager call skips
the dispatcher and launches straight from its plan (api.py), since the op's dispatch costs more
than the launch itself. An eager call that records a gradient does too, inside an
autograd.Function (_Attention, below), whose backward calls attention_backward directly.
The ops are defined with ``torch.library.Library`` (cheaper per call than ``custom_op``) and a
fake implementation that computes every output's shape from the inputs alone.

``knobs`` carries the spec fields a caller gave (block_n=..., out_dtype=...) as text,
``name=repr(value)`` joined by commas: an op schema has no dict type.

Autograd: ``facodegen::attention`` has a backward (torch.library.register_autograd) that runs
    torch.ops.facodegen.attention_backward(dout, q, k, v, out, lse, causal, softmax_scale, arch,
                                           knobs) -> (dq, dk, dv)
(the generated backward kernels, facodegen/ops/backward.py) on the forward's saved O and LSE; the LSE
output is marked non-differentiable (no gradient flows back through it, as in FlashAttention).
That formula is what AOTAutograd traces under torch.compile; in eager mode _Attention does the same
work at a fraction of the op's autograd kernel's host cost (see _Attention).
A sliding window (window_size, and top-left causal), a softcap and sinks record a backward with the same
variant (attention_backward's window_size, causal_alignment, softcap and sinks: the sm80 backward's LOCAL
and SOFTCAP kernels, and either arch's SINKS ones, whose postprocess also writes the sinks' gradient;
attention_varlen_backward's through attention_varlen, on sm80's kernels). fp8 inputs and the mutating
``attention_out`` (out=/lse_out=) have no backward: a call that would record a gradient raises at the
forward rather than returning an output with no grad_fn or a wrong one.

``facodegen.attention_with_kvcache`` (facodegen/ops/kvcache.py) calls the kvcache ops on torch tensors
while Dynamo traces it; an eager call launches from its plan. Both ops mark k_cache and v_cache
mutated (the append writes the new k, v into them in place, as flash_attn_with_kvcache does), so
torch.compile functionalizes the write and orders later reads of the caches after it. They have no
backward: a call on tensors that require grad (with grad enabled) raises.
"""

from __future__ import annotations

import ast
import functools

import torch
from torch.autograd.function import once_differentiable

from . import api, backward, kvcache

_LIB = torch.library.Library("facodegen", "DEF")
# The attention variants (window_size, softcap, sinks: facodegen.attention's) come last, with
# defaults, so a call that names none of them is the op's older form.
_ARGS = ("bool causal, float? softmax_scale, str? arch, Tensor? q_descale, Tensor? k_descale, "
         "Tensor? v_descale, str knobs, int[] window_size=[-1, -1], float softcap=0., Tensor? sinks=None, "
         "str causal_alignment=\"bottom_right\", bool deterministic=False")
_LIB.define(f"attention(Tensor q, Tensor k, Tensor v, {_ARGS}) -> (Tensor, Tensor)")
_LIB.define(f"attention_out(Tensor q, Tensor k, Tensor v, Tensor(a!) out, Tensor(b!) lse, {_ARGS}) -> ()")
_LIB.define("attention_backward(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, bool causal, "
            "float? softmax_scale, str? arch, str knobs, int[] window_size=[-1, -1], "
            "str causal_alignment=\"bottom_right\", float softcap=0., Tensor? sinks=None) "
            "-> (Tensor, Tensor, Tensor, Tensor)")
# The kvcache ops: the caches are written (the append), k/v are the new tokens (None: no append).
_KV_IN = ("Tensor q, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor cache_seqlens, Tensor? page_table, Tensor? k, "
          "Tensor? v")
_KV_ARGS = ("bool causal, float? softmax_scale, int num_splits, str? arch, str knobs, bool check_inputs=False, "
            "int[] window_size=[-1, -1], float softcap=0.")
_LIB.define(f"attention_with_kvcache({_KV_IN}, {_KV_ARGS}) -> (Tensor, Tensor)")
_LIB.define(f"attention_with_kvcache_out({_KV_IN}, Tensor(c!) out, Tensor(d!) lse, {_KV_ARGS}) -> ()")

_DESCALES = ("q_descale", "k_descale", "v_descale")


def encode_knobs(spec_fields: dict) -> str:
    for name, value in spec_fields.items():
        if not isinstance(value, (bool, int, float, str, type(None))):
            raise TypeError(f"{name}={value!r}: a spec field passed through torch.ops.facodegen must be a bool, "
                            f"int, float, str or None")
    return ",".join(f"{name}={value!r}" for name, value in sorted(spec_fields.items()))


@functools.lru_cache(maxsize=256)
def decode_knobs(knobs: str) -> dict:
    fields = {}
    for item in filter(None, knobs.split(",")):
        name, _, text = item.partition("=")
        fields[name] = ast.literal_eval(text)
    return fields


# The refusals of a call that would record a gradient the backward has no kernel for; ``what``: the call
# they name (facodegen.attention, or attention_varlen, whose recording path shares the checks).
def _fp8_has_no_backward(what: str = "facodegen.attention") -> str:
    return (f"{what}: fp8 (e4m3) inputs have no backward yet; call it under torch.no_grad() or on tensors that do "
            f"not require grad")


def _out_has_no_backward(what: str = "facodegen.attention") -> str:
    return (f"{what} with out=/lse_out= has no backward: drop out= and lse_out= (use return_lse=True) on tensors "
            f"that require grad, or call it under torch.no_grad()")


def _head_dim_v_has_no_backward(q, v, what: str = "facodegen.attention") -> str:
    return (f"{what}: a V head dim of its own (head_dim_v={v.shape[-1]}, head_dim={q.shape[-1]}) has no backward "
            f"yet (the backward takes V as wide as Q and K); call it under torch.no_grad() or on tensors that do "
            f"not require grad")


def _split_v(q, v) -> bool:
    """v's head dim differs from q's (16-bit: head_dim_v; fp8's transposed V ends in seqlen_k)."""
    return (q.dtype != torch.float8_e4m3fn and q.dim() in (3, 4) and getattr(v, "dim", lambda: 0)() == q.dim()
            and v.shape[-1] != q.shape[-1])


def _refuse_without_backward(q, out, lse_out, v=None, what: str = "facodegen.attention") -> None:
    """A call that would record a gradient raises at the forward where the backward has no kernel (fp8, a ``v``
    narrower than q: head_dim_v, out=/lse_out=), rather than returning an output with no grad_fn or with a
    backward of another function. ``what``: the call the errors name (attention_varlen's packed q, k, v are 3-D).
    (Every attention variant has a backward.)"""
    if q.dtype == torch.float8_e4m3fn:
        raise NotImplementedError(_fp8_has_no_backward(what))
    if v is not None and _split_v(q, v):
        raise NotImplementedError(_head_dim_v_has_no_backward(q, v, what))
    if out is not None or lse_out is not None:
        raise NotImplementedError(_out_has_no_backward(what))


def attention(q, k, v, *, causal, softmax_scale, return_lse, out, lse_out, arch, variant=None, deterministic=False,
              **spec_fields):
    """facodegen.attention through the operators, as Dynamo and torch.export trace it (the arguments
    are attention()'s; ``variant``: api's (window_size, softcap, sinks, causal_alignment) or None;
    ``deterministic``: the backward's, which the op's autograd formula reads)."""
    if torch.is_grad_enabled() and any(getattr(t, "requires_grad", False) for t in (q, k, v)):
        _refuse_without_backward(q, out, lse_out, v)
    descales = [spec_fields.pop(name, None) for name in _DESCALES]
    window_size, softcap, sinks, alignment = variant or ((-1, -1), 0.0, None, "bottom_right")
    variant = (list(window_size), float(softcap), sinks, alignment)
    knobs = encode_knobs(spec_fields)
    if out is None and lse_out is None:
        out, lse = torch.ops.facodegen.attention(q, k, v, causal, softmax_scale, arch, *descales, knobs, *variant,
                                                 bool(deterministic))
        return (out, lse) if return_lse else out
    if out is None:
        out = q.new_empty(q.shape, dtype=_out_dtype(q, knobs))
    if lse_out is None:
        lse_out = q.new_empty(_lse_shape(q), dtype=torch.float32)
    torch.ops.facodegen.attention_out(q, k, v, out, lse_out, causal, softmax_scale, arch, *descales, knobs, *variant)
    return (out, lse_out) if return_lse else out


def attention_with_kvcache(q, k_cache, v_cache, cache_seqlens, *, page_table, k, v, causal, softmax_scale,
                           num_splits, return_lse, out, arch, check_inputs, window_size=(-1, -1), softcap=0.0, **knobs):
    """facodegen.attention_with_kvcache through the operators (the arguments are its own)."""
    if torch.is_grad_enabled() and any(getattr(t, "requires_grad", False) for t in (q, k_cache, v_cache, k, v)):
        raise NotImplementedError("facodegen.attention_with_kvcache has no backward (decode attention that writes "
                                  "the caches in place): call it under torch.no_grad() or torch.inference_mode(), "
                                  "or on tensors that do not require grad")
    kvcache.check_options(cache_seqlens, causal, softmax_scale, num_splits, knobs)   # before the schema's errors
    # (window_size and softcap are checked where the op runs, kvcache.decode_window, errors naming them)
    args = (causal, softmax_scale, num_splits, arch, encode_knobs(knobs), bool(check_inputs), list(window_size),
            softcap)
    if out is None:
        out, lse = torch.ops.facodegen.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens, page_table, k, v,
                                                              *args)
        return (out, lse) if return_lse else out
    lse = q.new_empty(_lse_shape(q), dtype=torch.float32)
    torch.ops.facodegen.attention_with_kvcache_out(q, k_cache, v_cache, cache_seqlens, page_table, k, v, out, lse,
                                                   *args)
    return (out, lse) if return_lse else out


def _fields(knobs: str, descales) -> dict:
    fields = dict(decode_knobs(knobs))
    fields.update({name: d for name, d in zip(_DESCALES, descales) if d is not None})
    return fields


def _out_dtype(q, knobs: str):
    if q.dtype == torch.float8_e4m3fn:
        return torch.float16 if decode_knobs(knobs).get("out_dtype") == "fp16" else torch.bfloat16
    return q.dtype


def _lse_shape(q) -> tuple:
    batch, seqlen_q, heads_q, _ = q.shape
    return (batch, heads_q, seqlen_q)


# ------------------------------------------------------------------ implementations

def _variant(window_size, softcap, sinks, causal_alignment):
    """api's variant tuple of the op's last arguments (None: a plain call). Top-left causal without
    a variant runs as the window (-1, 0) on its diagonal (one launch)."""
    if causal_alignment == "bottom_right" and api._variant_args(list(window_size), softcap, sinks) is None:
        return None
    return tuple(window_size), softcap, sinks, causal_alignment


def _attention_cuda(q, k, v, causal, softmax_scale, arch, q_descale, k_descale, v_descale, knobs,
                    window_size=(-1, -1), softcap=0.0, sinks=None, causal_alignment="bottom_right",
                    deterministic=False):   # (deterministic: the backward's, _attention_grad's)
    return api._attention_torch(torch, q, k, v, causal, softmax_scale, True, None, None, arch,
                                _fields(knobs, (q_descale, k_descale, v_descale)),
                                _variant(window_size, softcap, sinks, causal_alignment))


def _attention_out_cuda(q, k, v, out, lse, causal, softmax_scale, arch, q_descale, k_descale, v_descale, knobs,
                        window_size=(-1, -1), softcap=0.0, sinks=None, causal_alignment="bottom_right",
                        deterministic=False):
    api._attention_torch(torch, q, k, v, causal, softmax_scale, True, out, lse, arch,
                         _fields(knobs, (q_descale, k_descale, v_descale)),
                         _variant(window_size, softcap, sinks, causal_alignment))


def _attention_fake(q, k, v, causal, softmax_scale, arch, q_descale, k_descale, v_descale, knobs,
                    window_size=(-1, -1), softcap=0.0, sinks=None, causal_alignment="bottom_right",
                    deterministic=False):
    shape = (*q.shape[:3], v.shape[-1]) if _split_v(q, v) else q.shape     # (head_dim_v: v's head dim)
    return q.new_empty(shape, dtype=_out_dtype(q, knobs)), q.new_empty(_lse_shape(q), dtype=torch.float32)


def _attention_out_fake(q, k, v, out, lse, causal, softmax_scale, arch, q_descale, k_descale, v_descale, knobs,
                        window_size=(-1, -1), softcap=0.0, sinks=None, causal_alignment="bottom_right",
                        deterministic=False):
    return None


def _kvcache_cuda(q, k_cache, v_cache, cache_seqlens, page_table, k, v, causal, softmax_scale, num_splits, arch,
                  knobs, check_inputs=False, window_size=(-1, -1), softcap=0.0):
    return kvcache._eager(q, k_cache, v_cache, cache_seqlens, page_table, k, v, causal, softmax_scale, num_splits,
                          True, None, arch, check_inputs, decode_knobs(knobs), window_size=tuple(window_size),
                          softcap=softcap)


def _kvcache_out_cuda(q, k_cache, v_cache, cache_seqlens, page_table, k, v, out, lse, causal, softmax_scale,
                      num_splits, arch, knobs, check_inputs=False, window_size=(-1, -1), softcap=0.0):
    if lse.dtype != torch.float32 or tuple(lse.shape) != _lse_shape(q) or not lse.is_contiguous() or \
            lse.device != q.device:
        raise ValueError(f"lse must be a contiguous float32 tensor of shape {_lse_shape(q)} on {q.device}, got "
                         f"{lse.dtype} {tuple(lse.shape)} strides {lse.stride()} on {lse.device}")
    kvcache._eager(q, k_cache, v_cache, cache_seqlens, page_table, k, v, causal, softmax_scale, num_splits, True,
                   out, arch, check_inputs, decode_knobs(knobs), lse, window_size=tuple(window_size), softcap=softcap)


def _shape_view(name: str, x):
    """api._View of a fake or meta tensor: its shape, strides and dtype (no address: taken as aligned)."""
    if x is None:
        return None
    index = x.device.index
    return api._View(name, "torch", 0, tuple(x.shape), tuple(x.stride()), str(x.dtype).removeprefix("torch."),
                     -1 if index is None else index)


def _kvcache_check(q, k_cache, v_cache, cache_seqlens, page_table, k, v, out, num_splits):
    """The eager path's shape checks (kvcache.check_arguments) on the shapes alone, errors naming the argument."""
    views = [_shape_view(name, x) for name, x in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache),
                                                  ("cache_seqlens", cache_seqlens), ("page_table", page_table),
                                                  ("k", k), ("v", v), ("out", out))]
    kvcache.check_arguments(*views, num_splits)


def _kvcache_fake(q, k_cache, v_cache, cache_seqlens, page_table, k, v, causal, softmax_scale, num_splits, arch,
                  knobs, check_inputs=False, window_size=(-1, -1), softcap=0.0):
    _kvcache_check(q, k_cache, v_cache, cache_seqlens, page_table, k, v, None, num_splits)
    return torch.empty_like(q), q.new_empty(_lse_shape(q), dtype=torch.float32)   # O as the plan makes it


def _kvcache_out_fake(q, k_cache, v_cache, cache_seqlens, page_table, k, v, out, lse, causal, softmax_scale,
                      num_splits, arch, knobs, check_inputs=False, window_size=(-1, -1), softcap=0.0):
    _kvcache_check(q, k_cache, v_cache, cache_seqlens, page_table, k, v, out, num_splits)
    return None


def _kvcache_no_backward(op):
    def autograd_kernel(q, k_cache, v_cache, cache_seqlens, page_table, k, v, *args):
        if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (q, k_cache, v_cache, k, v)):
            raise NotImplementedError("facodegen.attention_with_kvcache has no backward: call it under "
                                      "torch.no_grad() or on tensors that do not require grad")
        with torch._C._AutoDispatchBelowAutograd():
            return op(q, k_cache, v_cache, cache_seqlens, page_table, k, v, *args)
    return autograd_kernel


def _attention_backward_cuda(dout, q, k, v, out, lse, causal, softmax_scale, arch, knobs, window_size=(-1, -1),
                             causal_alignment="bottom_right", softcap=0.0, sinks=None):
    """(dq, dk, dv, dsinks): dsinks the sinks' gradient, or an empty float32 tensor without sinks (an op's outputs
    are tensors)."""
    grads = backward.attention_backward(dout, q, k, v, out, lse, causal=causal, softmax_scale=softmax_scale,
                                        window_size=tuple(window_size), causal_alignment=causal_alignment,
                                        softcap=softcap, sinks=sinks, arch=arch, **decode_knobs(knobs))
    return grads if sinks is not None else (*grads, q.new_empty((0,), dtype=torch.float32))


def _attention_backward_fake(dout, q, k, v, out, lse, causal, softmax_scale, arch, knobs, window_size=(-1, -1),
                             causal_alignment="bottom_right", softcap=0.0, sinks=None):
    # attention_backward allocates contiguous gradients
    dsinks = q.new_empty((0,), dtype=torch.float32) if sinks is None else sinks.new_empty(sinks.shape)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), dsinks


def _no_backward(op):
    def autograd_kernel(q, k, v, *args):
        if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
            raise NotImplementedError(_out_has_no_backward())
        with torch._C._AutoDispatchBelowAutograd():
            return op(q, k, v, *args)
    return autograd_kernel


def _setup_context(ctx, inputs, output):
    q, k, v, causal, softmax_scale, arch, *_, window_size, softcap, sinks, causal_alignment, deterministic = inputs
    if _split_v(q, v):
        raise NotImplementedError(_head_dim_v_has_no_backward(q, v))
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, sinks)
    ctx.causal, ctx.softmax_scale, ctx.arch, ctx.deterministic = causal, softmax_scale, arch, deterministic
    ctx.window_size, ctx.causal_alignment, ctx.softcap = list(window_size), causal_alignment, softcap
    ctx.inputs = len(inputs)        # (a gradient, or None, for each)
    ctx.mark_non_differentiable(lse)


def _backward_knobs(deterministic: bool = False) -> dict:
    """The backward's knobs at backward time: the call's ``deterministic`` or
    torch.use_deterministic_algorithms(True) ask for bit-identical gradients, dQ's adds in a fixed order."""
    return {"deterministic": True} if deterministic or torch.are_deterministic_algorithms_enabled() else {}


def _attention_grad(ctx, grad_out, grad_lse):
    """dQ, dK, dV through the generated backward (the LSE output takes no gradient)."""
    q, k, v, out, lse, sinks = ctx.saved_tensors
    if q.dtype == torch.float8_e4m3fn:
        raise NotImplementedError(_fp8_has_no_backward())
    # an sm80 forward gets the sm80 backward, any other the default (backward.default_arch)
    dq, dk, dv, dsinks = torch.ops.facodegen.attention_backward(grad_out.contiguous(), q, k, v, out, lse, ctx.causal,
                                                                ctx.softmax_scale, backward.autograd_arch(ctx.arch),
                                                                encode_knobs(_backward_knobs(ctx.deterministic)),
                                                                ctx.window_size, ctx.causal_alignment, ctx.softcap,
                                                                sinks)
    grads = [dq, dk, dv] + [None] * (ctx.inputs - 3)
    if sinks is not None:
        grads[_SINKS_INPUT] = dsinks
    return tuple(grads)


# Where _attention_grad puts the sinks' gradient: their place among the op's inputs (its schema's)
_SINKS_INPUT = [a.name for a in torch.ops.facodegen.attention.default._schema.arguments].index("sinks")


# ------------------------------------------------------------------ eager autograd

def attention_recording(q, k, v, causal, softmax_scale, return_lse, out, lse_out, arch, spec_fields, variant,
                        deterministic=False):
    """facodegen.attention in eager mode on tensors that record a gradient (api.attention's
    arguments): _Attention, the direct launches of the no-grad call and of attention_backward. (``variant``: a
    window, a softcap and sinks, which the backward takes too; with sinks _AttentionSinks, whose input they are,
    so that they take their gradient.)"""
    _refuse_without_backward(q, out, lse_out, v)
    call = (causal, softmax_scale, arch, spec_fields, bool(deterministic), variant)
    if variant is None or variant[2] is None:
        out, lse = _Attention.apply(q, k, v, call)
    else:
        out, lse = _AttentionSinks.apply(q, k, v, variant[2], call)
    return (out, lse) if return_lse else out


def _forward(ctx, q, k, v, sinks, call):
    """_Attention's and _AttentionSinks' forward: the no-grad call's launch with the LSE; O and LSE saved (and the
    sinks, where given)."""
    causal, softmax_scale, arch, spec_fields, _, variant = call
    out, lse = api._attention_torch(torch, q, k, v, causal, softmax_scale, True, None, None, arch, spec_fields,
                                    variant)
    if sinks is None:
        ctx.save_for_backward(q, k, v, out, lse)
    else:
        ctx.save_for_backward(q, k, v, out, lse, sinks)
    ctx.call = call
    ctx.mark_non_differentiable(lse)
    # the LSE takes no gradient: the engine need not make a zero one for it (on a GPU: an allocation
    # and a fill kernel per backward)
    ctx.set_materialize_grads(False)
    return out, lse


class _Attention(torch.autograd.Function):
    """Attention with its backward, outside the dispatcher: the forward launches from the plan as a
    no-grad call does (api._attention_torch, the LSE too) and saves O and LSE; the backward calls
    attention_backward, whose plan launches the generated kernels. The same work as the op's
    autograd formula (_setup_context, _attention_grad) at a fraction of its host cost: per call,
    torch.library's autograd kernel rebinds the op's 14 arguments to its schema
    (torch._library.utils.fill_defaults), several times the cost of this whole forward.
    ``call``: (causal, softmax_scale, arch, spec_fields, deterministic, variant), one argument for
    Function.apply to walk rather than six (``variant``: api's, without sinks, or None)."""

    @staticmethod
    def forward(ctx, q, k, v, call):
        return _forward(ctx, q, k, v, None, call)

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        if torch.is_grad_enabled():     # create_graph=True: once_differentiable's error on a second derivative
            return _backward_once(ctx, grad_out)
        return _backward(ctx, grad_out)


class _AttentionSinks(torch.autograd.Function):
    """_Attention with sinks: they are an input (of apply), so the backward returns their gradient too, the
    SINKS postprocess's. (A class of its own keeps the common call's apply at four arguments.)"""

    @staticmethod
    def forward(ctx, q, k, v, sinks, call):
        return _forward(ctx, q, k, v, sinks, call)

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        if torch.is_grad_enabled():
            return _backward_once(ctx, grad_out)
        return _backward(ctx, grad_out)


def _backward(ctx, grad_out):
    """_Attention's and _AttentionSinks' backward (grad mode off: the engine's, without create_graph): dq, dk, dv
    (and dsinks), then None for ``call``."""
    saved = ctx.saved_tensors
    if grad_out is None:    # (no gradient reached O: set_materialize_grads(False) leaves it None)
        return (None,) * (len(saved) - 1)
    grad_out = _kernel_layout(grad_out)
    q, k, v, out, lse = saved[:5]
    causal, softmax_scale, arch, _, deterministic, variant = ctx.call
    variant_args = {} if variant is None else {"window_size": tuple(variant[0]), "causal_alignment": variant[3],
                                               "softcap": variant[1]}
    if len(saved) > 5:
        variant_args["sinks"] = saved[5]
    grads = backward.attention_backward(grad_out, q, k, v, out, lse, causal=causal, softmax_scale=softmax_scale,
                                        arch=backward.autograd_arch(arch), **variant_args,
                                        **_backward_knobs(deterministic))
    return (*grads, None)


_backward_once = once_differentiable(_backward)


def _kernel_layout(grad_out):
    """dO as the backward kernels read it: itself where its layout is one they take (head_dim contiguous,
    the other strides multiples of 8 elements, 16-byte aligned; e.g. a transposed (batch, heads, seqlen,
    head_dim) gradient seen as (b, s, h, d)), else a contiguous copy."""
    if grad_out.is_contiguous():
        return grad_out
    s = grad_out.stride()
    if s[-1] != 1 or any(x & 7 for x in s[:-1]) or grad_out.data_ptr() & 15:
        return grad_out.contiguous()
    return grad_out


def attention_varlen_recording(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale,
                               return_lse, out, arch, spec_fields, variant, deterministic=False):
    """facodegen.attention_varlen on tensors that record a gradient (its arguments; ``variant``: api's
    (window_size, softcap, sinks, alignment) or None; fp8, head_dim_v, a padded head_dim and ``out`` are
    refused): _VarlenAttention, the no-grad call and attention_varlen_backward."""
    _refuse_without_backward(q, out, None, v, what="facodegen.attention_varlen")
    if not isinstance(deterministic, bool):
        raise TypeError(f"deterministic must be True or False, got {deterministic!r}")
    variant_args = {} if variant is None else {"window_size": tuple(variant[0]), "softcap": variant[1]}
    call = (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale, arch, spec_fields,
            deterministic, variant_args)
    out, lse = _VarlenAttention.apply(q, k, v, None if variant is None else variant[2], call)
    return (out, lse) if return_lse else out


class _VarlenAttention(torch.autograd.Function):
    """attention_varlen with its backward (_Attention's way): the forward is the no-grad call with the
    LSE, which it saves with O; the backward runs attention_varlen_backward on them. ``sinks``: the sinks (or
    None), an input so that they take their gradient. ``call``: (cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
    max_seqlen_k, causal, softmax_scale, arch, spec_fields, deterministic, variant_args: window_size and
    softcap, or {}); the boundaries take no gradient."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, call):
        from .varlen import attention_varlen
        cu_q, cu_k, max_q, max_k, causal, softmax_scale, arch, spec_fields, _, variant_args = call
        out, lse = attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k, causal=causal, softmax_scale=softmax_scale,
                                    return_lse=True, arch=arch, sinks=sinks, **variant_args,
                                    **spec_fields)   # (grad mode is off in here)
        ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k, sinks)
        ctx.call = call
        ctx.mark_non_differentiable(lse)
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out, grad_lse):
        from .varlen_backward import attention_varlen_backward
        if grad_out is None:
            return None, None, None, None, None
        grad_out = _kernel_layout(grad_out)
        q, k, v, out, lse, cu_q, cu_k, sinks = ctx.saved_tensors
        _, _, max_q, max_k, causal, softmax_scale, arch, _, deterministic, variant_args = ctx.call
        grads = attention_varlen_backward(grad_out, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal=causal,
                                          softmax_scale=softmax_scale, arch=backward.autograd_arch(arch), sinks=sinks,
                                          **variant_args, **_backward_knobs(deterministic))
        return (*grads, None) if sinks is not None else (*grads, None, None)


_LIB.impl("attention", _attention_cuda, "CUDA")
_LIB.impl("attention_out", _attention_out_cuda, "CUDA")
_LIB.impl("attention_backward", _attention_backward_cuda, "CUDA")
_LIB.impl("attention_out", _no_backward(torch.ops.facodegen.attention_out), "Autograd")
torch.library.register_fake("facodegen::attention", _attention_fake, lib=_LIB)
torch.library.register_fake("facodegen::attention_out", _attention_out_fake, lib=_LIB)
torch.library.register_fake("facodegen::attention_backward", _attention_backward_fake, lib=_LIB)
torch.library.register_autograd("facodegen::attention", _attention_grad, setup_context=_setup_context, lib=_LIB)
_LIB.impl("attention_with_kvcache", _kvcache_cuda, "CUDA")
_LIB.impl("attention_with_kvcache_out", _kvcache_out_cuda, "CUDA")
_LIB.impl("attention_with_kvcache", _kvcache_no_backward(torch.ops.facodegen.attention_with_kvcache), "Autograd")
_LIB.impl("attention_with_kvcache_out", _kvcache_no_backward(torch.ops.facodegen.attention_with_kvcache_out),
          "Autograd")
torch.library.register_fake("facodegen::attention_with_kvcache", _kvcache_fake, lib=_LIB)
torch.library.register_fake("facodegen::attention_with_kvcache_out", _kvcache_out_fake, lib=_LIB)
