"""head_dim_v != head_dim (issue 40, part 2: V and O narrower than Q and K; DeepSeek MLA prefill is
192 / 128) on the CPU: the spec field and its errors, the name, header and emit line, the budget, the
rendered kernels (whole-width kernels unchanged), NVRTC compiles with no spills on sm_80 and sm_90a,
the TMA maps and a whole attention() call through the fake driver, the torch op's fake, autograd's
refusal, the paths that refuse it, the float64 reference and the fuzzer's draws.
(tests/gpu/test_head_dim_v_gpu.py runs the numerics.)"""

from __future__ import annotations

import math
import re

import numpy as np
import pytest

import facodegen
from facodegen import KernelSpec
from facodegen.codegen.render import emit
from facodegen.ops import api
from facodegen.runtime import tma
from facodegen.spec import SpecError, smem_bytes
from facodegen.spec.knobs import HEAD_DIMS_V
from facodegen.verify.reference import attention_reference, flash1_reference, flash2_reference, random_qkv
from forward_checks import compiled_clean

PAIRS = ((192, 128), (128, 64))


# ------------------------------------------------------------------ the spec

def test_head_dim_v_defaults_to_head_dim_and_is_named_only_when_it_differs():
    for arch in ("sm80", "sm90"):
        whole = KernelSpec(arch=arch, head_dim=128)
        assert whole.head_dim_v == 128 and not whole.split_v and "dv" not in whole.variant
        assert KernelSpec(arch=arch, head_dim=128, head_dim_v=128) == whole
        split = KernelSpec(arch=arch, head_dim=192, head_dim_v=128)
        assert split.split_v and split.variant.startswith(f"flash_fwd_{arch}_bf16_hd192_dv128_")
        assert split.replace(block_n=64).head_dim_v == 128          # a problem field: kept by replace
        assert split.replace(head_dim=128).head_dim_v == 128         # a new head_dim: V as wide again
        assert "head_dim_v" not in split.launch_fields()             # attention() reads it off v
    # a padded head_dim: head_dim_v = the problem's d (or the tile's) is "the same"
    padded = KernelSpec(arch="sm90", head_dim=80, head_dim_v=80)
    assert (padded.head_dim, padded.head_dim_real, padded.head_dim_v) == (96, 80, 96) and not padded.split_v
    assert KernelSpec(**padded.as_dict()) == padded


@pytest.mark.parametrize("fields, words", [
    (dict(head_dim=128, head_dim_v=60), "multiple of 8"),
    (dict(head_dim=128, head_dim_v=264), "multiple of 8 in [8, 256]"),
    (dict(head_dim=128, head_dim_v=0), "multiple of 8"),
    (dict(head_dim=128, head_dim_v=True), "integer"),
    (dict(head_dim=64, head_dim_v=128), "exceeds head_dim=64"),
    (dict(head_dim=128, head_dim_v=96), "64, 128, 192, 256"),
    (dict(head_dim=96, head_dim_v=64), "64, 128, 192, 256"),
    (dict(head_dim=80, head_dim_v=64), "padded head_dim=80"),
    (dict(arch="sm90", dtype="fp8", head_dim=128, head_dim_v=64), "fp8"),
    (dict(arch="sm80", head_dim=128, head_dim_v=64, schedule="fa1"), "schedule=fa1"),
])
def test_bad_head_dim_v_names_the_field(fields, words):
    with pytest.raises(SpecError, match=re.escape(words)) as err:
        KernelSpec(**{"arch": "sm80", **fields})
    assert err.value.field == "head_dim_v"


def test_every_pair_of_slab_multiples_makes_a_spec():
    for arch in ("sm80", "sm90"):
        for d in HEAD_DIMS_V:
            for dv in HEAD_DIMS_V:
                if dv < d:
                    for causal in (False, True):
                        assert KernelSpec(arch=arch, head_dim=d, head_dim_v=dv, causal=causal).head_dim_v == dv


