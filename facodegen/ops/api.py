"""The user-facing call: ``attention(q, k, v, ...)`` on CuPy arrays or torch CUDA tensors.

Every argument is checked here, before anything is compiled or launched; each error is a
``TypeError``/``ValueError`` that names the argument. The caller's arrays are used in place
(zero-copy: raw device pointers and strides), outputs are allocated by the caller's library
and the kernel runs on the caller's current stream.
"""

from __future__ import annotations

import functools
import math
import sys
from dataclasses import dataclass

from ..runtime import compiler as compile_mod
from ..runtime import driver
from ..tuning import tunedb
from ..runtime.launch import (Operand, Variants, grid, pack_params, resident_ctas, stream_k_flags,
                              stream_k_workspace_floats, workspace_floats)
from ..runtime.plan import LaunchPlan, PlanCache
from ..runtime.tma import map_operands
from ..spec import HEAD_DIMS, SEQLEN_RULE_FIELDS, KernelSpec, SpecError, seqlen_rule_fields
from ..spec.knobs import head_dim_problem, tile_head_dim

DTYPE_NAMES = {"float16": "fp16", "bfloat16": "bf16"}
# dtype=fp8 (sm90): e4m3 inputs (torch.float8_e4m3fn); other float8 flavours are refused by name.
FP8_NAMES = {"float8_e4m3fn": "fp8"}
OUT_DTYPE_NAMES = {"bf16": "bfloat16", "fp16": "float16"}
ELEMENT_SIZES = {"float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "float32": 4}
ALIGN_BYTES = 16  # cp.async and TMA move 16-byte chunks


# ------------------------------------------------------------------ tensor adapters

_TORCH = None


def _torch():
    """torch if the process has imported it (facodegen never imports it for a CuPy user), kept once
    found: Dynamo, tracing attention(), would otherwise trace sys.modules.get, and fails ("dictionary
    changed size during iteration") once a lazy import (CuPy's) has grown sys.modules between two
    compiles."""
    global _TORCH
    if _TORCH is None:
        _TORCH = sys.modules.get("torch")
    return _TORCH


def _cupy():
    import cupy
    return cupy


def _kind(x) -> str:
    torch = _torch()
    if torch is not None and isinstance(x, torch.Tensor):
        return "torch"
    cupy = sys.modules.get("cupy")
    if cupy is not None and isinstance(x, cupy.ndarray):
        return "cupy"
    return "other"


@dataclass(frozen=True)
class _View:
    """What the launcher needs of one tensor, whatever library holds it."""
    name: str
    kind: str
    ptr: int
    shape: tuple
    strides: tuple      # in elements
    dtype: str          # numpy-style name: float16, bfloat16, float32, ...
    device: int         # CUDA device ordinal, -1 for host

    def operand(self) -> Operand:
        return Operand(self.ptr, tuple(self.shape), tuple(self.strides))


def _view(name: str, x) -> _View:
    kind = _kind(x)
    if kind == "torch":
        if not x.is_cuda:
            raise TypeError(f"{name} is a torch tensor on {x.device}; pass a CUDA tensor")
        dtype = str(x.dtype).removeprefix("torch.")
        return _View(name, kind, x.data_ptr(), tuple(x.shape), tuple(x.stride()), dtype, x.device.index)
    if kind == "cupy":
        itemsize = x.dtype.itemsize
        if any(s % itemsize for s in x.strides):
            raise ValueError(f"{name} has strides {x.strides} bytes, not a multiple of its element size")
        return _View(name, kind, x.data.ptr, tuple(x.shape), tuple(s // itemsize for s in x.strides),
                     x.dtype.name, x.device.id)
    numpy = sys.modules.get("numpy")
    if numpy is not None and isinstance(x, numpy.ndarray):
        raise TypeError(f"{name} is a NumPy array in host memory; pass a CuPy array or a torch CUDA tensor "
                        f"(e.g. cupy.asarray({name}))")
    raise TypeError(f"{name} must be a CuPy array or a torch CUDA tensor, got {type(x).__name__}")


# ------------------------------------------------------------------ device facts

DeviceInfo = driver.DeviceInfo


def device_info(ordinal: int) -> DeviceInfo:
    """Name, compute capability, SM count and shared memory of a CUDA device (from the driver)."""
    return driver.device_info(ordinal)


def device_target(arch: str, info: DeviceInfo) -> str | None:
    """The real target ``arch``'s code is compiled for on this device (None: the arch's own).
    sm80 code is compiled for the GPU at hand: machine code only loads on its own major version."""
    return f"sm_{info.compute_capability[0]}{info.compute_capability[1]}" if arch == "sm80" else None


def default_arch(info: DeviceInfo) -> str:
    if info.compute_capability == (9, 0):
        return "sm90"
    if info.compute_capability >= (8, 0):
        return "sm80"
    raise ValueError(f"{info.name} (compute capability {info.compute_capability[0]}.{info.compute_capability[1]}) "
                     f"is older than sm80; facodegen's kernels need an Ampere or newer GPU")


def _check_arch(arch: str, info: DeviceInfo) -> None:
    cc = info.compute_capability
    if arch == "sm90" and cc != (9, 0):
        raise ValueError(f"arch='sm90' needs a compute capability 9.0 GPU (H100/H200); {info.name} is "
                         f"{cc[0]}.{cc[1]}: use arch='sm80' (--arch sm80)")
    if arch == "sm80" and cc < (8, 0):
        raise ValueError(f"arch='sm80' needs compute capability 8.0 or newer; {info.name} is {cc[0]}.{cc[1]}")


# ------------------------------------------------------------------ argument checks

def _check_same_place(q: _View, others) -> None:
    """k, v (and the like) must be the same kind of array as q, on q's device."""
    for t in others:
        if t.kind != q.kind:
            raise TypeError(f"{t.name} is a {t.kind} array but q is a {q.kind} array; pass one kind")
        if t.device != q.device:
            raise ValueError(f"{t.name} is on cuda:{t.device} but q is on cuda:{q.device}; put them on one device")


# Where a path takes only the head dims with their own tiles, what its error adds.
ANY_HEAD_DIM_NOTE = "(the 16-bit forward, attention(), takes any multiple of 8 in [8, 256])"


def _check_attention_shape(q: _View, k: _View, any_head_dim: bool = False, what: str = "") -> None:
    """q (batch, seqlen_q, heads_q, d) against k (batch, seqlen_k, heads_kv, d): one batch, one
    supported head_dim (any_head_dim: any multiple of 8 in [8, 256], the 16-bit forward's; else one of
    HEAD_DIMS, ``what`` naming the path), no empty dimension, heads_kv dividing heads_q."""
    batch, seqlen_q, heads_q, head_dim = q.shape
    _, seqlen_k, heads_kv, _ = k.shape
    if k.shape[0] != batch:
        raise ValueError(f"k has batch {k.shape[0]} but q has batch {batch}")
    if k.shape[3] != head_dim:
        raise ValueError(f"k and v have head_dim {k.shape[3]} but q has head_dim {head_dim}")
    if any_head_dim:
        why = head_dim_problem(head_dim)
        if why is not None:
            raise ValueError(f"head_dim (q.shape[3]) {why}")
    elif head_dim not in HEAD_DIMS:
        raise ValueError(f"head_dim={head_dim} is not supported{' by ' + what if what else ''}; choose one of "
                         f"{', '.join(map(str, HEAD_DIMS))}"
                         + ("" if head_dim_problem(head_dim) else f" {ANY_HEAD_DIM_NOTE}"))
    for name, value in (("batch", batch), ("seqlen_q (q.shape[1])", seqlen_q),
                        ("seqlen_k (k.shape[1])", seqlen_k), ("heads_q (q.shape[2])", heads_q),
                        ("heads_kv (k.shape[2])", heads_kv)):
        if value < 1:
            raise ValueError(f"{name} is {value}; an empty sequence or dimension cannot be attended")
    if heads_q % heads_kv:
        raise ValueError(f"heads_kv={heads_kv} (k.shape[2]) must divide heads_q={heads_q} (q.shape[2]) for GQA/MQA")


# What a path without a V head dim of its own says when v's last dimension differs from k's.
HEAD_DIM_V_NOTE = ("a head_dim_v of its own (v.shape[3] != k.shape[3]) runs in the 16-bit forwards, attention() and "
                   "attention_varlen, only (no backward yet)")


def _check_inputs(q: _View, k: _View, v: _View, any_head_dim: bool = False, what: str = "",
                  any_head_dim_v: bool = False) -> None:
    """q, k, v of one call (``any_head_dim``, ``what``: _check_attention_shape's; ``any_head_dim_v``:
    v's head_dim may differ from k's, the 16-bit forward's head_dim_v, checked by KernelSpec)."""
    for t in (q, k, v):
        if len(t.shape) != 4:
            raise ValueError(f"{t.name} must be 4-D (batch, seqlen, heads, head_dim), got shape {t.shape}")
    _check_same_place(q, (k, v))
    for t in (k, v):
        if t.dtype != q.dtype:
            raise TypeError(f"{t.name} has dtype {t.dtype} but q has {q.dtype}; q, k and v must share one dtype")
    if q.dtype not in DTYPE_NAMES:
        raise TypeError(f"q has dtype {q.dtype}; supported: {', '.join(DTYPE_NAMES)}")
    if k.shape != v.shape:
        if k.shape[:3] != v.shape[:3]:
            raise ValueError(f"k and v must have the same shape but for v's head_dim (head_dim_v), got k {k.shape} "
                             f"and v {v.shape}")
        if not any_head_dim_v:
            raise ValueError(f"k and v must have the same shape{' in ' + what if what else ''}, got k {k.shape} and "
                             f"v {v.shape}: {HEAD_DIM_V_NOTE}")
    _check_attention_shape(q, k, any_head_dim, what)
    for t in (q, k, v):
        _check_layout(t)


def _check_layout(t: _View) -> None:
    if t.strides[3] != 1:
        raise ValueError(f"{t.name}'s head_dim must be contiguous (stride 1), got strides {t.strides}; "
                         f"call .contiguous() or transpose back to (batch, seqlen, heads, head_dim)")
    if any(s < 0 for s in t.strides):
        raise ValueError(f"{t.name} has a negative stride {t.strides}")
    elem = ELEMENT_SIZES.get(t.dtype, 4)
    if t.ptr % ALIGN_BYTES:
        raise ValueError(f"{t.name}'s data pointer is not {ALIGN_BYTES}-byte aligned")
    for axis, stride in zip(("batch", "seqlen", "heads"), t.strides[:3]):
        if (stride * elem) % ALIGN_BYTES and t.shape[("batch", "seqlen", "heads").index(axis)] > 1:
            raise ValueError(f"{t.name}'s {axis} stride ({stride} elements) must be a multiple of "
                             f"{ALIGN_BYTES // elem} elements ({ALIGN_BYTES} bytes)")


def _check_out(out: _View, q: _View, dtype: str | None = None, hint: str = "", shape: tuple | None = None) -> None:
    """out: q's library and device, ``dtype`` (default q's), ``shape`` (default q's; head_dim_v: q's
    with v's head_dim), a layout the kernel writes."""
    dtype = dtype or q.dtype
    if out.kind != q.kind or out.dtype != dtype or out.device != q.device:
        raise TypeError(f"out must be a {q.kind} {dtype} array on cuda:{q.device}{hint}, got a {out.kind} "
                        f"{out.dtype} array on cuda:{out.device}")
    if shape is not None and tuple(shape) != tuple(q.shape):
        if out.shape != tuple(shape):
            raise ValueError(f"out has shape {out.shape}; expected (batch, seqlen_q, heads_q, head_dim_v) = "
                             f"{tuple(shape)} (q's with v's head_dim)")
    elif out.shape != q.shape:
        raise ValueError(f"out has shape {out.shape}, q has {q.shape}; they must match")
    _check_layout(out)


def _check_lse(lse: _View, q: _View) -> None:
    batch, seqlen_q, heads_q, _ = q.shape
    want = (batch, heads_q, seqlen_q)
    if lse.kind != q.kind or lse.dtype != "float32" or lse.device != q.device:
        raise TypeError(f"lse_out must be a float32 {q.kind} array on cuda:{q.device}")
    if lse.shape != want or lse.strides != (heads_q * seqlen_q, seqlen_q, 1):
        raise ValueError(f"lse_out must be a contiguous (batch, heads, seqlen_q) = {want} array, "
                         f"got shape {lse.shape} strides {lse.strides}")


# ------------------------------------------------------------------ compiled-kernel cache

@dataclass
class _Prepared:
    function: object        # driver.LoadedFunction (None in CPU tests that never launch)
    smem_bytes: int
    resident_ctas: int      # CTAs running at once: the persistent grid (launch.resident_ctas)


def compile_for_device(spec: KernelSpec, device: int = 0):
    """The spec's kernel as attention() compiles it for ``device``: for its real target (sm80 code for
    the GPU's own major version: device_target), from the compile cache when it is there."""
    return compile_mod.compile(spec, sm=device_target(spec.arch, device_info(device)))


@functools.lru_cache(maxsize=256)
def _prepare(spec: KernelSpec, device: int) -> _Prepared:
    """The spec's kernel loaded on ``device`` (compiled, or read from the compile cache, first)."""
    info = device_info(device)
    kernel = compile_for_device(spec, device)
    function = driver.load_function(kernel.cubin, spec.variant, device, max_dynamic_smem=spec.smem_bytes)
    with driver.on_device(device):
        resident = resident_ctas(spec, info.sms, function)
    return _Prepared(function, spec.smem_bytes, resident)


# ------------------------------------------------------------------ public API

def resolve_spec(head_dim: int, dtype: str, causal: bool, device: int, arch: str | None = None,
                 *, shape: tuple[int, int, int, int] | None = None, **spec_fields) -> KernelSpec:
    """The spec a call will run: arch and GPU budget from the device, the rest from the tuning
    database's entry for this device and ``shape`` = (batch, seqlen_q, seqlen_k, heads_q) where
    there is one (facodegen.tuning.tunedb), else from the defaults and the measured sequence-length
    table of spec.seqlen_rule_fields. Fields the caller gives always win;
    a tuned entry that does not combine with them into a valid spec is not used."""
    info = device_info(device)
    arch = arch or default_arch(info)
    _check_arch(arch, info)
    spec_fields.setdefault("gpu", info.budget_gpu)
    # a head_dim on another one's tile (80 on 96) takes that tile's tuned entries; a V head dim of its
    # own (head_dim_v) none: the database's entries were measured with V as wide as Q
    tuned = _tuned_fields(info, arch, _tile(head_dim), dtype, causal, shape) \
        if shape is not None and not _split_v(head_dim, spec_fields) else None
    spec = spec_for_shape(arch, head_dim, dtype, causal, shape, tuned, **spec_fields)
    if info.smem_per_block_optin and spec.smem_bytes > info.smem_per_block_optin:
        raise ValueError(f"stages/block sizes: the kernel needs {spec.smem_bytes} bytes of shared memory but "
                         f"{info.name} allows {info.smem_per_block_optin} per block")
    return spec


def spec_for_shape(arch: str, head_dim: int, dtype: str, causal: bool, shape: tuple[int, int, int, int] | None,
                   tuned: dict | None = None, **spec_fields) -> KernelSpec:
    """resolve_spec without a device: ``tuned`` (a tuning database entry's fields) where given,
    else the sequence-length table for ``shape`` = (batch, seqlen_q, seqlen_k, heads_q) unless the
    caller sets one of its fields, else the defaults; the caller's fields always win, and tuned or
    rule fields that do not combine with them into a valid spec are dropped."""
    if not tuned and shape is not None and not any(f in spec_fields for f in SEQLEN_RULE_FIELDS) \
            and not _split_v(head_dim, spec_fields):    # (the rules were measured with V as wide as Q)
        _, seqlen_q, seqlen_k, _ = shape
        tuned = seqlen_rule_fields(arch, _tile(head_dim), dtype, causal, seqlen_q, seqlen_k,
                                   real_head_dim=head_dim)
    if tuned:
        try:
            return KernelSpec(arch=arch, head_dim=head_dim, dtype=dtype, causal=causal, **{**tuned, **spec_fields})
        except (SpecError, TypeError):
            pass  # the caller's fields do not fit the tuned tiles: defaults + the caller's fields
    return KernelSpec(arch=arch, head_dim=head_dim, dtype=dtype, causal=causal, **spec_fields)


def _split_v(head_dim, spec_fields: dict) -> bool:
    """The call's V has a head dimension of its own (head_dim_v given and not head_dim)."""
    return spec_fields.get("head_dim_v") not in (None, head_dim)


def _tile(head_dim) -> int:
    """The tile head_dim a call's head_dim runs on (80 -> 96; a head_dim no kernel takes as it is, for
    KernelSpec to reject)."""
    return tile_head_dim(head_dim) if head_dim_problem(head_dim) is None else head_dim


def _tuned_fields(info: DeviceInfo, arch: str, head_dim: int, dtype: str, causal: bool, shape) -> dict | None:
    """Spec fields of the tuning database's entry for this call, or None (one stat per call while
    the database file is unchanged; any problem with it means defaults)."""
    from ..tuning import tunedb
    try:
        batch, seqlen_q, seqlen_k, heads_q = shape
        key = tunedb.make_key(info.name, info.compute_capability, compile_mod.nvrtc_identity(), arch, head_dim,
                              dtype, causal, seqlen_q, seqlen_k, batch, heads_q)
        entry = tunedb.lookup(key)
    except Exception:  # noqa: BLE001 (a tuning database must never break a call)
        return None
    return dict(entry["spec"]) if entry else None


def check_fp8_inputs(q: _View, k: _View, v: _View, v_layout: str) -> None:
    """q, k, v of an fp8 call: e4m3, one kind/device, shapes as for 16-bit inputs except V^T
    (batch, heads_kv, head_dim, seqlen_k) with v_layout=transposed. Raises naming the argument."""
    for t in (q, k, v):
        if t.dtype not in FP8_NAMES:
            raise TypeError(f"{t.name} has dtype {t.dtype}; dtype=fp8 takes float8_e4m3fn (e4m3) q, k and v "
                            f"(quantise bf16/fp16 with facodegen.ops.quantize.quantize_e4m3)")
        if len(t.shape) != 4:
            raise ValueError(f"{t.name} must be 4-D, got shape {t.shape}")
    _check_same_place(q, (k, v))
    if v_layout not in ("row", "transposed"):
        raise ValueError(f"v_layout must be 'row' or 'transposed', got {v_layout!r}")
    batch, _, _, head_dim = q.shape
    _, seqlen_k, heads_kv, _ = k.shape
    want_v = k.shape if v_layout == "row" else (batch, heads_kv, head_dim, seqlen_k)
    if tuple(v.shape) != tuple(want_v):
        what = "(batch, seqlen_k, heads_kv, head_dim)" if v_layout == "row" else \
            "(batch, heads_kv, head_dim, seqlen_k) (v_layout='transposed': V^T)"
        raise ValueError(f"v has shape {v.shape}; expected {what} = {tuple(want_v)}"
                         + (" (fp8 takes no head_dim_v of its own)" if v_layout == "row" and len(v.shape) == 4
                            and tuple(v.shape[:3]) == tuple(want_v[:3]) else ""))
    _check_attention_shape(q, k, any_head_dim=True)     # (a head_dim between the tiles: the next tile's, padded)
    _check_layout(q)
    _check_layout(k)
    if v_layout == "row":
        _check_layout(v)
    else:
        if v.strides[3] != 1:
            raise ValueError(f"v (V^T) must have contiguous keys (stride 1 on its last axis), got strides {v.strides}")
        if v.ptr % ALIGN_BYTES:
            raise ValueError(f"v's data pointer is not {ALIGN_BYTES}-byte aligned")
        for axis, stride, size in zip(("batch", "heads", "head_dim"), v.strides[:3], v.shape[:3]):
            if size > 1 and (stride <= 0 or stride % ALIGN_BYTES):
                raise ValueError(f"v (V^T)'s {axis} stride ({stride} elements) must be a positive multiple of "
                                 f"{ALIGN_BYTES}; allocate (batch, heads_kv, head_dim, seqlen_k rounded up to 16) "
                                 f"and pass the [..., :seqlen_k] view")


def check_descale(d: _View | None, name: str, q: _View, batch: int, heads_kv: int) -> tuple[int, int]:
    """(batch stride, head stride) in elements of a descale: a float32 scalar (0-d or one element:
    strides 0, 0) or a (batch, heads_kv) tensor, on q's device. Raises naming the argument."""
    if d is None:
        return 0, 0
    if d.kind != q.kind:
        raise TypeError(f"{name} is a {d.kind} array but q is a {q.kind} array; pass one kind")
    if d.dtype != "float32":
        raise TypeError(f"{name} has dtype {d.dtype}; descale factors are float32 (e.g. torch.tensor(1.0, "
                        f"dtype=torch.float32, device=q.device))")
    if d.device != q.device:
        raise ValueError(f"{name} is on cuda:{d.device} but q is on cuda:{q.device}; put it on q's device")
    count = 1
    for n in d.shape:
        count *= n
    if count == 1:
        return 0, 0
    if tuple(d.shape) != (batch, heads_kv):
        raise ValueError(f"{name} has shape {tuple(d.shape)}; expected a scalar or (batch, heads_kv) = "
                         f"{(batch, heads_kv)}")
    return d.strides[0], d.strides[1]


@functools.lru_cache(maxsize=None)
def _unit_descale(device: int, kind: str):
    """float32 1.0 on a device: the descale of an argument left out."""
    if kind == "torch":
        return _torch().ones((), dtype=_torch().float32, device=f"cuda:{device}")
    cupy = _cupy()
    with cupy.cuda.Device(device):
        return cupy.ones((), dtype=cupy.float32)


def transpose_v(v):
    """An fp8 V (batch, seqlen_k, heads_kv, head_dim) as V^T (batch, heads_kv, head_dim, seqlen_k), keys
    contiguous, in a buffer whose key axis is padded to 16 (the TMA stride rule), on the current
    stream: the layout ``v_layout="transposed"`` takes. For callers who keep V transposed across
    calls (e.g. a KV cache written that way), so the kernel skips its in-shared-memory transpose."""
    vv = _view("v", v)
    if vv.kind != "torch" or vv.dtype not in FP8_NAMES:
        raise TypeError(f"v: transpose_v takes a torch.float8_e4m3fn tensor, got {vv.kind} {vv.dtype}")
    if len(vv.shape) != 4:
        raise ValueError(f"v: expected (batch, seqlen_k, heads_kv, head_dim), got shape {vv.shape}")
    torch = _torch()
    batch, seqlen_k, heads_kv, head_dim = vv.shape
    padded = -(-seqlen_k // 16) * 16
    buffer = torch.empty((batch, heads_kv, head_dim, padded), dtype=v.dtype, device=v.device)
    view = buffer[..., :seqlen_k]
    # byte copy: elementwise kernels for float8 vary between torch versions, uint8 views do not
    view.view(torch.uint8).copy_(v.view(torch.uint8).permute(0, 2, 3, 1))
    return view


# ------------------------------------------------------------------ resolving a call (once per key)

_FP8_KNOBS = ("q_descale", "k_descale", "v_descale")
_NO_DESCALES = (None, None, None)


@dataclass
class _Outputs:
    """What a plan-cache hit needs besides the plan: its results' shapes and types, and the
    unit descales standing in for fp8 descales left out."""
    shape: tuple
    dtype: str                  # numpy-style name: bfloat16, float16
    lse_shape: tuple
    library_dtype: object       # the caller's library's dtype object for ``dtype`` (CuPy: a numpy.dtype)
    lse_library_dtype: object   # CuPy: numpy.dtype("float32"), the LSE's (torch: None, new_lse makes it)
    same_dtype: bool            # the output's dtype is q's (not fp8)
    unit_descale_ptrs: tuple    # fp8: q, k, v unit descale addresses (0 where the call gave one); () otherwise
    q_shape: tuple = ()         # q's shape (the output's differs with a head_dim_v of its own)
    _lse_like: object = None

    def __post_init__(self):
        # the output is empty_like(q): q's dtype and shape (not fp8, V as wide as Q); read per hit
        self.like_q = self.same_dtype and tuple(self.shape) == tuple(self.q_shape)

    def new_out(self, torch, q):
        """A new output for q: empty_like(q) where that is its shape and dtype, else q's layout with the
        output's dtype, else (head_dim_v) a contiguous (batch, seqlen_q, heads_q, head_dim_v) array."""
        if self.shape == self.q_shape:
            return torch.empty_like(q) if self.same_dtype else torch.empty_like(q, dtype=self.library_dtype)
        return q.new_empty(self.shape, dtype=self.library_dtype)

    def new_lse(self, torch, q):
        """A new (batch, heads, seqlen_q) float32 LSE on q's device: empty_like of a template on 4
        bytes of storage (strides 0), which parses no arguments and so costs half a torch.empty."""
        if self._lse_like is None:  # (q.device makes an object: read once, not per call)
            self._lse_like = torch.empty(1, dtype=torch.float32, device=q.device).as_strided(self.lse_shape,
                                                                                              (0, 0, 0))
        return torch.empty_like(self._lse_like)


@dataclass
class _Call:
    """One checked call: its plan and the arrays it runs on."""
    plan: LaunchPlan
    kind: str
    device: int
    out: object
    lse_out: object | None
    pointers: tuple          # q, k, v, o, lse (0: the plan's scratch)
    descales: tuple | None   # fp8: q, k, v descale addresses
    keep_alive: tuple        # device arrays the addresses point into (unit descales)
    sinks: int = 0           # the fp32 sinks' address (spec.sinks), else 0


def _is_fp8_call(qv: _View, spec_fields: dict) -> bool:
    return qv.dtype in FP8_NAMES or "float8" in qv.dtype or any(name in spec_fields for name in _FP8_KNOBS)


def _check_scale(softmax_scale, head_dim: int) -> float:
    if softmax_scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float)) \
            or not math.isfinite(softmax_scale):
        raise ValueError(f"softmax_scale must be a finite number, got {softmax_scale!r}")
    return float(softmax_scale)


# ------------------------------------------------------------------ attention variants

def _variant_args(window_size, softcap, sinks) -> tuple | None:
    """(window_size, softcap, sinks, "bottom_right") where a call asks for a variant, else None
    (the hot path's test: two comparisons and an identity check)."""
    if sinks is None and softcap == 0.0 and (window_size == (-1, -1) or window_size == [-1, -1]):
        return None
    return window_size, softcap, sinks, "bottom_right"


def _check_alignment(causal_alignment) -> None:
    if causal_alignment not in CAUSAL_ALIGNMENTS:
        raise ValueError(f"causal_alignment must be 'bottom_right' or 'top_left', got {causal_alignment!r}")


def _check_window(window_size) -> tuple[int, int]:
    """(left, right) of a window_size argument: two integers >= -1 (-1: unbounded on that side)."""
    try:
        left, right = window_size
    except (TypeError, ValueError):
        raise ValueError(f"window_size must be a pair (left, right) of integers >= -1 (-1: unbounded), "
                         f"got {window_size!r}") from None
    for side, value in (("left", left), ("right", right)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"window_size: the {side} size must be an integer, got {value!r}")
        if value < -1:
            raise ValueError(f"window_size: the {side} size must be >= -1 (-1: unbounded), got {value}")
    return int(left), int(right)


def _check_softcap(softcap) -> float:
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)) or math.isnan(softcap) \
            or softcap < 0 or math.isinf(softcap):
        raise ValueError(f"softcap must be a finite number >= 0 (0: off), got {softcap!r}")
    return float(softcap)


