"""The CUDA driver calls facodegen makes, on libcuda.so.1 through ctypes (the launch itself
through CuPy's Cython binding where CuPy is already imported: see Launcher).

Loading a cubin, launching it, zeroing a counter and pointing a TMA map at another tensor are
a few driver calls each; doing them here, not through CuPy, keeps ``import cupy`` (about 0.1 s)
off the path of torch users and costs about a microsecond per call (argtypes set once).
Every function raises ``DriverError`` naming the call and its CUresult; nothing here checks
user input (api.py does that first).

Contexts: modules are loaded into the device's primary context, the one CUDA's runtime (torch,
CuPy) makes current. A launch from a thread where no context is current yet (a new thread that
has not touched CUDA) gets CUDA_ERROR_INVALID_CONTEXT; ``Launcher`` then makes the primary context
current and tries once more.
"""

from __future__ import annotations

import ctypes
import functools
import sys
from dataclasses import dataclass

_c = ctypes
_VOIDP = _c.c_void_p
_UINT = _c.c_uint

CUDA_ERROR_OUT_OF_MEMORY = 2
CUDA_ERROR_INVALID_CONTEXT = 201
_ATTR_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8          # CUfunction_attribute
_DEV_ATTR = {"sms": 16, "major": 75, "minor": 76, "smem_optin": 97}   # CUdevice_attribute

_SIGNATURES = {
    "cuInit": [_UINT],
    "cuDeviceGet": [_c.POINTER(_c.c_int), _c.c_int],
    "cuDeviceGetCount": [_c.POINTER(_c.c_int)],
    "cuDeviceGetName": [_c.c_char_p, _c.c_int, _c.c_int],
    "cuDeviceGetAttribute": [_c.POINTER(_c.c_int), _c.c_int, _c.c_int],
    "cuDevicePrimaryCtxRetain": [_c.POINTER(_VOIDP), _c.c_int],
    "cuCtxPushCurrent_v2": [_VOIDP],
    "cuCtxPopCurrent_v2": [_c.POINTER(_VOIDP)],
    "cuCtxSetCurrent": [_VOIDP],
    "cuCtxGetCurrent": [_c.POINTER(_VOIDP)],
    "cuModuleLoadData": [_c.POINTER(_VOIDP), _c.c_char_p],
    "cuModuleGetFunction": [_c.POINTER(_VOIDP), _VOIDP, _c.c_char_p],
    "cuFuncSetAttribute": [_VOIDP, _c.c_int, _c.c_int],
    "cuMemsetD32Async": [_c.c_uint64, _UINT, _c.c_size_t, _VOIDP],
    "cuTensorMapReplaceAddress": [_VOIDP, _VOIDP],
    "cuGetErrorName": [_c.c_int, _c.POINTER(_c.c_char_p)],
}


class DriverError(RuntimeError):
    """A CUDA driver call failed; ``result`` is its CUresult."""

    def __init__(self, call: str, result: int, detail: str = ""):
        self.call, self.result = call, result
        hint = ("; the GPU is out of memory: free tensors (torch.cuda.empty_cache()) or run smaller problems"
                if result == CUDA_ERROR_OUT_OF_MEMORY else "")
        super().__init__(f"{call} failed with {error_name(result)} ({result}){': ' + detail if detail else ''}{hint}")


_LIB = None


def lib() -> ctypes.CDLL:
    """libcuda.so.1 with the signatures above, cuInit'ed once."""
    global _LIB
    if _LIB is None:
        try:
            loaded = ctypes.CDLL("libcuda.so.1")
        except OSError as err:
            raise RuntimeError("facodegen: libcuda.so.1 (the NVIDIA driver) is not available on this machine; "
                               "launching kernels and encoding TMA maps need a GPU driver") from err
        for name, argtypes in _SIGNATURES.items():
            fn = getattr(loaded, name)
            fn.argtypes, fn.restype = argtypes, _c.c_int
        result = loaded.cuInit(0)
        if result != 0:
            raise RuntimeError(f"facodegen: cuInit failed with CUresult {result}")
        _LIB = loaded
    return _LIB


def error_name(result: int) -> str:
    if _LIB is None:
        return f"CUresult {result}"
    name = _c.c_char_p()
    if _LIB.cuGetErrorName(result, _c.byref(name)) != 0 or not name.value:
        return f"CUresult {result}"
    return name.value.decode()


def check(result: int, call: str, detail: str = "") -> None:
    if result != 0:
        raise DriverError(call, result, detail)


# ------------------------------------------------------------------ devices and contexts

