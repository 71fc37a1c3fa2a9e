"""attention_varlen's backward on a GPU (facodegen.attention_varlen_backward: the sm80 backward built with
varlen=True, which runs on H100/H200 too, and there the sm90 one, TMA over the packed tokens): dQ, dK, dV of packed sequences against each sequence's
float64 gradients with FlashAttention-3's criterion (tests/gpu/test_backward_gpu.py's check_grads, per
sequence), over odd lengths (1, 17, 1000), empty sequences (no queries; queries with no key; q
longer than k under causal), GQA/MQA, every head_dim, fp16/bf16, causal or not; NaN-poisoned
gradient buffers (every covered row must be written); autograd through attention_varlen and
flash_attn_varlen_func (the forward's own O and LSE) against attention() on each sequence padded as
a batch of one; the deterministic mode bit-identical across runs; a second call with other
boundaries and the same totals (a plan-cache hit); sequences covering part of the buffers (dK, dV
outside them zero when the call makes them, untouched when given). Budget: under a minute on an H200.
"""

from __future__ import annotations

import itertools
from concurrent.futures import ThreadPoolExecutor

import pytest

torch = pytest.importorskip("torch")

from facodegen.runtime.compiler import gpu_available  # noqa: E402

HAVE_GPU, GPU_WHY = gpu_available()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not HAVE_GPU, reason=f"needs a CUDA GPU: {GPU_WHY}")]

import facodegen  # noqa: E402
from facodegen.ops import api, backward  # noqa: E402
from facodegen.spec.backward import BackwardSpec  # noqa: E402
from facodegen.verify.reference import sinks_gradient_reference  # noqa: E402
from test_backward_gpu import _hidden, check_grads, reference  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
HAVE_SM90 = HAVE_GPU and torch.cuda.get_device_capability() == (9, 0)
ARCHS = pytest.mark.parametrize("arch", ["sm80", pytest.param("sm90", marks=pytest.mark.skipif(
    not HAVE_SM90, reason="the sm90 backward needs an H100/H200"))])

# query lengths, key lengths, heads_q, heads_kv, head_dim, dtype
CASES = [
    ((1, 17, 1000, 0), (1, 17, 1000, 5), 4, 2, 128, "bf16"),      # odd lengths; a sequence with no query
    ((17, 1000, 1), (300, 17, 0), 8, 1, 64, "fp16"),               # MQA; q > k (causal: rows see none); no keys
    ((129, 64, 1), (128, 65, 3), 6, 3, 96, "bf16"),                # tile edges
    ((193, 7, 385), (191, 1, 500), 4, 1, 192, "fp16"),             # MQA, several query blocks
    ((300, 2, 77), (301, 200, 77), 2, 2, 256, "bf16"),             # head_dim 256's 64x64 tiles
    ((17, 300, 1), (40, 300, 2), 4, 2, 80, "bf16"),                # a padded head_dim: 80 on the 96 tile
    ((129, 5), (128, 200), 2, 1, 40, "fp16"),                      # 40 on the 64 tile, MQA
]


@pytest.fixture(scope="module", autouse=True)
def precompiled():
    """The varlen backward kernels these tests run, compiled in parallel."""
    info = api.device_info(torch.cuda.current_device())
    archs = ("sm80", "sm90") if info.compute_capability == (9, 0) else ("sm80",)
    specs = {BackwardSpec(arch=arch, head_dim=c[4], dtype=c[5], causal=causal, varlen=True)
             for arch in archs for c in CASES for causal in (False, True)}
    specs |= {BackwardSpec(arch=arch, head_dim=128, dtype="bf16", causal=causal, varlen=True, deterministic=True)
              for arch in archs for causal in (False, True)}
    specs |= {BackwardSpec(arch="sm90", head_dim=128, dtype="bf16", causal=True, varlen=True, **knobs)
              for knobs in ({"dq_tma_reduce": False}, {"dq_lag": True})} if "sm90" in archs else set()
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda spec: backward.compile(spec.replace(gpu=info.budget_gpu),
                                                    sm=api.device_target(spec.arch, info), verbose=False), specs))


def packed(lengths_q, lengths_k, hq, hkv, d, dtype, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    rand = lambda *s: torch.randn(*s, generator=gen, device="cuda").to(dtype)  # noqa: E731
    cu_q, cu_k = ([0, *itertools.accumulate(lengths)] for lengths in (lengths_q, lengths_k))
    q, do = rand(cu_q[-1], hq, d), rand(cu_q[-1], hq, d)
    k, v = rand(cu_k[-1], hkv, d), rand(cu_k[-1], hkv, d)
    as_tensor = lambda c: torch.tensor(c, dtype=torch.int32, device="cuda")  # noqa: E731
    return q, k, v, do, as_tensor(cu_q), as_tensor(cu_k)


def forward_of(q, k, v, cu_q, cu_k, causal, scale):
    """O (rounded to the dtype) and LSE (heads_q, total_q) of each sequence's float64 reference: the
    backward's inputs, so that only the backward is under test."""
    out = torch.zeros_like(q)
    lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), device="cuda")
    for (q0, q1), (k0, k1) in zip(_spans(cu_q), _spans(cu_k)):
        if q1 > q0 and k1 > k0:
            o, l_, _ = reference(q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], q[None, q0:q1], causal, scale,
                                 upcast=True)
            out[q0:q1], lse[:, q0:q1] = o[0].to(q.dtype), l_[0].float()
    return out, lse