def _check_sinks(sinks, q: _View) -> _View | None:
    """sinks: None, or a float32 (heads_q,) array of q's library on q's device, contiguous."""
    if sinks is None:
        return None
    if _kind(sinks) == "other":
        raise TypeError(f"sinks must be a float32 {q.kind} array of shape (heads_q,) = ({q.shape[2]},) on "
                        f"cuda:{q.device}, got {type(sinks).__name__}")
    s = _view("sinks", sinks)
    _check_same_place(q, (s,))
    if s.dtype != "float32":
        raise TypeError(f"sinks has dtype {s.dtype}; sinks are float32 logits, one per query head")
    if tuple(s.shape) != (q.shape[2],) or (q.shape[2] > 1 and s.strides != (1,)):
        raise ValueError(f"sinks has shape {tuple(s.shape)} strides {s.strides}; expected a contiguous (heads_q,) = "
                         f"({q.shape[2]},) array")
    if s.ptr % 4:
        raise ValueError("sinks' data pointer is not 4-byte aligned")
    return s


def window_params(left: int, right: int, causal: bool, seqlen_q: int, seqlen_k: int,
                  top_left: bool = False) -> tuple[bool, bool, int, int]:
    """(local, causal, window_left, window_right) of a call's window: whether it needs the window
    kernel, the spec's causal flag, and FlashParams' window in the bottom-right frame the kernels
    use (key j visible to query i iff i + d - window_left <= j <= i + d + window_right, d =
    seqlen_k - seqlen_q). causal=True is the window (left, 0), as FlashAttention has it; top_left
    moves the diagonal to d = 0 (i' = i). Unbounded sides (-1) and sides wider than the sequence
    are the same (the window then reaches every key on that side); the values are kept within
    +-(seqlen_q + seqlen_k + 1), so the kernel's sums never overflow. No window kernel where the
    window cuts nothing (plain attention) or is exactly the bottom-right causal mask."""
    if causal:
        right = 0
    shift = 0 if not top_left else seqlen_k - seqlen_q   # the bottom-right frame's diagonal is d further
    big = seqlen_q + seqlen_k + 1
    window_left = big if left < 0 else max(-big, min(big, left + shift))
    window_right = big if right < 0 else max(-big, min(big, right - shift))
    left_open = window_left >= seqlen_k - 1            # the last row's window reaches key 0
    right_open = window_right >= seqlen_q - 1          # the first row's window reaches the last key
    if left_open and right_open:
        return False, False, 0, 0
    if left_open and window_right == 0:
        return False, True, 0, 0
    return True, bool(causal or right == 0), window_left, window_right


