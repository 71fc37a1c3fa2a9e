"""The generated backward on a GPU: dQ, dK, dV against float64 with FlashAttention-3's criterion
(the kernel's max error <= 2x the same-precision torch reference's + twice the dtype's rounding of
the float64 result), over FA3's seqlen pairs x MHA/GQA/MQA x causal x head dims x fp16/bf16;
NaN-poisoned gradient buffers; autograd through facodegen.attention against attention_backward
and against the op's register_autograd formula, and its host cost against SDPA's (issue #38);
and torch.compile(fullgraph=True) of a forward+backward step.

O and LSE fed to the backward are the float64 reference's (O rounded to the dtype), so this file
compiles backward kernels only (one per head_dim x dtype x causal, 20, in parallel up front) and
the forward kernels of the few autograd tests. Budget: < 2 minutes on an H200.
"""

from __future__ import annotations

import itertools
from concurrent.futures import ThreadPoolExecutor

import pytest

torch = pytest.importorskip("torch")

from facodegen.runtime.compiler import gpu_available  # noqa: E402
from facodegen.verify.fuzz import fa3_bound  # noqa: E402

HAVE_GPU, GPU_WHY = gpu_available()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not HAVE_GPU, reason=f"needs a CUDA GPU: {GPU_WHY}")]

import facodegen  # noqa: E402
from facodegen.ops import api, backward  # noqa: E402
from facodegen.spec.backward import BackwardSpec, default_backward_specs  # noqa: E402
from facodegen.verify.reference import sinks_gradient_reference  # noqa: E402

HEAD_DIMS = (64, 96, 128, 192, 256)
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
SEQLENS = ((1, 1), (239, 1), (113, 203), (1023, 1024), (128, 128))
HEADS = {"mha": (4, 4), "gqa": (4, 2), "mqa": (4, 1)}


@pytest.fixture(scope="module", autouse=True)
def precompiled():
    """Every shipped backward kernel for this GPU, compiled in parallel (NVRTC releases the GIL)."""
    info = api.device_info(torch.cuda.current_device())
    jobs = [(s.replace(gpu=info.budget_gpu), api.device_target("sm80", info)) for s in default_backward_specs()]
    if info.compute_capability == (9, 0):   # and the sm90 defaults (what arch=None runs there), both dQ paths
        jobs += [(BackwardSpec(arch="sm90", head_dim=s.head_dim, dtype=s.dtype, causal=s.causal, dq_tma_reduce=t),
                  api.device_target("sm90", info)) for s in default_backward_specs() for t in (False, True)]
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda job: backward.compile(job[0], sm=job[1], verbose=False), jobs))


def reference(q, k, v, do, causal, scale, upcast, hidden=None, softcap=0.0, sinks=None):
    """O, LSE and (dQ, dK, dV) by torch autograd: float64 (upcast) or FA3's same-precision reference
    (scores and P V in the inputs' dtype, softmax in float32). Bottom-right causal, GQA by repetition;
    ``hidden``: a (seqlen_q, seqlen_k) bool mask of the hidden scores instead (a sliding window's); ``softcap``:
    the logits c tanh(scores / c); ``sinks``: (heads_q,) logits in each row's denominator (the LSE includes them)."""
    q, k, v = (x.detach().clone().double() if upcast else x.detach().clone() for x in (q, k, v))
    for x in (q, k, v):
        x.requires_grad_(True)
    group = q.shape[2] // k.shape[2]
    kk, vv = (x.repeat_interleave(group, dim=2) for x in (k, v))
    scores = torch.einsum("bqhd,bkhd->bhqk", q, kk)
    scores = (scores if upcast else scores.float()) * scale
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    sq, sk = q.shape[1], k.shape[1]
    if hidden is not None:
        scores = scores.masked_fill(hidden, float("-inf"))
    elif causal:
        rows = torch.arange(sq, device=q.device)[:, None]
        cols = torch.arange(sk, device=q.device)[None, :]
        scores = scores.masked_fill(cols > rows + (sk - sq), float("-inf"))
    if sinks is not None:
        sink = sinks.to(scores.dtype)[None, :, None, None].expand(*scores.shape[:3], 1)
        lse = torch.logsumexp(torch.cat([scores, sink], dim=-1), dim=-1)
    else:
        lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse[..., None]).nan_to_num(0.0)
    out = torch.einsum("bhqk,bkhd->bqhd", probs if upcast else probs.to(v.dtype), vv)
    grads = torch.autograd.grad(out, (q, k, v), do.double() if upcast else do)
    return out.detach(), lse.detach(), grads


def check_grads(got, do, q, k, v, causal, scale, hidden=None, softcap=0.0, sinks=None):
    """FA3's criterion for each of dQ, dK, dV; returns a message per failure."""
    _, _, ref = reference(q, k, v, do, causal, scale, upcast=True, hidden=hidden, softcap=softcap, sinks=sinks)
    _, _, low = reference(q, k, v, do, causal, scale, upcast=False, hidden=hidden, softcap=softcap, sinks=sinks)
    failures = []
    for name, g, r, lo in zip(("dq", "dk", "dv"), got, ref, low):
        if not torch.isfinite(g).all():
            failures.append(f"{name} has non-finite values")
            continue
        err = (g.double() - r).abs().max().item()
        bound = fa3_bound(r, lo, g.dtype) + 1e-6
        if err > bound:
            failures.append(f"{name} max err {err:.3e} > bound {bound:.3e}")
    return failures


