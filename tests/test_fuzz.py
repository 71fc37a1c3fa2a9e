"""The fuzzer's cases and reference on the CPU (its GPU run is `facodegen check --fuzz N`)."""

from __future__ import annotations

import collections
import dataclasses

import numpy as np
import pytest

from facodegen.ops import api
from facodegen.verify import fuzz
from facodegen.spec import HEAD_DIMS
from facodegen.spec import decode as dec


def test_cases_are_seeded_valid_and_cover_the_options():
    cases = fuzz.generate(3000, seed=5)
    assert cases == fuzz.generate(3000, seed=5) and cases != fuzz.generate(3000, seed=6)
    for c in cases:
        assert c.head_dim in HEAD_DIMS and c.heads_q % c.heads_kv == 0
        assert 1 <= c.seqlen_q <= 8192 and 1 <= c.seqlen_k <= 8192
        assert c.batch * c.heads_q * c.seqlen_q * c.seqlen_k <= fuzz.MAX_SCORES
        assert c.dtype != "fp8" or c.arch == "sm90"
    seen = collections.defaultdict(set)
    for c in cases:
        for name in ("arch", "dtype", "causal", "layout", "return_lse", "use_out", "head_dim"):
            seen[name].add(getattr(c, name))
        seen["gqa"].add(c.heads_q // c.heads_kv)
        seen["scaled"].add(c.softmax_scale is not None)
        seen["large"].add(c.magnitude > 1)
        seen["short"].add(min(c.seqlen_q, c.seqlen_k) < 8)
    assert seen["dtype"] == {"bf16", "fp16", "fp8"} and seen["layout"] == set(fuzz.LAYOUTS)
    assert seen["gqa"] == {1, 2, 4, 8} and seen["head_dim"] == set(HEAD_DIMS)
    for name in ("causal", "return_lse", "use_out", "scaled", "large", "short"):
        assert seen[name] == {False, True}, name


def test_the_kernels_stay_a_bounded_set():
    """Shapes vary freely; the specs they resolve to (arch x dtype x head_dim x causal and the
    sequence-length rules) do not, so 10,000 cases compile a few dozen kernels."""
    specs = {api.spec_for_shape(c.arch, c.head_dim, c.dtype, c.causal,
                                (c.batch, c.seqlen_q, c.seqlen_k, c.heads_q), gpu="h200")
             for c in fuzz.generate(10000, seed=1)}
    assert len(specs) <= 120, len(specs)


def test_a_case_reruns_from_its_command():
    case = fuzz.generate(1, seed=3)[0]
    command = case.repro()
    assert command.startswith("facodegen check --fuzz-case '")
    assert fuzz.Case.from_json(command.split("'")[1]) == case


def test_the_fuzz_reference_is_the_float64_reference():
    torch = pytest.importorskip("torch")
    from facodegen.verify.reference import attention_reference
    for sq, sk, hq, hkv, causal in ((17, 33, 4, 2, True), (33, 17, 2, 1, True), (5, 5, 2, 2, False)):
        g = torch.Generator().manual_seed(sq)
        q, k, v = (torch.randn(2, s, h, 16, generator=g) for s, h in ((sq, hq), (sk, hkv), (sk, hkv)))
        scale = 0.3
        out, lse = fuzz.attention_torch(q, k, v, causal, scale, upcast=True)
        ref, ref_lse = attention_reference(q.numpy(), k.numpy(), v.numpy(), causal=causal, softmax_scale=scale)
        assert abs(out.numpy() - ref).max() < 1e-12
        np.testing.assert_allclose(lse.numpy(), ref_lse, rtol=0, atol=1e-12)    # -inf where no key is visible
        low, _ = fuzz.attention_torch(q.to(torch.bfloat16), k.to(torch.bfloat16), v.to(torch.bfloat16), causal,
                                      scale, upcast=False)
        assert low.dtype == torch.bfloat16 and 0 < (low.double() - out).abs().max() < 5e-2


def test_representative_cases_cover_each_arch_dtype_and_causal():
    cases = fuzz.representative_cases()
    assert {(c.arch, c.dtype, c.causal) for c in cases} == {
        (a, d, c) for a, ds in (("sm80", ("bf16", "fp16")), ("sm90", ("bf16", "fp16", "fp8"))) for d in ds
        for c in (False, True)}
    variants = [c for c in cases if c.family == "variants"]
    assert {(c.arch, c.causal) for c in variants} == {(a, c) for a in ("sm80", "sm90") for c in (False, True)}
    assert {c.family for c in cases} == set(fuzz.FAMILIES)
    assert {(c.arch, c.dtype, c.causal) for c in cases if c.family == "backward"} == {
        (a, d, c) for a in ("sm80", "sm90") for d in ("bf16", "fp16") for c in (False, True)}
    # the sm90 backward's three splits (dQ by columns at head_dim 128, by keys at 64; at 256 both warpgroups
    # on the same keys, each half of head_dim), none deterministic (and 80 on the 96 tile: case 57)
    assert {c.head_dim for c in cases if c.family == "backward" and c.arch == "sm90" and not c.deterministic} == {
        64, 80, 128, 256}
    # and one with more key blocks than an H200 has SMs: persistent CTAs that take several
    assert any(c.family == "backward" and c.arch == "sm90" and -(-c.seqlen_k // 128) * c.heads_kv * c.batch > 132
               for c in cases)
    # the tile order before lpt (attention_backward(..., lpt=False), case.lpt_flipped) on such a launch
    assert [c.head_dim for c in cases if c.lpt_flipped] == [64, 80]     # (80: case 57, below)
    assert all(c.causal and not c.deterministic for c in cases if c.lpt_flipped)
    # and the rings away from their defaults (case.shallow_rings): a head_dim whose default dO ring is 2 deep
    # and one whose dQ tile is already in pieces
    rings = [c for c in cases if c.shallow_rings]
    assert {c.head_dim for c in rings} == {128, 256} and not any(c.deterministic or c.lpt_flipped for c in rings)
    # and dq_lag (case.dq_lag_flipped: head_dim 128's warpgroups handing dS^T over by mbarriers): case 46
    assert [(i, c.head_dim, c.causal) for i, c in enumerate(cases) if c.dq_lag_flipped] == [(46, 128, True)]
    # and varlen_lpt (case.varlen_lpt: a sequence's tiles longest first over L2-sized groups of its heads),
    # the last case, with sequences long enough that a group holds fewer than all heads (head_dim 128:
    # 65,536 keys of K and V in a group)
    assert [i for i, c in enumerate(cases) if c.varlen_lpt] == [47]
    assert max(fuzz.varlen_lengths(cases[47])[1]) * cases[47].heads_q > 65536
    # and varlen with all three attention variants (62: a window and softcap, whose backward runs too)
    assert [i for i, c in enumerate(cases) if c.family == "varlen" and c.has_variant] == [48, 55, 62]
    assert cases[48].sinks and cases[48].softcap and cases[48].window_left >= 0 and cases[48].arch == "sm90"
    # and the decode's window and softcap (paged, split, with an append)
    assert [i for i, c in enumerate(cases) if c.family == "kvcache" and c.has_variant] == [49]
    assert cases[49].page_size and cases[49].num_splits > 1 and cases[49].seqlen_new and cases[49].softcap
    # and fp8 varlen
    assert [i for i, c in enumerate(cases) if c.family == "varlen" and c.dtype == "fp8"] == [50, 55]
    # the varlen backward: the 16-bit varlen cases of seed 11, and deterministic, the last case
    assert [i for i, c in enumerate(cases) if c.varlen_backward] == [36, 37, 38, 39, 40, 41, 42, 43, 48, 51, 52,
                                                                      62]
    assert [(i, c.arch) for i, c in enumerate(cases) if c.varlen_backward and c.seed % 8 == 7] == [(51, "sm80"),
                                                                                                  (52, "sm90")]
    # and the sm80 backward with one warp a slab and looped GEMMs (case.sm80_knobs_flipped, turn 1)
    assert [i for i, c in enumerate(cases) if c.sm80_knobs_flipped] == [53]
    assert fuzz._second_call_knobs(cases[53]) == {"key_warps": 8, "dq_row_warps": 4, "k_unroll": 2, "stages": 1}
    # and fp8 with all three variants, alone and varlen (a window masking both edges of a row's keys)
    assert [(i, c.family) for i, c in enumerate(cases) if c.dtype == "fp8" and c.has_variant] == [(54, "variants"),
                                                                                                (55, "varlen")]
    assert all(cases[i].sinks and cases[i].softcap and cases[i].window_left > 0 < cases[i].window_right for i in (54, 55))
    # and an fp8 padded head dim (80 on the 96 tile)
    assert [i for i, c in enumerate(cases) if c.family == "head_dims" and c.dtype == "fp8"] == [56]
    # and the backward at a padded head dim (80 on the 96 tile) per arch: sm90's with lpt off too, sm80's deterministic
    assert [(i, c.arch) for i, c in enumerate(cases) if c.family == "backward"
            and c.head_dim not in (64, 96, 128, 192, 256)] == [(57, "sm90"), (58, "sm80")]
    assert cases[57].lpt_flipped and cases[58].deterministic and cases[57].causal and cases[58].causal
    # and the decode there (paged, split, an append)
    assert [i for i, c in enumerate(cases) if c.family == "kvcache" and c.head_dim == 80] == [59]
    assert cases[59].page_size and cases[59].num_splits > 1 and cases[59].seqlen_new
    assert len(cases) == 63
    assert cases[62].varlen_backward and cases[62].has_variant and not cases[62].sinks     # (its window, softcap)
    assert cases[48].varlen_backward and cases[48].sinks     # (the varlen variants case: its backward with sinks too)
    # the sliding-window backward, after each arch's forward (the sm80 LOCAL kernels both): cases 60, 61
    windowed = [(i, c.arch, c.causal) for i, c in enumerate(cases) if c.family == "backward" and fuzz.has_backward_variant(c)]
    assert windowed == [(60, "sm80", True), (61, "sm90", False)]
    assert not any(cases[i].deterministic for i in (60, 61))
    lengths_q, lengths_k = fuzz.varlen_lengths(cases[51])
    assert 0 in lengths_q and any(q > k for q, k in zip(lengths_q, lengths_k)) and cases[51].causal
    for arch in ("sm80", "sm90"):   # the turn counters too
        assert {c.deterministic for c in cases if c.family == "backward" and c.arch == arch} == {False, True}
    kv = [c for c in cases if c.family == "kvcache"]
    assert any(c.page_size and c.seqlen_new and c.num_splits > 1 for c in kv)
    assert all(c.sinks and c.softcap and c.window_left >= 0 for c in variants)
    # varlen on both archs' kernels (sm90: its own, TMA over the packed tokens), both dtypes and masks, and
    # sm90's fp8 (causal; and not, with the variants)
    assert {(c.arch, c.dtype, c.causal) for c in cases if c.family == "varlen"} == {
        (a, d, c) for a in ("sm80", "sm90") for d in ("bf16", "fp16") for c in (False, True)} | {
        ("sm90", "fp8", True), ("sm90", "fp8", False)}


def test_sanitizer_summaries_are_read():
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    import sanitize
    assert sanitize.errors_in("========= ERROR SUMMARY: 0 errors\n") == 0
    assert sanitize.errors_in("========= RACECHECK SUMMARY: 16 hazards displayed (16 errors, 0 warnings)") == 16
    assert sanitize.errors_in("Traceback ...") is None


def test_the_hostile_decode_cases_list_their_kernels(monkeypatch):
    """sanitize_decode.py compiles its cases' kernels in parallel first (fuzz.precompile over the
    cases' shapes as kvcache Cases): each names the decode kernel (and append/combine as it has them)."""
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    import sanitize_decode
    info = api.DeviceInfo(0, "NVIDIA H200", (9, 0), 132, 232448)
    monkeypatch.setattr(api, "device_info", lambda ordinal: info)
    for i in range(len(sanitize_decode.CASES)):
        name, *_, new, splits, fused, extra = sanitize_decode._case(i)
        specs = fuzz.case_specs(sanitize_decode.fuzz_case(i, "sm90"))
        decode = [s for s in specs if type(s).__name__ == "DecodeSpec"]
        # the window/softcap cases name the LOCAL / SOFTCAP decode kernel their call runs, the producer ones theirs
        assert [(s.local, s.softcap) for s in decode] == [("window_size" in extra, "softcap" in extra)], name
        assert [s.producer_warps for s in decode] == \
            [extra.get("producer_warps", dec.default_producer_warps("sm90", s.head_dim, s.split)) for s in decode], name
        kinds = {type(s).__name__ for s in specs}
        assert "DecodeSpec" in kinds and ("AppendSpec" in kinds) == bool(new), name
        if fused:   # the decode kernel merges its splits: no combine kernel to compile
            assert "CombineSpec" not in kinds and any(getattr(s, "fused_combine", False) for s in specs), name
        if "long split" in name:    # d256's 3-stage ring (split_stages) is under the sanitizer too
            assert [s.stages for s in specs if type(s).__name__ == "DecodeSpec"] == [3], name
    assert any(sanitize_decode._case(i)[11] for i in range(len(sanitize_decode.CASES)))
    assert any(sanitize_decode._case(i)[12] for i in range(len(sanitize_decode.CASES)))
    assert {sanitize_decode._case(i)[12].get("producer_warps", 0) for i in range(len(sanitize_decode.CASES))} == {0, 1, 2}


def test_the_hostile_varlen_cases_list_their_kernels(monkeypatch):
    """sanitize_varlen.py compiles its kernels through fuzz varlen Cases of the same shapes: each names the
    forward its calls run (persistent or not, fp8) and the varlen backward (the arch's, sm80's deterministic;
    none for fp8), and every kernel meets every hostile boundary set."""
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    import sanitize_varlen
    info = api.DeviceInfo(0, "NVIDIA H200", (9, 0), 132, 232448)
    monkeypatch.setattr(api, "device_info", lambda ordinal: info)
    monkeypatch.setattr(api, "_tuned_fields", lambda *a: None)
    for (label, arch, dtype, knobs, backward), case in zip(sanitize_varlen.KERNELS, sanitize_varlen.fuzz_cases()):
        forward, *rest = fuzz.case_specs(case)
        assert (forward.arch, forward.dtype, forward.varlen) == (arch, dtype, True), label
        assert forward.persistent == (arch == "sm90" and knobs.get("persistent", True)), label
        if backward is None:
            assert rest == [], label
        else:
            [spec] = rest
            assert (spec.arch, spec.varlen, spec.deterministic) == (backward[0], True,
                                                                    backward[1].get("deterministic", False)), label
    assert len(sanitize_varlen.CASES) == len(sanitize_varlen.KERNELS) * len(sanitize_varlen.BOUNDARIES)
    # the rows its finiteness checks read: each clamped span's first MAX_SEQLEN (64) rows, and in the
    # gradients the rows before the first span and after the last (zero_outside)
    rows = sanitize_varlen.defined_rows
    assert rows((0, 119, 119, 120), 120, False) == list(range(64)) + [119]
    assert rows((5, 10), 20, False) == list(range(5, 10)) and rows((5, 10), 20, True) == list(range(20))
    assert rows((-30, 40, 10 ** 6, 120), 120, True) == list(range(104))


def test_check_fuzz_without_a_gpu_is_one_clear_line(monkeypatch):
    from click.testing import CliRunner

    from facodegen import cli
    from facodegen.runtime import compiler
    monkeypatch.setattr(compiler, "gpu_available", lambda: (False, "no CUDA GPU (test)"))
    result = CliRunner().invoke(cli.main, ["check", "--fuzz", "10"])
    assert result.exit_code == 2 and "needs a CUDA GPU" in result.output


def test_case_spec_is_the_spec_the_call_resolves(monkeypatch):
    """check --fuzz compiles the kernels of its cases ahead (in parallel) from case_spec: it must name
    the kernel attention() will look up, or the run compiles them again one by one."""
    info = api.DeviceInfo(0, "NVIDIA H200", (9, 0), 132, 232448)
    monkeypatch.setattr(api, "device_info", lambda ordinal: info)
    monkeypatch.setattr(api, "_tuned_fields", lambda *a: None)
    for c in fuzz.generate(200, seed=2):
        spec = fuzz.case_spec(c)
        want = api.spec_for_shape(c.arch, c.head_dim, c.dtype, c.causal, (c.batch, c.seqlen_q, c.seqlen_k, c.heads_q),
                                  gpu="h200", **({"out_dtype": "bf16", "v_layout": "row"} if c.dtype == "fp8" else {}))
        assert spec == want
        assert (spec.dtype, spec.arch) == (c.dtype, c.arch)


def test_warm_cache_covers_what_the_gpu_tests_compile():
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    import warm_cache
    from facodegen.spec import default_fp8_specs, default_specs
    on_h200 = set(warm_cache.shipped_specs("sm90"))
    assert on_h200 == set(default_specs()) | set(default_fp8_specs())
    assert set(warm_cache.shipped_specs("sm80")) == {s for s in default_specs() if s.arch == "sm80"}


def test_backward_and_kvcache_families_are_drawn_within_their_kernels_limits():
    cases = fuzz.generate(4000, seed=9, family="all")
    by = collections.Counter(c.family for c in cases)
    # every family its share (#37 asks >= 2,000 per family of 10,000), refused draws redrawn in-family
    assert set(by) == set(fuzz.FAMILIES) and max(by.values()) - min(by.values()) <= 1, by
    for c in cases:
        if c.family == "backward":
            assert c.dtype in ("bf16", "fp16") and not c.use_out
            assert c.batch * c.heads_q * c.seqlen_q * c.seqlen_k <= fuzz.MAX_SCORES // 8
        if c.family == "kvcache":
            assert 1 <= c.seqlen_q <= 16 and c.layout == "contiguous" and c.dtype in ("bf16", "fp16")
            assert c.seqlen_new <= c.seqlen_k and c.page_size in fuzz.KVCACHE_PAGE_SIZES
            assert c.page_size == 0 or c.seqlen_k % c.page_size == 0
    kv = [c for c in cases if c.family == "kvcache"]
    assert {c.page_size for c in kv} == set(fuzz.KVCACHE_PAGE_SIZES) and {c.num_splits > 1 for c in kv} == {False, True}
    # about half of them merge their splits in the decode kernel (fused_combine), none of another family
    share = sum(c.fused_combine for c in kv) / len(kv)
    assert 0.4 < share < 0.6 and not any(c.fused_combine for c in cases if c.family != "kvcache")
    # about a quarter of the backward cases run autograd under torch.use_deterministic_algorithms
    share = sum(c.deterministic for c in cases if c.family == "backward") / by["backward"]
    assert 0.15 < share < 0.35 and not any(c.deterministic for c in cases if c.family != "backward")
    assert fuzz.Case.from_json(kv[0].to_json()) == kv[0]


def test_a_third_of_the_sm90_varlen_cases_run_one_cta_per_tile(monkeypatch):
    """sm90 varlen cases with seed 1 mod 3 call attention_varlen(..., persistent=False), the rest the
    persistent default; their specs (the kernels fuzz compiles first) say the same."""
    cases = [c for c in fuzz.generate(600, seed=9, family="varlen") if c.arch == "sm90"]
    share = sum(c.one_cta_per_tile for c in cases) / len(cases)
    assert 0.2 < share < 0.45, share
    assert not any(c.one_cta_per_tile for c in fuzz.generate(300, seed=9, family="all")
                   if not (c.family == "varlen" and c.arch == "sm90"))
    info = api.DeviceInfo(0, "NVIDIA H200", (9, 0), 132, 232448)
    monkeypatch.setattr(api, "device_info", lambda ordinal: info)
    for c in cases[:12]:
        spec = fuzz.case_spec(c)
        assert spec.varlen and spec.persistent == (not c.one_cta_per_tile)
    assert {c.one_cta_per_tile for c in cases[:12]} == {False, True}


def test_a_fifth_of_the_varlen_cases_have_attention_variants(monkeypatch):
    """Varlen cases with seed 4 mod 5 draw a window, softcap or sinks from their seed (bottom-right only),
    the others none; the cases drawn around them are those drawn before variants joined the family (the
    main draw is untouched); their specs carry the switches, resolved against max_seqlen's plan_bound."""
    cases = fuzz.generate(600, seed=9, family="varlen")
    with_variant = [c for c in cases if c.has_variant]
    assert {c.seed % 5 for c in with_variant} == {4} and len(with_variant) == sum(c.seed % 5 == 4 for c in cases)
    assert 0.12 < len(with_variant) / len(cases) < 0.28 and not any(c.top_left for c in cases)
    assert {bool(c.sinks) for c in with_variant} == {False, True} and any(c.softcap for c in with_variant)
    assert any((c.window_left, c.window_right) != (-1, -1) for c in with_variant)
    stripped = [dataclasses.replace(c, window_left=-1, window_right=-1, softcap=0.0, sinks=False) for c in cases]
    monkeypatch.setattr(fuzz, "_variant_fields", lambda rng, sq, sk: dict(window_left=-1, window_right=-1,
                                                                          softcap=0.0, sinks=False, top_left=False))
    assert fuzz.generate(600, seed=9, family="varlen") == stripped
    monkeypatch.undo()
    info = api.DeviceInfo(0, "NVIDIA H200", (9, 0), 132, 232448)
    monkeypatch.setattr(api, "device_info", lambda ordinal: info)
    for c in with_variant[:20]:
        spec = fuzz.case_spec(c)
        assert spec.varlen and spec.softcap == (c.softcap > 0) and spec.sinks == c.sinks


@pytest.mark.parametrize("family", ["varlen", "variants"])
def test_a_seventh_of_the_sm90_varlen_and_variants_cases_run_fp8(monkeypatch, family):
    """sm90 varlen and variants cases with seed 6 mod 7 run e4m3 inputs with descales (the attention variants
    too, where the case has them); their specs are the fp8 kernel's (varlen: V as the packed tokens; O in bf16)
    with the variants' switches."""
    cases = fuzz.generate(1200 if family == "varlen" else 400, seed=9, family=family)
    fp8 = [c for c in cases if c.dtype == "fp8"]
    assert fp8 and all(c.arch == "sm90" and c.seed % 7 == 6 for c in fp8)
    assert len(fp8) == sum(c.arch == "sm90" and c.seed % 7 == 6 for c in cases)
    assert any(c.has_variant for c in fp8)
    info = api.DeviceInfo(0, "NVIDIA H200", (9, 0), 132, 232448)
    monkeypatch.setattr(api, "device_info", lambda ordinal: info)
    for c in fp8[:10]:
        spec = fuzz.case_spec(c)
        assert spec.dtype == "fp8" and spec.v_layout == "row" and spec.out_dtype == "bf16"
        assert spec.varlen == (family == "varlen") and spec.softcap == (c.softcap > 0) and spec.sinks == c.sinks
        assert not spec.stream_k or not (spec.local or spec.varlen)
        if family == "varlen":
            assert not spec.defer_o_store


def test_a_fifth_of_the_kvcache_cases_have_a_window_or_softcap(monkeypatch):
    """kvcache cases with seed 3 mod 5 draw a window or softcap from their seed (never sinks or top-left), the
    others neither; case_specs' decode kernels carry the switches decode_window gives their call."""
    cases = fuzz.generate(600, seed=9, family="kvcache")
    with_variant = [c for c in cases if c.has_variant]
    assert {c.seed % 5 for c in with_variant} == {3} and len(with_variant) == sum(c.seed % 5 == 3 for c in cases)
    assert not any(c.sinks or c.top_left for c in cases)
    assert any(c.softcap for c in with_variant) and any(c.window_left >= 0 for c in with_variant)
    info = api.DeviceInfo(0, "NVIDIA H200", (9, 0), 132, 232448)
    monkeypatch.setattr(api, "device_info", lambda ordinal: info)
    from facodegen.ops import kvcache
    for c in with_variant[:30]:
        decode = fuzz.case_specs(c)[0]
        problem = kvcache._Problem(c.batch, c.seqlen_q, c.heads_q, c.heads_kv, c.head_dim, c.dtype, c.page_size > 0,
                                   c.page_size, c.batch * c.seqlen_k // c.page_size if c.page_size else 0, c.seqlen_k,
                                   c.seqlen_new)
        window = kvcache.decode_window((c.window_left, c.window_right), c.softcap, c.causal, problem)
        assert decode.kernel == "decode" and decode.softcap == (c.softcap > 0)
        assert decode.local == (window is not None and window.local)


def test_half_the_sm90_kvcache_cases_at_their_head_dims_set_producer_warps():
    """kvcache cases on sm90 at head_dim 64, 128 or 256 with seeds 2, 5 mod 12 take one producer warp, 8, 11
    mod 12 two, 3, 6 mod 12 none (with the combine kernel and fused_combine alike); every other case the
    call's default (None)."""
    cases = fuzz.generate(1200, seed=9, family="all")
    eligible = [c for c in cases if c.family == "kvcache" and c.arch == "sm90" and c.head_dim in (64, 128, 256)]
    assert {c.producer_warps for c in eligible} == {None, 0, 1, 2}
    assert all(c.producer_warps == {2: 1, 5: 1, 8: 2, 11: 2, 3: 0, 6: 0}.get(c.seed % 12) for c in eligible)
    assert {(c.producer_warps, c.fused_combine) for c in eligible if c.producer_warps is not None} == \
        {(w, fused) for w in (0, 1, 2) for fused in (False, True)}
    assert all(c.producer_warps is None for c in cases if c not in eligible)


def test_a_sixth_of_the_sm90_causal_varlen_cases_run_varlen_lpt(monkeypatch):
    """sm90 causal varlen cases with seed 2 mod 6 call attention_varlen(..., varlen_lpt=True): persistent
    ones only (not 1 mod 3), none elsewhere; their specs say so, and representative case 47 is one."""
    cases = [c for c in fuzz.generate(1200, seed=9, family="varlen") if c.arch == "sm90" and c.causal]
    share = sum(c.varlen_lpt for c in cases) / len(cases)
    assert 0.08 < share < 0.28, share
    assert not any(c.varlen_lpt and c.one_cta_per_tile for c in cases)
    assert not any(c.varlen_lpt for c in fuzz.generate(300, seed=9, family="all")
                   if not (c.family == "varlen" and c.arch == "sm90" and c.causal))
    info = api.DeviceInfo(0, "NVIDIA H200", (9, 0), 132, 232448)
    monkeypatch.setattr(api, "device_info", lambda ordinal: info)
    for c in cases[:30]:
        assert fuzz.case_spec(c).varlen_lpt == c.varlen_lpt
    assert {c.varlen_lpt for c in cases[:30]} == {False, True}
    case = fuzz.representative_cases()[47]
    assert case.varlen_lpt and fuzz.case_spec(case).varlen_lpt
    assert [c for c in fuzz.representative_cases() if c.varlen_lpt] == [case]


def _dense(name, shape, dtype):
    strides = [1]
    for n in reversed(shape[1:]):
        strides.insert(0, strides[0] * n)
    return api._View(name, "torch", 1 << 20, tuple(shape), tuple(strides), dtype, 0)


def test_case_specs_name_every_kernel_the_families_launch(monkeypatch):
    """precompile compiles what case_specs lists: the backward's forward and backward kernels, and the
    decode family's kernels as the call's own check_arguments and plan_specs pick them from the
    case's arrays (a wrong problem, e.g. the page count, would compile kernels the run never uses)."""
    from facodegen.ops import backward, kvcache
    info = api.DeviceInfo(0, "NVIDIA H200", (9, 0), 132, 232448)
    monkeypatch.setattr(api, "device_info", lambda ordinal: info)
    monkeypatch.setattr(api, "_tuned_fields", lambda *a: None)
    cases = fuzz.generate(3000, seed=4, family="all")
    for c in cases:
        specs = fuzz.case_specs(c)
        if c.family in ("forward", "variants", "head_dims"):
            assert specs == [fuzz.case_spec(c)]
        elif c.family == "backward":
            knobs = {"deterministic": True} if c.deterministic else {}
            causal, variant, _ = backward.variant_knobs((c.window_left, c.window_right),
                                                        "top_left" if c.top_left else "bottom_right", c.softcap,
                                                        c.sinks, c.causal, c.seqlen_q, c.seqlen_k, 1.0, {})
            # autograd's backward: sm80 after an sm80 forward, else the default (sm90 where it covers the call:
            # deterministic too, every head_dim, padded ones too)
            padded = c.head_dim not in (64, 96, 128, 192, 256)
            # (a window or softcap: the sm80 LOCAL / SOFTCAP kernels, which the sm90 backward has not; sinks either)
            arch = "sm80" if c.arch == "sm80" or set(variant) - {"sinks"} else "sm90"
            knobs.update(variant)
            lpt = [backward.choose(c.head_dim, c.dtype, causal, info, {"lpt": False, **variant}, arch)
                   ] if c.lpt_flipped else []
            rings = [backward.choose(c.head_dim, c.dtype, causal, info,
                                     fuzz.shallow_ring_knobs(c.head_dim, c.dtype, c.causal), arch)
                     ] if c.shallow_rings else []
            rings += [backward.choose(c.head_dim, c.dtype, causal, info, {"dq_lag": c.causal}, arch)
                      ] if c.dq_lag_flipped else []
            rings += [backward.choose(c.head_dim, c.dtype, causal, info,
                                      fuzz.sm80_flipped_knobs(c.head_dim, c.seed), arch)] if c.sm80_knobs_flipped else []
            assert specs == [fuzz.case_spec(c), backward.choose(c.head_dim, c.dtype, causal, info, knobs, arch), *lpt,
                             *rings]
            assert specs[1].deterministic == c.deterministic
            assert (specs[1].local, specs[1].softcap) == (variant.get("local", False), variant.get("softcap", False))
            lpt_default = arch == "sm90" and c.causal and not c.deterministic
            assert [s.lpt for s in specs[2:]] == [False] * len(lpt) + [lpt_default] * len(rings)
            assert (specs[1].head_dim_real, specs[1].dtype, specs[1].causal) == (c.head_dim, c.dtype, causal)
            assert specs[1].arch == arch and specs[1].padded == padded
        elif c.family == "varlen":      # as varlen._miss resolves it: its arch, max_seqlen's plan_bound in the shape
            from facodegen.ops import varlen
            bound = varlen.plan_bound
            shape = (c.batch, bound(c.seqlen_q), bound(c.seqlen_k), c.heads_q)
            local, causal, _, _ = api.window_params(c.window_left, c.window_right, c.causal, *shape[1:3])
            variant = dict(local=local, softcap=c.softcap > 0, sinks=c.sinks) if c.has_variant else {}
            bwd_causal, bwd_variant, _ = backward.variant_knobs((c.window_left, c.window_right), "bottom_right",
                                                                c.softcap, c.sinks, c.causal, *shape[1:3], 1.0, {})
            fp8 = {"out_dtype": "bf16", "v_layout": "row"} if c.dtype == "fp8" else {}
            assert specs == [api.resolve_spec(c.head_dim, c.dtype, causal, 0, varlen.check_arch(c.arch), shape=shape,
                                              varlen=True, **({"persistent": False} if c.one_cta_per_tile else {}),
                                              **({"varlen_lpt": True} if c.varlen_lpt else {}), **variant, **fp8)
                             ] + ([backward.choose(c.head_dim, c.dtype, bwd_causal, info, {
                                 "varlen": True, "deterministic": c.seed % 8 == 7, **bwd_variant},
                                 "sm80" if c.has_variant else c.arch)] if c.varlen_backward else [])
            assert c.varlen_backward == (c.dtype != "fp8" and c.seed % 4 == 3
                                         and c.heads_q * c.seqlen_q * c.seqlen_k <= fuzz.MAX_SCORES // 8)
        else:
            dtype = {"fp16": "float16", "bf16": "bfloat16"}[c.dtype]
            q = _dense("q", (c.batch, c.seqlen_q, c.heads_q, c.head_dim), dtype)
            rows = (c.batch * c.seqlen_k // c.page_size, c.page_size) if c.page_size else (c.batch, c.seqlen_k)
            kc, vc = (_dense(n, rows + (c.heads_kv, c.head_dim), dtype) for n in ("k_cache", "v_cache"))
            lengths = _dense("cache_seqlens", (c.batch,), "int32")
            table = _dense("page_table", (c.batch, c.seqlen_k // c.page_size), "int32") if c.page_size else None
            new = [_dense(n, (c.batch, c.seqlen_new, c.heads_kv, c.head_dim), dtype) if c.seqlen_new else None
                   for n in ("k", "v")]
            problem = kvcache.check_arguments(q, kc, vc, lengths, table, *new, None, c.num_splits)
            knobs = fuzz._kvcache_knobs(c)
            window = kvcache.decode_window((c.window_left, c.window_right), c.softcap, c.causal, problem)
            want, splits = kvcache.plan_specs(problem, c.arch, info.sms, c.num_splits, knobs, kvcache._smem_per_sm(info),
                                              window)
            assert specs == list(want.values())
            assert ("combine" in want) == (splits > 1 and not c.fused_combine) and ("append" in want) == (c.seqlen_new > 0)
            assert want["decode"].fused_combine == (splits > 1 and c.fused_combine)
            default = dec.default_producer_warps(c.arch, want["decode"].head_dim_real, splits > 1)   # (padded: 0)
            assert want["decode"].producer_warps == (default if c.producer_warps is None else c.producer_warps)
    with pytest.raises(ValueError, match="case_specs"):
        fuzz.case_spec(next(c for c in cases if c.family == "kvcache"))


def test_summary_counts_each_family():
    result = {"cases": 3, "failures": [], "by": {("kvcache", "sm90", "bf16"): [2, 0], ("backward", "sm80", "fp16"): [1, 0]}}
    table = fuzz.summary(result)
    assert "| kvcache | sm90 | bf16 | 2 | 0 |" in table and "| backward | sm80 | fp16 | 1 | 0 |" in table


def test_launch_only_checks_that_the_outputs_were_written():
    """The sanitizer sweep's children run facodegen's call without the references; a NaN left in
    a poisoned output (an element never written) or a +inf still fails the case."""
    torch = pytest.importorskip("torch")
    ok, _ = fuzz._launched(torch.zeros(3), torch.tensor([float("-inf"), 0.5]), None)
    assert ok
    ok, message = fuzz._launched(torch.zeros(3), torch.tensor([float("nan")]))
    assert not ok and "[1]" in message
    assert not fuzz._launched(torch.tensor([float("inf")]))[0]


def test_fa3_bound_is_twice_the_same_precision_error_plus_twice_the_rounding():
    torch = pytest.importorskip("torch")
    ref = torch.tensor([1.0, 1.0 + 2.0 ** -10, -3.0], dtype=torch.float64)
    low = ref + torch.tensor([0.0, 0.01, -0.02], dtype=torch.float64)
    rounding = ((ref.to(torch.bfloat16) + 0.3 - 0.3).double() - ref).abs().max().item()
    assert rounding > 0
    assert fuzz.fa3_bound(ref, low, torch.bfloat16) == pytest.approx(2 * 0.02 + 2 * rounding)
    assert fuzz.fa3_failure(low.to(torch.bfloat16), ref, low) is None
    assert "max err" in fuzz.fa3_failure((ref + 1).to(torch.bfloat16), ref, low)
    assert fuzz.fa3_failure(torch.tensor([float("nan")]), ref[:1], low[:1]) == "non-finite values"
    # a per-element floor comes off each element's error, not off the largest one
    got = (ref + torch.tensor([0.5, 0.0, 0.0], dtype=torch.float64)).to(torch.bfloat16)
    assert fuzz.fa3_failure(got, ref, low, torch.tensor([0.5, 0.0, 0.0], dtype=torch.float64)) is None
    assert "max err" in fuzz.fa3_failure(got, ref, low, torch.tensor([0.0, 0.5, 0.5], dtype=torch.float64))


def test_an_interrupted_run_reports_the_cases_it_ran(monkeypatch):
    """A time limit (SIGTERM under check --fuzz) or Ctrl-C ends the run with a table of what ran."""
    cases = fuzz.generate(5, seed=3)
    calls = []

    def run_case(case, launch_only=False):
        calls.append(case)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return True, "ok"
    monkeypatch.setattr(fuzz, "run_case", run_case)
    lines = []
    result = fuzz.run(cases, log=lines.append)
    assert result["interrupted"] and result["cases"] == 2 and not result["failures"]
    assert "interrupted after 2 of 5 cases" in lines[-1]
    assert "| all (interrupted) | | | 2 | 0 |" in fuzz.summary(result)


def test_a_hung_case_is_named_and_ends_the_process():
    """A kernel that never finishes blocks the run in a synchronize where no signal gets through: the
    watchdog names the case (its reproducer) and ends the process, so a time-limited device call
    reports the hang instead of coming back empty."""
    import threading
    import time
    case = fuzz.generate(1, seed=5)[0]
    lines, exits = [], []
    current, done = [(7, case, time.monotonic() - 10.0)], threading.Event()
    fuzz._watchdog(current, 1.0, lines.append, done, exit=exits.append)
    assert exits == [3] and lines[0].startswith("HUNG: case 7 still running after") and case.repro() in lines[0]
    lines.clear()
    current[0] = (8, case, time.monotonic())        # a case within its time: the watchdog waits
    threading.Timer(0.6, done.set).start()
    fuzz._watchdog(current, 1.0, lines.append, done, exit=exits.append)
    assert lines == [] and exits == [3]


def test_slow_cases_are_logged(monkeypatch):
    import time
    cases = fuzz.generate(2, seed=6)
    now = [0.0]

    def run_case(case, launch_only=False):
        now[0] += 7.0 if case is cases[0] else 0.5     # the first case is slow, the second is not
        return True, "ok"
    monkeypatch.setattr(fuzz, "run_case", run_case)
    monkeypatch.setattr(time, "monotonic", lambda: now[0])
    lines = []
    fuzz.run(cases, log=lines.append, case_seconds=None)
    assert len(lines) == 1 and lines[0].startswith("slow: case 1 took 7.0 s") and cases[0].repro() in lines[0]


def test_varlen_cases_are_16bit_on_both_archs_or_fp8_on_sm90_and_their_lengths_fit():
    cases = fuzz.generate(500, seed=4, family="varlen")
    assert {c.family for c in cases} == {"varlen"} and {c.arch for c in cases} == {"sm80", "sm90"}
    assert {c.dtype for c in cases} == {"bf16", "fp16", "fp8"} and {c.causal for c in cases} == {False, True}
    assert {c.arch for c in cases if c.dtype == "fp8"} == {"sm90"}
    drawn = set()
    for c in cases:
        lengths_q, lengths_k = fuzz.varlen_lengths(c)
        assert fuzz.varlen_lengths(c) == (lengths_q, lengths_k) and len(lengths_q) == len(lengths_k) == c.batch
        assert max(lengths_q) == c.seqlen_q and max(lengths_k) <= c.seqlen_k and sum(lengths_k) >= 1
        drawn |= {min(lengths_q), min(lengths_k)}
        fp8 = {"out_dtype": "bf16", "v_layout": "row"} if c.dtype == "fp8" else {}
        assert api.spec_for_shape(c.arch, c.head_dim, c.dtype, c.causal, (c.batch, c.seqlen_q, c.seqlen_k, c.heads_q),
                                  varlen=True, **fp8).varlen
    assert {0, 1} <= drawn


def test_adding_varlen_left_the_other_families_draws_unchanged(monkeypatch):
    """The families are appended: a single family's cases for a seed are what they were before varlen
    (the digests of the tree before it, commit 42b06b0), but for the kvcache cases' window and softcap
    (seed 3 mod 5, drawn from the case's seed after the main draw: stripped here, the rest as before) and
    the variants cases turned fp8 (sm90, seed 6 mod 7: left out here; the digest of the rest of the tree
    before them, b2a1ae6, is the same) and the backward and kvcache cases at a padded head_dim (seed 5 mod
    9, 7 mod 11: drawn without them here, BACKWARD_PADDED_EVERY = KVCACHE_PADDED_EVERY = 0), and the backward
    cases' sliding windows, softcaps and sinks (seed 6 mod 8, drawn from the case's seed after the main draw:
    stripped here)."""
    import hashlib
    before = {"forward": "bc988c84aecf", "variants": "21a6b55f402d", "backward": "34d69a1f7b28",
              "kvcache": "c7dd4993d16a"}
    for family, digest in before.items():
        cases = fuzz.generate(300, seed=1, family=family)
        if family == "kvcache":
            assert any(c.has_variant for c in cases)
            assert any(c.head_dim not in (64, 96, 128, 192, 256) for c in cases)
            monkeypatch.setattr(fuzz, "KVCACHE_PADDED_EVERY", 0)
            cases = fuzz.generate(300, seed=1, family=family)
            cases = [dataclasses.replace(c, window_left=-1, window_right=-1, softcap=0.0) for c in cases]
        if family == "variants":
            assert any(c.dtype == "fp8" for c in cases)
            cases = [c for c in cases if not (c.arch == "sm90" and c.seed % 7 == 6)]
        if family == "backward":
            assert any(c.head_dim not in (64, 96, 128, 192, 256) for c in cases)
            monkeypatch.setattr(fuzz, "BACKWARD_PADDED_EVERY", 0)
            cases = fuzz.generate(300, seed=1, family=family)
            assert any(c.has_variant for c in cases) and any(c.sinks for c in cases)
            cases = [dataclasses.replace(c, window_left=-1, window_right=-1, top_left=False, softcap=0.0, sinks=False)
                     for c in cases]
        assert hashlib.sha1("".join(c.to_json() for c in cases).encode()).hexdigest()[:12] == digest, family


def test_shallow_ring_cases_leave_every_ring_default():
    """case.shallow_rings (sm90 backward, seed 3 mod 8) runs a second attention_backward whose dO ring and
    dQ pieces both differ from the defaults at every head_dim (256's dO ring is 1 deep already), in a
    spec that exists; about an eighth of the sm90 backward draws, none of them deterministic or lpt."""
    from facodegen.spec.backward import BackwardSpec
    for head_dim in (64, 96, 128, 192, 256):
        for causal in (False, True):
            default = BackwardSpec(arch="sm90", head_dim=head_dim, causal=causal)
            knobs = fuzz.shallow_ring_knobs(head_dim, "bf16", causal)
            spec = default.replace(**knobs)
            assert spec.do_stages == 1 and spec.dq_pieces == 2 * default.dq_pieces
            assert spec.do_stages < default.do_stages or head_dim == 256
    cases = fuzz.generate(600, seed=31, family="backward")
    sm90 = [c for c in cases if c.arch == "sm90"]
    rings = [c for c in sm90 if c.shallow_rings]
    assert len(sm90) / 16 < len(rings) < len(sm90) / 4
    assert not any(c.deterministic or c.lpt_flipped for c in rings)
    assert {BackwardSpec(arch="sm90", head_dim=c.head_dim).head_dim for c in rings} == {64, 96, 128, 192, 256}


def test_a_quarter_of_the_sm80_backward_cases_flip_a_tuning_knob():
    """sm80 backward cases with seed 1 mod 4 call attention_backward once more with one tuning knob away from its
    tile's default, each of the four sets in turn (stages, one warp a slab with looped GEMMs, poly_exp2_tiles,
    frag_prefetch); each set makes a valid spec at every head_dim the family draws, padded ones too, that
    differs from the default there (and two stages only where the ring fits an A100)."""
    from facodegen.spec.backward import BackwardSpec
    cases = [c for c in fuzz.generate(2000, seed=3, family="backward") if c.arch == "sm80"]
    chosen = [c for c in cases if c.sm80_knobs_flipped]
    assert chosen and all(c.seed % 4 == 1 for c in chosen)
    assert not any(c.sm80_knobs_flipped for c in cases if c.seed % 4 != 1)
    assert {next(iter(fuzz.sm80_flipped_knobs(c.head_dim, c.seed))) for c in chosen} == {
        "stages", "key_warps", "poly_exp2_tiles", "frag_prefetch"}
    for d in sorted({c.head_dim for c in chosen} | {64, 96, 128, 192, 256}):
        default = BackwardSpec(arch="sm80", head_dim=d, gpu="h100")
        for seed in (1, 5, 9, 13, 29, 45):
            knobs = fuzz.sm80_flipped_knobs(d, seed)
            spec = BackwardSpec(arch="sm80", head_dim=d, gpu="h100", **knobs)
            assert spec != default and all(getattr(spec, k) == v for k, v in knobs.items()), (d, knobs)
            if knobs.get("stages") == 2:
                assert BackwardSpec(arch="sm80", head_dim=d, gpu="a100", **knobs).stages == 2


def test_backward_window_cases_and_their_criterion():
    """An eighth of the backward cases (seed 6 mod 8) carry a sliding window or a softcap (or both), none of them
    deterministic (the varlen family's take the window's turns), each a spec the sm80 backward builds;
    backward_failures with the case's variant passes float64's own gradients, rounded, and fails them against the
    plain reference."""
    import torch

    from facodegen.ops.api import window_params
    from facodegen.spec.backward import BackwardSpec
    cases = fuzz.generate(400, seed=60, family="backward")
    windowed = [c for c in cases if fuzz.has_backward_variant(c)]
    assert windowed and all(c.seed % 8 == 6 and not c.deterministic for c in windowed)
    assert all(not fuzz.has_backward_variant(c) for c in cases if c.seed % 8 != 6)
    for c in windowed:
        local, causal, _, _ = window_params(c.window_left, c.window_right, c.causal, c.seqlen_q, c.seqlen_k,
                                            c.top_left)
        BackwardSpec(arch="sm80", head_dim=c.head_dim, causal=causal, local=local, softcap=bool(c.softcap),
                     gpu="h100")
    assert any(c.softcap for c in windowed) and any(not c.softcap for c in windowed)
    torch.manual_seed(0)
    q, do = (torch.randn(1, 50, 2, 64).to(torch.bfloat16) for _ in range(2))
    k, v = (torch.randn(1, 70, 1, 64).to(torch.bfloat16) for _ in range(2))
    window = dict(window_size=(9, 3), top_left=True, softcap=2.0)
    inputs = [x.double().requires_grad_(True) for x in (q, k, v)]
    out, _ = fuzz.attention_torch(*inputs, True, 0.2, upcast=True, **window)
    grads = [g.to(torch.bfloat16) for g in torch.autograd.grad(out, inputs, do.double())]
    assert fuzz.backward_failures(q, k, v, do, True, 0.2, grads, **window) == []
    assert len(fuzz.backward_failures(q, k, v, do, True, 0.2, grads)) == 3
    assert any(c.sinks for c in windowed)


def test_the_sinks_gradient_criterion():
    """sinks_gradient_failures passes float64 autograd's own sink gradient (with a window and softcap) and fails it
    10% off; backward_failures takes the sinks in its references."""
    import torch
    torch.manual_seed(0)
    q, do = (torch.randn(1, 40, 4, 64).to(torch.bfloat16) for _ in range(2))
    k, v = (torch.randn(1, 50, 2, 64).to(torch.bfloat16) for _ in range(2))
    sinks = torch.randn(4) * 2
    variant = dict(window_size=(9, 3), top_left=False, softcap=5.0)
    inputs = [x.double().requires_grad_(True) for x in (q, k, v)] + [sinks.double().requires_grad_(True)]
    out, _ = fuzz.attention_torch(*inputs[:3], True, 0.2, upcast=True, sinks=inputs[3], **variant)
    grads = torch.autograd.grad(out, inputs, do.double())
    assert fuzz.sinks_gradient_failures([(q, k, v, do)], True, 0.2, grads[3].float(), sinks, **variant) == []
    assert fuzz.sinks_gradient_failures([(q, k, v, do)], True, 0.2, grads[3].float() * 1.1, sinks, **variant)
    assert fuzz.backward_failures(q, k, v, do, True, 0.2, [g.to(torch.bfloat16) for g in grads[:3]], sinks=sinks,
                                  **variant) == []