def _variants(variant, qv: _View, seqlen_q: int, seqlen_k: int,
              causal: bool) -> tuple[dict, bool, Variants, _View | None]:
    """The spec fields, causal flag, run-time values and sinks view of a call's window_size,
    softcap, sinks and causal_alignment (``variant``), for sequences of at most seqlen_q queries and
    seqlen_k keys (qv: (batch, seqlen, heads_q, head_dim), varlen's packed q seen as one batch). Raises
    naming the argument."""
    window_size, softcap, sinks, alignment = variant
    left, right = _check_window(window_size)
    cap = _check_softcap(softcap)
    sv = _check_sinks(sinks, qv)
    local, causal, window_left, window_right = window_params(left, right, causal, seqlen_q, seqlen_k,
                                                             alignment == "top_left")
    fields = {"local": local, "softcap": cap > 0, "sinks": sv is not None}
    return fields, causal, Variants(window_left, window_right, cap, sv.ptr if sv is not None else 0), sv


def _resolve(q, k, v, *, causal, softmax_scale, out, lse_out, want_lse: bool, arch, spec_fields: dict,
             variant: tuple | None = None) -> _Call:
    """Check every argument, pick and load the kernel, allocate the output (and the LSE where it
    is wanted) and build the launch plan: the slow half of a call, done once per call key.
    ``variant``: (window_size, softcap, sinks, causal_alignment) of a call that gave any of them."""
    qv, kv, vv = _view("q", q), _view("k", k), _view("v", v)
    spec_fields = dict(spec_fields)
    fp8 = _is_fp8_call(qv, spec_fields)
    descale_values = [spec_fields.pop(name, None) for name in _FP8_KNOBS]
    if fp8:
        if arch is not None and arch != "sm90":
            raise ValueError(f"arch={arch!r}: dtype=fp8 (e4m3 q, k, v) runs on sm90 (H100/H200) only; use arch='sm90'")
        arch = "sm90"
        spec_fields.setdefault("v_layout", "row")
        spec_fields["v_layout"] = spec_fields["v_layout"] or "row"
        check_fp8_inputs(qv, kv, vv, spec_fields["v_layout"])
        out_dtype = spec_fields.get("out_dtype") or "bf16"
        if out_dtype not in OUT_DTYPE_NAMES:
            raise ValueError(f"out_dtype must be 'bf16' or 'fp16', got {out_dtype!r}")
        spec_fields["out_dtype"] = out_dtype
        dtype, out_name = "fp8", OUT_DTYPE_NAMES[out_dtype]
    else:
        # d outside HEAD_DIMS: the next tile, padded; v's head_dim (head_dim_v) may differ from q's and k's
        _check_inputs(qv, kv, vv, any_head_dim=True, any_head_dim_v=True)
        dtype, out_name = DTYPE_NAMES[qv.dtype], qv.dtype
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be True or False, got {causal!r}")
    batch, seqlen_q, heads_q, head_dim = qv.shape
    seqlen_k, heads_kv = kv.shape[1], kv.shape[2]
    scale = _check_scale(softmax_scale, head_dim)       # 1/sqrt(d) of Q and K, whatever V's width
    head_dim_v = head_dim if fp8 else vv.shape[3]
    out_shape = (batch, seqlen_q, heads_q, head_dim_v)
    if head_dim_v != head_dim:
        if "head_dim_v" in spec_fields and spec_fields["head_dim_v"] != head_dim_v:
            raise ValueError(f"head_dim_v={spec_fields['head_dim_v']} but v has head_dim {head_dim_v} (v.shape[3])")
        spec_fields["head_dim_v"] = head_dim_v
    variants, sinks_view = None, None
    # local=True alone has no sizes; a whole spec's local=False (the tuner's, tests' spec_kwargs) is the
    # default. softcap and sinks are attention()'s own arguments.
    if spec_fields.pop("local", False):
        raise ValueError("local is set by window_size=(left, right), whose sizes the kernel needs; pass window_size")
    if variant is not None:
        fields, causal, variants, sinks_view = _variants(variant, qv, seqlen_q, seqlen_k, causal)
        spec_fields.update(fields)

    descales, keep, unit_ptrs = _fp8_descales(qv, descale_values, batch, heads_kv) if fp8 else ({}, (), ())
    spec = resolve_spec(head_dim, dtype, causal, qv.device, arch, shape=(batch, seqlen_q, seqlen_k, heads_q),
                        **spec_fields)
    lse_shape = (batch, heads_q, seqlen_q)
    if qv.kind == "torch":
        library_dtype, lse_library_dtype = getattr(_torch(), out_name), None    # (new_lse makes the LSE)
    else:   # numpy.dtype objects: CuPy takes them as they are (a name is parsed again on every call)
        library_dtype, lse_library_dtype = _cupy().dtype(out_name), _cupy().dtype("float32")
    outputs = _Outputs(out_shape, out_name, lse_shape, library_dtype, lse_library_dtype, out_name == qv.dtype,
                       unit_ptrs, q_shape=qv.shape)
    if out is None:     # as a plan-cache hit makes it (torch: _Outputs.new_out, q's layout where it can)
        out = outputs.new_out(_torch(), q) if qv.kind == "torch" else _empty(qv, out_shape, out_name)
    outv = _view("out", out)
    _check_out(outv, qv, out_name, f" (out_dtype={spec.out_dtype})" if fp8 else "", shape=out_shape)
    lsev = None
    if lse_out is None and want_lse:
        lse_out = _empty(qv, lse_shape, "float32")
    if lse_out is not None:
        lsev = _view("lse_out", lse_out)
        _check_lse(lsev, qv)

    prepared = _prepare(spec, qv.device)
    launch_grid = grid(spec, batch, heads_q, seqlen_q, prepared.resident_ctas)
    lse_ptr = lsev.ptr if lsev is not None else 0
    driver.ensure_context(qv.device)     # (sm90: the TMA maps are encoded in a context)
    param_bytes = pack_params(spec, qv.operand(), kv.operand(), vv.operand(), outv.operand(), lse_ptr, 0, scale,
                              descales=descales or None, variants=variants)
    workspace = workspace_floats(spec, batch, heads_q, seqlen_q, head_dim) or \
        stream_k_workspace_floats(spec, prepared.resident_ctas)
    plan = LaunchPlan(spec, prepared.function, launch_grid, param_bytes,
                      tensor_maps=map_operands(spec) if spec.arch == "sm90" else {},
                      lse_floats=math.prod(lse_shape), workspace_floats=workspace,
                      stream_k_flags=stream_k_flags(spec, launch_grid[0]),
                      switch_context=qv.device != _current_device(qv.kind),
                      allocate=functools.partial(_allocate, qv.kind, qv.device), outputs=outputs)
    assert not plan.plain or (outputs.same_dtype and not unit_ptrs), "a plain plan patches no descales"
    descale_ptrs = tuple(descales[n].ptr for n in ("q", "k", "v")) if fp8 else None
    return _Call(plan, qv.kind, qv.device, out, lse_out, (qv.ptr, kv.ptr, vv.ptr, outv.ptr, lse_ptr),
                 descale_ptrs, keep, sinks_view.ptr if sinks_view is not None else 0)