def make(batch, sq, sk, hq, hkv, d, dtype, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    rand = lambda *s: torch.randn(*s, generator=gen, device="cuda", dtype=torch.float32).to(dtype)  # noqa: E731
    return rand(batch, sq, hq, d), rand(batch, sk, hkv, d), rand(batch, sk, hkv, d), rand(batch, sq, hq, d)


def run_backward(q, k, v, do, causal, scale, poison=False, **knobs):
    out64, lse64, _ = reference(q, k, v, do, causal, scale, upcast=True)
    out, lse = out64.to(q.dtype), lse64.float().contiguous()
    kwargs = dict(knobs)
    if poison:
        kwargs.update({n: torch.full_like(x, float("nan")) for n, x in (("dq", q), ("dk", k), ("dv", v))})
    return facodegen.attention_backward(do, q, k, v, out, lse, causal=causal, softmax_scale=scale, **kwargs)


# One case per (seqlen pair, causal, head_dim, dtype), the head layout cycling through MHA/GQA/MQA;
# every head layout crossed with every seqlen pair and causal at head_dim 128 bf16 besides.
_GRID = [(sq, sk, causal, d, dt, list(HEADS)[i % 3])
         for i, ((sq, sk), causal, d, dt) in enumerate(itertools.product(SEQLENS, (False, True), HEAD_DIMS, DTYPES))]
_GRID += [(sq, sk, causal, 128, "bf16", h) for (sq, sk), causal, h in itertools.product(SEQLENS, (False, True), HEADS)
          if (sq, sk, causal, 128, "bf16", h) not in _GRID]


@pytest.mark.parametrize("sq, sk, causal, d, dt, heads", _GRID,
                         ids=[f"{sq}x{sk}-{'causal' if c else 'full'}-hd{d}-{dt}-{h}" for sq, sk, c, d, dt, h in _GRID])
def test_gradients_match_float64(sq, sk, causal, d, dt, heads):
    hq, hkv = HEADS[heads]
    batch = 2 if sq * sk < 100_000 else 1
    q, k, v, do = make(batch, sq, sk, hq, hkv, d, DTYPES[dt], seed=sq * 7 + sk * 13 + d)
    scale = d ** -0.5 if (sq + d) % 2 else 0.3     # the default and another scale
    got = run_backward(q, k, v, do, causal, scale, poison=(sq == 113))
    assert check_grads(got, do, q, k, v, causal, scale) == []


@pytest.mark.parametrize("causal", [False, True])
def test_strided_inputs_and_poisoned_outputs(causal):
    base = torch.randn(2, 97, 8, 128, device="cuda", dtype=torch.bfloat16)
    q = base[:, :, ::2]                                   # every other head: a head stride of 256
    k = torch.randn(2, 150, 2, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(2, 150, 2, 128, device="cuda", dtype=torch.bfloat16)
    do = torch.randn(2, 97, 4, 128, device="cuda", dtype=torch.bfloat16)
    got = run_backward(q, k, v, do, causal, 0.125, poison=True)
    assert check_grads(got, do, q, k, v, causal, 0.125) == []


@pytest.mark.parametrize("arch, knobs", [("sm80", {}), ("sm80", {"stages": 2, "key_warps": 4, "dq_row_warps": 2}),
                                         ("sm90", {}), ("sm90", {"dq_tma_reduce": True}),
                                         ("sm90", {"dq_tma_reduce": True, "do_stages": 1, "dp_lookahead": False})],
                         ids=["sm80", "sm80-st2-kw4-qw2", "sm90", "sm90-dqtma", "sm90-dqtma-dos1"])
@pytest.mark.parametrize("sq, sk, causal, d, heads", [(1023, 1024, True, 128, "gqa"), (239, 1, False, 64, "mha"),
                                                      (113, 2000, True, 256, "mqa"), (2048, 2048, False, 96, "mha"),
                                                      (777, 3000, False, 64, "gqa"), (501, 700, True, 192, "gqa")])
def test_deterministic_gradients_are_bit_identical_and_right(arch, knobs, sq, sk, causal, d, heads):
    """deterministic=True: dQ's fp32 adds in key-block order (sm90: and warpgroup 0's before 1's where
    both add into every column, head_dim 64), so three runs give the same bits (and each passes the
    criterion); many key blocks per query block (sk 2000: 16, sm90 head_dim 256: 32) make the turns count."""
    if arch == "sm90" and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the sm90 backward: a compute capability 9.0 GPU")
    if knobs.get("dq_row_warps") == 2 and d == 96:   # (96 columns of dQ do not split over 4 warps: FA2's 96 grid)
        knobs = {**knobs, "key_warps": 4, "dq_row_warps": 4}
    hq, hkv = HEADS[heads]
    q, k, v, do = make(2, sq, sk, hq, hkv, d, torch.bfloat16, seed=sq + sk + d)
    out64, lse64, _ = reference(q, k, v, do, causal, d ** -0.5, upcast=True)
    out, lse = out64.to(q.dtype), lse64.float().contiguous()
    runs = [facodegen.attention_backward(do, q, k, v, out, lse, causal=causal, deterministic=True, arch=arch, **knobs)
            for _ in range(3)]
    torch.cuda.synchronize()
    for other in runs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(runs[0], other))
    assert check_grads(runs[0], do, q, k, v, causal, d ** -0.5) == []


def test_autograd_is_deterministic_under_torch_use_deterministic_algorithms():
    q, k, v, do = make(2, 1000, 1000, 8, 2, 128, torch.bfloat16, seed=5)
    grads = []
    torch.use_deterministic_algorithms(True)
    try:
        for _ in range(2):
            leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
            facodegen.attention(*leaves, causal=True).backward(do)
            grads.append(leaves[0].grad)
    finally:
        torch.use_deterministic_algorithms(False)
    assert torch.equal(grads[0], grads[1])


@pytest.mark.parametrize("d, causal, heads", [(64, True, "gqa"), (128, False, "mha"), (256, True, "mqa")])
def test_autograd_through_attention_equals_attention_backward(d, causal, heads):
    hq, hkv = HEADS[heads]
    q, k, v, do = make(2, 300, 257, hq, hkv, d, torch.bfloat16, seed=d)
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
    out = facodegen.attention(*leaves, causal=causal)
    assert out.grad_fn is not None
    out.backward(do)
    with torch.no_grad():
        out2, lse = facodegen.attention(q, k, v, causal=causal, return_lse=True)
    dq, dk, dv = facodegen.attention_backward(do, q, k, v, out2, lse, causal=causal)
    assert torch.equal(out, out2)
    torch.testing.assert_close(leaves[0].grad, dq, atol=2e-2, rtol=2e-2)   # dQ: fp32 atomics, any order
    assert torch.equal(leaves[1].grad, dk) and torch.equal(leaves[2].grad, dv)
    assert check_grads((leaves[0].grad, leaves[1].grad, leaves[2].grad), do, q, k, v, causal, d ** -0.5) == []


def test_eager_autograd_equals_the_ops_formula():
    """The eager recording call (torch_op._Attention: plan launches, no dispatcher) against the
    op's register_autograd formula (what torch.compile traces) on one GQA problem: the same O and
    LSE, and under torch.use_deterministic_algorithms(True) the same dQ, dK, dV bits, which meet
    the float64 criterion; dO a strided view (the backward takes it contiguous)."""
    q, k, v, _ = make(2, 300, 257, 8, 2, 128, torch.bfloat16, seed=11)
    do = torch.randn(2, 8, 300, 128, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    eager = [x.clone().requires_grad_(True) for x in (q, k, v)]
    traced = [x.clone().requires_grad_(True) for x in (q, k, v)]
    torch.use_deterministic_algorithms(True)
    try:
        out, lse = facodegen.attention(*eager, causal=True, return_lse=True)
        assert type(out.grad_fn).__name__ == "_AttentionBackward" and not lse.requires_grad
        out.backward(do)
        op_out, op_lse = torch.ops.facodegen.attention(*traced, True, None, None, None, None, None, "")
        assert type(op_out.grad_fn).__name__ != "_AttentionBackward" and not op_lse.requires_grad
        op_out.backward(do)
    finally:
        torch.use_deterministic_algorithms(False)
    torch.cuda.synchronize()
    assert torch.equal(out, op_out) and torch.equal(lse, op_lse)
    for a, b in zip(eager, traced):
        assert torch.equal(a.grad, b.grad)
    assert check_grads([x.grad for x in eager], do, q, k, v, True, 128 ** -0.5) == []


def test_recording_host_cost_is_at_most_twice_sdpas():
    """Issue #38's bar: a facodegen.attention() call that records autograd costs the host at most
    2x what SDPA's does with autograd, on (1, 128, 8, 128) bf16 causal (the overhead suite's shape;
    scripts/host_cost_breakdown.py has the breakdown)."""
    from facodegen import bench
    q, k, v = (torch.randn(1, 128, 8, 128, device="cuda", dtype=torch.bfloat16).requires_grad_(True)
               for _ in range(3))
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    timing = {"warmup": 100, "calls": 1000, "repeats": 5, "chunk": 100}
    ours = bench.time_host_per_call(lambda: facodegen.attention(q, k, v, causal=True), torch.cuda.synchronize,
                                    **timing)["host_us"]
    sdpa = bench.time_host_per_call(lambda: torch.nn.functional.scaled_dot_product_attention(
        qt, kt, vt, is_causal=True), torch.cuda.synchronize, **timing)["host_us"]
    assert ours <= 2 * sdpa, f"facodegen.attention() recording autograd: {ours:.1f} µs, SDPA's {sdpa:.1f} µs"


def test_compiled_training_step_matches_eager():
    torch.manual_seed(0)

    class Block(torch.nn.Module):
        def __init__(self, dim=256, heads=4, kv_heads=2):
            super().__init__()
            self.heads, self.kv_heads, self.d = heads, kv_heads, dim // heads
            self.q = torch.nn.Linear(dim, dim, bias=False)
            self.kv = torch.nn.Linear(dim, 2 * kv_heads * self.d, bias=False)
            self.o = torch.nn.Linear(dim, dim, bias=False)

        def forward(self, x):
            b, s, _ = x.shape
            q = self.q(x).view(b, s, self.heads, self.d)
            k, v = self.kv(x).view(b, s, 2, self.kv_heads, self.d).unbind(2)
            return self.o(facodegen.attention(q, k, v, causal=True).reshape(b, s, -1))

    model = Block().cuda().to(torch.bfloat16)
    x = torch.randn(2, 200, 256, device="cuda", dtype=torch.bfloat16)

    def loss_of(model, x):
        return model(x).float().square().mean()

    def step(loss_fn):
        # The forward is compiled (fullgraph: no graph break around facodegen's op); AOTAutograd
        # compiles its backward, which .backward() runs (Dynamo does not trace autograd.grad itself).
        model.zero_grad(set_to_none=True)
        loss = loss_fn(model, x)
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters()]

    eager_loss, eager_grads = step(loss_of)
    compiled_loss, compiled_grads = step(torch.compile(loss_of, fullgraph=True))
    torch.testing.assert_close(compiled_loss, eager_loss, atol=1e-3, rtol=1e-3)
    for a, b in zip(compiled_grads, eager_grads):
        torch.testing.assert_close(a, b, atol=2e-2, rtol=2e-2)


def test_non_default_tiles_and_cupy():
    cupy = pytest.importorskip("cupy")
    q, k, v, do = make(1, 130, 190, 4, 2, 128, torch.float16, seed=3)
    ref = run_backward(q, k, v, do, True, 0.1)
    out64, lse64, _ = reference(q, k, v, do, True, 0.1, upcast=True)
    out, lse = out64.to(q.dtype), lse64.float().contiguous()
    small = facodegen.attention_backward(do, q, k, v, out, lse, causal=True, softmax_scale=0.1,
                                         block_m=64, block_n=64, num_warps=4)
    assert check_grads(small, do, q, k, v, True, 0.1) == []
    as_cupy = [cupy.asarray(x) for x in (do, q, k, v, out, lse)]
    dq, dk, dv = facodegen.attention_backward(*as_cupy, causal=True, softmax_scale=0.1)
    assert torch.equal(torch.as_tensor(dk, device="cuda"), ref[1])
    assert torch.equal(torch.as_tensor(dv, device="cuda"), ref[2])


# sm80 warp grids away from the default (key_warps, dq_row_warps: FlashAttention-2's d128 layout and others,
# at the head_dims whose default tile they split) and the 2-deep Q/dO ring (stages), causal and not, GQA
_GRID_WARPS = [(d, kw, qw, st, causal) for d, kw, qw, st in
               ((128, 4, 2, 1), (128, 2, 2, 1), (128, 4, 4, 1), (64, 4, 2, 1), (64, 2, 4, 1), (96, 4, 4, 1),
                (128, None, None, 2), (128, 4, 2, 2), (64, 4, 2, 2), (96, None, None, 2), (192, None, None, 2),
                (256, None, None, 2), (96, 4, 4, 1), (192, 2, 2, 1), (256, 2, 2, 1)) for causal in (False, True)]


@pytest.mark.parametrize("d, key_warps, dq_row_warps, stages, causal", _GRID_WARPS,
                         ids=[f"hd{d}-kw{kw}-qw{qw}-st{st}-{'causal' if c else 'full'}" for d, kw, qw, st, c in _GRID_WARPS])
def test_sm80_warp_grids_match_float64_and_the_default_dk_dv(d, key_warps, dq_row_warps, stages, causal):
    """Another warp grid, or the 2-deep ring, changes which warp computes an element or when its operands
    land, not the order of its sums: dK and dV bit-identical to the default's, dQ (fp32 atomics in any
    order) within the criterion; 239 queries make 4 steps a key block (2 at head_dim 64's 128 rows), so the
    ring's two stages take turns."""
    q, k, v, do = make(2, 239, 203, 4, 2, d, torch.bfloat16, seed=d + 10 * (key_warps or 0) + (dq_row_warps or 0))
    scale = d ** -0.5
    got = run_backward(q, k, v, do, causal, scale, poison=True, arch="sm80", key_warps=key_warps,
                       dq_row_warps=dq_row_warps, stages=stages)
    assert check_grads(got, do, q, k, v, causal, scale) == []
    default = run_backward(q, k, v, do, causal, scale, arch="sm80")
    assert torch.equal(got[1], default[1]) and torch.equal(got[2], default[2])


_PREFETCH = [(d, grid, st, causal) for d, grid, st in
             ((128, {"key_warps": 4, "dq_row_warps": 2}, 1), (128, {"key_warps": 4, "dq_row_warps": 2}, 2), (128, {}, 1),
              (64, {"key_warps": 4, "dq_row_warps": 2}, 1), (96, {}, 1), (192, {}, 1), (256, {}, 1))
             for causal in (False, True)]


@pytest.mark.parametrize("d, grid, stages, causal", _PREFETCH,
                         ids=[f"hd{d}-{'kw4-qw2' if g else 'grid'}-st{st}-{'causal' if c else 'full'}"
                              for d, g, st, c in _PREFETCH])
def test_sm80_frag_prefetch_matches_float64_and_the_same_grid_without_it(d, grid, stages, causal):
    """frag_prefetch loads the next k16 step's fragments earlier, the same MMAs in the same order: dV
    bit-identical to the same grid without it (k_unroll 2 both); dK within the criterion, as dQ (fp32 atomics in
    any order): without frag_prefetch, 32 or fewer S^T registers keep P^T for dS^T in fp32 (P_IN_FP32), with it
    in elem_t pairs."""
    q, k, v, do = make(2, 239, 203, 4, 2, d, torch.bfloat16, seed=d + 7 * stages + len(grid))
    scale = d ** -0.5
    got = run_backward(q, k, v, do, causal, scale, poison=True, arch="sm80", frag_prefetch=True, stages=stages,
                       k_unroll=2, **grid)
    assert check_grads(got, do, q, k, v, causal, scale) == []
    plain = run_backward(q, k, v, do, causal, scale, arch="sm80", stages=stages, k_unroll=2, **grid)
    assert torch.equal(got[2], plain[2])


@pytest.mark.parametrize("d", [64, 96, 128, 192, 256])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_sm80_dq_bulk_add_matches_float64_and_the_same_kernel_without_it(d, causal):
    """dq_bulk_add stages each whole query block's dQ in shared memory and bulk-adds it a row a lane: dQ within the
    criterion (fp32 adds in any order), dK and dV bit-identical to the kernel without it (their path is the same);
    239 queries against 203 keys leave a partial query block, whose adds stay vector reductions. Two stages where
    the staging fits beside them (d64, d128), else one."""
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("dq_bulk_add: sm_90's cp.reduce.async.bulk")
    q, k, v, do = make(2, 239, 203, 4, 2, d, torch.bfloat16, seed=d + 5 * causal)
    scale = d ** -0.5
    stages = {} if d in (64, 96, 128) else {"stages": 1}
    got = run_backward(q, k, v, do, causal, scale, poison=True, arch="sm80", dq_bulk_add=True, **stages)
    assert check_grads(got, do, q, k, v, causal, scale) == []
    plain = run_backward(q, k, v, do, causal, scale, arch="sm80", **stages)
    assert torch.equal(got[1], plain[1]) and torch.equal(got[2], plain[2])


@pytest.mark.parametrize("d", [64, 96, 128, 192, 256])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_sm80_k_unroll_all_matches_float64_and_the_looped_gemms(d, causal):
    """k_unroll=0 unrolls every warp GEMM's k16 steps (straight-line code), the same MMAs in the same order: dK
    and dV bit-identical to the default's loops (k_unroll 2), dQ (fp32 atomics in any order) within the
    criterion; 239 queries against 203 keys leave partial blocks on both sides."""
    q, k, v, do = make(2, 239, 203, 4, 2, d, torch.bfloat16, seed=d + 3 * causal)
    scale = d ** -0.5
    got = run_backward(q, k, v, do, causal, scale, poison=True, arch="sm80", k_unroll=0)
    assert check_grads(got, do, q, k, v, causal, scale) == []
    looped = run_backward(q, k, v, do, causal, scale, arch="sm80", k_unroll=2)
    assert torch.equal(got[1], looped[1]) and torch.equal(got[2], looped[2])


_PADDED = [(d, sq, sk, causal, heads, dt) for d, (sq, sk), causal, heads, dt in
           ((8, (1, 1), False, "mha", "bf16"), (40, (239, 1), True, "gqa", "fp16"), (80, (113, 203), True, "gqa", "bf16"),
            (80, (1023, 1024), False, "mqa", "fp16"), (112, (128, 128), True, "mha", "bf16"),
            (160, (113, 203), False, "gqa", "bf16"), (248, (239, 300), True, "mqa", "fp16"),
            (56, (1000, 17), False, "gqa", "bf16"))]


@pytest.mark.parametrize("arch", ["sm80", "sm90"])
@pytest.mark.parametrize("d, sq, sk, causal, heads, dt", _PADDED,
                         ids=[f"d{d}-{sq}x{sk}-{'causal' if c else 'full'}-{h}-{dt}" for d, sq, sk, c, h, dt in _PADDED])
def test_padded_head_dims_match_float64_and_write_only_their_columns(d, sq, sk, causal, heads, dt, arch):
    """A head_dim between the tiles (either arch's kernel of the next tile): dQ, dK, dV within FA3's
    criterion, written into views of d columns of NaN-filled buffers 16 columns wider, whose columns past d
    stay NaN (the kernels never write past d), with the default scale 1/sqrt(d)."""
    if arch == "sm90" and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the sm90 backward needs an H100/H200")
    hq, hkv = HEADS[heads]
    q, k, v, do = make(2, sq, sk, hq, hkv, d, DTYPES[dt], seed=d * 31 + sq)
    scale = d ** -0.5
    out64, lse64, _ = reference(q, k, v, do, causal, scale, upcast=True)
    wide = [torch.full((*x.shape[:3], d + 16), float("nan"), device="cuda", dtype=x.dtype) for x in (q, k, v)]
    grads = facodegen.attention_backward(do, q, k, v, out64.to(q.dtype), lse64.float().contiguous(), causal=causal,
                                         dq=wide[0][..., :d], dk=wide[1][..., :d], dv=wide[2][..., :d], arch=arch)
    assert check_grads(grads, do, q, k, v, causal, scale) == []
    assert all(torch.isnan(w[..., d:]).all() for w in wide)


def test_autograd_of_a_padded_head_dim_matches_attention_backward():
    """attention() on head_dim 80 tensors that require grad records the padded backward: its dK, dV are
    attention_backward's on the same O and LSE bit for bit (dQ: fp32 atomics in any order), and all three
    meet FA3's criterion."""
    q, k, v, do = make(2, 300, 300, 4, 2, 80, torch.bfloat16, seed=80)
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
    out = facodegen.attention(*leaves, causal=True)
    assert out.grad_fn is not None
    got = torch.autograd.grad(out, leaves, do)
    with torch.no_grad():
        out2, lse = facodegen.attention(q, k, v, causal=True, return_lse=True)
    direct = facodegen.attention_backward(do, q, k, v, out2, lse, causal=True)
    assert torch.equal(out, out2)
    torch.testing.assert_close(got[0], direct[0], atol=2e-2, rtol=2e-2)
    assert torch.equal(got[1], direct[1]) and torch.equal(got[2], direct[2])
    assert check_grads(got, do, q, k, v, True, 80 ** -0.5) == []


def test_errors_name_the_argument():
    q, k, v, do = make(1, 64, 64, 2, 2, 64, torch.bfloat16, seed=1)
    out, lse = facodegen.attention(q, k, v, return_lse=True)
    with pytest.raises(ValueError, match="lse must be a contiguous"):
        facodegen.attention_backward(do, q, k, v, out, lse[:, :, :32])
    with pytest.raises(TypeError, match="do must be a torch bfloat16"):
        facodegen.attention_backward(do.half(), q, k, v, out, lse)
    with pytest.raises(TypeError, match="q is a torch tensor on cpu"):
        facodegen.attention_backward(do, q.cpu(), k, v, out, lse)


def test_default_spec_fits_this_gpu():
    info = api.device_info(torch.cuda.current_device())
    for d in HEAD_DIMS:
        assert BackwardSpec(head_dim=d, gpu=info.budget_gpu).smem_bytes <= info.smem_per_block_optin


# ------------------------------------------------------------------ sm90 (FlashAttention-3's backward)

HAVE_SM90 = HAVE_GPU and torch.cuda.get_device_capability() == (9, 0)
sm90_only = pytest.mark.skipif(not HAVE_SM90, reason="the sm90 backward needs an H100/H200")
SM90_HEAD_DIMS = (64, 96, 128, 192, 256)     # 192, 256: the warpgroups split head_dim (KV_SPLIT_COLS)
SM90_SEQLENS = ((1, 1), (239, 1), (113, 203), (1023, 1024), (128, 128), (64, 65), (200, 64))
# Every seqlen pair x causal x head_dim x dtype, the head layout cycling through MHA/GQA/MQA, and every
# head layout at head_dim 128 bf16 besides.
_GRID90 = [(sq, sk, causal, d, dt, list(HEADS)[i % 3]) for i, ((sq, sk), causal, d, dt)
           in enumerate(itertools.product(SM90_SEQLENS, (False, True), SM90_HEAD_DIMS, DTYPES))]
_GRID90 += [(sq, sk, causal, 128, "bf16", h) for (sq, sk), causal, h in itertools.product(SM90_SEQLENS, (False, True),
                                                                                          HEADS)
            if (sq, sk, causal, 128, "bf16", h) not in _GRID90]


@sm90_only
@pytest.mark.parametrize("sq, sk, causal, d, dt, heads", _GRID90,
                         ids=[f"sm90-{sq}x{sk}-{'causal' if c else 'full'}-hd{d}-{dt}-{h}" for sq, sk, c, d, dt, h in _GRID90])
def test_sm90_gradients_match_float64(sq, sk, causal, d, dt, heads):
    hq, hkv = HEADS[heads]
    batch = 2 if sq * sk < 100_000 else 1
    q, k, v, do = make(batch, sq, sk, hq, hkv, d, DTYPES[dt], seed=sq * 7 + sk * 13 + d + 1)
    scale = d ** -0.5 if (sq + d) % 2 else 0.3
    got = run_backward(q, k, v, do, causal, scale, poison=(sq == 113), arch="sm90")
    assert check_grads(got, do, q, k, v, causal, scale) == []


@sm90_only
@pytest.mark.parametrize("d", [128, 192, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_sm90_strided_inputs_and_a_second_call_on_other_tensors(causal, d):
    """Strided Q (a head stride of 2 x head_dim), then a second call of the same layout on other
    tensors: the plan's TMA maps must follow the new pointers."""
    base = torch.randn(2, 97, 8, d, device="cuda", dtype=torch.bfloat16)
    q = base[:, :, ::2]
    k = torch.randn(2, 150, 2, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(2, 150, 2, d, device="cuda", dtype=torch.bfloat16)
    do = torch.randn(2, 97, 4, d, device="cuda", dtype=torch.bfloat16)
    got = run_backward(q, k, v, do, causal, 0.125, poison=True, arch="sm90")
    assert check_grads(got, do, q, k, v, causal, 0.125) == []
    q2, k2, v2, do2 = (torch.randn_like(x) for x in (base, k, v, do))
    q2 = q2[:, :, ::2]
    got2 = run_backward(q2, k2, v2, do2, causal, 0.125, arch="sm90")
    assert check_grads(got2, do2, q2, k2, v2, causal, 0.125) == []


@sm90_only
@pytest.mark.parametrize("d, causal", [(64, False), (128, True), (192, False), (256, True)])
def test_sm90_matches_sm80(d, causal):
    """The two backwards on the same O and LSE: dK, dV within bf16 rounding of each other (different
    summation orders), dQ too (fp32 atomics in any order)."""
    q, k, v, do = make(2, 700, 900, 8, 2, d, torch.bfloat16, seed=11)
    a = run_backward(q, k, v, do, causal, d ** -0.5, arch="sm80")
    b = run_backward(q, k, v, do, causal, d ** -0.5, arch="sm90")
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, atol=2e-2, rtol=2e-2)


@sm90_only
@pytest.mark.parametrize("dt", ["bf16", "fp16"])
def test_sm90_backward_of_the_sm90_forward_at_large_logits(dt):
    """Inputs x16 (logits in the thousands): the sm90 forward's LSE with the sm90 backward, against
    float64. The sm80 backward recomputes S in mma.sync order and its P = exp(S - LSE) was ~1% off
    here (README, facodegen check --fuzz); both sm90 kernels sum the scores the wgmma way."""
    q, k, v, do = make(1, 300, 300, 4, 4, 128, DTYPES[dt], seed=7)
    q, k = q * 4, k * 4
    out, lse = facodegen.attention(q, k, v, causal=True, return_lse=True, arch="sm90")
    got = facodegen.attention_backward(do, q, k, v, out, lse, causal=True, arch="sm90")
    assert check_grads(got, do, q, k, v, True, 128 ** -0.5) == []


# ------------------------------------------------------------------ sm90 dq_tma_reduce (dQ by TMA bulk reduce-add)
# The knob stages each warpgroup's fp32 dQ tile in shared memory and adds it into a tiled, padded
# dq_accum with cp.reduce.async.bulk (templates/sm90/flash_bwd.cu.j2); the rows past seqlen_q add
# zeros into the padding, so odd seqlen_q (1, 113, 239) with several heads checks that no tile
# spills into the next head's rows.

@sm90_only
@pytest.mark.parametrize("sq, sk, causal, d, dt, heads", _GRID90,
                         ids=[f"dqtma-{sq}x{sk}-{'causal' if c else 'full'}-hd{d}-{dt}-{h}"
                              for sq, sk, c, d, dt, h in _GRID90])
def test_sm90_dq_tma_reduce_gradients_match_float64(sq, sk, causal, d, dt, heads):
    hq, hkv = HEADS[heads]
    batch = 2 if sq * sk < 100_000 else 1
    q, k, v, do = make(batch, sq, sk, hq, hkv, d, DTYPES[dt], seed=sq * 7 + sk * 13 + d + 2)
    scale = d ** -0.5 if (sq + d) % 2 else 0.3
    got = run_backward(q, k, v, do, causal, scale, poison=(sq == 113), arch="sm90", dq_tma_reduce=True)
    assert check_grads(got, do, q, k, v, causal, scale) == []


@sm90_only
@pytest.mark.parametrize("sq, sk, hq, hkv", [(113, 239, 8, 2), (239, 113, 6, 1), (1, 300, 4, 4), (1000, 1000, 8, 1)])
@pytest.mark.parametrize("d", [64, 96, 128, 192, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_sm90_dq_tma_reduce_changes_only_dq(sq, sk, hq, hkv, d, causal):
    """The knob on and off on the same inputs: dK and dV alike (the same code computes them; expected
    bit-identical, compared within bf16 rounding), dQ within fp32 summation-order noise (both add in
    any order), and right against float64."""
    q, k, v, do = make(2, sq, sk, hq, hkv, d, torch.bfloat16, seed=sq + sk + d)
    off = run_backward(q, k, v, do, causal, d ** -0.5, arch="sm90", dq_tma_reduce=False)
    on = run_backward(q, k, v, do, causal, d ** -0.5, poison=True, arch="sm90", dq_tma_reduce=True)
    for x, y in zip(on, off):
        torch.testing.assert_close(x, y, atol=1e-2, rtol=1e-2)
    assert check_grads(on, do, q, k, v, causal, d ** -0.5) == []


@sm90_only
def test_sm90_dq_tma_reduce_strided_inputs_and_a_second_call():
    """Strided Q (a head stride of 256), twice on other tensors of that layout (the plan's second call
    reuses the stream's scratch: the preprocess must zero the tiled dq_accum again)."""
    for _ in range(2):
        q = torch.randn(2, 97, 8, 128, device="cuda", dtype=torch.bfloat16)[:, :, ::2]
        k, v = (torch.randn(2, 150, 2, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        do = torch.randn(2, 97, 4, 128, device="cuda", dtype=torch.bfloat16)
        got = run_backward(q, k, v, do, True, 0.125, poison=True, arch="sm90", dq_tma_reduce=True)
        assert check_grads(got, do, q, k, v, True, 0.125) == []


# ------------------------------------------------------------------ sm90 do_stages=1 (a dO ring of one stage)
# Each step releases its dO stage once dV has read it (do_empty), the Q ring stays 2 deep; at head_dim
# 256 with dq_tma_reduce the dO tile left out holds the dQ tiles, staged and reduced in quarters.

@sm90_only
@pytest.mark.parametrize("sq, sk, hq, hkv", [(113, 239, 8, 2), (239, 113, 6, 1), (1, 300, 4, 4), (1000, 1000, 8, 1)])
@pytest.mark.parametrize("d, knobs", [(256, {"dq_tma_reduce": True}), (256, {"dq_tma_reduce": False}),
                                      (192, {}), (128, {"dp_lookahead": False}), (64, {})],
                         ids=["hd256-dqtma", "hd256-red", "hd192", "hd128", "hd64"])
@pytest.mark.parametrize("causal", [False, True])
def test_sm90_one_do_stage_matches_the_default(sq, sk, hq, hkv, d, knobs, causal):
    """do_stages=1 against the default on the same inputs: dK, dV alike (compared within bf16
    rounding), dQ within fp32 summation-order noise, and right against float64 (poisoned outputs)."""
    q, k, v, do = make(2, sq, sk, hq, hkv, d, torch.bfloat16, seed=sq + 3 * sk + d)
    base = run_backward(q, k, v, do, causal, d ** -0.5, arch="sm90")
    one = run_backward(q, k, v, do, causal, d ** -0.5, poison=True, arch="sm90", do_stages=1, **knobs)
    for x, y in zip(one, base):
        torch.testing.assert_close(x, y, atol=1e-2, rtol=1e-2)
    assert check_grads(one, do, q, k, v, causal, d ** -0.5) == []


# ------------------------------------------------------------------ sm90 dq_lag (head_dim 128: dQ a step late)
# Each step computes the previous step's dQ from the other dS^T buffer (ds_full / ds_empty mbarriers
# instead of the every-step named barrier), a tile's last step also its own; one step a tile (sq 1),
# several query heads a tile (GQA: the lagged dQ's head changes mid-tile), many tiles per persistent
# CTA (8k keys: 64 tiles x 2 pairs x batch 2 > 132), blocks no query sees, and one CTA per tile.

@sm90_only
@pytest.mark.parametrize("sq, sk, hq, hkv, persistent", [(113, 239, 8, 2, True), (239, 113, 6, 1, True),
                                                         (1, 300, 4, 4, True), (1000, 1000, 8, 1, True),
                                                         (300, 8192, 4, 2, True), (1000, 1000, 8, 1, False)])
@pytest.mark.parametrize("causal", [False, True])
def test_sm90_dq_lag_matches_the_default(sq, sk, hq, hkv, persistent, causal):
    """dq_lag=True against dq_lag=False (the default with a causal mask; without one dq_lag is the default)
    on the same inputs: dK, dV alike, dQ within fp32 summation-order noise, and right against float64
    (poisoned outputs)."""
    q, k, v, do = make(2, sq, sk, hq, hkv, 128, torch.bfloat16, seed=sq + 5 * sk + hq)
    base = run_backward(q, k, v, do, causal, 128 ** -0.5, arch="sm90", dq_lag=False)
    lag = run_backward(q, k, v, do, causal, 128 ** -0.5, poison=True, arch="sm90", dq_lag=True,
                       persistent=persistent)
    for x, y in zip(lag, base):
        torch.testing.assert_close(x, y, atol=1e-2, rtol=1e-2)
    assert check_grads(lag, do, q, k, v, causal, 128 ** -0.5) == []


@sm90_only
@pytest.mark.parametrize("d", [192, 256])
def test_sm90_is_the_default_at_head_dims_192_256(d):
    """arch=None on an H100/H200 runs the sm90 backward at head_dim 192 and 256 too (default_arch)."""
    info = api.device_info(torch.cuda.current_device())
    assert backward.default_arch(info, d, "bf16", True, {}) == "sm90"
    spec = backward.choose(d, "bf16", True, info, {})
    assert (spec.arch, spec.block_n) == ("sm90", 64) and spec.smem_bytes <= info.smem_per_block_optin


# ------------------------------------------------------------------ sm90 block_m=128 (head_dim 64, a knob value)
# S^T, dP^T of 128 queries per consumer warpgroup, dQ as two m64 tiles of queries from one dS^T tile,
# dq_accum tiles / stat rows / turn counters per 128-row query block: odd seqlen_q (1, 65, 113, 130,
# 239, 300) end inside either m64 tile of a block, several heads check no tile reaches the next head.
SM90_WIDE_M_SEQLENS = ((1, 1), (239, 1), (113, 203), (1023, 1024), (128, 128), (64, 65), (200, 64), (130, 257),
                       (300, 129), (65, 1000))
_GRID_WIDE_M = [(sq, sk, causal, tma, list(DTYPES)[i % 2], list(HEADS)[i % 3]) for i, ((sq, sk), causal, tma)
                in enumerate(itertools.product(SM90_WIDE_M_SEQLENS, (False, True), (True, False)))]


@sm90_only
@pytest.mark.parametrize("sq, sk, causal, tma, dt, heads", _GRID_WIDE_M,
                         ids=[f"bm128-{sq}x{sk}-{'causal' if c else 'full'}-{'dqtma' if t else 'red'}-{dt}-{h}"
                              for sq, sk, c, t, dt, h in _GRID_WIDE_M])
def test_sm90_block_m_128_gradients_match_float64(sq, sk, causal, tma, dt, heads):
    hq, hkv = HEADS[heads]
    batch = 2 if sq * sk < 100_000 else 1
    q, k, v, do = make(batch, sq, sk, hq, hkv, 64, DTYPES[dt], seed=sq * 7 + sk * 13 + 3)
    scale = 0.125 if sq % 2 else 0.3
    got = run_backward(q, k, v, do, causal, scale, poison=(sq in (113, 130)), arch="sm90", block_m=128,
                       dq_tma_reduce=tma)
    assert check_grads(got, do, q, k, v, causal, scale) == []


@sm90_only
@pytest.mark.parametrize("sq, sk, hq, hkv", [(113, 239, 8, 2), (239, 113, 6, 1), (1000, 1000, 8, 1)])
@pytest.mark.parametrize("causal", [False, True])
def test_sm90_block_m_128_matches_block_m_64(sq, sk, hq, hkv, causal):
    """block_m 128 (head_dim 64's default) against 64 on the same inputs: dK, dV within bf16 rounding
    (the same sums in another order over the query blocks), dQ within fp32 summation-order noise."""
    q, k, v, do = make(2, sq, sk, hq, hkv, 64, torch.bfloat16, seed=sq + sk + 64)
    a = run_backward(q, k, v, do, causal, 0.125, arch="sm90", block_m=64)
    b = run_backward(q, k, v, do, causal, 0.125, poison=True, arch="sm90", block_m=128)
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, atol=1e-2, rtol=1e-2)


@sm90_only
@pytest.mark.parametrize("tma", [False, True], ids=["red", "dqtma"])
@pytest.mark.parametrize("sq, sk, causal, heads", [(239, 1, False, "mha"), (777, 3000, False, "gqa"),
                                                   (1023, 1024, True, "gqa"), (129, 2000, True, "mqa")])
def test_sm90_block_m_128_deterministic_is_bit_identical_and_right(sq, sk, causal, heads, tma):
    """deterministic=True at block_m 128 (turn counters per 128-row query block; warpgroup 0's adds
    before 1's): three runs give the same bits and pass the criterion."""
    hq, hkv = HEADS[heads]
    q, k, v, do = make(2, sq, sk, hq, hkv, 64, torch.bfloat16, seed=sq + sk + 128)
    out64, lse64, _ = reference(q, k, v, do, causal, 0.125, upcast=True)
    out, lse = out64.to(q.dtype), lse64.float().contiguous()
    runs = [facodegen.attention_backward(do, q, k, v, out, lse, causal=causal, softmax_scale=0.125, deterministic=True,
                                         arch="sm90", block_m=128, dq_tma_reduce=tma) for _ in range(3)]
    torch.cuda.synchronize()
    for other in runs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(runs[0], other))
    assert check_grads(runs[0], do, q, k, v, causal, 0.125) == []


# ------------------------------------------------------------------ sm90 s_lookahead (next step's S^T issued early)
# The knob changes only when each consumer warpgroup issues and waits on S^T (a step's S^T in flight
# across the loop's back edge, step 0's before the loop, a spare one after the last step) and when the
# next stage's q_full is waited on; dp_lookahead the same for dP^T and do_full. Lengths: one step per CTA (1, 65: the spare S^T right after the
# prologue's), many steps (1023, 1000), odd ends inside a block, GQA/MQA (steps run over the group's
# heads, so S^T of the next head's first block is the one issued early).
SM90_LOOKAHEAD_TILES = ((64, 64), (64, 128), (96, 64), (128, 64))      # (head_dim, block_m)
# dp_lookahead (the next step's dP^T issued right after its S^T) on every other pair of cases
_GRID_LOOKAHEAD = [(sq, sk, causal, d, bm, list(DTYPES)[i % 2], list(HEADS)[i % 3], (i // 2) % 2 == 1)
                   for i, ((sq, sk), causal, (d, bm))
                   in enumerate(itertools.product(SM90_WIDE_M_SEQLENS, (False, True), SM90_LOOKAHEAD_TILES))]


@sm90_only
@pytest.mark.parametrize("sq, sk, causal, d, bm, dt, heads, dp", _GRID_LOOKAHEAD,
                         ids=[f"{'dplook' if dp else 'slook'}-{sq}x{sk}-{'causal' if c else 'full'}-hd{d}-bm{bm}-{dt}-{h}"
                              for sq, sk, c, d, bm, dt, h, dp in _GRID_LOOKAHEAD])
def test_sm90_s_lookahead_gradients_match_float64(sq, sk, causal, d, bm, dt, heads, dp):
    hq, hkv = HEADS[heads]
    batch = 2 if sq * sk < 100_000 else 1
    q, k, v, do = make(batch, sq, sk, hq, hkv, d, DTYPES[dt], seed=sq * 7 + sk * 13 + d + 5)
    scale = d ** -0.5 if (sq + d) % 2 else 0.3
    got = run_backward(q, k, v, do, causal, scale, poison=(sq in (113, 130)), arch="sm90", block_m=bm,
                       s_lookahead=True, dp_lookahead=dp)
    assert check_grads(got, do, q, k, v, causal, scale) == []


@sm90_only
@pytest.mark.parametrize("dp", [False, True], ids=["slook", "dplook"])
@pytest.mark.parametrize("d, bm", SM90_LOOKAHEAD_TILES, ids=[f"hd{d}-bm{bm}" for d, bm in SM90_LOOKAHEAD_TILES])
@pytest.mark.parametrize("sq, sk, causal, heads", [(239, 1, False, "mha"), (777, 3000, False, "gqa"),
                                                   (1023, 1024, True, "gqa"), (129, 2000, True, "mqa")])
def test_sm90_s_lookahead_is_bit_identical_to_the_default(sq, sk, causal, heads, d, bm, dp):
    """Deterministic (dQ added in key-block order), with and without s_lookahead (and dp_lookahead):
    the same GEMMs on the same tiles in the same accumulation order, so the same bits in dQ, dK and dV
    (block_m 128 takes the bulk reduce-add, which s_lookahead needs there)."""
    hq, hkv = HEADS[heads]
    q, k, v, do = make(2, sq, sk, hq, hkv, d, torch.bfloat16, seed=sq + sk + d + bm)
    out64, lse64, _ = reference(q, k, v, do, causal, 0.125, upcast=True)
    out, lse = out64.to(q.dtype), lse64.float().contiguous()
    knobs = dict(arch="sm90", block_m=bm, deterministic=True, dq_tma_reduce=bm == 128)
    runs = [facodegen.attention_backward(do, q, k, v, out, lse, causal=causal, softmax_scale=0.125, s_lookahead=la,
                                         dp_lookahead=la and dp, **knobs) for la in (False, True)]
    torch.cuda.synchronize()
    for name, a, b in zip(("dq", "dk", "dv"), *runs):
        assert torch.equal(a, b), name
    assert check_grads(runs[1], do, q, k, v, causal, 0.125) == []


def deterministic_runs(q, k, v, do, causal, *knob_sets, scale=0.125):
    """The sm90 backward under deterministic=True once per knob set, on the float64 forward's O and LSE:
    asserts they give the same bits in dQ, dK and dV, and returns the gradients of each."""
    out64, lse64, _ = reference(q, k, v, do, causal, scale, upcast=True)
    out, lse = out64.to(q.dtype), lse64.float().contiguous()
    runs = [facodegen.attention_backward(do, q, k, v, out, lse, causal=causal, softmax_scale=scale, arch="sm90",
                                         deterministic=True, **knobs) for knobs in knob_sets]
    torch.cuda.synchronize()
    for name, *grads in zip(("dq", "dk", "dv"), *runs):
        assert all(torch.equal(grads[0], g) for g in grads[1:]), name
    return runs


# ------------------------------------------------------------------ sm90 persistent (a tile counter)
# min(tiles, SMs) CTAs draw key blocks from a counter; the producer loads the next block's K, V while the
# consumers write the last one's dK, dV. Lengths with more tiles than SMs, so CTAs run several: 4096
# keys x 4 kv heads x batch 2 = 256 tiles of 128 keys (512 of 64 at head_dim 192, 256); causal with
# seqlen_q < seqlen_k, so most tiles see no query (dK = dV = 0, no K, V load); odd ends; GQA/MQA.
_PERSISTENT_LENGTHS = ((64, 4096), (1000, 4096), (4096, 1000), (1, 1), (239, 1))
_GRID_PERSISTENT = [(sq, sk, causal, d, list(DTYPES)[i % 2], list(HEADS)[i % 3])
                    for i, ((sq, sk), causal, d) in enumerate(itertools.product(_PERSISTENT_LENGTHS, (False, True),
                                                                                SM90_HEAD_DIMS))]


@sm90_only
@pytest.mark.parametrize("sq, sk, causal, d, dt, heads", _GRID_PERSISTENT,
                         ids=[f"pers-{sq}x{sk}-{'causal' if c else 'full'}-hd{d}-{dt}-{h}"
                              for sq, sk, c, d, dt, h in _GRID_PERSISTENT])
def test_sm90_persistent_gradients_match_float64(sq, sk, causal, d, dt, heads):
    hq, hkv = (8, HEADS[heads][1] * 2) if heads != "mqa" else (8, 1)
    q, k, v, do = make(2, sq, sk, hq, hkv, d, DTYPES[dt], seed=sq * 3 + sk * 5 + d + 11)
    scale = d ** -0.5 if (sq + d) % 2 else 0.3
    got = run_backward(q, k, v, do, causal, scale, poison=True, arch="sm90", persistent=True)
    assert check_grads(got, do, q, k, v, causal, scale) == []


@sm90_only
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("sq, sk, causal, heads", [(1000, 4096, False, "gqa"), (4096, 4096, True, "mha")])
def test_sm90_persistent_is_bit_identical_to_one_cta_per_tile(sq, sk, causal, heads, d):
    """Deterministic (dQ added in key-block order): the persistent kernel runs the same GEMMs on the same
    tiles in the same accumulation order as one CTA per tile, so the same bits in dQ, dK and dV."""
    hq, hkv = HEADS[heads]
    q, k, v, do = make(2, sq, sk, hq, hkv, d, torch.bfloat16, seed=sq + sk + d)
    runs = deterministic_runs(q, k, v, do, causal, {"persistent": False}, {"persistent": True})
    assert check_grads(runs[1], do, q, k, v, causal, 0.125) == []


# ------------------------------------------------------------------ sm90 lpt (causal tiles longest first)
# Key blocks first within groups of (kv head, batch) pairs whose Q and dO fit 24 MB of L2, the last group
# at least 4 x SMs / key blocks pairs wide (lpt_tail_pair; 132 SMs here): 4096 queries x head_dim 128 is
# 2 MB a pair (16 pairs, 32 key blocks: one group, all of them); head_dim 64 at 8 query heads a kv head
# 8 MB (4 pairs, one group); head_dim 256 at 4096 4 MB (16 pairs of 64 key blocks: a group of 6, then the
# last 10); seqlen_q < seqlen_k (blocks no query sees); both schedulers.
_GRID_LPT = [(sq, sk, d, hq, hkv, pers) for (sq, sk, d, hq, hkv) in ((4096, 4096, 128, 8, 8), (4096, 4096, 64, 16, 2),
                                                                      (1000, 4096, 256, 8, 8), (113, 203, 96, 4, 1),
                                                                      (4096, 4096, 256, 8, 8))
             for pers in (False, True)]


@sm90_only
@pytest.mark.parametrize("sq, sk, d, hq, hkv, pers", _GRID_LPT,
                         ids=[f"lpt-{sq}x{sk}-hd{d}-{hq}x{hkv}-{'pers' if p else 'np'}" for sq, sk, d, hq, hkv, p in _GRID_LPT])
def test_sm90_lpt_gradients_match_float64(sq, sk, d, hq, hkv, pers):
    q, k, v, do = make(2, sq, sk, hq, hkv, d, torch.bfloat16, seed=sq + 7 * sk + d + hq)
    got = run_backward(q, k, v, do, True, d ** -0.5, poison=True, arch="sm90", lpt=True, persistent=pers)
    assert check_grads(got, do, q, k, v, True, d ** -0.5) == []


@sm90_only
def test_sm90_lpt_is_bit_identical_to_the_default_order():
    """Deterministic: the key blocks still add into a query block's dQ in key-block order, so the order
    in which the tiles start changes no bit of dQ, dK or dV."""
    q, k, v, do = make(2, 4096, 4096, 16, 4, 128, torch.bfloat16, seed=3)
    deterministic_runs(q, k, v, do, True, {"lpt": False}, {"lpt": True})


@pytest.mark.parametrize("d, tiles", [(64, 2), (128, 1), (128, 4), (256, 1)])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_sm80_poly_exp2_tiles_matches_float64(d, tiles, causal):
    """poly_exp2_tiles takes P's exp2 of that many n8 query tiles on the FMA pipe (the forward's cubic poly_exp2,
    ~1e-4 relative, under bf16's rounding of P and dS): every gradient within FA3's criterion of the float64
    reference, with NaN-poisoned outputs, partial blocks on both sides (239 queries, 203 keys) and, causal, the
    masked path's exp2(+inf) of rows that see no key."""
    q, k, v, do = make(2, 239, 203, 4, 2, d, torch.bfloat16, seed=d + tiles + 5 * causal)
    scale = d ** -0.5
    got = run_backward(q, k, v, do, causal, scale, poison=True, arch="sm80", poly_exp2_tiles=tiles)
    assert check_grads(got, do, q, k, v, causal, scale) == []


# ------------------------------------------------------------------ sliding window (the sm80 LOCAL kernels)

# sq, sk, causal, window_size, top_left, head_dim, dtype, heads
_WINDOWS = [
    (113, 203, True, (40, -1), False, 128, "bf16", "gqa"),
    (203, 113, False, (17, 33), False, 64, "fp16", "mha"),
    (1000, 1000, True, (256, 0), False, 128, "bf16", "mqa"),     # Mistral's shape of window
    (239, 1, False, (0, 0), False, 256, "bf16", "mha"),
    (1, 1, True, (0, -1), False, 96, "fp16", "gqa"),
    (128, 300, False, (-1, 8), False, 192, "bf16", "gqa"),
    (300, 128, True, (5, -1), False, 64, "bf16", "mqa"),          # rows that see no key
    (113, 203, False, (8, 8), True, 128, "fp16", "mha"),          # top-left window
    (1023, 1024, True, (-1, -1), True, 128, "bf16", "gqa"),       # top-left causal
    (1000, 1000, False, (1, 1), False, 256, "fp16", "gqa"),       # a window of 3
]


def _hidden(sq, sk, causal, window_size, top_left):
    import numpy as np

    from facodegen.verify.reference import window_mask
    return torch.from_numpy(window_mask(np.arange(sq), np.arange(sk), sq, sk, window_size, causal, top_left)).cuda()


@pytest.mark.parametrize("sq, sk, causal, window_size, top_left, d, dt, heads", _WINDOWS,
                         ids=[f"{sq}x{sk}-{'causal' if c else 'full'}-w{w[0]}_{w[1]}{'-tl' if t else ''}-hd{d}-{dt}-{h}"
                              for sq, sk, c, w, t, d, dt, h in _WINDOWS])
def test_window_gradients_match_float64(sq, sk, causal, window_size, top_left, d, dt, heads):
    """attention_backward with the forward's window_size / causal_alignment (arch=None: the sm80 LOCAL kernels on
    every GPU) against float64 with the same window, FA3's criterion, NaN-poisoned gradient buffers."""
    hq, hkv = HEADS[heads]
    q, k, v, do = make(2 if sq * sk < 100_000 else 1, sq, sk, hq, hkv, d, DTYPES[dt], seed=sq + 3 * sk + d)
    scale = 0.3 if d == 64 else d ** -0.5
    hidden = _hidden(sq, sk, causal, window_size, top_left)
    out64, lse64, _ = reference(q, k, v, do, causal, scale, upcast=True, hidden=hidden)
    poison = {n: torch.full_like(x, float("nan")) for n, x in (("dq", q), ("dk", k), ("dv", v))}
    got = facodegen.attention_backward(do, q, k, v, out64.to(q.dtype), lse64.float().contiguous(), causal=causal,
                                       softmax_scale=scale, window_size=window_size,
                                       causal_alignment="top_left" if top_left else "bottom_right", **poison)
    assert check_grads(got, do, q, k, v, causal, scale, hidden=hidden) == []


@pytest.mark.parametrize("window_size, causal_alignment", [((64, 0), "bottom_right"), ((32, 16), "top_left")])
def test_autograd_through_a_window_equals_attention_backward(window_size, causal_alignment):
    """facodegen.attention(..., window_size=...) on tensors that require grad records the window's backward: its
    gradients are attention_backward's with the same window, and float64's."""
    q, k, v, do = make(2, 300, 257, 4, 2, 128, torch.bfloat16, seed=11)
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
    variant = dict(window_size=window_size, causal_alignment=causal_alignment)
    out = facodegen.attention(*leaves, causal=True, **variant)
    out.backward(do)
    with torch.no_grad():
        out2, lse = facodegen.attention(q, k, v, causal=True, return_lse=True, **variant)
    dq, dk, dv = facodegen.attention_backward(do, q, k, v, out2, lse, causal=True, **variant)
    assert torch.equal(out, out2)
    torch.testing.assert_close(leaves[0].grad, dq, atol=2e-2, rtol=2e-2)   # dQ: fp32 atomics, any order
    assert torch.equal(leaves[1].grad, dk) and torch.equal(leaves[2].grad, dv)
    hidden = _hidden(300, 257, True, window_size, causal_alignment == "top_left")
    assert check_grads((leaves[0].grad, leaves[1].grad, leaves[2].grad), do, q, k, v, True, 128 ** -0.5,
                       hidden=hidden) == []


# ------------------------------------------------------------------ softcap (the sm80 SOFTCAP kernels)

# sq, sk, causal, softcap, window_size, head_dim, dtype, heads
_SOFTCAPS = [
    (113, 203, True, 5.0, None, 128, "bf16", "gqa"),       # a cap that bites (inputs x 1, scale 1/sqrt(d))
    (203, 113, False, 30.0, None, 64, "fp16", "mha"),      # head_dim 64's SOFTCAP tile (64 queries)
    (1000, 1000, True, 50.0, (256, 0), 256, "bf16", "mqa"),   # Gemma-2's cap with a window
    (239, 1, False, 2.0, None, 96, "fp16", "gqa"),
    (128, 300, True, 10.0, (-1, 8), 192, "bf16", "gqa"),
]


@pytest.mark.parametrize("sq, sk, causal, softcap, window_size, d, dt, heads", _SOFTCAPS,
                         ids=[f"{sq}x{sk}-{'causal' if c else 'full'}-cap{cap:g}{'-w' if w else ''}-hd{d}-{dt}-{h}"
                              for sq, sk, c, cap, w, d, dt, h in _SOFTCAPS])
def test_softcap_gradients_match_float64(sq, sk, causal, softcap, window_size, d, dt, heads):
    """attention_backward with the forward's softcap (and window) against float64 with the same cap (FA3's criterion,
    NaN-poisoned gradient buffers); inputs at 3x unit scale so that the logits reach the cap."""
    hq, hkv = HEADS[heads]
    q, k, v, do = make(1, sq, sk, hq, hkv, d, DTYPES[dt], seed=sq + 7 * sk + d)
    q, k = q * 3, k * 3
    scale = d ** -0.5
    hidden = None if window_size is None else _hidden(sq, sk, causal, window_size, False)
    out64, lse64, _ = reference(q, k, v, do, causal, scale, upcast=True, hidden=hidden, softcap=softcap)
    poison = {n: torch.full_like(x, float("nan")) for n, x in (("dq", q), ("dk", k), ("dv", v))}
    got = facodegen.attention_backward(do, q, k, v, out64.to(q.dtype), lse64.float().contiguous(), causal=causal,
                                       softmax_scale=scale, softcap=softcap, window_size=window_size or (-1, -1),
                                       **poison)
    assert check_grads(got, do, q, k, v, causal, scale, hidden=hidden, softcap=softcap) == []


def test_autograd_through_a_softcap_equals_attention_backward():
    """facodegen.attention(..., softcap=...) on tensors that require grad records the softcap's backward."""
    q, k, v, do = make(2, 300, 257, 4, 2, 128, torch.bfloat16, seed=12)
    q, k = q * 3, k * 3
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
    out = facodegen.attention(*leaves, causal=True, softcap=20.0)
    out.backward(do)
    with torch.no_grad():
        out2, lse = facodegen.attention(q, k, v, causal=True, return_lse=True, softcap=20.0)
    dq, dk, dv = facodegen.attention_backward(do, q, k, v, out2, lse, causal=True, softcap=20.0)
    assert torch.equal(out, out2)
    torch.testing.assert_close(leaves[0].grad, dq, atol=2e-2, rtol=2e-2)   # dQ: fp32 atomics, any order
    assert torch.equal(leaves[1].grad, dk) and torch.equal(leaves[2].grad, dv)
    assert check_grads((leaves[0].grad, leaves[1].grad, leaves[2].grad), do, q, k, v, True, 128 ** -0.5,
                       softcap=20.0) == []


# ------------------------------------------------------------------ sinks (either arch: the postprocess's sink gradient)

@pytest.mark.parametrize("arch", ["sm80", "sm90"])
@pytest.mark.parametrize("sq, sk, causal, d, heads", [(113, 203, True, 128, "gqa"), (239, 113, True, 64, "mha"),
                                                      (1000, 1000, False, 256, "mqa"), (1, 300, False, 96, "gqa")])
def test_sinks_gradients_match_float64(arch, sq, sk, causal, d, heads):
    """attention_backward with the forward's sinks: dQ, dK, dV by FA3's criterion against float64 attention with the
    sinks (their LSE includes them), and dsinks within twice the same-precision reference's error + 1e-3 of its
    scale, bit-identical across runs (summed in a fixed order)."""
    if arch == "sm90" and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the sm90 backward runs on H100/H200")
    hq, hkv = HEADS[heads]
    q, k, v, do = make(2, sq, sk, hq, hkv, d, torch.bfloat16, seed=sq + sk + d)
    sinks = torch.linspace(-2.0, 3.0, hq, device="cuda")
    scale = d ** -0.5
    out64, lse64, _ = reference(q, k, v, do, causal, scale, upcast=True, sinks=sinks)
    out, lse = out64.to(q.dtype), lse64.float().contiguous()
    runs = [facodegen.attention_backward(do, q, k, v, out, lse, causal=causal, softmax_scale=scale, sinks=sinks,
                                         arch=arch) for _ in range(2)]
    dq, dk, dv, dsinks = runs[0]
    assert torch.equal(dsinks, runs[1][3])
    assert check_grads((dq, dk, dv), do, q, k, v, causal, scale, sinks=sinks) == []
    # float64 from the float64 forward (the formula is the gradient: tests/test_backward_reference.py), and the
    # same formula on what the kernels see (O rounded to bf16) as the same-precision baseline
    ref = torch.from_numpy(sinks_gradient_reference(do.cpu(), out64.cpu(), lse64.cpu(), sinks.cpu())).cuda()
    low = torch.from_numpy(sinks_gradient_reference(do.cpu(), out.cpu(), lse.cpu(), sinks.cpu())).cuda()
    err, base = (dsinks.double() - ref).abs().max().item(), (low - ref).abs().max().item()
    assert err <= 2 * base + 1e-3 * ref.abs().max().item(), f"dsinks max err {err:.3e} (bf16 O's {base:.3e})"


def test_autograd_through_sinks_equals_attention_backward():
    """facodegen.attention(..., sinks=...) on tensors that require grad (the sinks too) records the SINKS backward:
    the same gradients as attention_backward, dsinks included."""
    q, k, v, do = make(2, 300, 257, 4, 2, 128, torch.bfloat16, seed=13)
    sinks = torch.linspace(-1.0, 2.0, 4, device="cuda")
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v, sinks)]
    out = facodegen.attention(*leaves[:3], causal=True, sinks=leaves[3])
    out.backward(do)
    with torch.no_grad():
        out2, lse = facodegen.attention(q, k, v, causal=True, return_lse=True, sinks=sinks)
    dq, dk, dv, dsinks = facodegen.attention_backward(do, q, k, v, out2, lse, causal=True, sinks=sinks)
    assert torch.equal(out, out2) and torch.equal(leaves[3].grad, dsinks)
    torch.testing.assert_close(leaves[0].grad, dq, atol=2e-2, rtol=2e-2)   # dQ: fp32 atomics, any order
    assert torch.equal(leaves[1].grad, dk) and torch.equal(leaves[2].grad, dv)


@pytest.mark.parametrize("sq, sk, causal, window_size, heads", [(1023, 1024, True, (200, -1), "gqa"),
                                                                (700, 500, False, (64, 130), "mha")])
def test_deterministic_window_gradients_are_bit_identical_and_right(sq, sk, causal, window_size, heads):
    """deterministic=True with a window (the LOCAL kernels' dQ turns counted from each query block's first key
    block): two runs bit-identical, and right by FA3's criterion."""
    hq, hkv = HEADS[heads]
    q, k, v, do = make(1, sq, sk, hq, hkv, 128, torch.bfloat16, seed=sq + sk)
    scale = 128 ** -0.5
    hidden = _hidden(sq, sk, causal, window_size, False)
    out64, lse64, _ = reference(q, k, v, do, causal, scale, upcast=True, hidden=hidden)
    runs = [facodegen.attention_backward(do, q, k, v, out64.to(q.dtype), lse64.float().contiguous(), causal=causal,
                                         softmax_scale=scale, window_size=window_size, deterministic=True)
            for _ in range(2)]
    assert all(torch.equal(a, b) for a, b in zip(*runs))
    assert check_grads(runs[0], do, q, k, v, causal, scale, hidden=hidden) == []
