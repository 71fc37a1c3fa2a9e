"""``attention_varlen``: attention over packed variable-length sequences, FlashAttention's
``flash_attn_varlen_func`` semantics, on the forward kernel built with ``varlen=True``: the sm90
(wgmma, TMA) kernel on H100/H200, the sm80 one elsewhere (the arch is chosen as attention()'s is).

q is (total_q, heads_q, head_dim), k and v (total_k, heads_kv, head_dim): the sequences one after
another, sequence b's queries at tokens cu_seqlens_q[b] .. cu_seqlens_q[b+1]-1 and its keys at
cu_seqlens_k[b] .. cu_seqlens_k[b+1]-1 (int32 device arrays of shape (batch + 1,)). The kernel
reads the boundaries itself (grid z = sequence), so a call never syncs: max_seqlen_q and
max_seqlen_k are host ints the caller knows, and only max_seqlen_q shapes the grid.

A plan is built for max_seqlen rounded up to a power of two (plan_bound): the grid covers that
many query rows per sequence (sm80, sm90 with persistent=False: a tile past its sequence's end returns
at once; sm90 persistent, the default: at most one CTA per SM, which count and number the real tiles
themselves from cu_seqlens_q, no sequence's beyond that many rows), so a server whose longest sequence
grows each step meets a new plan only when it crosses a power of two.

The checks and the plumbing are the forward's (api.py): the packed tensors are seen as one batch
of total_tokens rows, so the dtype, device, head_dim, GQA, stride and alignment checks, the spec
resolution, the compiled-kernel cache and the launch plan are the same code. A plan is keyed by
the tensors' layouts (not their token counts), the number of sequences and max_seqlen_q/k's
plan_bound, never by the values in cu_seqlens: a call whose boundaries or total tokens change is a plan-cache hit
that patches the cu_seqlens addresses and total_q (the LSE's head stride) into its FlashParams.

sm90: the TMA maps span the packed tokens ({head_dim, total, heads, 1}; a tile's loads start at its
sequence's first token and run into the next sequence's rows, which the masks hide, and past the
last token the TMA unit reads zeros), so they depend on total_q and total_k: a call with totals or
addresses the plan has not seen encodes the maps anew (LaunchPlan's encode_maps; an image per
(addresses, totals) is kept, as attention()'s are per addresses): Q, K, V and, with varlen_tma_store
(the default), O, whose 64-row boxes the kernel stores only where they lie inside one sequence (the
rows of a sequence's last partial block go row by row). No device value is read on the host.
"""

from __future__ import annotations

import dataclasses
import functools
import numbers
import sys

from . import api
from ..tuning import tunedb
from .api import (_FP8_KNOBS, ARRAY_META, ARRAY_PTR, DTYPE_NAMES, OUT_DTYPE_NAMES, _allocate,
                  _check_inputs, _check_out, _check_same_place, _check_scale, _current_device, _current_stream, _empty,
                  _kind, _torch, _View, _view, resolve_spec)
from ..runtime import driver, tma
from ..runtime.launch import Varlen, grid, pack_params
from ..runtime.plan import LaunchPlan, PlanCache

VARLEN_ARCHS = ("sm80", "sm90")     # arch=None: the device's (sm90 on H100/H200), as attention()