def _fp8_descales(qv: _View, values, batch: int, heads_kv: int) -> tuple[dict, tuple, tuple]:
    """The q, k, v descales of an fp8 call: ({name: launch.Descale}, the arrays they point into,
    the unit descales' addresses where one was left out, else 0). Raises naming the argument."""
    from ..runtime.launch import Descale
    descales, keep, unit_ptrs = {}, [], []
    for name, value in zip(("q", "k", "v"), values):
        arg = f"{name}_descale"
        if value is not None and _kind(value) == "other":
            raise TypeError(f"{arg} must be a float32 {qv.kind} tensor on cuda:{qv.device} (a scalar or "
                            f"(batch, heads_kv)), got {type(value).__name__}")
        view = _view(arg, value) if value is not None else None
        strides = check_descale(view, arg, qv, batch, heads_kv)
        unit = value is None
        if unit:
            value = _unit_descale(qv.device, qv.kind)
            view = _view(arg, value)
        unit_ptrs.append(view.ptr if unit else 0)
        keep.append(value)
        descales[name] = Descale(view.ptr, *strides)
    return descales, tuple(keep), tuple(unit_ptrs)


def _launch(call: _Call) -> None:
    plan = call.plan
    if plan.plain:  # (no descales, no sinks: call.descales is None, call.sinks 0)
        plan.launch_plain(_current_stream(call.kind, call.device), *call.pointers)
    else:
        plan.launch(_current_stream(call.kind, call.device), *call.pointers, descales=call.descales, sinks=call.sinks)


