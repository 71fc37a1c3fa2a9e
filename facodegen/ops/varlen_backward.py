"""``attention_varlen_backward``: the gradients of ``attention_varlen`` (packed variable-length
sequences, FlashAttention's ``flash_attn_varlen_func`` backward), and what its autograd runs.

The kernels are the backward's (ops/backward.py) built with ``varlen=True``; no value of cu_seqlens is
read on the host, so a call never syncs. sm80 (any GPU): the
preprocess (D = rowsum(dO ∘ O), dq_accum = 0) and the postprocess (dQ = softmax_scale * dq_accum) see
the packed query tokens as one batch of total_q rows, so LSE, D and dq_accum have one row per packed
token, as the varlen forward's LSE (heads_q, total_q) has; the main kernel's grid z is the sequence,
whose first tokens and lengths it reads from cu_seqlens_q / cu_seqlens_k, and its grid x covers
max_seqlen_k's plan_bound keys (a key block past its sequence's keys returns). sm90 (H100/H200's
default): one CTA per tile (key block of max_seqlen_k's bound, kv head, sequence), TMA maps over the
packed tokens, the pre- and postprocess per sequence (grid z) writing LSE * log2(e) and D (and the
tiled dq_accum) in each sequence's padded blocks (spec/backward.py varlen_padded_blocks).

A plan is keyed by the arrays' layouts without their token counts (as attention_varlen's), the number of
sequences and the max_seqlen bounds, never by the values in cu_seqlens or the totals: a call with other
boundaries or other totals (a training step's new packing) is a plan-cache hit that patches the
cu_seqlens addresses and the totals into its BwdParams, launches the grids of its totals (sm80's
preprocess and postprocess run over the packed rows) and, sm90, the TMA maps of its totals
(backward.VarlenTotals). A hit first checks that the arrays agree on the totals (q, dO, O, the LSE and dQ
on total_q, K, V, dK, dV on total_k), else the checked path names the one that does not. The scratch
(dq_accum, D, LSE * log2(e)) is allocated per call in the caller's library, never kept by the plan (its
size follows the totals).
"""

from __future__ import annotations

import functools
import math

from . import api, backward, varlen
from ..runtime import driver, tma
from ..runtime.plan import PlanCache
from ..spec.backward import ELEMENT_BYTES

_PLANS = PlanCache()


def attention_varlen_backward(do, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int,
                              max_seqlen_k: int, *, causal: bool = False, softmax_scale: float | None = None,
                              window_size=(-1, -1), softcap: float = 0.0, sinks=None, dq=None, dk=None, dv=None,
                              arch: str | None = None, check_inputs: bool = False, **knobs):
    """Gradients (dq, dk, dv) of attention_varlen given dO = ``do`` and the forward's ``out`` and ``lse``.

    q, out, do: (total_q, heads_q, head_dim); k, v: (total_k, heads_kv, head_dim), fp16 or bf16 torch
    CUDA tensors or CuPy arrays (attention_varlen's layout rules; head_dim any multiple of 8 in [8, 256]: 64,
    96, 128, 192, 256 or the next one's tile, padded inside the kernels; V as wide as Q and K); lse: the
    forward's float32 natural-log LSE, contiguous (heads_q, total_q) (attention_varlen(..., return_lse=True));
    cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, ``causal``, ``softmax_scale``, ``window_size`` and
    ``softcap``: the forward's (a window on each sequence's bottom-right diagonal and a softcap run the sm80
    backward's LOCAL and SOFTCAP kernels, on every GPU), and so must ``sinks`` (the sm80 SINKS kernels too): the
    call then returns (dq, dk, dv, dsinks), dsinks a new float32 (heads_q,) array.
    dK and dV of a kv head are summed over the query heads that share it (GQA/MQA). dq, dk, dv: arrays to
    write the gradients into (default: new contiguous ones, zero at the tokens no sequence covers; given ones
    keep what they held there, but for dQ on sm80, written zero). ``arch``: None (sm90 on H100/H200, where it
    takes the call's knobs; else sm80), "sm80" (any GPU) or "sm90". ``knobs``: BackwardSpec fields (block_n=...,
    deterministic=True, ...). ``check_inputs``: attention_varlen's (cu_seqlens checked on the host, a sync).
    Runs on the caller's current stream.
    """
    if check_inputs:
        varlen.check_boundaries(varlen._host_ints(cu_seqlens_q), varlen._host_ints(cu_seqlens_k), q.shape[0],
                                k.shape[0], max_seqlen_q, max_seqlen_k)
    window_size = backward.hashable_window(window_size)
    kind = api._kind(q)
    plan = key = None
    if kind != "other":
        try:
            key = _call_key(kind, (do, q, k, v, out, lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, sinks), (
                max_seqlen_q.__class__, varlen.plan_bound(max_seqlen_q), max_seqlen_k.__class__,
                varlen.plan_bound(max_seqlen_k), causal.__class__, causal, softmax_scale.__class__, softmax_scale,
                window_size, softcap.__class__, softcap, arch, tuple(sorted(knobs.items()))))
            plan = None if key is None else _PLANS.get(key)
        except (AttributeError, TypeError, ValueError, IndexError):   # not arrays of one library, an unhashable knob
            plan = key = None
    if plan is None:
        plan = _resolve(do, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                        softmax_scale, dq, dk, dv, arch, knobs, window_size, softcap, sinks)
        if key is not None:
            _PLANS.put(key, plan)
    device = plan.device
    # (the preprocess zeroes the rows of these that no sequence covers: BwdParams.zero_outside)
    dq = backward._new_like(kind, device, q) if dq is None else dq
    dk = backward._new_like(kind, device, k) if dk is None else dk
    dv = backward._new_like(kind, device, v) if dv is None else dv
    pointers = backward.call_pointers(kind, (q, k, v, out, do, lse, dq, dk, dv))
    ptr = api.ARRAY_PTR[kind]
    cu_seqlens = (ptr(cu_seqlens_q), ptr(cu_seqlens_k))
    if (cu_seqlens[0] | cu_seqlens[1]) & 3:
        raise ValueError("cu_seqlens_q, cu_seqlens_k: data pointers must be 4-byte aligned")
    if sinks is None:
        plan.launch(api._current_stream(kind, device), pointers, cu_seqlens, (q.shape[0], k.shape[0]))
        return dq, dk, dv
    dsinks = backward._zeros_like(kind, device, sinks)
    plan.launch(api._current_stream(kind, device), pointers, cu_seqlens, (q.shape[0], k.shape[0]),
                sinks=(ptr(sinks), ptr(dsinks)))
    return dq, dk, dv, dsinks