@dataclass(frozen=True)
class DeviceInfo:
    ordinal: int
    name: str
    compute_capability: tuple[int, int]
    sms: int
    smem_per_block_optin: int

    @property
    def budget_gpu(self) -> str:
        """The budget-model GPU name (spec.GPUS key) whose limits fit this device: by name for the
        ones it knows, else by compute capability (8.6, 8.9 and 12.x have 99 KB of shared memory
        per block; 8.0, 8.7 and 10.x at least the A100's 163 KB)."""
        lowered = self.name.lower()
        for key in ("h200", "h100", "a100"):
            if key in lowered:
                return key
        cc = self.compute_capability
        if cc == (9, 0):
            return "h100"
        if cc == (8, 6):
            return "sm86"
        if cc == (8, 9) or cc[0] == 12:
            return "sm89"
        return "a100"


def _device(ordinal: int) -> int:
    handle = _c.c_int()
    check(lib().cuDeviceGet(_c.byref(handle), ordinal), "cuDeviceGet", f"device {ordinal}")
    return handle.value


def _attribute(device: int, name: str) -> int:
    value = _c.c_int()
    check(lib().cuDeviceGetAttribute(_c.byref(value), _DEV_ATTR[name], device), "cuDeviceGetAttribute", name)
    return value.value


@functools.lru_cache(maxsize=None)
def device_info(ordinal: int) -> DeviceInfo:
    device = _device(ordinal)
    raw = _c.create_string_buffer(256)
    check(lib().cuDeviceGetName(raw, 256, device), "cuDeviceGetName")
    return DeviceInfo(ordinal, raw.value.decode(), (_attribute(device, "major"), _attribute(device, "minor")),
                      _attribute(device, "sms"), _attribute(device, "smem_optin"))


@functools.lru_cache(maxsize=None)
def primary_context(ordinal: int) -> int:
    """The device's primary context (retained once for the life of the process)."""
    ctx = _VOIDP()
    check(lib().cuDevicePrimaryCtxRetain(_c.byref(ctx), _device(ordinal)), "cuDevicePrimaryCtxRetain")
    return ctx.value


class on_device:  # noqa: N801 (used as a context manager, like torch.cuda.device)
    """Makes ``ordinal``'s primary context current for a block, restoring the caller's after."""

    def __init__(self, ordinal: int):
        self.ctx = primary_context(ordinal)

    def __enter__(self):
        check(lib().cuCtxPushCurrent_v2(self.ctx), "cuCtxPushCurrent")

    def __exit__(self, *exc):
        popped = _VOIDP()
        check(lib().cuCtxPopCurrent_v2(_c.byref(popped)), "cuCtxPopCurrent")


def ensure_context(ordinal: int) -> None:
    """Where the calling thread has no current context, make ``ordinal``'s primary context current
    (and leave it so). A thread that has not touched CUDA yet has none, e.g. the autograd engine's
    worker running a backward first thing: cuTensorMapEncodeTiled fails there (CUresult 201,
    CUDA_ERROR_INVALID_CONTEXT: H200, 2026-12-04), as a launch would (Launcher.failed retries)."""
    current = _VOIDP()
    check(lib().cuCtxGetCurrent(_c.byref(current)), "cuCtxGetCurrent")
    if not current.value:
        check(lib().cuCtxSetCurrent(primary_context(ordinal)), "cuCtxSetCurrent")


# ------------------------------------------------------------------ modules and launches

@dataclass(frozen=True)
class LoadedFunction:
    """A kernel loaded on one device: the CUfunction handle (``ptr``) and its module."""
    ptr: int
    module: int
    device: int


def load_function(cubin: bytes, name: str, ordinal: int, max_dynamic_smem: int = 0) -> LoadedFunction:
    """Load ``cubin`` into ``ordinal``'s primary context and look up kernel ``name``; with
    ``max_dynamic_smem`` > 48 KB the kernel is allowed that much dynamic shared memory."""
    module, function = _VOIDP(), _VOIDP()
    with on_device(ordinal):
        check(lib().cuModuleLoadData(_c.byref(module), cubin), "cuModuleLoadData", name)
        check(lib().cuModuleGetFunction(_c.byref(function), module, name.encode()), "cuModuleGetFunction", name)
        if max_dynamic_smem:
            check(lib().cuFuncSetAttribute(function, _ATTR_MAX_DYNAMIC_SHARED_SIZE_BYTES, max_dynamic_smem),
                  "cuFuncSetAttribute", f"{name}: {max_dynamic_smem} bytes of dynamic shared memory")
    return LoadedFunction(function.value, module.value, ordinal)