def test_budget_counts_v_and_o_at_head_dim_v():
    # sm90 192 / 128: FA3's 128 x 128, O over the V ring: Q 48K + 2 x (K 48K + V 32K) + 1K of barriers
    spec = KernelSpec(arch="sm90", head_dim=192, head_dim_v=128)
    assert (spec.block_m, spec.block_n, spec.stages, spec.separate_o, spec.o_in_v) == (128, 128, 2, False, True)
    assert spec.smem_bytes == 128 * 192 * 2 + 2 * 128 * (192 + 128) * 2 + 1024
    # its own O buffer (32K) would not fit the H200's 227K
    with pytest.raises(SpecError, match="head_dim_v=128"):
        KernelSpec(arch="sm90", head_dim=192, head_dim_v=128, separate_o=True, o_in_v=False)
    # 112 keys leave room for it: Q 48K + O 32K + 2 x 112 x 320 x 2
    own_o = KernelSpec(arch="sm90", head_dim=192, head_dim_v=128, block_n=112, o_in_v=False)
    assert own_o.separate_o and own_o.smem_bytes == 48 * 1024 + 32 * 1024 + 2 * 112 * 320 * 2 + 1024
    # sm90 128 / 64: head_dim 128's tile, V and O half as wide
    spec = KernelSpec(arch="sm90", head_dim=128, head_dim_v=64)
    assert (spec.block_n, spec.separate_o) == (160, True)
    assert spec.smem_bytes == 32 * 1024 + 16 * 1024 + 2 * 160 * (128 + 64) * 2 + 1024
    # sm80: the V ring keeps K's rows (head_dim columns, head_dim_v of them loaded)
    spec = KernelSpec(arch="sm80", head_dim=192, head_dim_v=128)
    assert smem_bytes(spec) == smem_bytes(KernelSpec(arch="sm80", head_dim=192))
    # O's registers: head_dim_v / 2 a consumer thread on sm90
    from facodegen.spec import register_estimate
    assert register_estimate(KernelSpec(arch="sm90", head_dim=192, head_dim_v=128)) == 64 + 64 + 32 + 32


# ------------------------------------------------------------------ rendering

@pytest.mark.parametrize("arch", ["sm80", "sm90"])
def test_header_emit_line_and_constants(arch):
    spec = KernelSpec(arch=arch, head_dim=192, head_dim_v=128, causal=True)
    src = emit(spec)
    assert "--head-dim 192 --head-dim-v 128" in src.splitlines()[4]
    assert re.search(r"//   head_dim_v\s+= 128", src) and "head dim of V and O: d_v = 128" in src
    assert "constexpr int HEAD_DIM_V" in src
    if arch == "sm90":
        assert "wgmma_rs_n128(" in src and "wgmma_rs_n192(" not in src       # O += P V: N = d_v
        assert "load_kv<V_SLABS>" in src and "V_TILE_BYTES" in src
    else:
        assert "load_kv_tile<V_ROW_CHUNKS>" in src and "V_ROW_CHUNKS" in src


def test_whole_width_kernels_do_not_mention_head_dim_v():
    for spec in facodegen.default_specs()[::3]:
        src = emit(spec)
        assert "HEAD_DIM_V" not in src and "head_dim_v" not in src and "--head-dim-v" not in src


def test_cli_emit_takes_head_dim_v():
    from click.testing import CliRunner

    from facodegen.cli import main
    runner = CliRunner()
    result = runner.invoke(main, ["emit", "--arch", "sm90", "--head-dim", "192", "--head-dim-v", "128"])
    assert result.exit_code == 0, result.output
    assert "flash_fwd_sm90_bf16_hd192_dv128_bm128_bn128" in result.output
    line = next(x for x in result.output.splitlines() if x.startswith("//   facodegen emit"))
    again = runner.invoke(main, line.removeprefix("//   facodegen ").split())
    assert again.exit_code == 0 and again.output == result.output      # the header's line reproduces it
    bad = runner.invoke(main, ["emit", "--arch", "sm80", "--head-dim", "128", "--head-dim-v", "100"])
    assert bad.exit_code != 0 and "head_dim_v" in bad.output


# ------------------------------------------------------------------ compiled: no spills, the instructions

