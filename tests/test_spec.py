"""KernelSpec validation, defaults and the budget model (CPU)."""

import dataclasses

import pytest

from facodegen.spec import (GPUS, KernelSpec, SpecError, default_specs, default_tiles, register_estimate,
                            smem_bytes)


def test_defaults_resolve_every_field():
    for spec in default_specs():
        for field in dataclasses.fields(spec):
            assert getattr(spec, field.name) is not None, (spec.variant, field.name)


def test_spec_is_frozen_and_hashable():
    a = KernelSpec(arch="sm80", head_dim=64)
    b = KernelSpec(arch="sm80", head_dim=64)
    assert a == b and hash(a) == hash(b)
    assert len({a, b, KernelSpec(arch="sm80", head_dim=128)}) == 2
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.block_m = 64


def test_keyword_only():
    with pytest.raises(TypeError):
        KernelSpec("sm80")


def test_user_values_win_over_defaults():
    spec = KernelSpec(arch="sm80", head_dim=128, block_n=32, stages=3)
    assert (spec.block_n, spec.stages) == (32, 3)
    assert spec.block_m == default_tiles("sm80", 128, "bf16", False, "a100").block_m


@pytest.mark.parametrize("fields, knob, words", [
    (dict(arch="sm70"), "arch", "sm80"),
    (dict(head_dim=84), "head_dim", "multiple of 8 in [8, 256]"),
    (dict(head_dim=264), "head_dim", "multiple of 8 in [8, 256]"),
    (dict(head_dim=96, head_dim_real=112), "head_dim_real", "use head_dim=128"),
    (dict(dtype="fp32"), "dtype", "bf16"),
    (dict(block_m=96, num_warps=4), "block_m", "multiple of 16*num_warps=64"),
    (dict(block_n=24), "block_n", "multiple of 16"),
    (dict(num_warps=3), "num_warps", "num_warps=3"),
    (dict(stages=0), "stages", "positive"),
    (dict(stages=5), "stages", "1 to 4"),
    (dict(causal="yes"), "causal", "True or False"),
    (dict(gpu="v100"), "gpu", "a100"),
    (dict(head_dim=256, block_m=256, num_warps=8, block_n=128), "block_m", "registers"),
    (dict(head_dim=256, block_n=128, stages=4, gpu="h200"), "stages", "shared memory"),
    (dict(arch="sm80", pingpong=True), "pingpong", "sm90 knob"),
    (dict(arch="sm90", q_in_regs=True), "q_in_regs", "only dtype=fp8"),
    (dict(arch="sm90", dtype="fp8", head_dim=256, q_in_regs=True), "block_n", "registers"),
    (dict(arch="sm90", consumer_warpgroups=4), "consumer_warpgroups", "1, 2, 3"),
    (dict(arch="sm90", block_m=128, consumer_warpgroups=3), "block_m", "64*consumer_warpgroups=192"),
    (dict(arch="sm90", num_warps=8), "num_warps", "4*(consumer_warpgroups+1)"),
    (dict(arch="sm90", consumer_warpgroups=1, pingpong=True), "pingpong", ">= 2"),
    (dict(arch="sm90", producer_regs=20), "producer_regs", "multiple of 8"),
    (dict(arch="sm90", producer_regs=64, consumer_regs=256), "consumer_regs", "register"),
    (dict(arch="sm90", head_dim=256, block_n=96), "stages", "shared memory"),
    (dict(arch="sm90", head_dim=128, block_n=256, stages=1), "block_n", "registers"),
    (dict(arch="sm80", ctas_per_sm=2), "ctas_per_sm", "sm90 knob"),
    (dict(arch="sm90", ctas_per_sm=4), "ctas_per_sm", "1, 2, 3"),
    (dict(arch="sm90", head_dim=128, consumer_warpgroups=1, ctas_per_sm=2, block_n=128), "ctas_per_sm",
     "2 CTAs per SM"),
    (dict(arch="sm90", head_dim=64, ctas_per_sm=2), "block_n", "consumer_regs=72"),
    (dict(arch="sm90", softmax_chains=3), "softmax_chains", "1, 2, 4, 8"),
    (dict(arch="sm90", uniform_wg="yes"), "uniform_wg", "True or False"),
    (dict(arch="sm90", head_dim=128, block_n=128, poly_exp2_tiles=17), "poly_exp2_tiles", "block_n/8 = 16"),
    (dict(arch="sm80", poly_exp2_tiles=-1), "poly_exp2_tiles", "from 0"),
    (dict(arch="sm90", poly_exp2_tiles=True), "poly_exp2_tiles", "integer"),
    (dict(arch="sm80", schedule="fa1", poly_exp2_tiles=2), "poly_exp2_tiles", "fa1"),
    (dict(arch="sm90", anchor_softmax=True, optimistic_max=True), "optimistic_max", "anchor_softmax=False"),
    (dict(arch="sm80", optimistic_max=True), "optimistic_max", "sm90 knob"),
    (dict(arch="sm80", l2_prefetch=1), "l2_prefetch", "sm90 knob"),
    (dict(arch="sm90", l2_prefetch=5), "l2_prefetch", "from 0 (off) to 4"),
    (dict(arch="sm90", dtype="fp8", l2_prefetch=True), "l2_prefetch", "integer"),
])
def test_each_invalid_field_names_its_knob(fields, knob, words):
    with pytest.raises(SpecError) as err:
        KernelSpec(**fields)
    assert err.value.field == knob
    assert words in str(err.value)
    assert isinstance(err.value, ValueError)