def _spans(cu):
    cu = cu.tolist()
    return list(zip(cu, cu[1:]))


def check_sequences(grads, do, q, k, v, cu_q, cu_k, causal, scale, masks=None, softcap=0.0, sinks=None):
    """check_grads per sequence (a sequence with no query or no key: zero gradients); ``masks``: each sequence's
    hidden scores (a window's), ``softcap``: the logits' cap, ``sinks``: the sink logits."""
    dq, dk, dv = grads
    failures = []
    for b, ((q0, q1), (k0, k1)) in enumerate(zip(_spans(cu_q), _spans(cu_k))):
        if q1 == q0 or k1 == k0:
            if dq[q0:q1].abs().sum() or dk[k0:k1].abs().sum() or dv[k0:k1].abs().sum():
                failures.append(f"sequence {b} ({q1 - q0} queries, {k1 - k0} keys) has non-zero gradients")
            continue
        got = (dq[None, q0:q1], dk[None, k0:k1], dv[None, k0:k1])
        failures += [f"sequence {b}: {f}" for f in check_grads(got, do[None, q0:q1], q[None, q0:q1], k[None, k0:k1],
                                                               v[None, k0:k1], causal, scale,
                                                               hidden=None if masks is None else masks[b],
                                                               softcap=softcap, sinks=sinks)]
    return failures


@ARCHS
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"hd{c[4]}-{c[5]}-h{c[2]}/{c[3]}")
def test_varlen_gradients_match_float64(case, causal, arch):
    lengths_q, lengths_k, hq, hkv, d, dt = case
    q, k, v, do, cu_q, cu_k = packed(lengths_q, lengths_k, hq, hkv, d, DTYPES[dt], seed=d + causal)
    scale = d ** -0.5 if causal else 0.3
    out, lse = forward_of(q, k, v, cu_q, cu_k, causal, scale)
    poison = {n: torch.full_like(x, float("nan")) for n, x in (("dq", q), ("dk", k), ("dv", v))}
    grads = facodegen.attention_varlen_backward(do, q, k, v, out, lse, cu_q, cu_k, max(lengths_q), max(lengths_k),
                                                causal=causal, softmax_scale=scale, arch=arch, **poison)
    assert all(g is poison[n] for g, n in zip(grads, ("dq", "dk", "dv")))
    assert check_sequences(grads, do, q, k, v, cu_q, cu_k, causal, scale) == []


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_autograd_through_attention_varlen_matches_attention_per_sequence(causal):
    """torch.autograd through attention_varlen (its own forward's O and LSE) and through
    flash_attn_varlen_func against facodegen.attention's autograd on each sequence as a batch of one."""
    lengths = (1, 17, 300, 64)
    q, k, v, do, cu_q, cu_k = packed(lengths, lengths, 4, 2, 128, torch.bfloat16, seed=11)
    for call in ("attention_varlen", "flash_attn_varlen_func"):
        leaves = [x.detach().clone().requires_grad_(True) for x in (q, k, v)]
        out = getattr(facodegen, call)(*leaves, cu_q, cu_k, max(lengths), max(lengths), causal=causal)
        out.backward(do)
        for (q0, q1) in _spans(cu_q):
            parts = [x.detach()[None, q0:q1].clone().requires_grad_(True) for x in (q, k, v)]
            ref = facodegen.attention(*parts, causal=causal)
            ref.backward(do[None, q0:q1])
            for name, leaf, part in zip("qkv", leaves, parts):
                err = (leaf.grad[q0:q1].float() - part.grad[0].float()).abs().max().item()
                assert err <= 2e-2 * max(1.0, part.grad.abs().max().item()), (call, name, q0, err)