# ------------------------------------------------------------------ the prepared path

class PreparedAttention:
    """One attention call with its arguments bound: calling it launches the kernel again on the
    stream current at call time. ``spec`` is the kernel it runs and ``grid`` its launch grid;
    ``out`` and ``lse_out`` the arrays it writes."""

    def __init__(self, call: _Call, return_lse: bool):
        self._call = call
        self._return_lse = return_lse
        self.spec = call.plan.spec
        self.grid = call.plan.grid
        self.out, self.lse_out = call.out, call.lse_out

    def __call__(self):
        _launch(self._call)
        return (self.out, self.lse_out) if self._return_lse else self.out

    @property
    def workspace(self):
        """The fp32 workspace (fa1's O, m, l; stream_k's split tiles, then its flags) this call
        uses on the current stream, or None: a float32 view of the plan's scratch."""
        call = self._call
        scratch = call.plan.scratch(_current_stream(call.kind, call.device))
        start, nbytes = call.plan.workspace_range()
        if not nbytes:
            return None
        raw = scratch.holder[start:start + nbytes]
        return raw.view(getattr(_torch(), "float32") if call.kind == "torch" else "float32")

    @property
    def _param_bytes(self) -> bytes:
        return self._call.plan.param_bytes()


def prepare(q, k, v, *, causal: bool = False, softmax_scale: float | None = None, return_lse: bool = False,
            out=None, lse_out=None, arch: str | None = None, causal_alignment: str = "bottom_right",
            window_size=(-1, -1), softcap: float = 0.0, sinks=None, **spec_fields) -> PreparedAttention:
    """Check the arguments, pick and compile the kernel, and bind everything for launching;
    the arguments are those of :func:`attention` (causal_alignment="top_left" with causal and
    seqlen_q != seqlen_k only together with a variant: window_size, softcap or sinks). Calling the
    result launches again on the current stream with the same arrays."""
    _check_alignment(causal_alignment)
    # top-left causal runs as the window (-1, 0) on its diagonal: one launch (attention() splits it)
    variant = _variant_args(window_size, softcap, sinks) or (
        ((-1, -1), 0.0, None, causal_alignment) if causal_alignment != "bottom_right" else None)
    if variant is not None:
        variant = variant[:3] + (causal_alignment,)
    call = _resolve(q, k, v, causal=causal, softmax_scale=softmax_scale, out=out, lse_out=lse_out,
                    want_lse=bool(return_lse), arch=arch, spec_fields=spec_fields, variant=variant)
    return PreparedAttention(call, bool(return_lse))


# ------------------------------------------------------------------ the public call

_PLANS = PlanCache()
CAUSAL_ALIGNMENTS = ("bottom_right", "top_left")
# attention()'s defaults of the variant arguments, which its fast path recognises by identity (a caller
# who passes the same values explicitly takes the general path, to the same result)
_BOTTOM_RIGHT = "bottom_right"
_NO_WINDOW = (-1, -1)
_NO_SOFTCAP = 0.0