def test_optimistic_max_defaults_follow_the_measurements():
    on = [KernelSpec(arch="sm90", head_dim=128, causal=True), KernelSpec(arch="sm90", head_dim=64),
          KernelSpec(arch="sm90", head_dim=64, causal=True), KernelSpec(arch="sm90", head_dim=256, dtype="fp16"),
          KernelSpec(arch="sm90", head_dim=256, causal=True)]
    off = [KernelSpec(arch="sm90", head_dim=96), KernelSpec(arch="sm90", head_dim=192, causal=True),
           KernelSpec(arch="sm90", head_dim=64, dtype="fp8"), KernelSpec(arch="sm90", head_dim=128, dtype="fp8"),
           KernelSpec(arch="sm90", head_dim=128, anchor_softmax=True),
           KernelSpec(arch="sm80", head_dim=128)]
    assert all(s.optimistic_max for s in on) and not any(s.optimistic_max for s in off)


def test_fp8_anchor_and_chain_defaults_follow_the_measurements():
    """fp8: the anchored exact step at head_dim 64 and 128 (two chains at 128); the optimistic step
    only on request. The two defaults give way to an explicit value of the other, and two P
    buffers take the optimistic step. 16-bit kernels never anchor by default."""
    def fp8(**kw):
        return KernelSpec(arch="sm90", dtype="fp8", **kw)
    anchored = [fp8(head_dim=64), fp8(head_dim=64, causal=True), fp8(head_dim=128), fp8(head_dim=128, causal=True)]
    assert all(s.anchor_softmax and not s.optimistic_max for s in anchored)
    plain = [fp8(head_dim=256), fp8(head_dim=256, causal=True), fp8(head_dim=96),
             KernelSpec(arch="sm90", head_dim=64), KernelSpec(arch="sm90", head_dim=128, causal=True)]
    assert not any(s.anchor_softmax for s in plain)
    assert all(fp8(head_dim=128, causal=c).softmax_chains == 2 for c in (False, True))
    assert not any(fp8(head_dim=d, causal=c).optimistic_max for d in (64, 96, 128, 192, 256) for c in (False, True))
    explicit = fp8(head_dim=128, causal=True, optimistic_max=True)
    assert explicit.optimistic_max and not explicit.anchor_softmax
    two_p = fp8(head_dim=128, causal=True, p_buffers=2, producer_regs=24, consumer_regs=240)
    assert two_p.optimistic_max and not two_p.anchor_softmax
    assert not fp8(head_dim=64, anchor_softmax=False).anchor_softmax


