"""driver.Launcher on the CPU: what it hands CuPy's cuLaunchKernel binding, and how it handles the
binding's errors (a thread with no current context, any other CUresult). The binding is faked;
the GPU tests launch for real."""

from __future__ import annotations

import functools
import sys
import types

import pytest

from facodegen.runtime import driver


class FakeDriverError(Exception):
    """cupy_backends' CUDADriverError: the failing CUresult as ``status``."""

    def __init__(self, status):
        super().__init__(f"CUresult {status}")
        self.status = status


class FakeBinding:
    """launchKernel that records its arguments and fails with the given CUresults first."""

    def __init__(self, *failures):
        self.calls = []
        self.failures = list(failures)

    def __call__(self, *args):
        self.calls.append(args)
        if self.failures:
            raise FakeDriverError(self.failures.pop(0))


@pytest.fixture
def binding(monkeypatch):
    made = {}

    def install(*failures):
        made["binding"] = FakeBinding(*failures)
        return made["binding"]
    monkeypatch.setattr(driver, "_launch_binding",
                        lambda: (lambda *fixed: functools.partial(made["binding"], *fixed), FakeDriverError))
    context_calls = []
    monkeypatch.setattr(driver, "lib", lambda: types.SimpleNamespace(
        cuCtxSetCurrent=lambda ctx: context_calls.append(ctx) or 0))
    monkeypatch.setattr(driver, "primary_context", lambda ordinal: 0xC0 + ordinal)
    install.context_calls = context_calls
    return install


def _launcher():
    return driver.Launcher(driver.LoadedFunction(ptr=0x7F00_1234, module=1, device=3), (132, 8, 2), 384, 200_000)


def test_the_binding_gets_plain_ints_in_cuLaunchKernel_order(binding):
    fake = binding()
    _launcher()(0x5555_0000, 0x7000_0040)
    # f, grid x/y/z, block x/y/z, dynamic shared memory, stream, kernelParams, extra (none)
    assert fake.calls == [(0x7F00_1234, 132, 8, 2, 384, 1, 1, 200_000, 0x5555_0000, 0x7000_0040, 0)]
    assert all(type(a) is int for a in fake.calls[0])
    assert binding.context_calls == []


def test_a_thread_without_a_context_gets_the_primary_one_and_one_retry(binding):
    fake = binding(driver.CUDA_ERROR_INVALID_CONTEXT)
    _launcher()(7, 8)
    assert binding.context_calls == [0xC0 + 3]      # the function's device's primary context
    assert len(fake.calls) == 2 and fake.calls[0] == fake.calls[1]


def test_a_failed_retry_raises_driver_error(binding):
    binding(driver.CUDA_ERROR_INVALID_CONTEXT, 700)
    with pytest.raises(driver.DriverError, match=r"cuLaunchKernel failed with CUresult 700 \(700\)") as raised:
        _launcher()(7, 8)
    assert raised.value.result == 700 and raised.value.call == "cuLaunchKernel"


def test_another_error_raises_driver_error_without_retrying(binding):
    fake = binding(driver.CUDA_ERROR_OUT_OF_MEMORY)
    with pytest.raises(driver.DriverError, match="cuLaunchKernel failed.*the GPU is out of memory"):
        _launcher()(7, 8)
    assert len(fake.calls) == 1 and binding.context_calls == []


def _plain_plan(monkeypatch):
    """A LaunchPlan over _launcher()'s function: launch_plain calls the binding itself (Launcher.bare)."""
    from facodegen.runtime import params, plan
    from facodegen.spec import KernelSpec
    monkeypatch.setattr(driver, "stream_arg", lambda stream: stream)
    monkeypatch.setattr(driver, "memset_d32_async", lambda *a: None)
    spec = KernelSpec(arch="sm80", head_dim=128, dtype="bf16", causal=True)
    return plan.LaunchPlan(spec, driver.LoadedFunction(ptr=0x7F00_1234, module=1, device=3), (132, 8, 2),
                           bytes(params.layout("sm80", "bf16")[1]), tensor_maps={}, lse_floats=4, workspace_floats=0,
                           stream_k_flags=(0, 0), switch_context=False, allocate=lambda n: (None, 1 << 20))


@pytest.mark.parametrize("failures, raises", [((), None), ((driver.CUDA_ERROR_INVALID_CONTEXT,), None),
                                              ((driver.CUDA_ERROR_INVALID_CONTEXT, 700), "CUresult 700"),
                                              ((driver.CUDA_ERROR_OUT_OF_MEMORY,), "out of memory")])