def attention(q, k, v, *, causal: bool = False, softmax_scale: float | None = None, return_lse: bool = False,
              out=None, lse_out=None, arch: str | None = None, causal_alignment: str = _BOTTOM_RIGHT,
              window_size=_NO_WINDOW, softcap: float = _NO_SOFTCAP, sinks=None, deterministic: bool = False,
              **spec_fields):
    """Attention forward, O = softmax(scale * Q K^T [+ causal mask]) V.

    q: (batch, seqlen_q, heads_q, head_dim); k, v: (batch, seqlen_k, heads_kv, head_dim), fp16 or
    bf16 CuPy arrays or torch CUDA tensors (any batch/seq/head strides, contiguous head_dim;
    heads_kv divides heads_q). head_dim: any multiple of 8 in [8, 256]; 64, 96, 128, 192 and 256 have
    kernels of their own, the others run on the next one's tile with the columns past head_dim
    zero-filled inside the kernel (nothing copied; fp8 and the backward take those five only).
    v may be narrower than q and k (fp16/bf16, forward only): v (batch, seqlen_k, heads_kv, head_dim_v)
    with head_dim and head_dim_v both 64, 128, 192 or 256 and head_dim_v < head_dim (DeepSeek MLA
    prefill: 192 and 128); O is then (batch, seqlen_q, heads_q, head_dim_v), the default scale still
    1/sqrt(head_dim).
    Returns O in q's dtype (and the float32 natural-log LSE of shape
    (batch, heads_q, seqlen_q) when ``return_lse``), in the caller's library, computed on its
    current stream. ``out``/``lse_out`` receive the results in place. Spec fields (block_n=...,
    stages=...) may be given to override the defaults.

    Causal masking is aligned to the bottom-right corner of the score matrix by default
    (FlashAttention's convention: the last query row sees every key); ``causal_alignment=
    "top_left"`` aligns it to the top-left corner (torch SDPA's is_causal: query row i sees keys
    0..i). The two differ only when seqlen_q != seqlen_k.

    The first call with given shapes, strides, dtypes, device and options checks everything
    and builds a launch plan (and compiles the kernel if the compile cache has none); later
    calls with the same key look the plan up and launch (a few microseconds of host time).

    On torch tensors that require grad, the call records its backward: the generated backward
    kernels (facodegen.attention_backward) on the saved O and LSE; the LSE takes no gradient. Under
    ``torch.compile``/``torch.export`` the call goes through the ``facodegen::attention`` custom op
    (facodegen.ops.torch_op), whose autograd formula runs the same backward. fp8 inputs and
    out=/lse_out= have no backward: a call that would record a gradient raises.
    ``deterministic=True``: that backward adds dQ in a fixed order, so gradients are bit-identical across
    runs (so they are under torch.use_deterministic_algorithms(True)); the forward is deterministic anyway.

    FP8 (sm90): q, k, v as torch.float8_e4m3fn; ``q_descale``/``k_descale``/``v_descale`` float32
    device tensors, each a scalar or (batch, heads_kv) (default 1); the scores are
    (q*q_descale)(k*k_descale)^T and V is v*v_descale. ``out_dtype="bf16"`` (default) or "fp16";
    ``v_layout="transposed"`` takes V^T (batch, heads_kv, head_dim, seqlen_k), keys contiguous, head_dim
    stride a multiple of 16 (see facodegen.ops.quantize for bf16 -> e4m3).

    Attention variants (bf16/fp16 on sm80 and sm90, fp8 on sm90, where the descales scale the score inside
    the softcap's tanh; a kernel is compiled per feature, the values are run-time arguments):

    * ``window_size=(left, right)``, FlashAttention's sliding window (-1: unbounded on that side):
      query row i sees keys j with i' - left <= j <= i' + right, i' = i + seqlen_k - seqlen_q (the
      causal diagonal; i' = i under ``causal_alignment="top_left"``). ``causal=True`` is the window
      (left, 0). Key blocks outside every row's window are skipped, not masked. A row that sees
      no key gets O = 0 and LSE = -inf.
    * ``softcap=c`` (0: off): the logits become c * tanh(softmax_scale * s / c) before the softmax
      (FlashAttention-2/3's convention; tanh.approx, relative error ~5e-4 of a logit near the cap).
    * ``sinks``: float32 (heads_q,) logits, one per query head (gpt-oss): each joins its head's
      softmax denominator and adds no value, O = sum_j e^(x_j) v_j / (sum_j e^(x_j) + e^(sink)).
      The LSE returned includes the sink, log(sum_j e^(x_j) + e^(sink)), as FlashAttention-4's and
      vLLM's kernels return it; a row that sees no key gets O = 0 and LSE = sink.
    Tensors that require grad record the generated backward (fp16/bf16, plain attention, and a window,
    top-left causal or a softcap: the sm80 backward's LOCAL and SOFTCAP kernels; sinks, which take their gradient
    too: either arch's SINKS kernels); fp8 inputs have no backward yet and raise there.
    """
    torch = _TORCH
    # The common torch call (no variant, knob or lse_out; eager; nothing to record), and the fp8 call
    # with its three descales and nothing else: its plan-cache hit in this one frame (_attention_torch's,
    # with the same key). Anything else goes on below.
    if (torch is not None and sinks is None and window_size is _NO_WINDOW and softcap is _NO_SOFTCAP
            and causal_alignment is _BOTTOM_RIGHT and lse_out is None and (not spec_fields or len(spec_fields) == 3)
            and not torch.compiler.is_compiling() and q.__class__ is torch.Tensor):
        descales = None
        try:
            if (q.requires_grad or k.requires_grad or v.requires_grad) and torch.is_grad_enabled():
                plan = None     # (in this order: no tensor requires grad is the common case, read first)
            elif spec_fields:
                device = q.get_device()
                descales = _given_descales(spec_fields)
                plan = None if descales is None else _PLANS._plans.get(
                    key := _fp8_key(torch, q, k, v, device, causal, softmax_scale, return_lse, arch, out, descales))
            else:
                device = q.get_device()
                key = (q.dtype, q.shape, q.stride(), k.dtype, k.shape, k.stride(), k.get_device(),
                       v.dtype, v.shape, v.stride(), v.get_device(), device, torch._C._cuda_getDevice(),
                       causal.__class__, causal, softmax_scale.__class__, softmax_scale, return_lse, arch,
                       None if out is None else (out.dtype, out.shape, out.stride(), out.get_device()),
                       tunedb.generation())
                plan = _PLANS._plans.get(key)
        except (AttributeError, TypeError):   # k or v not a torch tensor, an unhashable argument
            plan = None
        if plan is not None:
            made = plan.outputs
            if out is None:     # empty_like: the plan's layout (q's), cheaper than torch.empty/new_empty
                out = torch.empty_like(q) if made.like_q else made.new_out(torch, q)
            lse = made.new_lse(torch, q) if return_lse else None
            qp, kp, vp, op = q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr()
            if (qp | kp | vp | op) & 15:    # a misaligned view: the checked path says which
                return _miss(key, q, k, v, causal, softmax_scale, return_lse, out, lse, arch, spec_fields)
            stream = torch._C._cuda_getCurrentRawStream(device)
            if plan.plain:
                plan.launch_plain(stream, qp, kp, vp, op, 0 if lse is None else lse.data_ptr())
            elif descales is not None and plan.descaled:
                plan.launch_plain(stream, qp, kp, vp, op, 0 if lse is None else lse.data_ptr(),
                                  (descales[0].data_ptr(), descales[1].data_ptr(), descales[2].data_ptr()))
            elif descales is not None:     # (a device not current)
                plan.launch(stream, qp, kp, vp, op, 0 if lse is None else lse.data_ptr(),
                            _descale_ptrs(descales, made.unit_descale_ptrs, _torch_ptr))
            else:   # fp8 (its unit descales: none given), a device not current
                plan.launch(stream, qp, kp, vp, op, 0 if lse is None else lse.data_ptr(),
                            made.unit_descale_ptrs or None)
            return (out, lse) if return_lse else out
    variant = _variant_args(window_size, softcap, sinks)
    if causal_alignment != "bottom_right":
        _check_alignment(causal_alignment)
        if variant is not None:
            variant = variant[:3] + (causal_alignment,)     # the window kernel takes the top-left diagonal
        elif causal is True and q.shape[1] != k.shape[1]:
            if not _records_grad(q, k, v):
                return _top_left(q, k, v, softmax_scale=softmax_scale, return_lse=return_lse, out=out,
                                 lse_out=lse_out, arch=arch, deterministic=deterministic, **spec_fields)
            # (recording a gradient: one launch of the window kernel, whose backward takes the window too;
            # _top_left's second part writes into out=, which records none)
            variant = ((-1, -1), 0.0, None, causal_alignment)
    torch = _torch()
    if torch is not None and isinstance(q, torch.Tensor):
        if torch.compiler.is_compiling():   # Dynamo and torch.export trace the ops (and their autograd formula)
            from . import torch_op
            return torch_op.attention(q, k, v, causal=causal, softmax_scale=softmax_scale, return_lse=return_lse,
                                      out=out, lse_out=lse_out, arch=arch, variant=variant,
                                      deterministic=deterministic, **spec_fields)
        if _records_grad(q, k, v):
            from . import torch_op
            return torch_op.attention_recording(q, k, v, causal, softmax_scale, return_lse, out, lse_out, arch,
                                                spec_fields, variant, deterministic)
        return _attention_torch(torch, q, k, v, causal, softmax_scale, return_lse, out, lse_out, arch, spec_fields,
                                variant)
    return _attention_any(q, k, v, causal, softmax_scale, return_lse, out, lse_out, arch, spec_fields, variant)