def test_smem_budget_counts_bytes_and_stages():
    spec = KernelSpec(arch="sm80", head_dim=128, block_m=128, block_n=64, stages=2)
    # Q 128x128x2 bytes + 2 stages x (K + V) 64x128x2 bytes
    assert smem_bytes(spec) == 128 * 128 * 2 + 2 * 2 * 64 * 128 * 2
    deeper = KernelSpec(arch="sm80", head_dim=128, block_m=128, block_n=64, stages=3)
    assert smem_bytes(deeper) - smem_bytes(spec) == 2 * 64 * 128 * 2


def test_gpu_budget_changes_what_fits():
    # 192 KB: over the A100's 163 KB, within the H200's 227 KB.
    fields = dict(arch="sm80", head_dim=256, block_m=128, block_n=64, num_warps=8, stages=2)
    with pytest.raises(SpecError):
        KernelSpec(gpu="a100", **fields)
    assert KernelSpec(gpu="h200", **fields).smem_bytes == 196608


def test_defaults_fit_their_budgets():
    for spec in default_specs():
        assert spec.smem_bytes <= GPUS[spec.gpu].smem_per_block
        limit = 255 if spec.arch == "sm80" else spec.consumer_regs
        assert register_estimate(spec) <= limit


def test_sm90_defaults_follow_fa3_table():
    spec = KernelSpec(arch="sm90", head_dim=128)
    # 128x160 with its own O buffer (FA3's 128x176 fits only with O aliasing Q)
    assert (spec.block_m, spec.block_n, spec.consumer_warpgroups, spec.stages) == (128, 160, 2, 2)
    assert (spec.producer_regs, spec.consumer_regs) == (24, 240)
    assert spec.intra_wg_overlap and spec.persistent and spec.separate_o and spec.l2_hints
    # no pingpong at d128 (measured): O's rescale runs under Q K^T instead
    assert not spec.pingpong and spec.rescale_under_qk and not spec.anchor_softmax
    causal = KernelSpec(arch="sm90", head_dim=128, causal=True)
    assert causal.block_n == 128 and not causal.pingpong and causal.separate_o and causal.rescale_under_qk
    assert KernelSpec(arch="sm90", head_dim=64).pingpong and not KernelSpec(arch="sm90", head_dim=64).rescale_under_qk
    assert KernelSpec(arch="sm90", head_dim=256).block_n == 80
    three = KernelSpec(arch="sm90", head_dim=64)
    assert (three.block_m, three.consumer_warpgroups, three.consumer_regs) == (192, 3, 160)


def test_variant_names_are_unique_and_stable():
    names = [s.variant for s in default_specs()]
    assert len(names) == len(set(names))
    assert KernelSpec(arch="sm90", head_dim=128).variant == \
        "flash_fwd_sm90_bf16_hd128_bm128_bn160_w12_st2_r24x240_ov_so_rsq_opt"


def test_replace_rederives_defaults():
    spec = KernelSpec(arch="sm90", head_dim=128)
    assert spec.replace(head_dim=256).block_n == 80
    assert spec.replace(block_n=128).block_n == 128


def test_sm90_separate_o_is_derived_from_the_budget():
    # Q 32K + O 32K + 2 x (K + V) of 160 rows + 1K = 230400 bytes: fits 227 KB
    spec = KernelSpec(arch="sm90", head_dim=128)
    assert spec.separate_o
    assert smem_bytes(spec) == 32768 + 32768 + 2 * 2 * 160 * 128 * 2 + 1024
    # 176 rows fit only with O aliasing Q; hdim256 never has room for its own O tile
    assert not KernelSpec(arch="sm90", head_dim=128, block_n=176).separate_o
    assert not KernelSpec(arch="sm90", head_dim=256).separate_o
    with pytest.raises(SpecError) as err:
        KernelSpec(arch="sm90", head_dim=128, block_n=176, separate_o=True)
    assert err.value.field == "stages" and "separate_o=False" in str(err.value)
    with pytest.raises(SpecError) as err:
        KernelSpec(arch="sm80", separate_o=True)
    assert err.value.field == "separate_o"