@ARCHS
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_deterministic_varlen_gradients_are_bit_identical(causal, arch):
    """deterministic=True: the key blocks add into a query block's dQ in turn (counters at each sequence's
    padded blocks), so three runs give the same bits, and the right ones."""
    lengths_q, lengths_k = (1000, 1, 0, 513), (700, 1, 9, 1500)
    q, k, v, do, cu_q, cu_k = packed(lengths_q, lengths_k, 8, 2, 128, torch.bfloat16, seed=5)
    out, lse = forward_of(q, k, v, cu_q, cu_k, causal, 0.1)
    runs = [facodegen.attention_varlen_backward(do, q, k, v, out, lse, cu_q, cu_k, 1000, 1500, causal=causal,
                                                softmax_scale=0.1, deterministic=True, arch=arch) for _ in range(3)]
    for later in runs[1:]:
        assert all(torch.equal(a.view(torch.int16), b.view(torch.int16)) for a, b in zip(runs[0], later))
    assert check_sequences(runs[0], do, q, k, v, cu_q, cu_k, causal, 0.1) == []


@ARCHS
def test_other_boundaries_with_the_same_totals_hit_the_plan(arch):
    lengths_a, lengths_b = (100, 28, 0, 1), (1, 0, 28, 100)
    q, k, v, do, cu_q, cu_k = packed(lengths_a, lengths_a, 4, 4, 64, torch.bfloat16, seed=2)
    cu_b = torch.tensor([0, *itertools.accumulate(lengths_b)], dtype=torch.int32, device="cuda")
    for cu in (cu_q, cu_b):
        out, lse = forward_of(q, k, v, cu, cu, True, 0.125)
        grads = facodegen.attention_varlen_backward(do, q, k, v, out, lse, cu, cu, 100, 100, causal=True,
                                                    softmax_scale=0.125, arch=arch)
        assert check_sequences(grads, do, q, k, v, cu, cu, True, 0.125) == []