_PLANS = PlanCache()


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int, *,
                     causal: bool = False, softmax_scale: float | None = None, window_size=(-1, -1),
                     softcap: float = 0.0, sinks=None, return_lse: bool = False, out=None, arch: str | None = None,
                     deterministic: bool = False, check_inputs: bool = False, **spec_fields):
    """Attention over packed variable-length sequences (FlashAttention's ``flash_attn_varlen_func``).

    q: (total_q, heads_q, head_dim); k, v: (total_k, heads_kv, head_dim), fp16 or bf16 torch CUDA
    tensors or CuPy arrays (any token/head strides, contiguous head_dim; heads_kv divides heads_q).
    cu_seqlens_q, cu_seqlens_k: int32 (batch + 1,) device arrays of prefix sums (cu_seqlens[0] = 0):
    sequence b is tokens cu_seqlens[b] .. cu_seqlens[b+1]-1. max_seqlen_q, max_seqlen_k: host ints at
    least each sequence's length (the grid covers max_seqlen_q query rows per sequence, rounded up to
    a power of two so that growing lengths reuse a plan: rows past that are not computed, as in
    FlashAttention; nothing reads cu_seqlens on the host).

    Per sequence, exactly attention() of that sequence: causal aligned bottom-right (the last query
    sees every key), a zero-length sequence produces nothing, a query that sees no key gets O = 0
    and LSE = -inf. The attention variants as attention() takes them, per sequence: ``window_size=(left,
    right)`` (a sliding window on each sequence's bottom-right diagonal, -1 = unbounded; with
    ``causal`` the right side is 0), ``softcap`` (> 0: logits c * tanh(scale * s / c)) and ``sinks`` (a
    float32 (heads_q,) array: one extra logit per query head in the softmax's denominator). Returns O
    (total_q, heads_q, head_dim) in q's dtype, and with ``return_lse`` the float32 natural-log LSE
    (heads_q, total_q) (FlashAttention-2/3 varlen's layout; with sinks, the sink included). ``out``
    receives O in place. ``arch``: "sm90" (the default on H100/H200) or "sm80" (the default elsewhere;
    it runs on sm90 GPUs too). Spec fields (block_n=..., stages=...) override the defaults. fp8 (sm90):
    float8_e4m3fn q, k, v with ``q_descale``, ``k_descale``, ``v_descale`` (float32 scalars or
    (sequences, heads_kv), as attention() takes them, the batch being the sequences; one left out is 1),
    O in ``out_dtype`` (bf16 by default), no variants. Gradients: torch tensors that require grad record
    one (attention_varlen_backward: the sm90 backward's varlen kernels on H100/H200, sm80's elsewhere),
    for fp16/bf16 with head_dim 64, 96, 128, 192 or 256 shared by Q, K and V, no ``out`` (a window, a softcap and
    sinks take the sm80 backward's LOCAL, SOFTCAP and SINKS kernels, deterministic too; the sinks their gradient);
    the others raise at the forward. ``deterministic``: that backward's dQ adds in key-block order, so gradients are
    bit-identical across runs (so they are under torch.use_deterministic_algorithms(True)); the forward
    is deterministic either way. ``check_inputs=True`` reads cu_seqlens on the host first (a sync) and
    raises ValueError naming the argument where they are not boundaries of the packed tokens
    (check_boundaries); without it the kernels clamp each sequence into the packed tokens (no read or
    write outside them), computing on whatever that leaves.
    """
    if check_inputs:
        check_boundaries(_host_ints(cu_seqlens_q), _host_ints(cu_seqlens_k), q.shape[0], k.shape[0], max_seqlen_q,
                         max_seqlen_k)
    torch = _torch()
    key = plan = None
    variant = api._variant_args(window_size, softcap, sinks)
    if api._records_grad(q, k, v):
        from .torch_op import attention_varlen_recording     # (the gradient: attention_varlen_backward)
        return attention_varlen_recording(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                                          softmax_scale, return_lse, out, arch, spec_fields, variant, deterministic)
    try:
        if torch is not None and isinstance(q, torch.Tensor):
            kind, device, current = "torch", q.get_device(), torch._C._cuda_getDevice()
            if device >= 0:     # _PACKED_META's and ARRAY_META's parts, written out flat (a server's every step)
                key = ("torch", q.dtype, q.shape[1:], q.stride(), device, k.dtype, k.shape[1:], k.stride(),
                       k.get_device(), v.dtype, v.shape[1:], v.stride(), v.get_device(), cu_seqlens_q.dtype,
                       cu_seqlens_q.shape, cu_seqlens_q.stride(), cu_seqlens_q.get_device(), cu_seqlens_k.dtype,
                       cu_seqlens_k.shape, cu_seqlens_k.stride(), cu_seqlens_k.get_device(),
                       max_seqlen_q.__class__, plan_bound(max_seqlen_q), max_seqlen_k.__class__,
                       plan_bound(max_seqlen_k), current,
                       causal.__class__, causal, softmax_scale.__class__, softmax_scale, bool(return_lse), arch,
                       *(_knob_key(spec_fields, ARRAY_META["torch"]) if spec_fields else ((), None)),
                       None if out is None else _PACKED_META["torch"](out), tunedb.generation(),
                       None if variant is None else api._variant_key(variant, ARRAY_META["torch"]))
                plan = _PLANS._plans.get(key)
        else:
            cupy = sys.modules.get("cupy")
            kind = "cupy" if cupy is not None and isinstance(q, cupy.ndarray) else "other"
            device = q.device.id if kind == "cupy" else -1
            current = cupy.cuda.runtime.getDevice() if kind == "cupy" else -1
            if device >= 0:
                meta, packed = ARRAY_META[kind], _PACKED_META[kind]
                key = (kind, packed(q), packed(k), packed(v), meta(cu_seqlens_q), meta(cu_seqlens_k),
                       max_seqlen_q.__class__, plan_bound(max_seqlen_q), max_seqlen_k.__class__,
                       plan_bound(max_seqlen_k), current,
                       causal.__class__, causal, softmax_scale.__class__, softmax_scale, bool(return_lse), arch,
                       *_knob_key(spec_fields, meta), packed(out), tunedb.generation(),
                       None if variant is None else api._variant_key(variant, meta))
                plan = _PLANS.get(key)
    except (AttributeError, TypeError):     # not all arrays of one library, an unhashable knob: the checked path
        key = plan = None
    if plan is None:
        return _miss(key, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale,
                     bool(return_lse), out, arch, spec_fields, variant)
    total_q, heads_q = q.shape[0], q.shape[1]
    if v.shape[0] != k.shape[0] or out is not None and out.shape[0] != total_q:    # (the key has no totals)
        return _miss(None, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale,
                     bool(return_lse), out, arch, spec_fields, variant)   # the checked path names the array
    made = plan.outputs
    # made.tokens: the tokens whose LSE the plan's scratch holds (the total it was built for); a
    # larger total not asking for the LSE writes it to a temporary instead.
    lse_needed = return_lse or total_q > made.tokens
    if kind == "torch":
        if out is None:
            out = torch.empty_like(q) if made.out_dtype is None else torch.empty(
                q.shape if made.out_shape is None else (total_q, *made.out_shape), dtype=made.out_dtype,
                device=q.device)
        lse = torch.empty((heads_q, total_q), dtype=torch.float32, device=q.device) if lse_needed else None
        stream = torch._C._cuda_getCurrentRawStream(device)
        ptr = torch.Tensor.data_ptr     # (ARRAY_PTR's, without its frame)
    else:
        with cupy.cuda.Device(device):
            if out is None:
                out = cupy.empty(q.shape if made.out_shape is None else (total_q, *made.out_shape),
                                 dtype=q.dtype if made.out_dtype is None else made.out_dtype)
            lse = cupy.empty((heads_q, total_q), dtype=cupy.float32) if lse_needed else None
            stream = cupy.cuda.get_current_stream().ptr
        ptr = ARRAY_PTR[kind]
    pointers = (ptr(q), ptr(k), ptr(v), ptr(out))
    cu_q, cu_k = ptr(cu_seqlens_q), ptr(cu_seqlens_k)
    sinks_ptr = ptr(sinks) if sinks is not None else 0
    if (pointers[0] | pointers[1] | pointers[2] | pointers[3]) & 15 or (cu_q | cu_k | sinks_ptr) & 3:
        return _miss(None, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale,
                     bool(return_lse), out, arch, spec_fields, variant)    # misaligned: the checked path says which
    descales = None
    if made.unit_descale_ptrs:     # fp8: the call's descales' addresses, the plan's unit ones where left out
        descales = api._descale_ptrs(tuple(spec_fields.get(n) for n in _FP8_KNOBS), made.unit_descale_ptrs, ptr)
    _launch(plan, stream, pointers, ptr(lse) if lse is not None else 0, cu_q, cu_k, total_q, k.shape[0], sinks_ptr,
            descales)
    return (out, lse) if return_lse else out