def test_two_ctas_per_sm_halve_the_register_pool_and_double_the_grid():
    from facodegen.runtime.launch import grid, resident_ctas
    from facodegen.spec import sm90_cta_register_pool
    one = KernelSpec(arch="sm90", head_dim=64, causal=True, consumer_warpgroups=1)
    two = one.replace(consumer_warpgroups=1, ctas_per_sm=2)
    assert (two.producer_regs, two.consumer_regs) == (24, 232) and two.variant.endswith("_c2_q2_ch4_causal")
    assert sm90_cta_register_pool(256, 2) == 128 * (24 + 232) == sm90_cta_register_pool(256) // 2
    assert resident_ctas(two, 132) == 264 and resident_ctas(one, 132) == 132
    assert grid(two, 32, 32, 512, 264) == (264, 1, 1) and grid(one, 32, 32, 512, 132) == (132, 1, 1)
    assert grid(two, 1, 1, 128, 264) == (2, 1, 1)      # never more CTAs than tiles


def test_cluster_m_checks_pads_m_blocks_and_halves_the_kv_box():
    from facodegen.runtime import tma
    from facodegen.runtime.launch import grid, num_m_blocks
    spec = KernelSpec(arch="sm90", head_dim=256, cluster_m=2)
    assert "_cl2" in spec.variant
    assert KernelSpec(arch="sm90", head_dim=256).cluster_m == 1 and KernelSpec().cluster_m == 1
    for bad, field in [(dict(causal=True), "cluster_m"), (dict(dtype="fp8"), "cluster_m"),
                       (dict(block_n=72), "block_n"), (dict(cluster_m=4), "cluster_m"),
                       (dict(arch="sm80"), "cluster_m")]:
        with pytest.raises(SpecError) as err:
            KernelSpec(**{"arch": "sm90", "head_dim": 256, "cluster_m": 2, **bad})
        assert err.value.field == field, (bad, err.value)
    # odd m-block counts round up to whole clusters; the grid follows
    assert [num_m_blocks(spec, s) for s in (1, 128, 129, 300, 1000)] == [2, 2, 2, 4, 8]
    assert num_m_blocks(KernelSpec(arch="sm90", head_dim=256), 300) == 3
    assert grid(KernelSpec(arch="sm90", head_dim=256, cluster_m=2, persistent=False), 3, 4, 300, 132) == (4, 4, 3)
    assert grid(spec, 3, 4, 300, 130) == (48, 1, 1) and grid(spec, 16, 8, 2048, 130) == (130, 1, 1)
    # each CTA's K/V box is half the tile (the multicast share); Q and O keep theirs
    args = tma.tensor_map_args(spec, 1 << 20, 2 << 20, 3 << 20, 4 << 20, 2, 300, 500, 8, 2,
                               (300 * 8 * 256, 8 * 256, 256), (500 * 2 * 256, 2 * 256, 256),
                               (500 * 2 * 256, 2 * 256, 256), (300 * 8 * 256, 8 * 256, 256))
    assert [args[n].box[1] for n in ("tma_q", "tma_k", "tma_v", "tma_o")] == [128, 40, 40, 64]


def test_three_ctas_per_sm_split_a_third_of_the_register_file():
    from facodegen.runtime.launch import resident_ctas
    from facodegen.spec import register_split, sm90_cta_register_pool
    three = KernelSpec(arch="sm90", head_dim=64, causal=True, consumer_warpgroups=1, ctas_per_sm=3, block_n=64)
    assert register_split(1, 3) == (three.producer_regs, three.consumer_regs) == (24, 136)
    assert 3 * sm90_cta_register_pool(256, 3) <= 65536 and 128 * (24 + 136) == sm90_cta_register_pool(256, 3)
    assert register_split(1, 2) == (24, 232) and register_split(2, 2) == (24, 104)
    assert resident_ctas(three, 132) == 396 and three.variant.endswith("_c3_q2_ch4_causal")
    with pytest.raises(SpecError) as err:       # 128 keys need about 160 registers
        KernelSpec(arch="sm90", head_dim=64, causal=True, consumer_warpgroups=1, ctas_per_sm=3, block_n=128)
    assert err.value.field == "block_n"


