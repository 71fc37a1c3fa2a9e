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

from . import compiler as compile_mod
from .launch import (Operand, grid, launch_prepared, pack_params, resident_ctas, stream_k_flags,
                     stream_k_workspace_floats, workspace_floats)
from .spec import HEAD_DIMS, SEQLEN_RULE_FIELDS, KernelSpec, SpecError, seqlen_rule_fields

DTYPE_NAMES = {"float16": "fp16", "bfloat16": "bf16"}
# dtype=fp8 (sm90): e4m3 inputs (torch.float8_e4m3fn); other float8 flavours are refused by name.
FP8_NAMES = {"float8_e4m3fn": "fp8"}
OUT_DTYPE_NAMES = {"bf16": "bfloat16", "fp16": "float16"}
ELEMENT_SIZES = {"float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "float32": 4}
CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8
ALIGN_BYTES = 16  # cp.async and TMA move 16-byte chunks


# ------------------------------------------------------------------ tensor adapters

def _torch():
    return sys.modules.get("torch")


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

@dataclass(frozen=True)
class DeviceInfo:
    ordinal: int
    name: str
    compute_capability: tuple[int, int]
    sms: int
    smem_per_block_optin: int

    @property
    def budget_gpu(self) -> str:
        """The budget-model GPU name (spec.GPUS key) whose limits fit this device."""
        lowered = self.name.lower()
        for key in ("h200", "h100", "a100"):
            if key in lowered:
                return key
        return "h100" if self.compute_capability == (9, 0) else "a100"


@functools.lru_cache(maxsize=None)
def device_info(ordinal: int) -> DeviceInfo:
    from cupy.cuda import runtime
    props = runtime.getDeviceProperties(ordinal)
    name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
    return DeviceInfo(ordinal, name, (props["major"], props["minor"]), props["multiProcessorCount"],
                      props.get("sharedMemPerBlockOptin", 0))


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


def _check_attention_shape(q: _View, k: _View) -> None:
    """q (batch, seqlen_q, heads_q, d) against k (batch, seqlen_k, heads_kv, d): one batch, one
    supported head_dim, no empty dimension, heads_kv dividing heads_q."""
    batch, seqlen_q, heads_q, head_dim = q.shape
    _, seqlen_k, heads_kv, _ = k.shape
    if k.shape[0] != batch:
        raise ValueError(f"k has batch {k.shape[0]} but q has batch {batch}")
    if k.shape[3] != head_dim:
        raise ValueError(f"k and v have head_dim {k.shape[3]} but q has head_dim {head_dim}")
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"head_dim={head_dim} is not supported; choose one of {', '.join(map(str, HEAD_DIMS))}")
    for name, value in (("batch", batch), ("seqlen_q (q.shape[1])", seqlen_q),
                        ("seqlen_k (k.shape[1])", seqlen_k), ("heads_q (q.shape[2])", heads_q),
                        ("heads_kv (k.shape[2])", heads_kv)):
        if value < 1:
            raise ValueError(f"{name} is {value}; an empty sequence or dimension cannot be attended")
    if heads_q % heads_kv:
        raise ValueError(f"heads_kv={heads_kv} (k.shape[2]) must divide heads_q={heads_q} (q.shape[2]) for GQA/MQA")


def _check_inputs(q: _View, k: _View, v: _View) -> None:
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
        raise ValueError(f"k and v must have the same shape, got k {k.shape} and v {v.shape}")
    _check_attention_shape(q, k)
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


def _check_out(out: _View, q: _View) -> None:
    if out.kind != q.kind or out.dtype != q.dtype or out.device != q.device:
        raise TypeError(f"out must be a {q.kind} {q.dtype} array on cuda:{q.device} like q")
    if out.shape != q.shape:
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
    function: object
    smem_bytes: int
    resident_ctas: int      # CTAs running at once: the persistent grid (launch.resident_ctas)