def check_boundaries(cu_q, cu_k, total_q: int, total_k: int, max_seqlen_q: int, max_seqlen_k: int) -> None:
    """check_inputs=True: host copies of cu_seqlens_q and cu_seqlens_k against the packed tokens. Each
    starts at 0 or later, never decreases, ends within its total, and no sequence is longer than its
    max_seqlen (whose rows or keys past it the kernels would not compute). Raises ValueError naming the
    argument and the first sequence at fault."""
    for name, cu, total, longest, bound in (("cu_seqlens_q", cu_q, total_q, "max_seqlen_q", max_seqlen_q),
                                            ("cu_seqlens_k", cu_k, total_k, "max_seqlen_k", max_seqlen_k)):
        cu = [int(x) for x in cu]
        if cu[0] < 0:
            raise ValueError(f"{name}[0] = {cu[0]} is negative; cu_seqlens are token offsets into the packed tensors")
        for b, (start, end) in enumerate(zip(cu, cu[1:])):
            if end < start:
                raise ValueError(f"{name} decreases at sequence {b}: {name}[{b}] = {start}, {name}[{b + 1}] = {end}")
            if end - start > bound:
                raise ValueError(f"sequence {b} has {end - start} tokens ({name}[{b + 1}] - {name}[{b}]) but {longest} "
                                 f"is {bound}: the kernels cover {longest} tokens per sequence")
        if cu[-1] > total:
            raise ValueError(f"{name}[-1] = {cu[-1]} is past the {total} packed tokens")


