"""The launch paths the host-path work changed, on a GPU: driver.Launcher (ctypes, or CuPy's cuLaunchKernel
binding where CuPy is imported) from a thread that has not touched CUDA, CuPy plan-cache hits (no device switch when q's
device is current) and fp8 hits with descales given and left out. Each compares a hit's result
with the reference, like tests/gpu/test_host_path.py."""

from __future__ import annotations

import threading

import pytest

from facodegen.ops import api
from facodegen.verify.reference import attention_reference, check, check_lse

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs torch with CUDA")]

SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


def _qkv(shape, dtype=torch.float16, seed=0):
    b, sq, sk, hq, hkv, d = shape
    g = torch.Generator(device="cuda").manual_seed(seed)
    return tuple(torch.randn(b, s, h, d, device="cuda", dtype=dtype, generator=g)
                 for s, h in ((sq, hq), (sk, hkv), (sk, hkv)))


def _check(out, lse, q, k, v, causal, dtype="fp16", descales=(1.0, 1.0, 1.0)):
    qn, kn, vn = ((x.float() * s).cpu().numpy() for x, s in zip((q, k, v), descales))
    o_ref, lse_ref = attention_reference(qn, kn, vn, causal=causal)
    ok, msg = check(torch.as_tensor(out).float().cpu().numpy(), o_ref, dtype)
    assert ok, msg
    if lse is not None:
        ok, msg = check_lse(torch.as_tensor(lse).cpu().numpy(), lse_ref)
        assert ok, msg


def test_a_hit_from_a_new_thread_launches():
    """A thread that has not touched CUDA may have no current context: the launch makes the
    device's primary context current and tries again (driver.Launcher)."""
    q, k, v = _qkv((1, 256, 256, 8, 2, 128))
    api.attention(q, k, v, causal=True, out=torch.empty_like(q))    # the plan the thread's call finds
    out = torch.full_like(q, float("nan"))
    torch.cuda.synchronize()
    errors, misses = [], api._PLANS.misses

    def launch():
        try:
            api.attention(q, k, v, causal=True, out=out)
        except Exception as err:   # noqa: BLE001 (reported by the main thread)
            errors.append(err)
    thread = threading.Thread(target=launch)
    thread.start()
    thread.join()
    assert not errors, errors
    assert api._PLANS.misses == misses     # the thread's call was a hit: nothing there touched CUDA first
    torch.cuda.synchronize()
    _check(out, None, q, k, v, True)


def test_cupy_hits_compute_what_misses_compute():
    cupy = pytest.importorskip("cupy")
    for seed in range(3):
        q, k, v = (cupy.asarray(x) for x in _qkv((2, 200, 300, 8, 2, 128), seed=seed))
        out, lse = api.attention(q, k, v, causal=True, return_lse=True)
        cupy.cuda.Device().synchronize()
        assert out.shape == q.shape and out.dtype == q.dtype and out.strides == q.strides
        assert lse.shape == (2, 8, 200) and lse.dtype == cupy.float32
        _check(cupy.asnumpy(out), cupy.asnumpy(lse), *(torch.as_tensor(cupy.asnumpy(x)) for x in (q, k, v)), True)


def test_cupy_hits_on_another_device_than_the_current_one():
    cupy = pytest.importorskip("cupy")
    if cupy.cuda.runtime.getDeviceCount() < 2:
        pytest.skip("needs two GPUs")
    with cupy.cuda.Device(1):
        arrays = [tuple(cupy.asarray(x.cpu().numpy()) for x in _qkv((1, 128, 128, 4, 4, 64), seed=seed))
                  for seed in range(2)]
    for q, k, v in arrays:      # cuda:0 current: a miss, then a hit
        out = api.attention(q, k, v)
        assert out.device.id == 1
        with cupy.cuda.Device(1):
            cupy.cuda.Device().synchronize()
        _check(cupy.asnumpy(out), None, *(torch.as_tensor(cupy.asnumpy(x)) for x in (q, k, v)), False)


@pytest.mark.skipif(not SM90, reason="fp8 runs on sm90")
def test_fp8_hits_with_descales_given_and_left_out():
    q, k, v = _qkv((1, 256, 256, 8, 2, 128), dtype=torch.bfloat16)
    q8, k8, v8 = (x.to(torch.float8_e4m3fn) for x in (q, k, v))
    for round_ in range(2):     # a miss, then a hit, per way of passing the descales
        half = torch.tensor(0.5, device="cuda")
        out = api.attention(q8, k8, v8, causal=True, k_descale=half)
        torch.cuda.synchronize()
        _check(out, None, q8, k8, v8, True, "fp8", (1.0, 0.5, 1.0))
        out = api.attention(q8, k8, v8, causal=True)
        torch.cuda.synchronize()
        _check(out, None, q8, k8, v8, True, "fp8")