compiler = pytest.importorskip("facodegen.runtime.compiler")

COMPILED = [KernelSpec(arch=a, head_dim=d, head_dim_v=dv, causal=c, dtype=t)
            for a in ("sm80", "sm90") for d, dv in PAIRS for c in (False, True)
            for t in (("bf16",) if (d, c) != (128, True) else ("fp16",))] + [
    # the knobs around O's place and the V loads on sm90: its own O buffer, O over Q, two Q buffers,
    # clusters (multicast V halves), an L2 prefetch of V; the variants
    KernelSpec(arch="sm90", head_dim=192, head_dim_v=128, block_n=112, o_in_v=False),
    KernelSpec(arch="sm90", head_dim=192, head_dim_v=128, o_in_v=False, separate_o=False),
    KernelSpec(arch="sm90", head_dim=128, head_dim_v=64, causal=True, pingpong=True, o_in_v=True, q_stages=2),
    KernelSpec(arch="sm90", head_dim=256, head_dim_v=128, cluster_m=2),
    KernelSpec(arch="sm90", head_dim=192, head_dim_v=128, l2_prefetch=2),
    KernelSpec(arch="sm90", head_dim=192, head_dim_v=128, causal=True, local=True, softcap=True, sinks=True),
    KernelSpec(arch="sm80", head_dim=192, head_dim_v=128, causal=True, local=True, softcap=True, sinks=True),
    KernelSpec(arch="sm80", head_dim=256, head_dim_v=64, dtype="fp16"),
]


@pytest.mark.parametrize("spec", COMPILED, ids=lambda s: s.variant)
def test_head_dim_v_kernels_compile_clean(spec):
    kernel, counts = compiled_clean(spec)
    if spec.arch == "sm90":
        sass = kernel.sass()
        assert f"HGMMA.64x{spec.block_n}x16.F32" in sass              # S = Q K^T: N = block_n
        assert f"HGMMA.64x{spec.head_dim_v}x16.F32" in sass           # O += P V: N = head_dim_v
        if spec.head_dim != spec.block_n:
            assert f"HGMMA.64x{spec.head_dim}x16" not in sass         # nothing is head_dim wide
        # the consumers run within their setmaxnreg budget (ptxas reports the entry count)
        assert max(int(x) for x in re.findall(r"\bR(\d+)\b", sass)) < spec.consumer_regs


def test_sm80_p_v_covers_head_dim_v_only():
    """The P V MMAs span d_v: fewer HMMA than the whole-width kernel's, the same Q K^T."""
    split = compiler.compile(KernelSpec(arch="sm80", head_dim=192, head_dim_v=128))
    whole = compiler.compile(KernelSpec(arch="sm80", head_dim=192))
    # 8 warps x 16 rows, 64 keys: Q K^T 12 k16 x 8 n8, P V 4 k16 x (d_v / 8) n8
    assert split.sass_counts()["HMMA"] == 12 * 8 + 4 * 16
    assert whole.sass_counts()["HMMA"] == 12 * 8 + 4 * 24


# ------------------------------------------------------------------ host side: TMA maps, a whole call

PTR = 1 << 20


@pytest.mark.parametrize("d, dv", PAIRS)
def test_tma_maps_of_v_and_o_are_head_dim_v_wide(d, dv):
    spec = KernelSpec(arch="sm90", head_dim=d, head_dim_v=dv)
    b, s, h, hkv = 2, 17, 4, 2
    maps = tma.tensor_map_args(spec, PTR, PTR + (1 << 16), PTR + (2 << 16), PTR + (3 << 16), b, s, s, h, hkv,
                               (s * h * d, h * d, d), (s * hkv * d, hkv * d, d), (s * hkv * dv, hkv * dv, dv),
                               (s * h * dv, h * dv, dv))
    assert {n: a.dims[0] for n, a in maps.items()} == {"tma_q": d, "tma_k": d, "tma_v": dv, "tma_o": dv}
    assert maps["tma_v"].strides[0] == hkv * dv * 2 and maps["tma_o"].strides[0] == h * dv * 2
    assert {a.box[0] for a in maps.values()} == {64}            # one slab geometry: 128B, 64 columns