def test_two_p_buffers_need_the_optimistic_overlapped_loop_and_their_registers():
    two = KernelSpec(arch="sm90", head_dim=128, causal=True, p_buffers=2)
    assert two.p_buffers == 2 and "_p2_" in two.variant and KernelSpec(arch="sm90", head_dim=128).p_buffers == 1
    assert register_estimate(two) - register_estimate(two.replace(p_buffers=1)) == 64 * 128 // 128 // 2
    for fields in (dict(optimistic_max=False), dict(intra_wg_overlap=False)):
        with pytest.raises(SpecError) as err:
            KernelSpec(arch="sm90", head_dim=128, causal=True, p_buffers=2, **fields)
        assert err.value.field == "p_buffers"
    with pytest.raises(SpecError) as err:               # 160 keys: O 64 + S 80 + 2 x P 40 + 32 > 240
        KernelSpec(arch="sm90", head_dim=128, block_n=160, p_buffers=2)
    assert err.value.field == "block_n"
    for bad in (3, 0, True):
        with pytest.raises(SpecError) as err:
            KernelSpec(arch="sm90", head_dim=128, p_buffers=bad)
        assert err.value.field == "p_buffers"
    with pytest.raises(SpecError) as err:
        KernelSpec(arch="sm80", head_dim=128, p_buffers=2)
    assert err.value.field == "p_buffers"


def test_rebuild_q_desc_is_an_sm90_shared_memory_q_knob():
    spec = KernelSpec(arch="sm90", head_dim=256, rebuild_q_desc=True)
    assert spec.variant.endswith("_rqd") and not KernelSpec(arch="sm90", head_dim=256).rebuild_q_desc
    assert register_estimate(spec) == register_estimate(spec.replace(rebuild_q_desc=False))
    with pytest.raises(SpecError) as err:               # Q K^T reads Q from registers: no descriptor
        KernelSpec(arch="sm90", head_dim=128, dtype="fp8", q_in_regs=True, rebuild_q_desc=True)
    assert err.value.field == "rebuild_q_desc"
    for bad in (dict(arch="sm80", rebuild_q_desc=True), dict(arch="sm90", rebuild_q_desc="yes")):
        with pytest.raises(SpecError) as err:
            KernelSpec(head_dim=128, **bad)
        assert err.value.field == "rebuild_q_desc"


def test_dynamic_scheduler_defaults_and_its_errors():
    """The counter hands out causal tiles and the fp8 kernels' up to head_dim 128; a name suffix says
    where a spec departs from that causal default; it needs persistent CTAs and sm90."""
    def sm90(**kw):
        return KernelSpec(arch="sm90", **kw)
    assert [sm90(head_dim=d, dtype="fp8").dynamic_scheduler for d in (64, 96, 128, 192, 256)] == [True, True, True, False, False]
    assert all(sm90(head_dim=d, dtype=t, causal=True).dynamic_scheduler for d in (64, 128, 256) for t in ("bf16", "fp8"))
    assert not any(sm90(head_dim=d).dynamic_scheduler for d in (64, 128, 256))
    assert not sm90(head_dim=128, causal=True, persistent=False).dynamic_scheduler
    assert "_dyn" in sm90(head_dim=128, dtype="fp8").variant and "_dyn" not in sm90(head_dim=256, dtype="fp8").variant
    assert "_dyn" in sm90(head_dim=128, dynamic_scheduler=1).variant
    static_causal = sm90(head_dim=128, causal=True, dynamic_scheduler=False)
    assert "_stat" in static_causal.variant and static_causal != sm90(head_dim=128, causal=True)
    assert "_dyn" not in sm90(head_dim=128, causal=True).variant
    assert not KernelSpec(arch="sm80", head_dim=128, causal=True).dynamic_scheduler
    for bad in (dict(arch="sm90", persistent=False, dynamic_scheduler=True), dict(arch="sm80", dynamic_scheduler=True),
                dict(arch="sm90", dynamic_scheduler="yes")):
        with pytest.raises(SpecError) as err:
            KernelSpec(head_dim=128, **bad)
        assert err.value.field == "dynamic_scheduler", (bad, err.value)