def _call_key(kind: str, arrays: tuple, options: tuple) -> tuple | None:
    """The plan key of a call on ``arrays`` = (do, q, k, v, out, lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k,
    sinks): the packed arrays' metas without their token counts (varlen._PACKED_META), the LSE's without its
    total_q (its heads, rank, inner stride, whether its rows are contiguous), the boundaries' and sinks' metas,
    the ``options`` and the current device; None where the arrays disagree on a total (the checked path names
    which)."""
    do, q, k, v, out, lse, dq, dk, dv, cu_q, cu_k, sinks = arrays
    total_q, total_k = q.shape[0], k.shape[0]
    if not (do.shape[0] == out.shape[0] == lse.shape[-1] == total_q == (total_q if dq is None else dq.shape[0])
            and v.shape[0] == total_k == (total_k if dk is None else dk.shape[0])
            == (total_k if dv is None else dv.shape[0])):
        return None
    packed, meta = varlen._PACKED_META[kind], api.ARRAY_META[kind]
    m = meta(lse)
    lse_layout = (m[0], m[1][0], len(m[1]), m[2][-1], m[2][0] == m[2][-1] * m[1][-1], m[3])
    return (kind, *(packed(x) for x in (do, q, k, v, out, dq, dk, dv)), lse_layout, meta(cu_q), meta(cu_k),
            meta(sinks), *options, api._current_device(kind))


def _encode_maps(built: dict, row_bytes: dict, targets: tuple, total_q: int, total_k: int) -> dict[str, bytes]:
    """sm90: the maps of a call with other addresses (``targets``: q, k, v, dO) or totals, from the plan's
    checked ones (``built``: tiled_args', the key fixes the layouts; ``row_bytes``: each tensor's row stride)."""
    return {name: tma.encode(tma.with_rows(args, ptr, total_k if name in ("tma_k", "tma_v") else total_q,
                                           row_bytes[name]))
            for (name, args), ptr in zip(built.items(), targets)}


def zero_outside_bits(arch: str, new_dq: bool, new_dk: bool, new_dv: bool) -> int:
    """BwdParams.zero_outside: the arrays the call makes whose rows outside every sequence the preprocess
    zeroes (bit 0 dQ, 1 dK, 2 dV). The main kernel writes dK, dV only at the sequences' keys; sm80's
    postprocess writes every row of dQ (dq_accum is zero outside them), sm90's only the sequences'.
    Arrays the caller gave keep what they held there."""
    return int(arch == "sm90" and new_dq) | int(new_dk) << 1 | int(new_dv) << 2