@ARCHS
def test_tokens_outside_the_sequences(arch):
    """Boundaries covering part of the buffers: gradients made by the call are zero outside them (the
    preprocess writes the zeros: no fill launch), and given dK, dV keep what they held there (a TMA box of
    the next sequence's rows is read, never written)."""
    q, k, v, do, _, _ = packed((150,), (200,), 4, 2, 128, torch.bfloat16, seed=4)
    cu_q = torch.tensor([7, 20, 20, 120], dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([5, 5, 60, 190], dtype=torch.int32, device="cuda")
    out, lse = forward_of(q, k, v, cu_q, cu_k, False, 0.2)
    # NaN in the blocks torch's caching allocator hands dQ, dK, dV next: the zeros must be written
    poison = [torch.full_like(x, float("nan")) for x in (q, k, v)]
    del poison
    dq, dk, dv = facodegen.attention_varlen_backward(do, q, k, v, out, lse, cu_q, cu_k, 100, 130, softmax_scale=0.2,
                                                     arch=arch)
    outside_q = torch.ones(150, dtype=torch.bool, device="cuda")
    outside_q[7:120] = False
    outside_k = torch.ones(200, dtype=torch.bool, device="cuda")
    outside_k[5:190] = False
    assert not dq[outside_q].any() and not dk[outside_k].any() and not dv[outside_k].any()
    given = torch.full_like(k, -3.0)
    _, dk2, _ = facodegen.attention_varlen_backward(do, q, k, v, out, lse, cu_q, cu_k, 100, 130, softmax_scale=0.2,
                                                    dk=given, arch=arch)
    assert dk2 is given and (given[outside_k] == -3.0).all() and torch.equal(given[~outside_k], dk[~outside_k])
    local = (cu_q - 7, cu_k - 5)
    grads = (dq[7:120], dk[5:190], dv[5:190])
    assert check_sequences(grads, do[7:120], q[7:120], k[5:190], v[5:190], *local, False, 0.2) == []


@pytest.mark.skipif(not HAVE_SM90, reason="the sm90 backward needs an H100/H200")
@pytest.mark.parametrize("knobs", [{"dq_tma_reduce": False}, {"dq_lag": True}], ids=["vector-dq", "dq-lag"])
def test_sm90_varlen_knobs(knobs):
    """The sm90 varlen backward's dQ paths other than the default bulk reduce-add: every thread's vector
    adds into a row per packed token, and dq_lag's lagged write-out."""
    lengths_q, lengths_k = (1000, 1, 0, 513), (700, 1, 9, 1500)
    q, k, v, do, cu_q, cu_k = packed(lengths_q, lengths_k, 8, 2, 128, torch.bfloat16, seed=9)
    out, lse = forward_of(q, k, v, cu_q, cu_k, True, 0.1)
    grads = facodegen.attention_varlen_backward(do, q, k, v, out, lse, cu_q, cu_k, 1000, 1500, causal=True,
                                                softmax_scale=0.1, arch="sm90", **knobs)
    assert check_sequences(grads, do, q, k, v, cu_q, cu_k, True, 0.1) == []


@ARCHS
def test_hostile_boundaries_are_clamped_and_check_inputs_refuses_them(arch):
    """cu_seqlens that decrease, start below 0 and run past the packed tokens: check_inputs=True refuses
    them naming the argument; without it the forward and the backward clamp each sequence into the packed
    tokens and finish with finite outputs (scripts/sanitize_varlen.py shows no access outside them)."""
    q, k, v, do, _, _ = packed((120,), (90,), 4, 2, 128, torch.bfloat16, seed=6)
    cu_q = torch.tensor([0, 50, 20, 120], dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([-5, 10 ** 9, 50, 90], dtype=torch.int32, device="cuda")
    with pytest.raises(ValueError, match="cu_seqlens_q decreases at sequence 1"):
        facodegen.attention_varlen(q, k, v, cu_q, cu_k, 64, 64, check_inputs=True, arch=arch)
    # (max_seqlen 128 bounds every clamped span, [0, 50), [20, 120) and [0, 90), [50, 90): every row is some
    # sequence's; rows of a span longer than its max_seqlen, which check_inputs refuses, are not written)
    out, lse = facodegen.attention_varlen(q, k, v, cu_q, cu_k, 128, 128, causal=True, return_lse=True, arch=arch)
    with pytest.raises(ValueError, match="cu_seqlens_k\\[0\\] = -5 is negative"):
        facodegen.attention_varlen_backward(do, q, k, v, out, lse, cu_q.sort().values, cu_k, 128, 64,
                                            check_inputs=True)     # (sorted: q's boundaries pass, k's first is -5)
    grads = facodegen.attention_varlen_backward(do, q, k, v, out, lse, cu_q, cu_k, 128, 128, causal=True, arch=arch)
    torch.cuda.synchronize()
    assert not torch.isnan(out.float()).any() and all(torch.isfinite(g.float()).all() for g in grads)


@pytest.mark.parametrize("window_size, softcap, with_sinks", [((40, -1), 0.0, False), ((-1, -1), 5.0, False),
                                                              ((17, 9), 30.0, False), ((-1, -1), 0.0, True),
                                                              ((17, 9), 30.0, True)],
                         ids=["window", "softcap", "both", "sinks", "all"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_varlen_window_and_softcap_gradients_match_float64(window_size, softcap, with_sinks, causal):
    """attention_varlen_backward with a window on each sequence's diagonal, a softcap and sinks (the sm80 LOCAL,
    SOFTCAP and SINKS kernels, arch=None: on every GPU) against each sequence's float64 reference with them (FA3's
    criterion; a sequence with no query or key: zero gradients; the sinks' gradient summed over the sequences
    against the float64 formula's), inputs at 3x unit scale so that the cap bites."""
    lengths_q, lengths_k = [100, 0, 1, 257, 64], [120, 33, 0, 300, 64]
    q, k, v, do, cu_q, cu_k = packed(lengths_q, lengths_k, 4, 2, 128, torch.bfloat16, seed=21)
    q, k = q * 3, k * 3
    scale = 128 ** -0.5
    sinks = torch.linspace(-1.0, 2.0, 4, device="cuda") if with_sinks else None
    out, lse = torch.zeros_like(q), torch.full((q.shape[1], q.shape[0]), float("-inf"), device="cuda")
    if sinks is not None:   # (a sequence with no key: LSE = sink)
        lse[:] = sinks[:, None]
    dsinks_ref = 0.0
    masks = []
    for (q0, q1), (k0, k1) in zip(_spans(cu_q), _spans(cu_k)):
        hidden = _hidden(q1 - q0, k1 - k0, causal, window_size, False) if window_size != (-1, -1) else None
        masks.append(hidden)
        if q1 > q0 and k1 > k0:
            o, l_, _ = reference(q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], q[None, q0:q1], causal, scale,
                                 upcast=True, hidden=hidden, softcap=softcap, sinks=sinks)
            out[q0:q1], lse[:, q0:q1] = o[0].to(q.dtype), l_[0].float()
            if sinks is not None:
                dsinks_ref = dsinks_ref + sinks_gradient_reference(do[None, q0:q1].cpu(), o.cpu(), l_.cpu(),
                                                                   sinks.cpu())
    poison = {n: torch.full_like(x, float("nan")) for n, x in (("dq", q), ("dk", k), ("dv", v))}
    grads = facodegen.attention_varlen_backward(do, q, k, v, out, lse, cu_q, cu_k, max(lengths_q), max(lengths_k),
                                                causal=causal, softmax_scale=scale, window_size=window_size,
                                                softcap=softcap, sinks=sinks, **poison)
    assert check_sequences(grads[:3], do, q, k, v, cu_q, cu_k, causal, scale, masks, softcap, sinks) == []
    if sinks is not None:
        ref = torch.as_tensor(dsinks_ref)
        err = (grads[3].cpu().double() - ref).abs().max().item()
        assert err <= 2e-2 * ref.abs().max().item() + 1e-3, f"dsinks max err {err:.3e}"