@functools.lru_cache(maxsize=256)
def _prepare(spec: KernelSpec, device: int) -> _Prepared:
    from cupy_backends.cuda.api import driver
    from cupy.cuda import Device
    info = device_info(device)
    # sm80 code is compiled for the GPU at hand (machine code only loads on its own major version).
    sm = f"sm_{info.compute_capability[0]}{info.compute_capability[1]}" if spec.arch == "sm80" else None
    with Device(device):
        function = compile_mod.compile(spec, sm=sm).function()
        driver.funcSetAttribute(function.ptr, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, spec.smem_bytes)
        resident = resident_ctas(spec, info.sms, function)
    return _Prepared(function, spec.smem_bytes, resident)


@functools.lru_cache(maxsize=None)
def _tile_counter(device: int):
    """One int per device for the dynamic tile scheduler, zeroed on the stream before each launch."""
    cupy = _cupy()
    with cupy.cuda.Device(device):
        return cupy.zeros(1, dtype=cupy.int32)


# ------------------------------------------------------------------ public API

def resolve_spec(head_dim: int, dtype: str, causal: bool, device: int, arch: str | None = None,
                 *, shape: tuple[int, int, int, int] | None = None, **spec_fields) -> KernelSpec:
    """The spec a call will run: arch and GPU budget from the device, the rest from the tuning
    database's entry for this device and ``shape`` = (batch, seqlen_q, seqlen_k, heads_q) where
    there is one (facodegen.tunedb), else from the defaults and the measured sequence-length
    table of spec.seqlen_rule_fields. Fields the caller gives always win;
    a tuned entry that does not combine with them into a valid spec is not used."""
    info = device_info(device)
    arch = arch or default_arch(info)
    _check_arch(arch, info)
    spec_fields.setdefault("gpu", info.budget_gpu)
    tuned = _tuned_fields(info, arch, head_dim, dtype, causal, shape) if shape is not None else None
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
    if not tuned and shape is not None and not any(f in spec_fields for f in SEQLEN_RULE_FIELDS):
        _, seqlen_q, seqlen_k, _ = shape
        tuned = seqlen_rule_fields(arch, head_dim, dtype, causal, seqlen_q, seqlen_k)
    if tuned:
        try:
            return KernelSpec(arch=arch, head_dim=head_dim, dtype=dtype, causal=causal, **{**tuned, **spec_fields})
        except (SpecError, TypeError):
            pass  # the caller's fields do not fit the tuned tiles: defaults + the caller's fields
    return KernelSpec(arch=arch, head_dim=head_dim, dtype=dtype, causal=causal, **spec_fields)


def _tuned_fields(info: DeviceInfo, arch: str, head_dim: int, dtype: str, causal: bool, shape) -> dict | None:
    """Spec fields of the tuning database's entry for this call, or None (one stat per call while
    the database file is unchanged; any problem with it means defaults)."""
    from . import tunedb
    try:
        batch, seqlen_q, seqlen_k, heads_q = shape
        key = tunedb.make_key(info.name, info.compute_capability, compile_mod.nvrtc_identity(), arch, head_dim,
                              dtype, causal, seqlen_q, seqlen_k, batch, heads_q)
        entry = tunedb.lookup(key)
    except Exception:  # noqa: BLE001 (a tuning database must never break a call)
        return None
    return dict(entry["spec"]) if entry else None