def _resolve(do, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale,
             dq, dk, dv, arch, knobs, window_size=(-1, -1), softcap=0.0, sinks=None) -> backward.BackwardPlan:
    """Check every argument (errors name it), pick and load the kernels, build the plan."""
    qv, kv, vv = api._view("q", q), api._view("k", k), api._view("v", v)
    varlen.check_packed(qv, kv, vv, backward=True)
    cu_q, _ = varlen.check_cu_seqlens(qv, cu_seqlens_q, cu_seqlens_k)
    max_q, max_k = (varlen.plan_bound(varlen.check_max_seqlen(name, value)) for name, value in
                    (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)))
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be True or False, got {causal!r}")
    if "varlen" in knobs:
        raise ValueError("varlen is attention_varlen_backward's own switch; leave it out of the knobs")
    total_q, heads_q, head_dim = qv.shape
    total_k, heads_kv = kv.shape[0], kv.shape[1]
    sequences = cu_q.shape[0] - 1
    views = {"q": qv, "k": kv, "v": vv}
    for name, x in (("do", do), ("out", out)):
        view = api._view(name, x)
        backward._check_like(varlen.as_one_batch(view), varlen.as_one_batch(qv), name)
        views["dout" if name == "do" else "o"] = view
    lsev = api._view("lse", lse)
    if lsev.kind != qv.kind or lsev.dtype != "float32" or lsev.device != qv.device:
        raise TypeError(f"lse must be a float32 {qv.kind} array on cuda:{qv.device} (attention_varlen's "
                        f"return_lse), got a {lsev.kind} {lsev.dtype} array on cuda:{lsev.device}")
    if lsev.shape != (heads_q, total_q) or lsev.strides != (total_q, 1):
        raise ValueError(f"lse must be a contiguous (heads_q, total_q) = {(heads_q, total_q)} array (attention_varlen's "
                         f"return_lse), got shape {lsev.shape} strides {lsev.strides}")
    backward.gradient_views(views, dq, dk, dv, checked=varlen.as_one_batch)
    scale = api._check_scale(softmax_scale, head_dim)
    # (the window folded as for sequences of the plan's bounds: open sides are open for every sequence)
    causal, knobs, variant_values = backward.variant_knobs(
        window_size, "bottom_right", softcap, api._check_sinks(sinks, varlen.as_one_batch(qv)) is not None, causal,
        max_q, max_k, scale, knobs)
    info, spec, functions = backward.spec_of_call(qv, head_dim, causal, {**knobs, "varlen": True}, arch)
    packed = {name: varlen.as_one_batch(view) for name, view in views.items()}    # (as FlashParams takes them)
    values = backward.stride_values(packed)
    values.update(batch=sequences, seqlen_q=total_q, seqlen_k=total_k, heads_q=heads_q, heads_kv=heads_kv,
                  softmax_scale=scale, scale_log2=scale * math.log2(math.e), cu_seqlens_q=0, cu_seqlens_k=0,
                  zero_outside=zero_outside_bits(spec.arch, dq is None, dk is None, dv is None), **variant_values)
    encode_maps = None
    if spec.arch == "sm90":     # TMA maps over the packed tokens (as one batch); tiles over max_seqlen_k's bound
        driver.ensure_context(qv.device)
        map_args = backward.tensor_map_args(spec, packed, 1, total_q, total_k, heads_q, heads_kv)
        values.update({name: tma.encode(a) for name, a in map_args.items()}, lpt_pairs=0, lpt_tail_pair=0,
                      varlen_max_seqlen_k=max_k)
        row_bytes = {name: packed[operand].strides[1] * ELEMENT_BYTES
                     for name, operand in backward._MAP_OPERANDS.items()}
        encode_maps = functools.partial(_encode_maps, map_args, row_bytes)
    totals = backward.VarlenTotals(spec, sequences, heads_q, heads_kv, max_q, max_k, info.sms, encode_maps)
    grid3, (accum_floats, stat_floats, semaphore_ints) = totals.of(total_q)
    return backward.BackwardPlan(
        spec, functions, grid3,
        backward.pack_for(spec, values), allocate=functools.partial(api._allocate, qv.kind, qv.device),
        map_targets=tuple(views[operand].ptr for operand in backward._MAP_OPERANDS.values()),
        device=qv.device, accum_floats=accum_floats, dpsum_floats=stat_floats, semaphore_ints=semaphore_ints,
        switch_context=qv.device != api._current_device(qv.kind), keep_scratch=False, varlen=totals,
        totals=(total_q, total_k))


__all__ = ["attention_varlen_backward"]