def _host_ints(x) -> list[int]:
    """An int32 device array's values on the host (a sync; torch's and CuPy's tolist)."""
    return x.tolist()


def plan_bound(max_seqlen: int) -> int:
    """The length a plan is built for: ``max_seqlen`` rounded up to a power of two (0 stays 0; a
    negative value is left as it is, for the checked path to refuse)."""
    return max_seqlen if max_seqlen <= 0 else 1 << (max_seqlen - 1).bit_length()


def _packed_meta(meta):
    """A packed tensor's plan-key meta without its token count (calls with other totals hit too)."""
    def packed(x):
        m = meta(x)
        return m and (m[0], m[1][1:], m[2], m[3])
    return packed


def _torch_packed_meta(x):
    """_packed_meta(ARRAY_META["torch"]) in one frame (the varlen backward's key takes eight a call)."""
    return None if x is None else (x.dtype, x.shape[1:], x.stride(), x.get_device())


_PACKED_META = {"torch": _torch_packed_meta, "cupy": _packed_meta(ARRAY_META["cupy"])}


def _launch(plan: LaunchPlan, stream: int, pointers: tuple, lse: int, cu_seqlens_q: int, cu_seqlens_k: int,
            total_q: int, total_k: int, sinks: int = 0, descales: tuple[int, int, int] | None = None) -> None:
    """The plan launched with this call's addresses and totals (the extents sm90's maps depend on; a plan
    without maps ignores them)."""
    if plan.grid[0]:    # max_seqlen_q = 0: every sequence is empty, there is nothing to compute
        if plan.varlen_plain:
            plan.launch_plain(stream, *pointers, lse, None, (cu_seqlens_q, cu_seqlens_k, total_q, total_k),
                              (total_q, total_k))
        else:
            plan.launch(stream, *pointers, lse, descales, sinks=sinks,
                        varlen=(cu_seqlens_q, cu_seqlens_k, total_q, total_k), extents=(total_q, total_k))


def _knob_key(spec_fields: dict, meta) -> tuple:
    """(the knobs, the fp8 descales' metas or None): the plan-key parts of a call's keyword fields (a
    descale tensor keys by its layout, its address is patched per call; api._split_knobs' split)."""
    knobs, descales = api._split_knobs(spec_fields)
    return knobs, None if all(d is None for d in descales) else tuple(None if d is None else meta(d) for d in descales)