def test_stream_k_is_an_fp8_non_causal_static_knob():
    """stream_k: named in the variant, it turns the fp8 default's dynamic scheduler off; the 16-bit
    kernels, causal masks, the counter and non-persistent grids are refused by name."""
    def sm90(**kw):
        return KernelSpec(arch="sm90", **kw)
    assert [sm90(head_dim=d, dtype="fp8").stream_k for d in (64, 96, 128, 192, 256)] == [False] * 4 + [True]
    assert not any(sm90(head_dim=d, dtype=t, causal=True).stream_k for d in (64, 128, 256) for t in ("bf16", "fp8"))
    assert not sm90(head_dim=256).stream_k and not sm90(head_dim=256, dtype="fp8", persistent=False).stream_k
    assert not sm90(head_dim=256, dtype="fp8", dynamic_scheduler=True).stream_k
    spec = sm90(head_dim=128, dtype="fp8", stream_k=True)
    assert spec.stream_k and not spec.dynamic_scheduler and "_sk" in spec.variant
    assert "_sk" not in sm90(head_dim=128, dtype="fp8").variant
    for bad in (dict(stream_k=True), dict(dtype="fp8", causal=True, stream_k=True),
                dict(dtype="fp8", dynamic_scheduler=True, stream_k=True),
                dict(dtype="fp8", persistent=False, stream_k=True), dict(dtype="fp8", stream_k="yes")):
        with pytest.raises(SpecError) as err:
            sm90(head_dim=128, **bad)
        assert err.value.field == "stream_k", (bad, err.value)
    with pytest.raises(SpecError) as err:
        KernelSpec(arch="sm80", head_dim=128, stream_k=True)
    assert err.value.field == "stream_k"


def test_stream_k_rule_keeps_it_from_short_keys():
    """The sequence-length table turns stream_k and defer_o_store off below 8k keys (stream_k's piece
    boundaries cost more than the last wave there; the deferred store measured slower), at head_dim 256
    fp8 non-causal only; the rule's spec is valid and static."""
    from facodegen.spec import seqlen_rule_fields
    for s in (512, 1024, 4096, 8191):
        fields = seqlen_rule_fields("sm90", 256, "fp8", False, 16384, s)
        assert fields == {"stream_k": False, "defer_o_store": False}, (s, fields)
        spec = KernelSpec(arch="sm90", head_dim=256, dtype="fp8", **fields)
        assert not spec.dynamic_scheduler and not spec.defer_o_store
        assert seqlen_rule_fields("sm90", 256, "fp8", True, s, s) == {}
    assert seqlen_rule_fields("sm90", 256, "fp8", False, 8192, 8192) == {}
    assert seqlen_rule_fields("sm90", 256, "fp8", True, 8192, 8192) == {}
    assert seqlen_rule_fields("sm90", 128, "fp8", False, 1024, 1024) == {}


def test_two_q_buffers_take_a_second_q_tile_and_need_o_elsewhere():
    one = KernelSpec(arch="sm90", head_dim=64, causal=True, q_stages=1)
    two = KernelSpec(arch="sm90", head_dim=64, causal=True, q_stages=2)
    assert one.q_stages == 1 and two.q_stages == 2 and two.variant.endswith("_q2_ch4_causal")
    # the default: two for 16-bit causal kernels where a second Q tile fits beside O's own place
    assert KernelSpec(arch="sm90", head_dim=64, causal=True) == two
    assert [KernelSpec(arch="sm90", head_dim=d, causal=True).q_stages for d in (64, 96, 128, 192, 256)] == [2, 2, 2, 1, 1]
    assert KernelSpec(arch="sm90", head_dim=128).q_stages == 1
    assert KernelSpec(arch="sm90", head_dim=128, dtype="fp8", causal=True).q_stages == 1
    assert KernelSpec(arch="sm90", head_dim=128, causal=True, separate_o=False).q_stages == 1      # O over Q
    assert KernelSpec(arch="sm90", head_dim=128, causal=True, block_n=176, o_in_v=True).q_stages == 1   # no room
    assert two.smem_bytes - one.smem_bytes == one.block_m * 64 * 2
    fp8 = KernelSpec(arch="sm90", head_dim=128, dtype="fp8", q_stages=2)
    assert fp8.smem_bytes - KernelSpec(arch="sm90", head_dim=128, dtype="fp8").smem_bytes == 128 * 128
    # head_dim 128's 128x160 tile fits its own O buffer with one Q tile but not with two
    assert KernelSpec(arch="sm90", head_dim=128).separate_o
    assert not KernelSpec(arch="sm90", head_dim=128, q_stages=2, o_in_v=True).separate_o
    for bad, field in [(dict(q_stages=3), "q_stages"), (dict(q_stages=True), "q_stages"),
                       (dict(q_stages=2, separate_o=False), "q_stages"),
                       (dict(q_stages=2, separate_o=True, block_n=160), "stages")]:
        with pytest.raises(SpecError) as err:
            KernelSpec(**{"arch": "sm90", "head_dim": 128, **bad})
        assert err.value.field == field, (bad, err.value)
    with pytest.raises(SpecError) as err:
        KernelSpec(arch="sm80", q_stages=2)
    assert err.value.field == "q_stages" and "sm80" in str(err.value)


