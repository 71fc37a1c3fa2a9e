"""The public call's host path on a GPU: plan-cache hits compute what misses compute, causal
alignment, the torch operators under torch.compile / torch.export / CUDA graphs, streams, and
a fresh process finding its kernel in the compile cache without rendering or compiling.

Host cost per call is measured by the bench suite (`facodegen bench --suite overhead`), not here."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings

import pytest

from facodegen.ops import api
from facodegen.verify.reference import attention_reference, check, check_lse

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs torch with CUDA")]

SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
ARCHS = ["sm80", "sm90"] if SM90 else ["sm80"]


def _qkv(b, sq, sk, hq, hkv, d, dtype=torch.bfloat16, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return tuple(torch.randn(b, s, h, d, device="cuda", dtype=dtype, generator=g)
                 for s, h in ((sq, hq), (sk, hkv), (sk, hkv)))


def _np(x):
    return x.float().cpu().numpy()


def _check(out, lse, q, k, v, causal, scale=None):
    o_ref, lse_ref = attention_reference(_np(q), _np(k), _np(v), causal=causal, softmax_scale=scale)
    ok, msg = check(_np(out), o_ref, "bf16" if q.dtype == torch.bfloat16 else "fp16")
    assert ok, msg
    if lse is not None:
        ok, msg = check_lse(lse.cpu().numpy(), lse_ref)
        assert ok, msg


@pytest.mark.parametrize("arch", ARCHS)
def test_hits_compute_what_misses_compute(arch):
    """Several keys in turns, each called three times with fresh inputs and poisoned outputs:
    the first call builds a plan, the next two launch from it with other pointers."""
    cases = [dict(shape=(2, 300, 300, 8, 2, 128), causal=True), dict(shape=(1, 17, 1000, 4, 4, 64), causal=False),
             dict(shape=(3, 1000, 17, 4, 1, 128), causal=True, return_lse=True),
             dict(shape=(1, 1, 513, 8, 2, 96), causal=False, softmax_scale=0.3)]
    for round_ in range(3):
        for i, c in enumerate(cases):
            q, k, v = _qkv(*c["shape"], seed=100 * round_ + i)
            out = torch.full_like(q, float("nan"))
            lse = torch.full((q.shape[0], q.shape[2], q.shape[1]), float("nan"), device="cuda") \
                if c.get("return_lse") else None
            result = api.attention(q, k, v, causal=c["causal"], softmax_scale=c.get("softmax_scale"), out=out,
                                   lse_out=lse, return_lse=bool(lse is not None), arch=arch)
            torch.cuda.synchronize()
            _check(out, lse, q, k, v, c["causal"], c.get("softmax_scale"))
            assert (result[0] if isinstance(result, tuple) else result) is out


def test_hits_allocate_out_and_lse_like_misses():
    """Results made by a hit (out like q, the LSE from the plan's template) hold the right values."""
    for seed in range(3):
        q, k, v = _qkv(2, 200, 300, 8, 2, 128, seed=seed)
        out, lse = api.attention(q, k, v, causal=True, return_lse=True)
        torch.cuda.synchronize()
        assert out.shape == q.shape and out.stride() == q.stride() and lse.shape == (2, 8, 200)
        _check(out, lse, q, k, v, True)


def test_mixed_libraries_are_refused_by_name():
    import cupy
    q, k, v = _qkv(1, 64, 64, 2, 2, 64)
    api.attention(q, k, v)
    with pytest.raises(TypeError, match="k is a cupy array"):
        api.attention(q, cupy.asarray(k.float().cpu().numpy()).astype(cupy.float16), v)
    with pytest.raises(TypeError, match="k is a NumPy array"):
        api.attention(q, k.float().cpu().numpy(), v)


@pytest.mark.parametrize("arch", ARCHS)
def test_a_strided_view_after_a_contiguous_call(arch):
    """Same shape, other strides (q a slice of a wider buffer): a miss, not a wrong hit."""
    q, k, v = _qkv(2, 256, 256, 8, 8, 128)
    api.attention(q, k, v, arch=arch)
    wide = torch.randn(2, 256, 16, 128, device="cuda", dtype=torch.bfloat16)
    qs = wide[:, :, ::2]
    out = api.attention(qs, k, v, arch=arch)
    torch.cuda.synchronize()
    _check(out, None, qs, k, v, False)


def test_a_view_offset_by_8_bytes_is_refused():
    q, k, v = _qkv(1, 128, 128, 4, 4, 128)
    api.attention(q, k, v)
    flat = torch.randn(q.numel() + 8, device="cuda", dtype=torch.bfloat16)
    shifted = flat[4:4 + q.numel()].view(q.shape)
    with pytest.raises(ValueError, match="16-byte aligned"):
        api.attention(shifted, k, v)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("sq,sk", [(100, 300), (300, 100), (17, 17), (1, 50)])
def test_top_left_alignment_is_sdpa_is_causal(arch, sq, sk):
    q, k, v = _qkv(2, sq, sk, 4, 2, 64, seed=sq + sk)
    out, lse = api.attention(q, k, v, causal=True, causal_alignment="top_left", return_lse=True, arch=arch)
    torch.cuda.synchronize()
    qd, kd, vd = (x.double().transpose(1, 2) for x in (q, k, v))
    kd, vd = kd.repeat_interleave(2, dim=1), vd.repeat_interleave(2, dim=1)
    scores = qd @ kd.transpose(-1, -2) / 8.0
    scores = scores.masked_fill(torch.ones(sq, sk, dtype=torch.bool, device="cuda").triu(1), float("-inf"))
    ref = (torch.softmax(scores, -1) @ vd).transpose(1, 2)
    err = ((out.double() - ref).norm() / ref.norm()).item()
    assert err < 1e-2, err
    ref_lse = torch.logsumexp(scores, -1)
    assert torch.allclose(lse.double(), ref_lse, atol=1e-3, rtol=1e-3)


def test_another_stream_runs_there():
    q, k, v = _qkv(2, 512, 512, 8, 8, 128)
    api.attention(q, k, v, causal=True)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        out = torch.full_like(q, float("nan"))
        torch.cuda._sleep(2_000_000)        # the launch must queue behind this on `side`
        api.attention(q, k, v, causal=True, out=out)
    side.synchronize()
    _check(out, None, q, k, v, True)


def test_requires_grad_records_the_backward():
    """An input that requires grad makes the call autograd's (the generated backward); under
    no_grad the same call records nothing."""
    q, k, v = _qkv(1, 64, 64, 2, 2, 64)
    q.requires_grad_(True)
    out = api.attention(q, k, v)
    assert out.requires_grad and out.grad_fn is not None
    out.float().square().sum().backward()
    assert q.grad is not None and bool(torch.isfinite(q.grad).all()) and bool(q.grad.abs().sum() > 0)
    with torch.no_grad():
        assert not api.attention(q, k, v).requires_grad


def test_torch_compile_fullgraph_no_warning():
    q, k, v = _qkv(2, 333, 333, 8, 2, 128)

    def layer(q, k, v):
        out, lse = api.attention(q * 1.0, k, v, causal=True, return_lse=True)
        return out.float().sum(-1), lse

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiled = torch.compile(layer, fullgraph=True)
        got = compiled(q, k, v)
    dynamo = [str(w.message) for w in caught if "dynamo" in w.filename or "graph break" in str(w.message).lower()]
    assert not dynamo, dynamo
    want = layer(q, k, v)
    torch.cuda.synchronize()
    assert torch.allclose(got[0], want[0], atol=1e-2) and torch.equal(got[1], want[1])


def test_torch_compile_with_out_and_top_left():
    q, k, v = _qkv(1, 64, 200, 4, 4, 64)

    def f(q, k, v):
        out = torch.empty_like(q)
        api.attention(q, k, v, causal=True, causal_alignment="top_left", out=out)
        return out

    got = torch.compile(f, fullgraph=True)(q, k, v)
    torch.cuda.synchronize()
    assert torch.equal(got, f(q, k, v))


def test_torch_export():
    q, k, v = _qkv(1, 128, 128, 4, 2, 128)

    class Attention(torch.nn.Module):
        def forward(self, q, k, v):
            return api.attention(q, k, v, causal=True)

    program = torch.export.export(Attention(), (q, k, v))
    assert "facodegen.attention" in str(program.graph)
    assert torch.equal(program.module()(q, k, v), Attention()(q, k, v))


@pytest.mark.parametrize("arch", ARCHS)
def test_cuda_graph_capture_and_replay(arch):
    q, k, v = _qkv(2, 384, 384, 8, 2, 128)
    static_out = torch.empty_like(q)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        api.attention(q, k, v, causal=True, out=static_out, arch=arch)   # warm: the plan exists
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        api.attention(q, k, v, causal=True, out=static_out, arch=arch)
    for seed in range(3):
        fresh = _qkv(2, 384, 384, 8, 2, 128, seed=seed + 7)
        for dst, src in zip((q, k, v), fresh):
            dst.copy_(src)
        static_out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        _check(static_out, None, q, k, v, True)


def test_fresh_process_reads_the_compile_cache_without_compiling(tmp_path):
    """A second process with the same cache dir finds the kernel through the spec index: no
    compile line, and its first call is fast (the number itself is reported by the bench)."""
    script = tmp_path / "first_call.py"
    script.write_text(
        "import time, torch, facodegen\n"
        "q, k, v = (torch.randn(1, 512, 8, 128, device='cuda', dtype=torch.bfloat16) for _ in range(3))\n"
        "torch.cuda.synchronize()\n"
        "t = time.perf_counter(); facodegen.attention(q, k, v, causal=True); torch.cuda.synchronize()\n"
        "print(f'first_call_ms {1e3 * (time.perf_counter() - t):.1f}')\n"
        "print('cupy imported' if 'cupy' in __import__('sys').modules else 'no cupy')\n")
    env = dict(os.environ, FACODEGEN_QUIET="0")
    runs = [subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=300)
            for _ in range(2)]
    for r in runs:
        assert r.returncode == 0, r.stderr
    assert "compiling" not in runs[1].stderr, runs[1].stderr
    assert "no cupy" in runs[1].stdout
    print(runs[1].stdout)