class PreparedAttention:
    """One attention call with its arguments bound: calling it launches the kernel again on the
    stream current at call time. Reuse it to keep host work off a hot loop (the spec, the
    compiled kernel, the FlashParams bytes and the tensor maps are built once). ``spec`` is the
    kernel it runs, ``grid`` its launch grid and ``workspace`` the fp32 buffer of stream_k's split
    tiles (None without stream_k)."""

    def __init__(self, spec: KernelSpec, q: _View, out, lse_out, param_bytes: bytes, return_lse: bool,
                 keep_alive: tuple = (), workspace=None):
        import ctypes
        self.spec = spec
        # Device buffers param_bytes points into besides q, k, v, out and lse (fa1's fp32 workspace,
        # the fp8 descales, among them the unit ones made for left-out arguments): they live as
        # long as this object.
        self._keep_alive = tuple(x for x in keep_alive if x is not None)
        self.workspace = workspace   # stream_k: the split tiles' fp32 slots, then the flags (else None)
        self.out, self.lse_out, self._return_lse = out, lse_out, return_lse
        self._q = q
        self._prepared = _prepare(spec, q.device)
        batch, seqlen_q, heads_q, _ = q.shape
        self.grid = grid(spec, batch, heads_q, seqlen_q, self._prepared.resident_ctas)   # launch grid (x, y, z)
        self._counter = _tile_counter(q.device) if spec.arch == "sm90" and spec.persistent else None
        # stream_k's flags follow the workspace's slots; zeroed on the first launch's stream, and the
        # kernel lowers each flag it reads, so every later launch finds them down too
        first, count = stream_k_flags(spec, self.grid[0])
        self._flags_to_zero = (_workspace_ptr(workspace) + 4 * first, 4 * count) if count else None
        self._param_bytes = param_bytes
        # Kept alive with the object: the driver reads them at each launch.
        self._param_buffer = ctypes.create_string_buffer(param_bytes, len(param_bytes))
        self._kernel_params = (ctypes.c_void_p * 1)(ctypes.addressof(self._param_buffer))

    def __call__(self):
        from cupy.cuda import Device, runtime
        stream = _current_stream(self._q)
        with Device(self._q.device):
            if self._counter is not None:
                runtime.memsetAsync(self._counter.data.ptr, 0, 4, stream)
            if self._flags_to_zero is not None:
                runtime.memsetAsync(self._flags_to_zero[0], 0, self._flags_to_zero[1], stream)
                self._flags_to_zero = None
            launch_prepared(self._prepared.function, self.grid, self.spec.threads, self._prepared.smem_bytes,
                            stream, self._kernel_params)
        return (self.out, self.lse_out) if self._return_lse else self.out


def prepare(q, k, v, *, causal: bool = False, softmax_scale: float | None = None, return_lse: bool = False,
            out=None, lse_out=None, arch: str | None = None, **spec_fields) -> PreparedAttention:
    """Check the arguments, pick and compile the kernel, and bind everything for launching;
    the arguments are those of :func:`attention`."""
    qv, kv, vv = _view("q", q), _view("k", k), _view("v", v)
    if qv.dtype in FP8_NAMES or "float8" in qv.dtype or any(
            name in spec_fields for name in ("q_descale", "k_descale", "v_descale")):
        return _prepare_fp8(qv, kv, vv, causal=causal, softmax_scale=softmax_scale, return_lse=return_lse,
                            out=out, lse_out=lse_out, arch=arch, **spec_fields)
    _check_inputs(qv, kv, vv)
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be True or False, got {causal!r}")
    batch, seqlen_q, heads_q, head_dim = qv.shape
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(head_dim)
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float)) \
            or not math.isfinite(softmax_scale):
        raise ValueError(f"softmax_scale must be a finite number, got {softmax_scale!r}")
    spec = resolve_spec(head_dim, DTYPE_NAMES[qv.dtype], causal, qv.device, arch,
                        shape=(batch, seqlen_q, kv.shape[1], heads_q), **spec_fields)

    if out is None:
        out = _empty(qv, qv.shape, qv.dtype)
    outv = _view("out", out)
    _check_out(outv, qv)
    if lse_out is None:
        lse_out = _empty(qv, (batch, heads_q, seqlen_q), "float32")
    lsev = _view("lse_out", lse_out)
    _check_lse(lsev, qv)

    counter = _tile_counter(qv.device)
    # schedule=fa1 (loop_order=kv_outer) keeps O, m, l in an fp32 workspace between K/V blocks: one per
    # call, (batch*heads_q*seqlen_q*(head_dim+2)) floats, kept alive by the PreparedAttention.
    n_workspace = workspace_floats(spec, batch, heads_q, seqlen_q, head_dim)
    workspace = _empty(qv, (n_workspace,), "float32") if n_workspace else None
    param_bytes = pack_params(spec, qv.operand(), kv.operand(), vv.operand(), outv.operand(), lsev.ptr,
                              counter.data.ptr, float(softmax_scale),
                              workspace_ptr=_workspace_ptr(workspace))
    return PreparedAttention(spec, qv, out, lse_out, param_bytes, return_lse, keep_alive=(workspace,))