def test_o_in_v_takes_the_v_ring_and_needs_room_there():
    spec = KernelSpec(arch="sm90", head_dim=256, o_in_v=True)
    assert not spec.separate_o and "_oinv" in spec.variant
    assert spec.smem_bytes == KernelSpec(arch="sm90", head_dim=256).smem_bytes    # no tile of its own
    assert not KernelSpec(arch="sm90", head_dim=256).o_in_v
    for bad in [dict(separate_o=True, head_dim=64), dict(dtype="fp8"), dict(block_n=32, stages=2, head_dim=128),
                dict(arch="sm80"), dict(o_in_v="yes")]:
        with pytest.raises(SpecError) as err:
            KernelSpec(**{"arch": "sm90", "head_dim": 256, "o_in_v": True, **bad})
        assert err.value.field == "o_in_v", (bad, err.value)


def test_defer_o_store_is_an_fp8_knob_of_the_overlapped_loop():
    """defer_o_store: named in the variant; on by default at head_dim 256 non-causal with the in-kernel
    V^T only (and off there without intra-warpgroup overlap or with Q in registers); the 16-bit types,
    sm80 and the loop without intra-warpgroup overlap (no prologue Q K^T to hide the stores under) are
    refused by name."""
    def fp8(**kw):
        return KernelSpec(arch="sm90", dtype="fp8", **kw)
    for d in (64, 96, 128, 192, 256):
        for c in (False, True):
            assert fp8(head_dim=d, causal=c).defer_o_store == (d == 256 and not c), (d, c)
            assert not fp8(head_dim=d, causal=c, v_layout="transposed").defer_o_store
    assert not fp8(head_dim=256, intra_wg_overlap=False).defer_o_store
    assert not fp8(head_dim=256, block_n=64, q_in_regs=True).defer_o_store     # (its consumers would spill)
    on, off = fp8(head_dim=256), fp8(head_dim=256, defer_o_store=False)
    assert "_dos" in on.variant and "_dos" not in off.variant
    assert on.smem_bytes == off.smem_bytes        # O waits in registers, not shared memory
    for kw in (dict(arch="sm90", dtype="bf16"), dict(arch="sm80", dtype="bf16"),
               dict(arch="sm90", dtype="fp8", intra_wg_overlap=False)):
        with pytest.raises(SpecError) as err:
            KernelSpec(head_dim=128, defer_o_store=True, **kw)
        assert err.value.field == "defer_o_store", (kw, err.value)