def _records_grad(q, k, v) -> bool:
    """A call on torch tensors that would record a gradient (grad mode on, q, k or v requiring grad; k, v may be of
    another library: the checked path names them)."""
    torch = _torch()
    return (torch is not None and isinstance(q, torch.Tensor) and torch.is_grad_enabled()
            and (q.requires_grad or getattr(k, "requires_grad", False) or getattr(v, "requires_grad", False)))


def _variant_key(variant, meta) -> tuple | None:
    """The part of a plan key a variant call adds: the window and softcap values (a new value is a
    new plan: its FlashParams image holds them) and the sinks' metadata (their address is patched
    per call); None for a plain call."""
    if variant is None:
        return None
    window_size, softcap, sinks, alignment = variant
    return (tuple(window_size), softcap.__class__, softcap, None if sinks is None else meta(sinks), alignment)


def _split_knobs(spec_fields: dict) -> tuple[tuple, tuple]:
    """(the knobs as a sorted tuple, the fp8 descale arrays): the parts of the key kwargs make."""
    descales = (spec_fields.get("q_descale"), spec_fields.get("k_descale"), spec_fields.get("v_descale"))
    if len(spec_fields) == (descales[0] is not None) + (descales[1] is not None) + (descales[2] is not None):
        return (), descales     # an fp8 call with descales and nothing else: no generator, no sort
    return tuple(sorted((n, x) for n, x in spec_fields.items() if n not in _FP8_KNOBS)), descales


def _descale_ptrs(descales: tuple, unit_ptrs: tuple, ptr) -> tuple[int, int, int]:
    """The q, k, v descale addresses of an fp8 hit: each given array's (``ptr(array)``), else the
    plan's unit descale's (``unit_ptrs``; the key tells given from left out)."""
    dq, dk, dv = descales
    return (unit_ptrs[0] if dq is None else ptr(dq), unit_ptrs[1] if dk is None else ptr(dk),
            unit_ptrs[2] if dv is None else ptr(dv))


def _given_descales(spec_fields: dict) -> tuple | None:
    """The q, k, v descales of knobs that are exactly the three of them, else None."""
    dq, dk, dv = spec_fields.get("q_descale"), spec_fields.get("k_descale"), spec_fields.get("v_descale")
    return None if dq is None or dk is None or dv is None else (dq, dk, dv)


def _fp8_key(torch, q, k, v, device: int, causal, softmax_scale, return_lse, arch, out, descales: tuple) -> tuple:
    """The plan key of an fp8 call on torch tensors that gives its three descales and nothing else
    (attention()'s fast path and _attention_torch build it alike; ``device``: q.get_device(), which
    both have read): the common key's fields with the descales' layouts and devices, "fp8" first."""
    dq, dk, dv = descales
    return ("fp8", q.dtype, q.shape, q.stride(), k.dtype, k.shape, k.stride(), k.get_device(),
            v.dtype, v.shape, v.stride(), v.get_device(), device, torch._C._cuda_getDevice(),
            causal.__class__, causal, softmax_scale.__class__, softmax_scale, return_lse, arch,
            None if out is None else (out.dtype, out.shape, out.stride(), out.get_device()),
            dq.dtype, dq.shape, dq.stride(), dq.get_device(), dk.dtype, dk.shape, dk.stride(), dk.get_device(),
            dv.dtype, dv.shape, dv.stride(), dv.get_device(), tunedb.generation())


def _attention_torch(torch, q, k, v, causal, softmax_scale, return_lse, out, lse_out, arch, spec_fields,
                     variant=None):
    """attention() on torch tensors, eager: a plan-cache hit launches at once; anything unusual
    (a miss, a misaligned view, an unhashable knob) takes the checked path."""
    device = q.get_device()
    descales = _NO_DESCALES
    given = False   # an fp8 call that gave its three descales (and no other knob)
    try:
        if not spec_fields and variant is None and lse_out is None:
            # the common call: attention()'s fast path builds the same key (tests/test_plan_cache.py checks)
            key = (q.dtype, q.shape, q.stride(), k.dtype, k.shape, k.stride(), k.get_device(),
                   v.dtype, v.shape, v.stride(), v.get_device(), device, torch._C._cuda_getDevice(),
                   causal.__class__, causal, softmax_scale.__class__, softmax_scale, return_lse, arch,
                   None if out is None else (out.dtype, out.shape, out.stride(), out.get_device()),
                   tunedb.generation())
        elif len(spec_fields) == 3 and variant is None and lse_out is None and \
                (given_descales := _given_descales(spec_fields)) is not None:
            # fp8 with its three descales and nothing else: a key of its own, "fp8" first
            descales, given = given_descales, True
            dq, dk, dv = descales
            key = _fp8_key(torch, q, k, v, device, causal, softmax_scale, return_lse, arch, out, descales)
        else:   # a knob, an fp8 descale, a variant or lse_out: a key of another length, "torch" first
            knobs, descales = _split_knobs(spec_fields) if spec_fields else ((), _NO_DESCALES)
            key = ("torch", q.dtype, q.shape, q.stride(), k.dtype, k.shape, k.stride(), k.get_device(),
                   v.dtype, v.shape, v.stride(), v.get_device(), device, torch._C._cuda_getDevice(),
                   causal.__class__, causal, softmax_scale.__class__, softmax_scale, return_lse, arch, knobs,
                   None if out is None else (out.dtype, out.shape, out.stride(), out.get_device()),
                   None if lse_out is None else (lse_out.dtype, lse_out.shape, lse_out.stride(),
                                                 lse_out.get_device()),
                   None if descales is _NO_DESCALES else
                   (_torch_meta(descales[0]), _torch_meta(descales[1]), _torch_meta(descales[2])),
                   tunedb.generation(), None if variant is None else _variant_key(variant, _torch_meta))
        # (no plan has a key of device -1: the checked path refuses tensors not on a GPU)
        plan = _PLANS._plans.get(key)
    except (AttributeError, TypeError):  # not all torch tensors, an unhashable knob: the checked path says
        plan = key = None
    if plan is not None:
        made = plan.outputs
        if out is None:     # empty_like: the plan's layout (q's), at half torch.empty's host cost
            out = torch.empty_like(q) if made.like_q else made.new_out(torch, q)
        if lse_out is None and return_lse:
            lse_out = made.new_lse(torch, q)
        qp, kp, vp, op = q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr()
        if not (qp | kp | vp | op) & 15:
            if plan.plain:
                plan.launch_plain(torch._C._cuda_getCurrentRawStream(device), qp, kp, vp, op,
                                  0 if lse_out is None else lse_out.data_ptr())
            elif given and plan.descaled:
                plan.launch_plain(torch._C._cuda_getCurrentRawStream(device), qp, kp, vp, op,
                                  0 if lse_out is None else lse_out.data_ptr(),
                                  (dq.data_ptr(), dk.data_ptr(), dv.data_ptr()))
            else:
                plan.launch(torch._C._cuda_getCurrentRawStream(device), qp, kp, vp, op,
                            0 if lse_out is None else lse_out.data_ptr(),
                            _descale_ptrs(descales, made.unit_descale_ptrs, _torch_ptr) if made.unit_descale_ptrs
                            else None, 0 if variant is None or variant[2] is None else variant[2].data_ptr())
            return (out, lse_out) if return_lse else out
    return _miss(key, q, k, v, causal, softmax_scale, return_lse, out, lse_out, arch, spec_fields, variant)