def test_launch_plain_handles_the_bindings_errors_as_the_launcher_does(binding, monkeypatch, failures, raises):
    """LaunchPlan.launch_plain skips Launcher.__call__ (Launcher.bare) and hands a failure to
    Launcher.failed: the same retry on a thread without a context, the same DriverError."""
    fake = binding(*failures)
    plan = _plain_plan(monkeypatch)
    if raises:
        with pytest.raises(driver.DriverError, match=raises):
            plan.launch_plain(7, 16, 32, 48, 64)
    else:
        plan.launch_plain(7, 16, 32, 48, 64)
    retried = failures[:1] == (driver.CUDA_ERROR_INVALID_CONTEXT,)
    assert binding.context_calls == ([0xC0 + 3] if retried else [])
    assert len(fake.calls) == 1 + retried and all(c[8:] == (7, plan._last.kernel_params, 0) for c in fake.calls)
    assert not plan._lock.locked()


def test_cupys_binding_has_the_signature_launcher_relies_on():
    """Imported without libcuda (it loads the driver on first call) and without ``import cupy``."""
    binding = pytest.importorskip("cupy_backends.cuda.api.driver")
    assert binding.launchKernel.__doc__.startswith(
        "launchKernel(intptr_t f, unsigned int grid_dim_x, unsigned int grid_dim_y, unsigned int grid_dim_z, "
        "unsigned int block_dim_x, unsigned int block_dim_y, unsigned int block_dim_z, "
        "unsigned int shared_mem_bytes, intptr_t stream, intptr_t kernel_params, intptr_t extra)")
    assert issubclass(binding.CUDADriverError, Exception)



def test_the_binding_is_cupys_only_where_cupy_is_imported(monkeypatch):
    """CuPy's binding imports cupy on its first call (~150 ms): a torch-only process must not pay it."""
    monkeypatch.setattr(driver, "lib", lambda: None)
    monkeypatch.delitem(sys.modules, "cupy", raising=False)
    assert driver._launch_binding() == (None, driver.LaunchError)
    pytest.importorskip("cupy_backends.cuda.api.driver")
    monkeypatch.setitem(sys.modules, "cupy", types.ModuleType("cupy"))
    bind, error = driver._launch_binding()
    assert bind(1, 2, 3, 4, 5, 6, 7, 8).func.__name__ == "launchKernel" and error.__name__ == "CUDADriverError"


def _ctypes_launcher(monkeypatch, status: int):
    """driver.Launcher on the ctypes binding, over a cuLaunchKernel that records its arguments."""
    calls = []

    def cu_launch_kernel(*args):
        calls.append(args)
        return status
    monkeypatch.setattr(driver, "lib", lambda: types.SimpleNamespace(cuLaunchKernel=cu_launch_kernel,
                                                                     cuCtxSetCurrent=lambda ctx: 0))
    monkeypatch.setattr(driver, "primary_context", lambda ordinal: 0xC0)
    monkeypatch.delitem(sys.modules, "cupy", raising=False)
    return _launcher(), calls


def test_the_ctypes_binding_passes_cuLaunchKernel_its_arguments_as_ctypes_values(monkeypatch):
    launcher, calls = _ctypes_launcher(monkeypatch, 0)
    launcher(0x5555_0000, 0x7000_0040)
    values = [None if a is None else a.value for a in calls[0]]
    assert values == [0x7F00_1234, 132, 8, 2, 384, 1, 1, 200_000, 0x5555_0000, 0x7000_0040, None]


def test_the_ctypes_binding_raises_driver_error_with_the_status(monkeypatch):
    launcher, calls = _ctypes_launcher(monkeypatch, 700)
    with pytest.raises(driver.DriverError, match="cuLaunchKernel failed") as raised:
        launcher(7, 8)
    assert raised.value.result == 700 and len(calls) == 1


@pytest.mark.parametrize("current, expected", [(0, [0xC2]), (0xAB, [])])
def test_ensure_context_sets_the_primary_one_only_where_the_thread_has_none(monkeypatch, current, expected):
    """A thread with no current context (the autograd engine's worker, first thing) gets device 2's
    primary context and keeps it; a thread that has one is left alone."""
    import ctypes
    set_calls = []

    def get_current(out):
        ctypes.cast(out, ctypes.POINTER(ctypes.c_void_p))[0] = current or None
        return 0
    monkeypatch.setattr(driver, "lib", lambda: types.SimpleNamespace(
        cuCtxGetCurrent=get_current, cuCtxSetCurrent=lambda ctx: set_calls.append(ctx) or 0))
    monkeypatch.setattr(driver, "primary_context", lambda ordinal: 0xC0 + ordinal)
    driver.ensure_context(2)
    assert set_calls == expected
