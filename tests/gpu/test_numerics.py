"""Numerics of the generated kernels on a GPU, against the float64 NumPy reference.

Every shipped default spec the GPU can run (sm80 kernels on compute capability 8.0 and newer,
sm90 kernels on 9.0 only), on random shapes: seqlen 1, 17, 127, 1000, seqlen_q != seqlen_k both
ways (causal rows with no visible key), GQA and MQA, a non-default softmax_scale. Outputs and LSE
are poisoned with NaN before each launch, so an element the kernel never writes fails the check.
Then a few non-default specs, the zero-copy and stream semantics of the API, strided inputs and
outputs, determinism, and the argument errors.

bf16 inputs come from torch (CuPy has no bfloat16), fp16 inputs from CuPy, so both adapters of
facodegen.ops.api are exercised. Kernels are compiled once per spec and reused (api caches them).
"""

from __future__ import annotations

import re

import numpy as np
import pytest

from facodegen.verify.reference import attention_reference, check, check_lse, random_qkv
from facodegen.spec import KernelSpec, default_fp8_specs, default_specs


def _gpu() -> tuple[bool, str]:
    try:
        from facodegen.runtime.compiler import gpu_available
    except Exception:  # noqa: BLE001
        gpu_available = None
    if gpu_available is not None:
        return gpu_available()
    try:
        import cupy
        n = cupy.cuda.runtime.getDeviceCount()
        return (n > 0, f"{n} CUDA device(s)")
    except Exception as err:  # noqa: BLE001
        return False, f"no CUDA GPU ({type(err).__name__}: {err})"


HAVE_GPU, GPU_WHY = _gpu()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not HAVE_GPU, reason=f"needs a CUDA GPU: {GPU_WHY}")]

if HAVE_GPU:
    import cupy
    _cc = str(cupy.cuda.Device().compute_capability)      # "90" on the H200, "80" on the A100
    CC = (int(_cc[:-1]), int(_cc[-1]))
else:
    cupy = None
    CC = (0, 0)

try:
    import torch
    HAVE_TORCH = bool(HAVE_GPU and torch.cuda.is_available())
except Exception:  # noqa: BLE001
    torch = None
    HAVE_TORCH = False


def arch_supported(arch: str) -> bool:
    return CC >= (8, 0) if arch == "sm80" else CC == (9, 0)


def attention(*args, **kwargs):
    from facodegen.ops.api import attention as attn
    return attn(*args, **kwargs)


def spec_kwargs(spec: KernelSpec) -> dict:
    """The spec's fields as a call's overrides (KernelSpec.launch_fields)."""
    return spec.launch_fields()


# ------------------------------------------------------------------------------------------------
# one case: fresh inputs, poisoned outputs, launch, check O and LSE against float64
# ------------------------------------------------------------------------------------------------

def _lib(dtype: str) -> str:
    return "torch" if dtype == "bf16" else "cupy"


def _inputs(shape, head_dim, dtype, lib, seed=None):
    b, sq, sk, hq, hkv = shape
    if lib == "torch":
        if not HAVE_TORCH:
            pytest.skip("bf16 inputs need torch (CuPy has no bfloat16)")
        return random_qkv(b, sq, sk, hq, hkv, head_dim, dtype, seed=seed, xp=torch, device="cuda")
    return random_qkv(b, sq, sk, hq, hkv, head_dim, dtype, seed=seed, xp=cupy)


def _poisoned(q, lib):
    b, sq, hq, _ = q.shape
    if lib == "torch":
        return (torch.full_like(q, float("nan")),
                torch.full((b, hq, sq), float("nan"), dtype=torch.float32, device=q.device))
    return cupy.full(q.shape, cupy.nan, dtype=q.dtype), cupy.full((b, hq, sq), cupy.nan, dtype=cupy.float32)


def _ptr(x):
    return x.data_ptr() if hasattr(x, "data_ptr") else x.data.ptr


def _sync():
    if cupy is not None:
        cupy.cuda.runtime.deviceSynchronize()


def run_case(spec: KernelSpec, shape, scale=None, seed=None, lib=None, shape_k=None) -> str:
    """Launch spec on one random problem and assert O and LSE; returns the check messages.
    ``shape_k(k)`` may reshape the score distribution by returning a new K (same shape and kind)."""
    lib = lib or _lib(spec.dtype)
    q, k, v = _inputs(shape, spec.head_dim, spec.dtype, lib, seed)
    if shape_k is not None:
        k = shape_k(k)
    out, lse_out = _poisoned(q, lib)
    o, lse = attention(q, k, v, causal=spec.causal, softmax_scale=scale, return_lse=True, out=out,
                       lse_out=lse_out, **spec_kwargs(spec))
    assert _ptr(o) == _ptr(out) and _ptr(lse) == _ptr(lse_out), "out=/lse_out= must be written in place"
    _sync()
    ref_o, ref_lse = attention_reference(q, k, v, spec.causal, scale)
    ok_o, msg_o = check(out, ref_o, spec.dtype)
    ok_l, msg_l = check_lse(lse_out, ref_lse)
    where = f"{spec.variant} shape(b,sq,sk,hq,hkv)={shape} scale={scale}"
    assert ok_o and ok_l, f"{where}: O {msg_o}; LSE {msg_l}"
    empty = np.isneginf(ref_lse)                 # rows with no visible key: O exactly 0
    if empty.any():
        from facodegen.verify.reference import to_float64
        got = to_float64(out).transpose(0, 2, 1, 3)[empty]
        assert (got == 0).all(), f"{where}: rows with no visible key must be 0"
    return f"{where}: {msg_o}; {msg_l}"


# (batch, seqlen_q, seqlen_k, heads_q, heads_kv), softmax_scale
SHAPES = [
    ((2, 1, 1, 2, 2), None),            # seqlen 1
    ((1, 17, 17, 4, 2), None),          # GQA, a ragged tile
    ((2, 127, 127, 2, 1), 0.3),         # MQA, non-default scale
    ((1, 1000, 1000, 2, 2), None),      # several tiles, ragged last tile
    ((1, 127, 300, 4, 4), None),        # seqlen_q < seqlen_k
    ((2, 300, 127, 2, 2), 0.05),        # seqlen_q > seqlen_k: causal rows with no visible key
    ((1, 17, 1000, 2, 1), None),        # few queries, many keys (decode-like)
    ((1, 1000, 17, 4, 2), 1.0),         # many queries, few keys
]
SHORT = [SHAPES[i] for i in (0, 2, 3, 4, 5)]

DEFAULT_SPECS = [s for s in default_specs()]


@pytest.mark.parametrize("spec", DEFAULT_SPECS, ids=lambda s: s.variant)
def test_default_spec(spec):
    if not arch_supported(spec.arch):
        pytest.skip(f"{spec.arch} kernels do not run on compute capability {CC[0]}.{CC[1]}")
    for shape, scale in SHAPES:
        run_case(spec, shape, scale)