@dataclasses.dataclass(frozen=True)
class VarlenOutputs:
    """What a varlen plan-cache hit needs besides the plan: ``tokens``, the total_q its scratch LSE holds;
    ``out_dtype``, O's library dtype where O is not made like q (fp8: out_dtype's; V narrower than Q and
    K); ``out_shape``, a token's (heads_q, head_dim_v) where O's shape is not q's; the unit descales'
    addresses an fp8 plan launches where a call leaves a descale out, and the arrays behind them (kept
    alive). None: as q."""
    tokens: int
    out_dtype: object = None
    out_shape: tuple | None = None
    unit_descale_ptrs: tuple = ()
    keep: tuple = ()


# ------------------------------------------------------------------ the checked path

def as_one_batch(t: _View) -> _View:
    """A packed (total_tokens, heads, head_dim) view as the forward's checks and FlashParams take it:
    one batch of total_tokens rows (its batch stride is never used)."""
    # (the constructor, not dataclasses.replace: a varlen backward miss makes ~25 of these, at ~4 µs a replace)
    return _View(t.name, t.kind, t.ptr, (1,) + tuple(t.shape), (0,) + tuple(t.strides), t.dtype, t.device)


def check_packed(q: _View, k: _View, v: _View, fp8: bool = False, backward: bool = False) -> None:
    """q, k, v of a varlen call: 3-D packed tensors with tokens, then the forward's checks (``fp8``: the
    e4m3 forward's, V as the packed tokens; ``backward``: the backward's, a head_dim of HEAD_DIMS shared
    by Q, K and V)."""
    for t in (q, k, v):
        if len(t.shape) != 3:
            raise ValueError(f"{t.name} must be 3-D (total_tokens, heads, head_dim): the sequences packed one after "
                             f"another, got shape {t.shape}")
        if t.shape[0] < 1:
            raise ValueError(f"{t.name} has no tokens (shape {t.shape}); a varlen call needs at least one")
    heads_q, heads_kv = q.shape[1], k.shape[1]
    if heads_kv < 1 or heads_q % heads_kv:   # (said here: the forward's message counts 4-D axes)
        raise ValueError(f"heads_kv={heads_kv} (k.shape[1]) must divide heads_q={heads_q} (q.shape[1]) for GQA/MQA")
    if fp8:
        api.check_fp8_inputs(*(as_one_batch(t) for t in (q, k, v)), "row")
    elif backward:
        _check_inputs(*(as_one_batch(t) for t in (q, k, v)), any_head_dim=True, what="attention_varlen_backward")
    else:
        _check_inputs(*(as_one_batch(t) for t in (q, k, v)), any_head_dim=True, what="attention_varlen",
                      any_head_dim_v=True)


def check_cu_seqlens(q: _View, cu_seqlens_q, cu_seqlens_k) -> tuple[_View, _View]:
    """The views of cu_seqlens_q and cu_seqlens_k: int32 (batch + 1,) contiguous arrays of q's library
    on q's device, batch >= 1, the same shape. Raises naming the argument."""
    views = []
    for name, x in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if _kind(x) == "other":
            raise TypeError(f"{name} must be an int32 {q.kind} array of shape (batch + 1,) on cuda:{q.device}, got "
                            f"{type(x).__name__}")
        c = _view(name, x)
        _check_same_place(q, (c,))
        if c.dtype != "int32":
            raise TypeError(f"{name} has dtype {c.dtype}; cu_seqlens are int32 prefix sums of the sequence lengths "
                            f"(FlashAttention's: torch.int32, starting at 0)")
        if len(c.shape) != 1 or c.shape[0] < 2:
            raise ValueError(f"{name} must be 1-D of shape (batch + 1,) with batch >= 1, got shape {tuple(c.shape)}")
        if c.strides != (1,):
            raise ValueError(f"{name} must be contiguous, got strides {c.strides}")
        if c.ptr % 4:
            raise ValueError(f"{name}'s data pointer is not 4-byte aligned")
        views.append(c)
    if views[0].shape != views[1].shape:
        raise ValueError(f"cu_seqlens_k has shape {views[1].shape} but cu_seqlens_q has {views[0].shape}; both hold "
                         f"batch + 1 sequence boundaries")
    return views[0], views[1]