from test_plan_cache import fake  # noqa: E402,F401
from fakes import FakeTensor, param_field as _field  # noqa: E402


@pytest.mark.usefixtures("fake")
@pytest.mark.parametrize("arch", ("sm80", "sm90"))
def test_a_call_with_a_narrower_v_runs_the_head_dim_v_kernel(monkeypatch, arch):
    encoded = []
    monkeypatch.setattr(tma, "encode", lambda args: encoded.append(args) or bytes(128))
    q, k, v = FakeTensor((2, 33, 4, 192)), FakeTensor((2, 40, 2, 192)), FakeTensor((2, 40, 2, 128))
    call = api.prepare(q, k, v, causal=True, arch=arch)
    assert (call.spec.head_dim, call.spec.head_dim_v) == (192, 128)
    assert call.spec.variant.startswith(f"flash_fwd_{arch}_bf16_hd192_dv128_")
    assert call.out.shape == (2, 33, 4, 128)
    assert math.isclose(_field(call._param_bytes, call.spec, "softmax_scale"), 1 / math.sqrt(192), rel_tol=1e-6)
    assert _field(call._param_bytes, call.spec, "o_row_stride") == 4 * 128
    assert _field(call._param_bytes, call.spec, "v_row_stride") == 2 * 128
    if arch == "sm90":
        assert [a.dims[0] for a in encoded] == [192, 192, 128, 128]
    # attention(): the first call takes the checked path, the second the plan-cache hit; both make O d_v wide
    for _ in range(2):
        out = facodegen.attention(q, k, v, causal=True, arch=arch)
        assert out.shape == (2, 33, 4, 128)


@pytest.mark.usefixtures("fake")
def test_call_errors_name_the_argument():
    q, k = FakeTensor((1, 16, 2, 192)), FakeTensor((1, 16, 2, 192))
    with pytest.raises(ValueError, match=r"out has shape \(1, 16, 2, 192\); expected .*head_dim_v"):
        facodegen.attention(q, k, FakeTensor((1, 16, 2, 128)), out=FakeTensor((1, 16, 2, 192)))
    with pytest.raises(ValueError, match="head_dim_v=256 exceeds head_dim=192"):
        facodegen.attention(q, k, FakeTensor((1, 16, 2, 256)))
    with pytest.raises(ValueError, match="head_dim_v=96 with head_dim=192"):
        facodegen.attention(q, k, FakeTensor((1, 16, 2, 96)))
    with pytest.raises(ValueError, match="same shape but for v's head_dim"):
        facodegen.attention(q, k, FakeTensor((1, 17, 2, 128)))


def view(name, shape, dtype="bfloat16"):
    return api._View(name, "torch", 1 << 20, shape, tuple(int(np.prod(shape[i + 1:])) for i in range(4)), dtype, 0)


def test_the_paths_without_head_dim_v_say_so():
    q, k, v = view("q", (1, 16, 2, 128)), view("k", (1, 16, 2, 128)), view("v", (1, 16, 2, 64))
    with pytest.raises(ValueError, match=r"head_dim_v of its own .* attention\(\) and attention_varlen"):
        api._check_inputs(q, k, v, what="attention_backward")
    with pytest.raises(ValueError, match="fp8 takes no head_dim_v"):
        api.check_fp8_inputs(*(view(n, s.shape, "float8_e4m3fn") for n, s in (("q", q), ("k", k), ("v", v))), "row")
    from facodegen.ops import kvcache
    cache = view("k_cache", (1, 64, 2, 128))
    with pytest.raises(ValueError, match="head_dim_v of its own"):
        kvcache.check_arguments(q, cache, view("v_cache", (1, 64, 2, 64)), None, None, None, None, None, 0)