def _attention_any(q, k, v, causal, softmax_scale, return_lse, out, lse_out, arch, spec_fields, variant=None):
    """attention() on CuPy arrays (and the errors for anything else)."""
    cupy = sys.modules.get("cupy")
    key = None
    if cupy is not None and isinstance(q, cupy.ndarray):
        knobs, descales = _split_knobs(spec_fields) if spec_fields else ((), _NO_DESCALES)
        meta = _cupy_meta
        try:
            current = cupy.cuda.runtime.getDevice()
            key = ("cupy", meta(q), meta(k), meta(v), current, causal.__class__, causal,
                   softmax_scale.__class__, softmax_scale, return_lse, arch, knobs, meta(out), meta(lse_out),
                   None if descales is _NO_DESCALES else  # (the common call: no generator to run)
                   tuple(meta(d) if isinstance(d, cupy.ndarray) else d for d in descales), tunedb.generation(),
                   None if variant is None else _variant_key(variant, meta))
            plan = _PLANS._plans.get(key)
        except (AttributeError, TypeError):  # not all CuPy arrays, an unhashable knob: the checked path says
            plan = key = None
        sinks = None if variant is None else variant[2]
        if plan is not None and (descales is _NO_DESCALES and sinks is None or
                                 all(isinstance(d, (cupy.ndarray, type(None))) for d in descales + (sinks,))):
            device = q.data.device_id
            if device == current:   # the common case: no device switch (two runtime calls) around the launch
                result = _cupy_hit(cupy, plan, q, k, v, out, lse_out, return_lse, descales, sinks)
            else:
                with cupy.cuda.Device(device):
                    result = _cupy_hit(cupy, plan, q, k, v, out, lse_out, return_lse, descales, sinks)
            if result is not None:
                return result
    return _miss(key, q, k, v, causal, softmax_scale, return_lse, out, lse_out, arch, spec_fields, variant)


def _cupy_hit(cupy, plan: LaunchPlan, q, k, v, out, lse_out, return_lse, descales, sinks):
    """A CuPy plan-cache hit with q's device current: allocate what the call did not pass, launch on
    the current stream and return attention()'s result; None where an address is not 16-byte
    aligned (the checked path then says which)."""
    made = plan.outputs
    if out is None:
        out = cupy.ndarray(made.shape, made.library_dtype)
    if lse_out is None and return_lse:
        lse_out = cupy.ndarray(made.lse_shape, made.lse_library_dtype)
    qp, kp, vp, op = q.data.ptr, k.data.ptr, v.data.ptr, out.data.ptr
    if (qp | kp | vp | op) & 15:
        return None
    if plan.plain:  # (no descales, no sinks)
        plan.launch_plain(cupy.cuda.get_current_stream().ptr, qp, kp, vp, op,
                          0 if lse_out is None else lse_out.data.ptr)
    else:
        plan.launch(cupy.cuda.get_current_stream().ptr, qp, kp, vp, op, 0 if lse_out is None else lse_out.data.ptr,
                    _descale_ptrs(descales, made.unit_descale_ptrs, _cupy_ptr) if made.unit_descale_ptrs else None,
                    0 if sinks is None else sinks.data.ptr)
    return (out, lse_out) if return_lse else out


def _miss(key, q, k, v, causal, softmax_scale, return_lse, out, lse_out, arch, spec_fields, variant=None):
    """The checked path: resolve the call (raising on bad input), remember its plan under
    ``key`` (None: not cacheable) and launch it."""
    call = _resolve(q, k, v, causal=causal, softmax_scale=softmax_scale, out=out, lse_out=lse_out,
                    want_lse=bool(return_lse), arch=arch, spec_fields=spec_fields, variant=variant)
    if key is not None:
        _PLANS.put(key, call.plan)
    _launch(call)
    return (call.out, call.lse_out) if return_lse else call.out


def _top_left(q, k, v, *, softmax_scale, return_lse, out, lse_out, arch, deterministic=False, **spec_fields):
    """Causal attention aligned top-left when seqlen_q != seqlen_k, from bottom-right launches on
    views. seqlen_q < seqlen_k: row i sees keys 0..i, which is bottom-right causal over the first
    seqlen_q keys. seqlen_q > seqlen_k: rows 0..seqlen_k-1 are a square causal problem and the
    rows after it see every key (no mask). The LSE of the two parts is written apart and copied
    into place (the kernels write a contiguous (batch, heads, rows) LSE)."""
    seqlen_q, seqlen_k = q.shape[1], k.shape[1]
    fp8_vt = spec_fields.get("v_layout") == "transposed"
    if seqlen_q < seqlen_k:
        v_part = v[..., :seqlen_q] if fp8_vt else v[:, :seqlen_q]
        return attention(q, k[:, :seqlen_q], v_part, causal=True, softmax_scale=softmax_scale,
                         return_lse=return_lse, out=out, lse_out=lse_out, arch=arch, deterministic=deterministic,
                         **spec_fields)
    square = dict(causal=True, softmax_scale=softmax_scale, return_lse=True, arch=arch, **spec_fields)
    if out is not None:
        _, lse_head = attention(q[:, :seqlen_k], k, v, out=out[:, :seqlen_k], **square)
    else:   # the first part's output tells the dtype (fp8 inputs give bf16 or fp16)
        out_head, lse_head = attention(q[:, :seqlen_k], k, v, **square)
        like = _view("out", out_head)
        out = _empty(like, (q.shape[0], seqlen_q) + tuple(out_head.shape[2:]), like.dtype)
        out[:, :seqlen_k] = out_head
    tail = attention(q[:, seqlen_k:], k, v, causal=False, softmax_scale=softmax_scale, return_lse=True,
                     out=out[:, seqlen_k:], arch=arch, **spec_fields)
    if not return_lse and lse_out is None:
        return out
    if lse_out is None:
        lse_out = _empty(_view("lse_out", lse_head), (q.shape[0], q.shape[2], seqlen_q), "float32")
    lse_out[..., :seqlen_k] = lse_head
    lse_out[..., seqlen_k:] = tail[1]
    return (out, lse_out) if return_lse else out


# ------------------------------------------------------------------ arrays, streams, devices

def _torch_meta(x):
    return None if x is None else (x.dtype, x.shape, x.stride(), x.get_device())


def _cupy_meta(x):    # (x.data.device_id: x.device's id without making a Device object)
    return None if x is None else (x.dtype, x.shape, x.strides, x.data.device_id)


def _torch_ptr(x) -> int:
    return x.data_ptr()


def _cupy_ptr(x) -> int:
    return x.data.ptr


# Per library (api._kind), for the plan-cache keys and the launch pointers of the other families'
# calls (attention_backward, attention_with_kvcache): what identifies an array's layout (None for
# an argument left out) and its device address. Chosen once per call by the first argument's kind.
ARRAY_META = {"torch": _torch_meta, "cupy": _cupy_meta}
ARRAY_PTR = {"torch": _torch_ptr, "cupy": _cupy_ptr}


def _empty(like: _View, shape, dtype: str):
    if like.kind == "torch":
        torch = _torch()
        return torch.empty(shape, dtype=getattr(torch, dtype), device=f"cuda:{like.device}")
    cupy = _cupy()
    with cupy.cuda.Device(like.device):
        return cupy.empty(shape, dtype=dtype)


def _allocate(kind: str, device: int, nbytes: int) -> tuple[object, int]:
    """``nbytes`` of device memory in the caller's library: (the array, its address)."""
    if kind == "torch":
        torch = _torch()
        buffer = torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{device}")
        return buffer, buffer.data_ptr()
    cupy = _cupy()
    with cupy.cuda.Device(device):
        buffer = cupy.empty(nbytes, dtype=cupy.uint8)
    return buffer, buffer.data.ptr


def _current_stream(kind: str, device: int) -> int:
    if kind == "torch":
        return _torch()._C._cuda_getCurrentRawStream(device)
    cupy = _cupy()
    with cupy.cuda.Device(device):
        return cupy.cuda.get_current_stream().ptr


def _current_device(kind: str) -> int:
    if kind == "torch":
        return _torch().cuda.current_device()
    return _cupy().cuda.runtime.getDevice()