def check_max_seqlen(name: str, value) -> int:
    """A max_seqlen argument: a host int >= 0 (a device tensor would need a sync to read)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be a host int (the longest sequence's length), got {type(value).__name__}; "
                        f"a varlen call reads no device value on the host (FlashAttention's max_seqlen is an int too)")
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")
    return int(value)


def check_arch(arch) -> str | None:
    """arch: None (the device's, as attention() picks it), "sm80" or "sm90"."""
    if arch not in (None,) + VARLEN_ARCHS:
        raise ValueError(f"arch={arch!r}: attention_varlen has the sm80 and sm90 kernels; pass arch='sm80', "
                         f"arch='sm90' or leave it out (the device's)")
    return arch


def map_encoder(spec, heads_q: int, heads_kv: int, strides: tuple):
    """sm90: encode_maps(q, k, v, o, total_q, total_k) -> the FlashParams maps over the packed tensors
    of those addresses and token counts (``strides``: q's, k's, v's, o's (batch, row, head), fixed by
    the plan's key)."""
    # varlen_tma_store: O's map too, over the packed (total_q, heads_q, head_dim) output (the whole blocks'
    # TMA stores); without it the kernel stores O row by row and its tma_o (Q's bytes) is never read
    stored = ("tma_q", "tma_k", "tma_v", "tma_o") if spec.varlen_tma_store else ("tma_q", "tma_k", "tma_v")

    def encode_maps(q: int, k: int, v: int, o: int, total_q: int, total_k: int) -> dict[str, bytes]:
        args = tma.tensor_map_args(spec, q, k, v, o, 1, total_q, total_k, heads_q, heads_kv, *strides)
        maps = {name: tma.encode(args[name]) for name in stored}
        maps.setdefault("tma_o", maps["tma_q"])
        return maps
    return encode_maps


def _miss(key, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale, return_lse,
          out, arch, spec_fields, variant=None):
    """The checked path: every argument checked (errors name it), the plan built, remembered under
    ``key`` (None: not cacheable) and launched. ``variant``: api._variant_args' (window_size, softcap,
    sinks, alignment) of a call that gave any of them; its window is resolved against the plan's
    bounds (max_seqlen's plan_bound), so every call the plan serves gets the same kernel and values."""
    qv, kv, vv = _view("q", q), _view("k", k), _view("v", v)
    spec_fields = dict(spec_fields)
    fp8 = api._is_fp8_call(qv, spec_fields)
    descale_values = [spec_fields.pop(name, None) for name in _FP8_KNOBS]
    check_packed(qv, kv, vv, fp8)
    cu_q, cu_k = check_cu_seqlens(qv, cu_seqlens_q, cu_seqlens_k)
    max_q, max_k = (plan_bound(check_max_seqlen(name, value)) for name, value in
                    (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)))
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be True or False, got {causal!r}")
    if "varlen" in spec_fields:
        raise ValueError("varlen is attention_varlen's own switch; leave it out of the spec fields")
    if spec_fields.get("local", False):
        raise ValueError("local is set by window_size=(left, right), whose sizes the kernel needs; pass window_size")
    total_q, heads_q, head_dim = qv.shape
    head_dim_v = vv.shape[2]     # (V narrower than Q and K: O is too, head_dim_v; the scale stays Q's)
    if head_dim_v != head_dim:
        if spec_fields.setdefault("head_dim_v", head_dim_v) != head_dim_v:
            raise ValueError(f"head_dim_v={spec_fields['head_dim_v']} but v has head_dim {head_dim_v} (v.shape[2])")
    out_shape = (total_q, heads_q, head_dim_v)
    scale = _check_scale(softmax_scale, head_dim)
    batch = cu_q.shape[0] - 1
    variants = sinks_view = None
    if variant is not None:
        fields, causal, variants, sinks_view = api._variants(variant, as_one_batch(qv), max_q, max_k, causal)
        spec_fields = {**spec_fields, **fields}
    dtype, out_name = DTYPE_NAMES.get(qv.dtype), qv.dtype
    if fp8:     # sm90 only; O in out_dtype (bf16 by default), V as the packed tokens
        if arch not in (None, "sm90"):
            raise ValueError(f"arch={arch!r}: fp8 (e4m3) varlen runs on sm90 (H100/H200) only; use arch='sm90'")
        arch, dtype = "sm90", "fp8"
        spec_fields["out_dtype"] = spec_fields.get("out_dtype") or "bf16"
        if spec_fields["out_dtype"] not in OUT_DTYPE_NAMES:
            raise ValueError(f"out_dtype must be 'bf16' or 'fp16', got {spec_fields['out_dtype']!r}")
        spec_fields.setdefault("v_layout", "row")
        out_name = OUT_DTYPE_NAMES[spec_fields["out_dtype"]]
    descales, keep, unit_ptrs = api._fp8_descales(as_one_batch(qv), descale_values, batch, kv.shape[1]) \
        if fp8 else ({}, (), ())
    spec = resolve_spec(head_dim, dtype, causal, qv.device, check_arch(arch),
                        shape=(batch, max_q, max_k, heads_q), varlen=True, **spec_fields)
    as_q = out_name == qv.dtype and out_shape == tuple(qv.shape)
    library_dtype = None if as_q else (getattr(_torch(), out_name) if qv.kind == "torch"
                                       else api._cupy().dtype(out_name))
    if out is None:     # as a plan-cache hit makes it (torch: empty_like(q), q's layout, where O is as q)
        out = (_torch().empty_like(q) if as_q else _torch().empty(out_shape, dtype=library_dtype, device=q.device)) \
            if qv.kind == "torch" else _empty(qv, out_shape, out_name)
    outv = _view("out", out)
    if tuple(outv.shape) != out_shape:
        raise ValueError(f"out has shape {tuple(outv.shape)}; expected (total_q, heads_q, head_dim_v) = {out_shape}")
    _check_out(as_one_batch(outv), as_one_batch(qv), out_name, shape=(1, *out_shape))
    lse = _empty(qv, (heads_q, total_q), "float32") if return_lse else None

    prepared = api._prepare(spec, qv.device)     # (through the module: tests stand a fake in)
    launch_grid = grid(spec, batch, heads_q, max_q, prepared.resident_ctas)
    lse_ptr = _view("lse", lse).ptr if lse is not None else 0
    boundaries = Varlen(cu_q.ptr, cu_k.ptr, batch, max_q, max_k, total_q, kv.shape[0])
    operands = [as_one_batch(t).operand() for t in (qv, kv, vv, outv)]
    sm90 = spec.arch == "sm90"
    if sm90:
        driver.ensure_context(qv.device)     # (the TMA maps are encoded in a context)
    param_bytes = pack_params(spec, *operands, lse_ptr, 0, scale, descales=descales or None, variants=variants,
                              varlen=boundaries)
    plan = LaunchPlan(spec, prepared.function, launch_grid, param_bytes,
                      tensor_maps=tma.map_operands(spec) if sm90 else {}, lse_floats=heads_q * total_q,
                      workspace_floats=0, stream_k_flags=(0, 0), switch_context=qv.device != _current_device(qv.kind),
                      allocate=functools.partial(_allocate, qv.kind, qv.device),
                      outputs=VarlenOutputs(total_q, library_dtype,
                                            None if out_shape == tuple(qv.shape) else out_shape[1:],
                                            tuple(unit_ptrs) if fp8 else (), tuple(keep)),
                      encode_maps=map_encoder(spec, heads_q, kv.shape[1], tuple(op.bsh_strides for op in operands))
                      if sm90 else None,
                      extents=(total_q, kv.shape[0]) if sm90 else ())
    if key is not None:
        _PLANS.put(key, plan)
    _launch(plan, _current_stream(qv.kind, qv.device), (qv.ptr, kv.ptr, vv.ptr, outv.ptr), lse_ptr, cu_q.ptr, cu_k.ptr,
            total_q, kv.shape[0], sinks_view.ptr if sinks_view is not None else 0,
            tuple(descales[n].ptr for n in ("q", "k", "v")) if fp8 else None)
    return (out, lse) if return_lse else out