def test_fp8_lazy_rescale_defaults_and_refusals():
    """fp8 lazy_rescale: on by default at head_dim 256 (causal or not, either V layout), off at the
    smaller head dims; named in the variant; the default gives way to optimistic_max and
    rescale_under_qk (whose own rescale it does not skip), and asking for it beside them is refused
    by name."""
    def fp8(**kw):
        return KernelSpec(arch="sm90", dtype="fp8", **kw)
    for d in (64, 96, 128, 192, 256):
        for c in (False, True):
            assert fp8(head_dim=d, causal=c).lazy_rescale == (d == 256), (d, c)
    assert fp8(head_dim=256, v_layout="transposed").lazy_rescale
    assert "_lz" in fp8(head_dim=256).variant and "_lz" not in fp8(head_dim=256, lazy_rescale=False).variant
    assert fp8(head_dim=128, lazy_rescale=True).lazy_rescale
    for kw in (dict(optimistic_max=True), dict(rescale_under_qk=True)):
        assert not fp8(head_dim=256, **kw).lazy_rescale, kw
        with pytest.raises(SpecError) as err:
            fp8(head_dim=256, lazy_rescale=True, **kw)
        assert err.value.field == "lazy_rescale", (kw, err.value)


def test_vt_in_place_is_an_fp8_row_v_knob_that_frees_the_v_ring():
    """vt_in_place: named in the variant, off by default; no row-major V ring in shared memory, so the
    fp8 K/V ring takes three stages where they fit (head_dim 256: 224 KB with Q); the 16-bit types and
    the caller's V^T are refused by name."""
    def fp8(**kw):
        return KernelSpec(arch="sm90", dtype="fp8", **kw)
    assert not any(fp8(head_dim=d).vt_in_place for d in (64, 96, 128, 192, 256))
    ring, in_place = fp8(head_dim=256), fp8(head_dim=256, vt_in_place=True)
    assert (ring.stages, in_place.stages) == (2, 3) and "_vip" in in_place.variant and "_vip" not in ring.variant
    assert in_place.smem_bytes == ring.smem_bytes             # 3 x (K + V^T) where 2 x (K + V^T + V) was
    assert fp8(head_dim=256, vt_in_place=True, stages=2).smem_bytes == ring.smem_bytes - 2 * 128 * 256
    for kw, field in ((dict(arch="sm90", dtype="bf16"), "vt_in_place"),
                      (dict(arch="sm90", dtype="fp8", v_layout="transposed"), "vt_in_place"),
                      (dict(arch="sm80", dtype="bf16"), "vt_in_place")):
        with pytest.raises(SpecError) as err:
            KernelSpec(head_dim=128, vt_in_place=True, **kw)
        assert err.value.field == field


def test_every_seqlen_rule_points_at_its_measurement_and_makes_a_valid_spec():
    """SEQLEN_RULES are data: each row's evidence phrase is in docs/seqlen-rules.md, its bounds are
    ordered, and its fields make a spec for every dtype, head_dim and causal it covers."""
    from pathlib import Path
    from facodegen.spec import SEQLEN_RULES
    doc = " ".join((Path(__file__).resolve().parents[1] / "docs" / "seqlen-rules.md").read_text().split())
    for rule in SEQLEN_RULES:
        assert " ".join(rule.evidence.split()) in doc, rule.evidence
        assert 0 <= rule.low <= rule.high and rule.length in ("seqlen_q", "seqlen_k")
        for dtype in rule.dtypes:
            for head_dim in rule.head_dims:
                for causal in ((False, True) if rule.causal is None else (rule.causal,)):
                    KernelSpec(arch="sm90", head_dim=head_dim, dtype=dtype, causal=causal, gpu="h200", **rule.fields)


def test_seqlen_rules_first_match_wins():
    from facodegen.spec import seqlen_rule_fields
    assert seqlen_rule_fields("sm80", 128, "bf16", False, 512, 512) == {}
    assert seqlen_rule_fields("sm90", 128, "bf16", False, 512, 512) == {"block_n": 128}
    # causal head_dim 128 with 16k keys: the long-tile row comes before the short-query rows
    assert seqlen_rule_fields("sm90", 128, "bf16", True, 1, 16384)["block_n"] == 144
    assert seqlen_rule_fields("sm90", 128, "bf16", True, 1, 16383) == {"pingpong": True, "uniform_wg": True}
    assert seqlen_rule_fields("sm90", 256, "fp8", False, 100, 8191) == {"stream_k": False, "defer_o_store": False}
    assert seqlen_rule_fields("sm90", 256, "fp8", False, 100, 8192) == {}