# ------------------------------------------------------------------ fp8 (e4m3, sm90)

def check_fp8_inputs(q: _View, k: _View, v: _View, v_layout: str) -> None:
    """q, k, v of an fp8 call: e4m3, one kind/device, shapes as for 16-bit inputs except V^T
    (batch, heads_kv, head_dim, seqlen_k) with v_layout=transposed. Raises naming the argument."""
    for t in (q, k, v):
        if t.dtype not in FP8_NAMES:
            raise TypeError(f"{t.name} has dtype {t.dtype}; dtype=fp8 takes float8_e4m3fn (e4m3) q, k and v "
                            f"(quantise bf16/fp16 with facodegen.quantize.quantize_e4m3)")
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
        raise ValueError(f"v has shape {v.shape}; expected {what} = {tuple(want_v)}")
    _check_attention_shape(q, k)
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


def _prepare_fp8(qv: _View, kv: _View, vv: _View, *, causal, softmax_scale, return_lse, out, lse_out, arch,
                 q_descale=None, k_descale=None, v_descale=None, **spec_fields) -> PreparedAttention:
    from .launch import Descale
    if arch is not None and arch != "sm90":
        raise ValueError(f"arch={arch!r}: dtype=fp8 (e4m3 q, k, v) runs on sm90 (H100/H200) only; use arch='sm90'")
    v_layout = spec_fields.get("v_layout") or "row"
    check_fp8_inputs(qv, kv, vv, v_layout)
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be True or False, got {causal!r}")
    out_dtype = spec_fields.get("out_dtype") or "bf16"
    if out_dtype not in OUT_DTYPE_NAMES:
        raise ValueError(f"out_dtype must be 'bf16' or 'fp16', got {out_dtype!r}")
    batch, seqlen_q, heads_q, head_dim = qv.shape
    _, seqlen_k, heads_kv, _ = kv.shape
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(head_dim)
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float)) \
            or not math.isfinite(softmax_scale):
        raise ValueError(f"softmax_scale must be a finite number, got {softmax_scale!r}")
    descales = {}
    keep = []
    for name, value in (("q", q_descale), ("k", k_descale), ("v", v_descale)):
        arg = f"{name}_descale"
        if value is not None and _kind(value) == "other":
            raise TypeError(f"{arg} must be a float32 {qv.kind} tensor on cuda:{qv.device} (a scalar or "
                            f"(batch, heads_kv)), got {type(value).__name__}")
        view = _view(arg, value) if value is not None else None
        strides = check_descale(view, arg, qv, batch, heads_kv)
        if value is None:
            value = _unit_descale(qv.device, qv.kind)
            view = _view(arg, value)
        keep.append(value)
        descales[name] = Descale(view.ptr, *strides)
    spec_fields.update(out_dtype=out_dtype, v_layout=v_layout)
    spec = resolve_spec(head_dim, "fp8", causal, qv.device, "sm90",
                        shape=(batch, seqlen_q, seqlen_k, heads_q), **spec_fields)
    out_name = OUT_DTYPE_NAMES[out_dtype]
    if out is None:
        out = _empty(qv, qv.shape, out_name)
    outv = _view("out", out)
    if outv.kind != qv.kind or outv.dtype != out_name or outv.device != qv.device:
        raise TypeError(f"out must be a {qv.kind} {out_name} array on cuda:{qv.device} (out_dtype={out_dtype})")
    if outv.shape != qv.shape:
        raise ValueError(f"out has shape {outv.shape}, q has {qv.shape}; they must match")
    _check_layout(outv)
    if lse_out is None:
        lse_out = _empty(qv, (batch, heads_q, seqlen_q), "float32")
    lsev = _view("lse_out", lse_out)
    _check_lse(lsev, qv)
    counter = _tile_counter(qv.device)
    workspace = _stream_k_workspace(spec, qv)
    param_bytes = pack_params(spec, qv.operand(), kv.operand(), vv.operand(), outv.operand(), lsev.ptr,
                              counter.data.ptr, float(softmax_scale), descales=descales,
                              workspace_ptr=_workspace_ptr(workspace))
    return PreparedAttention(spec, qv, out, lse_out, param_bytes, return_lse, keep_alive=(*keep, workspace),
                             workspace=workspace)