def test_autograd_and_the_torch_op():
    torch = pytest.importorskip("torch")
    from facodegen.ops import torch_op
    q = torch.zeros(1, 4, 2, 192, requires_grad=True)
    with pytest.raises(NotImplementedError, match="head_dim_v=128, head_dim=192.* no backward yet"):
        torch_op._refuse_without_backward(q, None, None, torch.zeros(1, 4, 2, 128))
    torch_op._refuse_without_backward(q, None, None, torch.zeros(1, 4, 2, 192))     # the same width: fine
    # the op's fake (what torch.compile traces): O takes v's head dim
    meta = lambda *s: torch.empty(*s, dtype=torch.bfloat16, device="meta")  # noqa: E731
    q, k, v = meta(2, 100, 8, 192), meta(2, 77, 2, 192), meta(2, 77, 2, 128)
    out, lse = torch.compile(lambda q, k, v: facodegen.attention(q, k, v, causal=True, return_lse=True),
                             fullgraph=True, backend="eager")(q, k, v)
    assert out.shape == (2, 100, 8, 128) and lse.shape == (2, 8, 100)


# ------------------------------------------------------------------ the float64 reference

@pytest.mark.parametrize("d, dv", PAIRS)
@pytest.mark.parametrize("causal", [False, True])
def test_reference_equals_a_zero_padded_v_cut_to_d_v(d, dv, causal):
    """O with V of d_v columns is the first d_v columns of O with V zero-padded to d; the tiled
    FlashAttention-1 and -2 references agree with the direct formula."""
    rng = np.random.default_rng(d + dv)
    q, k = rng.standard_normal((2, 37, 4, d)), rng.standard_normal((2, 50, 2, d))
    v = rng.standard_normal((2, 50, 2, dv))
    o, lse = attention_reference(q, k, v, causal=causal)
    assert o.shape == (2, 37, 4, dv)
    padded = np.concatenate([v, np.zeros(v.shape[:3] + (d - dv,))], axis=3)
    o_pad, lse_pad = attention_reference(q, k, padded, causal=causal)
    np.testing.assert_allclose(o, o_pad[..., :dv], rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(o_pad[..., dv:], 0.0)
    np.testing.assert_array_equal(lse, lse_pad)
    for tiled in (flash1_reference, flash2_reference):
        got, got_lse = tiled(q, k, v, causal=causal, block_m=16, block_n=16)
        np.testing.assert_allclose(got, o, rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(got_lse, lse, rtol=1e-12, atol=1e-12)
    # the default scale is Q's and K's 1/sqrt(d)
    scaled, _ = attention_reference(q, k, v, causal=causal, softmax_scale=1 / math.sqrt(d))
    np.testing.assert_array_equal(scaled, o)


def test_random_qkv_draws_a_narrower_v():
    q, k, v = random_qkv(1, 5, 7, 4, 2, 192, "fp16", seed=1, head_dim_v=128)
    assert (q.shape, k.shape, v.shape) == ((1, 5, 4, 192), (1, 7, 2, 192), (1, 7, 2, 128))


# ------------------------------------------------------------------ the fuzzer

def test_the_head_dims_family_draws_narrower_vs(monkeypatch):
    from facodegen.verify import fuzz
    info = api.DeviceInfo(0, "NVIDIA H200", (9, 0), 132, 232448)
    monkeypatch.setattr(api, "device_info", lambda ordinal: info)
    cases = fuzz.generate(200, seed=3, family="head_dims")
    split = [c for c in cases if c.head_dim_v]
    assert split and {(c.head_dim, c.head_dim_v) for c in split} == set(fuzz.SPLIT_V_PAIRS)
    assert all(c.seed % 4 == 3 for c in split) and all(c.seed % 4 != 3 for c in cases if not c.head_dim_v)
    for c in split[:6]:
        spec = fuzz.case_spec(c)
        assert (spec.head_dim, spec.head_dim_v, spec.arch) == (c.head_dim, c.head_dim_v, c.arch)
        assert fuzz.Case.from_json(c.to_json()) == c
    sweep = [c for c in fuzz.representative_cases() if c.head_dim_v]
    assert {(c.arch, c.head_dim, c.head_dim_v) for c in sweep} == {("sm80", 192, 128), ("sm90", 192, 128)}