NON_DEFAULT = [
    # arch, head_dim, dtype, causal, overrides
    ("sm80", 128, "bf16", False, {"stages": 1}),
    ("sm80", 64, "fp16", True, {"stages": 3}),
    ("sm80", 128, "bf16", True, {"block_n": 32}),
    ("sm80", 128, "fp16", False, {"block_n": 128, "num_warps": 8}),
    ("sm80", 96, "bf16", False, {"q_in_regs": True, "num_warps": 8}),
    ("sm80", 64, "bf16", True, {"q_in_regs": True, "block_n": 32}),
    ("sm80", 128, "fp16", True, {"block_m": 64}),
    ("sm90", 128, "bf16", False, {"pingpong": False}),
    ("sm90", 128, "fp16", True, {"pingpong": False}),
    ("sm90", 128, "bf16", False, {"intra_wg_overlap": False}),
    ("sm90", 64, "bf16", True, {"intra_wg_overlap": False}),
    ("sm90", 128, "bf16", True, {"persistent": False}),
    ("sm90", 256, "fp16", False, {"persistent": False}),
    ("sm90", 128, "bf16", False, {"consumer_warpgroups": 1}),
    ("sm90", 128, "bf16", True, {"stages": 3}),
    ("sm90", 128, "bf16", True, {"rescale_under_qk": False}),
    ("sm90", 256, "fp16", False, {"rescale_under_qk": True}),
    ("sm90", 256, "bf16", True, {"anchor_softmax": True}),
    ("sm90", 128, "bf16", True, {"softmax_chains": 2}),
    ("sm90", 64, "fp16", False, {"softmax_chains": 1}),
    ("sm80", 128, "bf16", True, {"softmax_chains": 4}),
    ("sm80", 64, "fp16", False, {"softmax_chains": 8}),
    ("sm90", 64, "bf16", True, {"consumer_warpgroups": 1, "ctas_per_sm": 2}),
    ("sm90", 64, "fp16", True, {"consumer_warpgroups": 1, "ctas_per_sm": 3, "block_n": 64}),
    ("sm90", 64, "bf16", False, {"consumer_warpgroups": 1, "ctas_per_sm": 3, "block_n": 96}),
    ("sm90", 128, "fp16", False, {"consumer_warpgroups": 1, "ctas_per_sm": 2, "block_n": 128, "stages": 1,
                                  "separate_o": False}),
    ("sm90", 256, "bf16", False, {"o_in_v": True}),
    ("sm90", 256, "fp16", True, {"o_in_v": True}),
    ("sm90", 256, "bf16", True, {"o_in_v": True, "persistent": False}),
    ("sm90", 128, "bf16", False, {"o_in_v": True, "pingpong": True, "block_n": 64}),
    ("sm90", 256, "fp16", False, {"o_in_v": True, "persistent": False}),
    ("sm90", 128, "bf16", True, {"pingpong": True, "uniform_wg": True}),    # the head_dim-128 causal rule up to 1k
    # the sequence-length rules with two P buffers (spec.seqlen_rule_fields)
    ("sm90", 128, "fp16", True, {"block_n": 128, "pingpong": True, "uniform_wg": True, "p_buffers": 2}),
    ("sm90", 128, "bf16", False, {"block_n": 144, "uniform_wg": True, "p_buffers": 2}),
    ("sm90", 256, "bf16", True, {"block_n": 64, "o_in_v": True, "uniform_wg": True, "p_buffers": 2, "rebuild_q_desc": True}),
    ("sm90", 256, "fp16", True, {"o_in_v": True, "uniform_wg": True, "p_buffers": 2, "rebuild_q_desc": True}),
    ("sm90", 256, "bf16", False, {"o_in_v": True, "uniform_wg": True, "p_buffers": 2, "rebuild_q_desc": True}),
    ("sm90", 256, "bf16", False, {"block_n": 64, "o_in_v": True, "uniform_wg": True, "p_buffers": 2, "rebuild_q_desc": True}),
    ("sm90", 256, "fp16", True, {"o_in_v": True, "uniform_wg": True}),
    ("sm90", 128, "fp16", True, {"o_in_v": True, "block_n": 176}),
    ("sm90", 128, "bf16", True, {"block_n": 144, "uniform_wg": True, "p_buffers": 2}),
    # Q descriptors rebuilt per step off the rules: one P buffer, no uniform_wg
    ("sm90", 256, "bf16", True, {"rebuild_q_desc": True}),
    ("sm90", 128, "bf16", False, {"block_n": 128, "p_buffers": 2, "rebuild_q_desc": True}),
    ("sm90", 128, "bf16", False, {"cluster_m": 2}),
    ("sm90", 256, "fp16", False, {"cluster_m": 2, "persistent": False}),
    ("sm90", 128, "fp16", False, {"cluster_m": 2, "block_n": 128, "pingpong": True}),
    ("sm90", 128, "bf16", True, {"uniform_wg": True}),
    ("sm90", 128, "bf16", True, {"poly_exp2_tiles": 4}),
    ("sm90", 64, "fp16", False, {"poly_exp2_tiles": 16}),     # every exp2 on the FMA pipe
    ("sm90", 256, "bf16", True, {"poly_exp2_tiles": 3}),
    ("sm80", 128, "bf16", True, {"poly_exp2_tiles": 2}),
    ("sm90", 128, "bf16", True, {"optimistic_max": True}),
    ("sm90", 64, "fp16", False, {"optimistic_max": True}),
    ("sm90", 256, "bf16", False, {"optimistic_max": True}),
    ("sm90", 128, "bf16", True, {"optimistic_max": True, "intra_wg_overlap": False}),
    # tiles from the counter without causal, and causal tiles every gridDim.x-th
    ("sm90", 128, "bf16", False, {"dynamic_scheduler": True}),
    ("sm90", 64, "fp16", True, {"dynamic_scheduler": False}),
    # K/V prefetched into L2 ahead of the loads (the prefetch must never stand in for a load)
    ("sm90", 128, "bf16", False, {"l2_prefetch": 2}),
    ("sm90", 256, "fp16", True, {"l2_prefetch": 1}),
    # schedule=fa1 (FlashAttention-1) and each of its switches flipped alone (issue 7)
    ("sm80", 128, "bf16", False, {"schedule": "fa1"}),
    ("sm80", 128, "bf16", True, {"schedule": "fa1"}),
    ("sm80", 64, "fp16", True, {"schedule": "fa1", "loop_order": "q_outer"}),
    ("sm80", 128, "bf16", True, {"schedule": "fa1", "warp_split": "q"}),
    ("sm80", 96, "fp16", False, {"schedule": "fa1", "rescale": "once"}),
    ("sm80", 256, "bf16", True, {"schedule": "fa1", "loop_order": "q_outer", "warp_split": "q", "rescale": "once"}),
    ("sm80", 192, "fp16", False, {"schedule": "fa1", "warp_split": "q", "rescale": "once"}),
]


def _non_default_id(case):
    arch, d, dtype, causal, overrides = case
    knobs = "-".join(f"{k}={v}" for k, v in overrides.items())
    return f"{arch}-hd{d}-{dtype}-{'causal' if causal else 'full'}-{knobs}"


@pytest.mark.parametrize("case", NON_DEFAULT, ids=_non_default_id)
def test_non_default_spec(case):
    arch, d, dtype, causal, overrides = case
    if not arch_supported(arch):
        pytest.skip(f"{arch} kernels do not run on compute capability {CC[0]}.{CC[1]}")
    spec = KernelSpec(arch=arch, head_dim=d, dtype=dtype, causal=causal, **overrides)
    for shape, scale in SHORT:
        run_case(spec, shape, scale)