class Launcher:
    """cuLaunchKernel of one kernel, through one of two bindings (_launch_binding), both taking
    plain ints:

    - CuPy's Cython binding (cupy_backends.cuda.api.driver.launchKernel), where the process has
      imported CuPy: it converts the ints in C and releases the GIL (H200, 2026-12-03: 4.69 µs a
      bare launch against 5.85 through ctypes). Its first call loads libcuda through ``import
      cupy`` (~150 ms, measured on the H200: 173 ms for a first call that was 20 ms without it), so
    - ctypes with the fixed arguments prebuilt (_ctypes_launch), everywhere else (torch users who
      never import CuPy).
    The launcher is chosen when the plan is built; CuPy imported later leaves earlier plans on ctypes."""

    def __init__(self, function: LoadedFunction, grid: tuple[int, int, int], threads: int, smem_bytes: int):
        self.function = function
        binding, self._error = _launch_binding()
        # (f, grid x/y/z, block x/y/z, dynamic shared memory): the arguments before stream, kernelParams, extra
        self._launch = (binding or _ctypes_launch)(function.ptr, grid[0], grid[1], grid[2], threads, 1, 1,
                                                   smem_bytes)
        # For a caller that saves this frame (plan.LaunchPlan.launch_plain): ``bare(stream,
        # kernel_params, 0)`` raises ``error`` on failure, which it hands to ``failed``.
        self.bare, self.error = self._launch, self._error

    def __call__(self, stream: int, kernel_params: int) -> None:
        """Launch on ``stream`` (a CUstream handle, 0: the legacy default stream) with
        ``kernel_params``, the address of a ``void*[]`` of argument pointers."""
        try:
            self._launch(stream, kernel_params, 0)
        except self._error as err:
            self.failed(err, stream, kernel_params)

    def failed(self, err, stream: int, kernel_params: int) -> None:
        """After a launch raised ``err``: raise DriverError, as every call here does, or where no
        context was current (a thread that has not touched CUDA yet) make the device's primary
        context current and launch once more."""
        if err.status != CUDA_ERROR_INVALID_CONTEXT:
            raise DriverError("cuLaunchKernel", err.status) from None
        check(lib().cuCtxSetCurrent(primary_context(self.function.device)), "cuCtxSetCurrent")
        try:
            self._launch(stream, kernel_params, 0)
        except self._error as again:
            raise DriverError("cuLaunchKernel", again.status) from None


def _launch_binding():
    """(CuPy's launchKernel, or None for ctypes; the exception a launch raises, with the failing
    CUresult as .status): CuPy's binding where CuPy is imported, else ctypes (see Launcher)."""
    lib()       # cuInit, and facodegen's message where there is no driver
    if "cupy" in sys.modules:
        from cupy_backends.cuda.api.driver import CUDADriverError, launchKernel

        def bind(*fixed):
            return functools.partial(launchKernel, *fixed)
        return bind, CUDADriverError
    return None, LaunchError


class LaunchError(RuntimeError):
    """A failed cuLaunchKernel through ctypes (CuPy's CUDADriverError's shape: ``status``)."""

    def __init__(self, status: int):
        super().__init__(f"cuLaunchKernel: CUresult {status}")
        self.status = status


def _ctypes_launch(function: int, gx: int, gy: int, gz: int, bx: int, by: int, bz: int, smem: int):
    """cuLaunchKernel of one kernel through ctypes as ``launch(stream, kernel_params, extra=0)``,
    raising LaunchError: the fixed arguments are ctypes objects made here, once (CPU, stub
    libcuda: 1.3 µs a call, against 1.7 with argtypes converting all eleven)."""
    raw, u = lib().cuLaunchKernel, _UINT
    fixed = (_VOIDP(function), u(gx), u(gy), u(gz), u(bx), u(by), u(bz), u(smem))

    def launch(stream: int, kernel_params: int, extra: int = 0) -> None:
        status = raw(*fixed, _VOIDP(stream), _VOIDP(kernel_params), None)
        if status != 0:
            raise LaunchError(status)
    return launch


def stream_arg(stream: int) -> int:
    """A stream as Launcher takes it: the raw CUstream handle, an int."""
    return stream


def memset_d32_async(ptr: int, value: int, count: int, stream: int) -> None:
    check(lib().cuMemsetD32Async(ptr, value, count, stream), "cuMemsetD32Async")


def replace_tensor_map_address(map_address: int, ptr: int) -> None:
    """Point the 64-byte aligned CUtensorMap at ``map_address`` at another global address (same
    shape, strides and box: only the base moves)."""
    check(lib().cuTensorMapReplaceAddress(map_address, ptr), "cuTensorMapReplaceAddress")