def _workspace_ptr(workspace) -> int:
    """The device address of a call's fp32 workspace (fa1's or stream_k's), 0 for none."""
    return _view("workspace", workspace).ptr if workspace is not None else 0


def _stream_k_workspace(spec: KernelSpec, like: _View):
    """stream_k: the split tiles' fp32 workspace of this call, sized for the persistent grid (its
    flags are zeroed on the first launch: PreparedAttention); None if unused."""
    floats = stream_k_workspace_floats(spec, _prepare(spec, like.device).resident_ctas)
    return _empty(like, (floats,), "float32") if floats else None


def attention(q, k, v, *, causal: bool = False, softmax_scale: float | None = None, return_lse: bool = False,
              out=None, lse_out=None, arch: str | None = None, **spec_fields):
    """Attention forward, O = softmax(scale * Q K^T [+ causal mask]) V.

    q: (batch, seqlen_q, heads_q, head_dim); k, v: (batch, seqlen_k, heads_kv, head_dim), fp16 or
    bf16 CuPy arrays or torch CUDA tensors (any batch/seq/head strides, contiguous head_dim;
    heads_kv divides heads_q). Causal masking is bottom-right aligned. Returns O in q's dtype (and
    the float32 natural-log LSE of shape (batch, heads_q, seqlen_q) when ``return_lse``), in the
    caller's library, computed on its current stream. Spec fields (block_n=..., stages=...) may be
    given to override the defaults; ``out``/``lse_out`` receive the results in place.

    FP8 (sm90): q, k, v as torch.float8_e4m3fn; ``q_descale``/``k_descale``/``v_descale`` float32
    device tensors, each a scalar or (batch, heads_kv) (default 1); the scores are
    (q*q_descale)(k*k_descale)^T and V is v*v_descale. ``out_dtype="bf16"`` (default) or "fp16";
    ``v_layout="transposed"`` takes V^T (batch, heads_kv, head_dim, seqlen_k), keys contiguous, head_dim
    stride a multiple of 16 (see facodegen.quantize for bf16 -> e4m3).
    """
    return prepare(q, k, v, causal=causal, softmax_scale=softmax_scale, return_lse=return_lse, out=out,
                   lse_out=lse_out, arch=arch, **spec_fields)()


def _empty(like: _View, shape, dtype: str):
    if like.kind == "torch":
        torch = _torch()
        return torch.empty(shape, dtype=getattr(torch, dtype), device=f"cuda:{like.device}")
    cupy = _cupy()
    with cupy.cuda.Device(like.device):
        return cupy.empty(shape, dtype=dtype)


def _current_stream(like: _View) -> int:
    if like.kind == "torch":
        return _torch().cuda.current_stream(like.device).cuda_stream
    return _cupy().cuda.get_current_stream().ptr