@pytest.mark.parametrize("head_dim,persistent", [(128, True), (256, True), (256, False)])
def test_cluster_multicast_many_tiles_per_cta(head_dim, persistent):
    """cluster_m=2: every CTA of the persistent grid runs several tile pairs (the K/V ring's
    barriers cycle through many laps across both CTAs), odd m-block counts padded, GQA."""
    if not arch_supported("sm90"):
        pytest.skip(f"sm90 kernels do not run on compute capability {CC[0]}.{CC[1]}")
    spec = KernelSpec(arch="sm90", head_dim=head_dim, dtype="bf16", cluster_m=2, persistent=persistent)
    from facodegen.ops import api
    resident = api._prepare(spec, 0).resident_ctas
    assert resident % 2 == 0 and 2 <= resident <= api.device_info(0).sms, resident
    # 256 tiles over <= 132 CTAs; 11 m-blocks (padded to 12) with a ragged last K/V block
    for shape in [(2, 2048, 2048, 8, 4), (3, 1384, 777, 6, 2)]:
        run_case(spec, shape)


@pytest.mark.parametrize("fields", [dict(head_dim=64, causal=True, consumer_warpgroups=2),
                                    dict(head_dim=128, causal=True, pingpong=True),
                                    dict(head_dim=128, causal=True, pingpong=True, o_in_v=True),
                                    dict(head_dim=128, block_n=128),
                                    dict(head_dim=64, persistent=False),
                                    dict(head_dim=64, causal=True, consumer_warpgroups=1, ctas_per_sm=3, block_n=64)],
                         ids=lambda f: ",".join(f"{k}={v}" for k, v in f.items()))
def test_two_q_buffers_many_tiles_per_cta(fields):
    """q_stages=2: each CTA runs many tiles, so both Q buffers go round several laps (their parities
    flip every other tile) on the static and the dynamic (causal) schedule; causal tiles whose rows
    see no key (seqlen_q > seqlen_k) sit between tiles that have some, and GQA."""
    if not arch_supported("sm90"):
        pytest.skip(f"sm90 kernels do not run on compute capability {CC[0]}.{CC[1]}")
    spec = KernelSpec(arch="sm90", dtype="bf16", q_stages=2, **fields)
    for shape in [(4, 2048, 2048, 8, 4), (3, 1384, 777, 6, 2), (2, 300, 127, 2, 2)]:
        run_case(spec, shape)


@pytest.mark.parametrize("fields", [dict(head_dim=128, causal=True, pingpong=True),
                                    dict(head_dim=128, causal=False, block_n=128),
                                    dict(head_dim=128, causal=True, block_n=144, q_stages=1),
                                    dict(head_dim=64, causal=False, consumer_warpgroups=2, block_n=128)],
                         ids=lambda f: ",".join(f"{k}={v}" for k, v in f.items()))
def test_two_p_buffers(fields):
    """p_buffers=2: the steady steps alternate between two P buffers and a tile whose step count is
    odd copies the last P back for the tail, so tiles of 1, 2, 3 and many blocks (seqlen_k 1 to
    2048, causal tiles of every length), partial blocks and GQA all pass; then scores that raise the
    row max on most steps, so the optimistic softmax redoes them into the buffer it writes."""
    if not arch_supported("sm90"):
        pytest.skip(f"sm90 kernels do not run on compute capability {CC[0]}.{CC[1]}")
    if not HAVE_TORCH:
        pytest.skip("bf16 inputs need torch")
    spec = KernelSpec(arch="sm90", dtype="bf16", p_buffers=2, **fields)
    for shape in [(4, 2048, 2048, 8, 4), (3, 1000, 257, 6, 2), (2, 300, 400, 2, 2), (1, 17, 17, 2, 2), (2, 1, 1, 2, 1)]:
        run_case(spec, shape)
    s = 1000
    growth = 1.0 + 40.0 * (1.0 - torch.arange(s, device="cuda", dtype=torch.float32) / s)
    run_case(spec, (2, s, s, 2, 2), lib="torch",
             shape_k=lambda k: (k.float() * growth[None, :, None, None]).to(torch.bfloat16))


@pytest.mark.parametrize("arch,head_dim,causal", [("sm80", 128, False), ("sm80", 64, True), ("sm90", 128, False),
                                                   ("sm90", 128, True), ("sm90", 64, False), ("sm90", 256, True)])
@pytest.mark.parametrize("mode", ["lazy", "exact", "optimistic"])
def test_rescale_with_a_row_max_that_keeps_growing(arch, head_dim, causal, mode):
    """Scores that grow toward key 0 (the last block each tile visits): every K/V block raises the
    row max by more than lazy_rescale's slack of 2^8, so O is rescaled on most steps, not just the
    first (on randn inputs the max settles after a block or two and the lazy branch is rarely taken);
    with optimistic_max, most steps fail the row-sum bound and are redone with the true max."""
    if not arch_supported(arch):
        pytest.skip(f"{arch} kernels do not run on compute capability {CC[0]}.{CC[1]}")
    if not HAVE_TORCH:
        pytest.skip("bf16 inputs need torch")
    if mode == "optimistic" and arch != "sm90":
        pytest.skip("optimistic_max is an sm90 knob")
    knobs = {"lazy_rescale": mode == "lazy"}
    if arch == "sm90":
        knobs["optimistic_max"] = mode == "optimistic"
    spec = KernelSpec(arch=arch, head_dim=head_dim, dtype="bf16", causal=causal, **knobs)
    s = 1000
    growth = 1.0 + 40.0 * (1.0 - torch.arange(s, device="cuda", dtype=torch.float32) / s)   # key j: x (1 + 40 (1 - j/s))
    run_case(spec, (2, s, s, 2, 2), lib="torch",
             shape_k=lambda k: (k.float() * growth[None, :, None, None]).to(torch.bfloat16))


@pytest.mark.parametrize("arch", ["sm80", "sm90"])
@pytest.mark.parametrize("lazy", [False, True])
def test_lse_does_not_drift_over_key_blocks_at_large_logits(arch, lazy):
    """Logits in the thousands (fp16 inputs x16) over 8,192 keys: one key dominates each row and the
    row max settles early, so every later K/V step keeps it. The rescale factor of a kept max must
    be exactly 1: when it was one FFMA (row_max*scale_log2 - max_scaled) it was max_scaled's rounding
    error, and l, so the LSE, drifted by up to half an ulp of max*scale_log2 per step (up to 0.04 over 64
    steps here), which the backward's P = e^(s - LSE) turns into gradient errors. The LSE must stay
    within the scores' own float32 error of float64's."""
    if not arch_supported(arch):
        pytest.skip(f"{arch} kernels do not run on compute capability {CC[0]}.{CC[1]}")
    if not HAVE_TORCH:
        pytest.skip("needs torch")
    import facodegen
    g = torch.Generator(device="cuda").manual_seed(5)
    q = (16 * torch.randn(1, 16, 2, 128, device="cuda", generator=g)).half()
    k, v = ((16 * torch.randn(1, 8192, 2, 128, device="cuda", generator=g)).half() for _ in range(2))
    _, lse = facodegen.attention(q, k, v, softmax_scale=1.0, return_lse=True, arch=arch, lazy_rescale=lazy)
    scores = torch.einsum("bqhd,bkhd->bhqk", q.double(), k.double())
    exact = torch.logsumexp(scores, dim=-1)
    err = (lse.double() - exact).abs()
    bound = 2e-3 + 4e-7 * exact.abs()       # the scores' float32 error (~1e-3 at 11,000); the drift reached 3.7e-6 |lse|
    assert bool((err <= bound).all()), f"LSE error {err.max().item():.3e} at |lse| ~{exact.abs().max().item():.0f}"


def test_poly_exp2_matches_exp2():
    """common/ptx.cuh.j2's poly_exp2 (2^x on the FMA pipe) against float64 2^x over the range the
    softmax feeds it: x <= 8 (lazy rescale's slack, fp8's offset) down to -126 within 1e-4, rounding
    boundaries included; below that under 2^-126 (a denormal the FTZ arithmetic reads as 0), and
    -inf (a masked score) exactly 0, so a row with no visible key keeps a zero sum."""
    from facodegen.codegen.render import context, environment
    spec = KernelSpec(arch=_native_arch())
    header = "".join(environment().get_template(name).render(**context(spec))
                     for name in ("common/types.cuh.j2", "common/ptx.cuh.j2"))
    kernel = cupy.RawKernel(header + r"""
extern "C" __global__ void poly(const float* x, float* y, int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = poly_exp2(x[i]);
}""", "poly", options=("-std=c++17",))

    def run(x):
        x = np.asarray(x, dtype=np.float32)
        y = cupy.full(x.size, np.nan, dtype=cupy.float32)
        kernel(((x.size + 255) // 256,), (256,), (cupy.asarray(x), y, np.int32(x.size)))
        return cupy.asnumpy(y).astype(np.float64)

    rng = np.random.default_rng()
    j = np.arange(-126, 9, dtype=np.float64)
    x = np.concatenate([rng.uniform(-126.0, 8.0, 200_000), j, j[1:] - 2.0 ** -20, j + 0.5]).astype(np.float32)
    y = run(x)
    rel = np.abs(y / np.exp2(x.astype(np.float64)) - 1.0)
    assert rel.max() < 1.0e-4, (x[rel.argmax()], y[rel.argmax()])
    low = run([-np.inf, -1e30, -200.0, -127.0, -126.5])
    assert (low >= 0).all() and (low < 2.0 ** -126).all() and low[0] == 0.0, low


def _native_arch() -> str:
    return "sm90" if CC == (9, 0) else "sm80"


def test_api_default_spec_on_this_gpu():
    """No spec fields at all: the API picks arch and budget GPU from the device."""
    for d, dtype, causal in ((128, "bf16", True), (256, "fp16", False), (64, "bf16", False)):
        lib = _lib(dtype)
        q, k, v = _inputs((2, 300, 300, 4, 2), d, dtype, lib)
        out, lse = attention(q, k, v, causal=causal, return_lse=True)
        _sync()
        ref_o, ref_lse = attention_reference(q, k, v, causal)
        ok, msg = check(out, ref_o, dtype)
        assert ok, msg
        ok, msg = check_lse(lse, ref_lse)
        assert ok, msg


def test_reference_torch_matches_numpy_reference():
    if not HAVE_TORCH:
        pytest.skip("needs torch")
    from facodegen.bench import reference_torch
    q, k, v = random_qkv(2, 130, 70, 4, 2, 64, "bf16", xp=torch, device="cuda")
    for causal in (False, True):
        ref = attention_reference(q, k, v, causal)[0]
        got = reference_torch(q, k, v, causal).cpu().numpy()
        assert np.abs(got - ref).max() < 1e-12


# ------------------------------------------------------------------------------------------------
# zero-copy, strides, streams, determinism
# ------------------------------------------------------------------------------------------------

def test_torch_zero_copy_and_out():
    if not HAVE_TORCH:
        pytest.skip("needs torch")
    arch = _native_arch()
    q, k, v = random_qkv(2, 256, 256, 4, 4, 128, "bf16", xp=torch, device="cuda")
    before = [x.clone() for x in (q, k, v)]
    o = attention(q, k, v, causal=True, arch=arch)
    assert isinstance(o, torch.Tensor) and o.device == q.device and o.dtype == q.dtype and o.shape == q.shape
    o2, lse = attention(q, k, v, causal=True, arch=arch, return_lse=True)
    assert isinstance(lse, torch.Tensor) and lse.dtype == torch.float32 and lse.shape == (2, 4, 256)
    out = torch.full_like(q, float("nan"))
    ret = attention(q, k, v, causal=True, arch=arch, out=out)
    assert ret.data_ptr() == out.data_ptr()
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(before, (q, k, v))), "inputs must not be modified"
    assert torch.equal(o, out) and torch.equal(o, o2)
    ok, msg = check(out, attention_reference(q, k, v, True)[0], "bf16")
    assert ok, msg


def test_cupy_zero_copy_and_out():
    arch = _native_arch()
    q, k, v = random_qkv(1, 200, 333, 8, 2, 64, "fp16", xp=cupy)
    o = attention(q, k, v, arch=arch)
    assert isinstance(o, cupy.ndarray) and o.dtype == q.dtype and o.shape == q.shape
    out = cupy.full(q.shape, cupy.nan, dtype=q.dtype)
    ret = attention(q, k, v, arch=arch, out=out)
    assert ret.data.ptr == out.data.ptr
    _sync()
    ok, msg = check(out, attention_reference(q, k, v)[0], "fp16")
    assert ok, msg


@pytest.mark.parametrize("arch", ["sm80", "sm90"])
def test_strided_inputs_and_output(arch):
    """Q/K/V as views of one packed (b, s, 3, h, d) tensor; O as a view with padded heads."""
    if not arch_supported(arch):
        pytest.skip(f"{arch} kernels do not run on compute capability {CC[0]}.{CC[1]}")
    if not HAVE_TORCH:
        pytest.skip("needs torch")
    b, s, h, d = 2, 257, 4, 128
    qkv = torch.randn(b, s, 3, h, d, device="cuda", dtype=torch.bfloat16)
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    buf = torch.full((b, s, h, d + 64), float("nan"), device="cuda", dtype=torch.bfloat16)
    out = buf[..., :d]
    for causal in (False, True):
        buf.fill_(float("nan"))
        attention(q, k, v, causal=causal, arch=arch, out=out)
        torch.cuda.synchronize()
        ok, msg = check(out, attention_reference(q, k, v, causal)[0], "bf16")
        assert ok, f"causal={causal}: {msg}"
        assert torch.isnan(buf[..., d:]).all(), "the kernel wrote outside O's view"


def _spin_cupy(cycles: int):
    kernel = cupy.RawKernel(r'''
    extern "C" __global__ void spin(long long cycles) {
        long long t0 = clock64();
        while (clock64() - t0 < cycles) { }
    }''', "spin")
    kernel((1,), (1,), (np.int64(cycles),))


@pytest.mark.parametrize("arch", ["sm80", "sm90"])
def test_torch_non_default_stream(arch):
    """Inputs are written on a side stream after a 20 ms spin; the kernel must run after them,
    on that stream (launched on any other stream it would read the NaN-poisoned q)."""
    if not arch_supported(arch):
        pytest.skip(f"{arch} kernels do not run on compute capability {CC[0]}.{CC[1]}")
    if not HAVE_TORCH:
        pytest.skip("needs torch")
    q_src, k, v = random_qkv(1, 512, 512, 4, 4, 128, "bf16", xp=torch, device="cuda")
    q = torch.full_like(q_src, float("nan"))
    out = torch.full_like(q_src, float("nan"))
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        torch.cuda._sleep(40_000_000)           # ~20 ms at 2 GHz
        q.copy_(q_src)
        ret = attention(q, k, v, causal=True, arch=arch, out=out)
    side.synchronize()
    assert ret.data_ptr() == out.data_ptr()
    ok, msg = check(out, attention_reference(q_src, k, v, True)[0], "bf16")
    assert ok, f"not ordered on the caller's torch stream: {msg}"


@pytest.mark.parametrize("arch", ["sm80", "sm90"])
def test_cupy_non_default_stream(arch):
    if not arch_supported(arch):
        pytest.skip(f"{arch} kernels do not run on compute capability {CC[0]}.{CC[1]}")
    q_src, k, v = random_qkv(1, 512, 512, 4, 4, 64, "fp16", xp=cupy)
    q = cupy.full(q_src.shape, cupy.nan, dtype=q_src.dtype)
    out = cupy.full(q_src.shape, cupy.nan, dtype=q_src.dtype)
    _sync()
    side = cupy.cuda.Stream(non_blocking=True)
    with side:
        _spin_cupy(40_000_000)
        q[...] = q_src
        attention(q, k, v, causal=True, arch=arch, out=out)
    side.synchronize()
    ok, msg = check(out, attention_reference(q_src, k, v, True)[0], "fp16")
    assert ok, f"not ordered on the caller's CuPy stream: {msg}"


@pytest.mark.parametrize("arch", ["sm80", "sm90"])
def test_deterministic(arch):
    """Two launches on the same inputs give the same bits (a difference means a race)."""
    if not arch_supported(arch):
        pytest.skip(f"{arch} kernels do not run on compute capability {CC[0]}.{CC[1]}")
    q, k, v = random_qkv(2, 1000, 1000, 8, 2, 128, "fp16", xp=cupy)
    results = []
    for _ in range(3):
        out = cupy.full(q.shape, cupy.nan, dtype=q.dtype)
        lse = cupy.full((2, 8, 1000), cupy.nan, dtype=cupy.float32)
        attention(q, k, v, causal=True, arch=arch, out=out, lse_out=lse, return_lse=True)
        results.append((out, lse))
    _sync()
    for out, lse in results[1:]:
        assert bool((out.view(cupy.uint16) == results[0][0].view(cupy.uint16)).all())
        assert bool((lse.view(cupy.uint32) == results[0][1].view(cupy.uint32)).all())


# ------------------------------------------------------------------------------------------------
# argument errors: ValueError/TypeError whose message names the argument
# ------------------------------------------------------------------------------------------------

def _raises(pattern, *args, **kwargs):
    with pytest.raises((ValueError, TypeError)) as info:
        attention(*args, **kwargs)
    assert re.search(pattern, str(info.value), re.IGNORECASE), \
        f"error message does not name {pattern!r}: {info.value}"


def test_bad_inputs_torch():
    if not HAVE_TORCH:
        pytest.skip("needs torch")
    q, k, v = random_qkv(1, 64, 64, 4, 4, 128, "bf16", xp=torch, device="cuda")
    _raises(r"dtype", q.float(), k.float(), v.float())
    _raises(r"dtype", q, k.half(), v.half())
    _raises(r"\bk\b|\bv\b", q, k, v[:, :32])
    _raises(r"head_dim", q, k[..., :64].contiguous(), v[..., :64].contiguous())
    # any multiple of 8 in [8, 256] runs (padded to the next tile); 84 and 264 do not
    for d in (84, 264):
        qd, kd, vd = (torch.randn(1, 64, 4, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        _raises(r"head_dim", qd, kd, vd)
    wide = torch.randn(1, 64, 4, 256, device="cuda", dtype=torch.bfloat16)
    _raises(r"head_dim|contiguous|stride", wide[..., ::2], k, v)
    q3 = torch.randn(1, 64, 3, 128, device="cuda", dtype=torch.bfloat16)
    k2 = torch.randn(1, 64, 2, 128, device="cuda", dtype=torch.bfloat16)
    _raises(r"heads", q3, k2, k2.clone())
    _raises(r"\bk\b|device|cpu", q, k.cpu(), v.cpu())
    _raises(r"\bq\b|numpy|host", q.float().cpu().numpy(), k, v)
    _raises(r"seqlen", q[:, :0], k, v)
    _raises(r"seqlen", q, k[:, :0], v[:, :0])
    _raises(r"\bout\b", q, k, v, out=torch.empty_like(q[:, :32]))
    _raises(r"\bout\b", q, k, v, out=torch.empty_like(q, dtype=torch.float16))
    _raises(r"lse_out", q, k, v, lse_out=torch.empty(1, 4, 64, device="cuda", dtype=torch.bfloat16))
    _raises(r"lse_out", q, k, v, lse_out=torch.empty(1, 64, 4, device="cuda", dtype=torch.float32))
    _raises(r"causal", q, k, v, causal=1)


def test_bad_inputs_cupy_and_host():
    q, k, v = random_qkv(1, 64, 64, 4, 4, 64, "fp16", xp=cupy)
    _raises(r"dtype", q.astype(cupy.float32), k.astype(cupy.float32), v.astype(cupy.float32))
    _raises(r"\bq\b|numpy|host", cupy.asnumpy(q), k, v)
    _raises(r"\bk\b|numpy|host", q, cupy.asnumpy(k), v)
    _raises(r"heads", q[:, :, :3], k[:, :, :2], v[:, :, :2])
    _raises(r"head_dim|contiguous|stride", cupy.asarray(q[..., ::-1]), k, v)
    _raises(r"seqlen", q[:, :0], k, v)
    _raises(r"\bq\b|4-d|shape", q[0], k, v)
    _raises(r"\bq\b|cupy|torch", [[1.0]], k, v)
    if HAVE_TORCH:
        _raises(r"\bk\b|kind|cupy|torch", q, torch.as_tensor(k, device="cuda"), v)
    _raises(r"arch|sm90|compute capability|spec", q, k, v, arch="sm90" if CC != (9, 0) else "sm70")


def test_spec_field_errors_name_the_knob():
    q, k, v = random_qkv(1, 64, 64, 4, 4, 128, "fp16", xp=cupy)
    arch = _native_arch()
    _raises(r"block_n", q, k, v, arch=arch, block_n=17)
    _raises(r"stages", q, k, v, arch=arch, stages=9)


# ------------------------------------------------------------------ fp8 (e4m3, sm90)

FP8_SHAPES = [   # (batch, seqlen_q, seqlen_k, heads_q, heads_kv)
    (1, 128, 192, 2, 2),
    (2, 1000, 1000, 4, 2),      # odd seqlen, GQA
    (1, 17, 333, 2, 1),         # MQA, seqlen_q < seqlen_k
    (1, 333, 17, 2, 2),         # causal: rows with no visible key
    (1, 1, 1, 1, 1),
]


def _fp8_case(spec: KernelSpec, shape, descale_per_head: bool = False, seed: int = 0, key_growth=None,
              poison_workspace: bool = False):
    """(kernel O, LSE, reference O, LSE, FA3's O or None) on randn bf16 quantised to e4m3;
    ``key_growth`` (seqlen_k factors) scales each key before quantising. ``poison_workspace``
    (stream_k): the split tiles' slots hold NaN before the launch, and every flag must be 0 after it."""
    from facodegen.ops.api import prepare, transpose_v
    from facodegen.runtime.launch import stream_k_flags
    from facodegen.ops.quantize import quantize_e4m3
    from facodegen.verify.reference import attention_reference_fp8
    b, sq, sk, hq, hkv = shape
    d = spec.head_dim
    g = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, generator=g)
               for s, h in ((sq, hq), (sk, hkv), (sk, hkv)))
    if key_growth is not None:
        k = (k.float() * key_growth[None, :, None, None]).to(torch.bfloat16)
    (q8, qd), (k8, kd), (v8, vd) = quantize_e4m3(q), quantize_e4m3(k), quantize_e4m3(v)
    if descale_per_head:
        spread = torch.rand(b, hkv, device="cuda", generator=g) + 0.5
        kd, vd = (kd * spread).contiguous(), (vd * spread.flip(-1)).contiguous()
    v_arg = transpose_v(v8) if spec.v_layout == "transposed" else v8
    out_t = torch.bfloat16 if spec.out_dtype == "bf16" else torch.float16
    out = torch.full((b, sq, hq, d), float("nan"), device="cuda", dtype=out_t)
    lse = torch.full((b, hq, sq), float("nan"), device="cuda", dtype=torch.float32)
    fields = spec.launch_fields()
    call = prepare(q8, k8, v_arg, causal=spec.causal, return_lse=True, out=out, lse_out=lse, q_descale=qd,
                   k_descale=kd, v_descale=vd, **fields)
    assert call.spec == spec
    first_flag, flags = stream_k_flags(spec, call.grid[0])
    if poison_workspace and flags:
        call.workspace[:first_flag] = float("nan")
    call()
    torch.cuda.synchronize()
    if poison_workspace and flags:
        assert not call.workspace[first_flag:first_flag + flags].view(torch.int32).any(), "a stream-K flag left raised"
    o_ref, lse_ref = attention_reference_fp8(q8, k8, v8, qd, kd, vd, causal=spec.causal)
    fa3 = None
    try:
        from flash_attn_interface import flash_attn_func
        per_kv = lambda x: x.reshape(1, 1).expand(b, hkv).contiguous() if x.numel() == 1 else x  # noqa: E731
        fa3 = flash_attn_func(q8, k8, v8, causal=spec.causal, q_descale=per_kv(qd), k_descale=per_kv(kd),
                              v_descale=per_kv(vd))
        fa3 = (fa3[0] if isinstance(fa3, tuple) else fa3).float().cpu().numpy()
    except Exception:  # noqa: BLE001 (FA3 absent or without fp8: the 3e-2 bound still applies)
        fa3 = None
    return out.float().cpu().numpy(), lse.cpu().numpy(), o_ref, lse_ref, fa3


def _rel(x, ref) -> float:
    return float(np.linalg.norm(np.nan_to_num(x - ref, nan=1e9)) / max(np.linalg.norm(ref), 1e-30))


FP8_SPECS = default_fp8_specs()


@pytest.mark.skipif(not (HAVE_TORCH and arch_supported("sm90")), reason="fp8 needs torch and an sm90 GPU")
@pytest.mark.parametrize("spec", FP8_SPECS, ids=lambda s: s.variant)
def test_fp8_default_spec(spec):
    _check_fp8_shapes(spec, seed0=0)


def _check_fp8_shapes(spec, seed0: int) -> None:
    """Every FP8_SHAPES case (the second with per-head descales): no NaN, O within FP8_TOLERANCE and
    1.1x FlashAttention-3's error where it runs, LSE close."""
    from facodegen.verify.reference import FP8_TOLERANCE
    for i, shape in enumerate(FP8_SHAPES):
        o, lse, o_ref, lse_ref, fa3 = _fp8_case(spec, shape, descale_per_head=(i == 1), seed=seed0 + i)
        assert not np.isnan(o).any(), (shape, "NaN in O")
        rel = _rel(o, o_ref)
        assert rel <= FP8_TOLERANCE, (shape, rel)
        if fa3 is not None and o_ref.size > 1000:
            assert rel <= 1.1 * _rel(fa3, o_ref) + 1e-3, (shape, rel, _rel(fa3, o_ref))
        ok, msg = check_lse(lse, lse_ref, atol=1e-2, rtol=1e-3)
        assert ok, (shape, msg)


@pytest.mark.skipif(not (HAVE_TORCH and arch_supported("sm90")), reason="fp8 needs torch and an sm90 GPU")
@pytest.mark.parametrize("head_dim,causal", [(256, False), (256, True), (128, False), (128, True), (64, False),
                                             (64, True), (96, False), (192, True)])
def test_fp8_vt_in_place(head_dim, causal):
    """vt_in_place: V lands in its V^T slot (rank-5 TMA boxes of 32 keys) and is transposed there, with
    three stages where they fit: the default shapes (odd lengths, a ragged last block, GQA, per-head
    descales), within FP8_TOLERANCE and 1.1x FlashAttention-3's error where it runs."""
    _check_fp8_shapes(KernelSpec(arch="sm90", dtype="fp8", head_dim=head_dim, causal=causal, vt_in_place=True),
                      seed0=20)


@pytest.mark.skipif(not (HAVE_TORCH and arch_supported("sm90")), reason="fp8 needs torch and an sm90 GPU")
@pytest.mark.parametrize("fields", [dict(head_dim=128, block_n=224), dict(head_dim=128, out_dtype="fp16"),
                                    dict(head_dim=64, causal=True, consumer_warpgroups=1, ctas_per_sm=2),
                                    dict(head_dim=128, pingpong=False, intra_wg_overlap=False, persistent=False),
                                    dict(head_dim=192, block_n=160, v_layout="transposed"),
                                    dict(head_dim=128, causal=True, poly_exp2_tiles=6),
                                    dict(head_dim=128, causal=True, optimistic_max=True),
                                    dict(head_dim=64, optimistic_max=True, v_layout="transposed"),
                                    dict(head_dim=256, causal=True, optimistic_max=True),
                                    dict(head_dim=128, q_in_regs=True),
                                    dict(head_dim=256, block_n=64, causal=True, q_in_regs=True),
                                    dict(head_dim=128, q_in_regs=True, v_layout="transposed", intra_wg_overlap=False),
                                    dict(head_dim=256, block_n=128, producer_regs=24, consumer_regs=240, persistent=True, uniform_wg=True),
                                    dict(head_dim=256, block_n=128, producer_regs=24, consumer_regs=240, persistent=True, uniform_wg=True,
                                         causal=True),
                                    dict(head_dim=128, causal=True, q_stages=2),
                                    dict(head_dim=128, q_stages=2, q_in_regs=True),
                                    dict(head_dim=128, producer_regs=24, consumer_regs=240, p_buffers=2),
                                    dict(head_dim=128, producer_regs=24, consumer_regs=240, p_buffers=2, causal=True),
                                    dict(head_dim=128, causal=True, rebuild_q_desc=True),
                                    dict(head_dim=256, rebuild_q_desc=True, v_layout="transposed"),
                                    dict(head_dim=256, l2_prefetch=2), dict(head_dim=128, causal=True, l2_prefetch=1),
                                    dict(head_dim=64, l2_prefetch=4, v_layout="transposed")],
                         ids=lambda f: ",".join(f"{k}={v}" for k, v in f.items()))
def test_fp8_non_default_spec(fields):
    from facodegen.verify.reference import FP8_TOLERANCE
    spec = KernelSpec(arch="sm90", dtype="fp8", **fields)
    o, _, o_ref, _, _ = _fp8_case(spec, (2, 1000, 1000, 4, 2), seed=7)
    assert not np.isnan(o).any() and _rel(o, o_ref) <= FP8_TOLERANCE


@pytest.mark.skipif(not (HAVE_TORCH and arch_supported("sm90")), reason="fp8 needs torch and an sm90 GPU")
@pytest.mark.parametrize("fields", [dict(head_dim=128), dict(head_dim=64), dict(head_dim=256, dynamic_scheduler=True),
                                    dict(head_dim=128, causal=True, dynamic_scheduler=False)],
                         ids=lambda f: ",".join(f"{k}={v}" for k, v in f.items()))
def test_fp8_many_tiles_per_cta(fields):
    """More tiles than CTAs (176-288 tiles on at most 132 CTAs), so the persistent CTAs go on past
    their first tile, through the counter (dynamic_scheduler, the default at head_dim 64/128) or the
    static order; odd lengths, a ragged last K/V block, GQA."""
    from facodegen.verify.reference import FP8_TOLERANCE
    spec = KernelSpec(arch="sm90", dtype="fp8", **fields)
    for shape in [(2, 2048, 512, 8, 4), (3, 1384, 777, 6, 2)]:
        o, _, o_ref, _, _ = _fp8_case(spec, shape, seed=11)
        err = _rel(o, o_ref)
        assert not np.isnan(o).any() and err <= FP8_TOLERANCE, (shape, err)


@pytest.mark.skipif(not (HAVE_TORCH and arch_supported("sm90")), reason="fp8 needs torch and an sm90 GPU")
@pytest.mark.parametrize("fields", [dict(head_dim=256), dict(head_dim=128), dict(head_dim=64),
                                    dict(head_dim=256, v_layout="transposed"), dict(head_dim=128, q_in_regs=True),
                                    dict(head_dim=128, producer_regs=24, consumer_regs=240, p_buffers=2)],
                         ids=lambda f: ",".join(f"{k}={v}" for k, v in f.items()))
def test_fp8_stream_k(fields):
    """stream_k: more tiles than CTAs and not a whole number of waves, so the last waves are cut
    along the keys and split tiles merge their PARTIAL pieces' O, m, l from the workspace (poisoned
    with NaN first: a merge that read an unwritten slot would show). After each call every flag is
    back at 0, for the next launch. On 132 SMs: one to three waves, shares of one to two tiles,
    seqlen_k of 4 to 16 blocks and a ragged last one; GQA; one K/V block per tile (17 keys) cuts
    nothing."""
    from facodegen.verify.reference import FP8_TOLERANCE
    spec = KernelSpec(arch="sm90", dtype="fp8", dynamic_scheduler=False, stream_k=True, **fields)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for shape in [(2, 2048, 1000, 8, 4), (3, 1384, 777, 6, 2), (1, 4096, 1000, 9, 3), (1, 4096, 2000, 13, 13),
                  (1, 2048, 17, 20, 4)]:
        b, sq, sk, hq, hkv = shape
        tiles = -(-sq // spec.block_m) * hq * b
        assert tiles > sms and tiles % sms, (shape, tiles, "the shape must not be whole waves")
        o, lse, o_ref, lse_ref, _ = _fp8_case(spec, shape, seed=13, poison_workspace=True)
        err = _rel(o, o_ref)
        assert not np.isnan(o).any() and err <= FP8_TOLERANCE, (shape, err)
        ok, msg = check_lse(lse, lse_ref, atol=1e-2, rtol=1e-3)
        assert ok, (shape, msg)


def _check_fp8_multi_tile(spec, seed: int) -> None:
    """Shapes of several tiles per CTA (stream-K's split tiles at head_dim 256 non-causal; empty
    causal tiles with 3000 queries over 1000 keys), O, LSE and the stream-K workspace poisoned with
    NaN: no NaN, O within FP8_TOLERANCE and 1.1x FlashAttention-3's error where it runs, LSE close."""
    from facodegen.verify.reference import FP8_TOLERANCE
    for shape in [(2, 2048, 1000, 8, 4), (1, 4096, 2000, 13, 13), (1, 3000, 1000, 16, 4)]:
        o, lse, o_ref, lse_ref, fa3 = _fp8_case(spec, shape, seed=seed, poison_workspace=True)
        err = _rel(o, o_ref)
        assert not np.isnan(o).any() and err <= FP8_TOLERANCE, (shape, err)
        if fa3 is not None:
            assert err <= 1.1 * _rel(fa3, o_ref) + 1e-3, (shape, err, _rel(fa3, o_ref))
        ok, msg = check_lse(lse, lse_ref, atol=1e-2, rtol=1e-3)
        assert ok, (shape, msg)


@pytest.mark.skipif(not (HAVE_TORCH and arch_supported("sm90")), reason="fp8 needs torch and an sm90 GPU")
@pytest.mark.parametrize("head_dim,causal", [(256, False), (256, True), (128, False), (128, True), (64, False),
                                             (64, True)])
def test_fp8_defer_o_store(head_dim, causal):
    """defer_o_store: a tile's O and LSE are stored under the next tile's first Q K^T, the last tile's
    after the loop, an empty tile's (causal, seqlen_q > seqlen_k) in the mainloop's else branch: the
    default shapes, then shapes of several tiles per CTA (O and LSE poisoned with NaN; head_dim 256
    non-causal with stream-K's split tiles), within FP8_TOLERANCE and 1.1x FlashAttention-3's error."""
    spec = KernelSpec(arch="sm90", dtype="fp8", head_dim=head_dim, causal=causal, defer_o_store=True)
    _check_fp8_shapes(spec, seed0=40)
    _check_fp8_multi_tile(spec, seed=41)


@pytest.mark.skipif(not (HAVE_TORCH and arch_supported("sm90")), reason="fp8 needs torch and an sm90 GPU")
@pytest.mark.parametrize("fields", [dict(head_dim=256), dict(head_dim=256, causal=True),
                                    dict(head_dim=256, intra_wg_overlap=False), dict(head_dim=128, causal=True),
                                    dict(head_dim=64)],
                         ids=lambda f: ",".join(f"{k}={v}" for k, v in f.items()))
def test_fp8_lazy_rescale(fields):
    """lazy_rescale (fp8): rows keep a stale max within 2^0.75 of the true one and a warp none of
    whose rows moved skips O's rescale: the default shapes, then shapes of several tiles per CTA (O
    and LSE poisoned with NaN; stream-K's split tiles merge O, m, l relative to stale maxes; empty
    causal tiles), within FP8_TOLERANCE and 1.1x FlashAttention-3's error, LSE to 1e-2."""
    spec = KernelSpec(arch="sm90", dtype="fp8", lazy_rescale=True, **fields)
    _check_fp8_shapes(spec, seed0=60)
    _check_fp8_multi_tile(spec, seed=61)


@pytest.mark.skipif(not (HAVE_TORCH and arch_supported("sm90")), reason="fp8 needs torch and an sm90 GPU")
@pytest.mark.parametrize("fields", [dict(head_dim=256, optimistic_max=True), dict(head_dim=128, optimistic_max=True),
                                    dict(head_dim=128), dict(head_dim=128, producer_regs=24, consumer_regs=240, p_buffers=2),
                                    dict(head_dim=256, lazy_rescale=True), dict(head_dim=64, lazy_rescale=True)],
                         ids=lambda f: ",".join(f"{k}={v}" for k, v in f.items()))
def test_fp8_row_max_that_keeps_growing(fields):
    """Keys scaled up toward key 0 (the last block a tile visits): the row max rises on most steps,
    beyond the optimistic step's slack of 2^2.7, so it must redo those steps at the new max before p
    passes e4m3's 448 (no NaN, O within the fp8 bound, and within 1.1x FA3's error on the same inputs
    if FA3 is there). The exact step (head_dim 128's default) takes the new max every step; the lazy
    one (head_dim 256's default) each time it rises by more than 2^0.75."""
    from facodegen.verify.reference import FP8_TOLERANCE
    spec = KernelSpec(arch="sm90", dtype="fp8", **fields)
    s = 1000
    growth = 1.0 + 6.0 * (1.0 - torch.arange(s, device="cuda", dtype=torch.float32) / s)
    o, _, o_ref, _, fa3 = _fp8_case(spec, (2, s, s, 2, 2), seed=3, key_growth=growth)
    err = _rel(o, o_ref)
    assert not np.isnan(o).any() and err <= FP8_TOLERANCE, err
    if fa3 is not None:
        assert err <= 1.1 * _rel(fa3, o_ref) + 1e-3, (err, _rel(fa3, o_ref))


@pytest.mark.skipif(not (HAVE_TORCH and arch_supported("sm90")), reason="fp8 needs torch and an sm90 GPU")
@pytest.mark.parametrize("shape", [(2, 1000, 300, 4, 2), (1, 17, 17, 2, 2), (3, 1, 1, 2, 1), (1, 300, 1000, 2, 2)])
def test_fp8_q_in_regs_odd_shapes(shape):
    """q_in_regs frees the Q buffer per warp once its rows are in registers, also in tiles with no
    visible key (causal, 1000 queries over 300 keys) and with a partial Q tile (17, 1)."""
    from facodegen.verify.reference import FP8_TOLERANCE
    spec = KernelSpec(arch="sm90", dtype="fp8", head_dim=128, causal=True, block_n=128, q_in_regs=True)
    o, lse, o_ref, lse_ref, _ = _fp8_case(spec, shape, seed=11)
    assert not np.isnan(o).any() and _rel(o, o_ref) <= FP8_TOLERANCE, (shape, _rel(o, o_ref))
    ok, msg = check_lse(lse, lse_ref, atol=1e-2, rtol=1e-3)
    assert ok, (shape, msg)


@pytest.mark.skipif(not (HAVE_TORCH and arch_supported("sm90")), reason="fp8 needs torch and an sm90 GPU")
def test_fp8_bad_arguments():
    q = torch.zeros(1, 64, 2, 128, device="cuda", dtype=torch.float8_e4m3fn)
    one = torch.ones((), device="cuda", dtype=torch.float32)
    with pytest.raises(TypeError, match="k has dtype"):
        attention(q, torch.zeros(1, 64, 2, 128, device="cuda", dtype=torch.bfloat16), q)
    with pytest.raises(TypeError, match="q_descale has dtype"):
        attention(q, q, q, q_descale=one.double())
    with pytest.raises(ValueError, match="k_descale has shape"):
        attention(q, q, q, k_descale=torch.ones(3, 3, device="cuda"))
    with pytest.raises(TypeError, match="v_descale must be a float32"):
        attention(q, q, q, v_descale=1.0)
    with pytest.raises(ValueError, match="sm90"):
        attention(q, q, q, arch="sm80")
    with pytest.raises(ValueError, match="v has shape"):
        attention(q, q, q, v_layout="transposed")


# ------------------------------------------------------------------ tune and bench on the GPU

@pytest.mark.skipif(not HAVE_TORCH, reason="tune times through torch CUDA events")
@pytest.mark.parametrize("arch,dtype", [("sm80", "bf16"), ("sm90", "bf16"), ("sm90", "fp8")])
def test_tune_checks_and_times_a_few_candidates(arch, dtype):
    """A small real tune round: every live candidate is checked against the reference and timed,
    and the winner is one of them (catches drift between tune and bench's launch helpers)."""
    if not arch_supported(arch):
        pytest.skip(f"{arch} kernels need a newer GPU than compute capability {CC}")
    from facodegen import bench
    from facodegen.tuning import tune as T
    cands = T.enumerate_candidates(arch, 64, dtype, causal=True, max_candidates=3)
    T.compile_candidates(cands, jobs=1, sm=None)
    c = bench.cell(64, True, 333, 2, 4, dtype)
    T.time_candidates(cands, c, arch, timing={"warmup": 1, "groups": 2, "calls": 2}, final_top=1, final_reps=1)
    timed = [x for x in cands if x.alive and x.times_ms]
    assert timed and any(x.is_default for x in timed), [(x.label, x.reason) for x in cands[:3]]
    assert all(x.err is not None and x.err < 3e-2 for x in timed)
    winner, default = T.pick_winner(cands)
    assert winner in timed and default is not None


@pytest.mark.skipif(not (HAVE_TORCH and arch_supported("sm90")), reason="fp8 bench cells need torch and an sm90 GPU")
def test_bench_fp8_cell_checks_facodegen_in_both_v_layouts():
    from facodegen import bench
    c = bench.cell(128, True, 1000, 1, 4, "fp8")
    row = bench.run_cell(c, peers=("cudnn",), timing={"warmup": 1, "groups": 2, "calls": 2},
                         variants={"facodegen row": "sm90:", "facodegen vt": "sm90:v_layout=transposed"})
    for name in ("facodegen row", "facodegen vt"):
        r = row["results"][name]
        assert r["tflops"] and r["err"] < 3e-2, (name, r)
    assert row["results"]["cudnn"]["note"].startswith("skipped")


@pytest.mark.skipif(not (HAVE_TORCH and arch_supported("sm90")), reason="bench cells need torch and an sm90 GPU")
def test_bench_interleaved_variants_are_checked_and_timed_apart():
    from facodegen import bench
    c = bench.cell(128, False, 1000, 2, 4, "bf16")
    row = bench.run_cell(c, peers=(), timing={"warmup": 1, "groups": 3, "calls": 2, "interleave": True},
                         variants={"facodegen a": "sm90:", "facodegen b": "sm90:block_n=64",
                                   "facodegen bad": "sm90:block_n=7"})
    a, b = row["results"]["facodegen a"], row["results"]["facodegen b"]
    assert a["tflops"] and b["tflops"] and a["err"] < 2e-2 and b["err"] < 2e-2
    assert a["variant"] != b["variant"] and a["min_ms"] <= a["ms"] <= a["max_ms"]
    assert row["results"]["facodegen bad"]["tflops"] is None and "block_n" in row["results"]["facodegen bad"]["note"]
