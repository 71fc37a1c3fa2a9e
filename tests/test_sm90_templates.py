"""The sm90 forward kernels share their plumbing (CPU, render only): the 16-bit and the fp8 template
both call each shared macro instead of a copy of its code, and the shared role macros take the
kernel's locals they use as arguments instead of reading them by name.

A template refactor that should change no byte is checked by scripts/render_digests.py (save at the
base, check after); these tests pin the structure it left."""

from __future__ import annotations

import re

import jinja2.nodes
import pytest

from facodegen import KernelSpec
from facodegen.codegen.render import context, environment, template_dir

KERNELS = ("sm90/flash_fwd.cu.j2", "sm90/flash_fwd_fp8.cu.j2")
# The plumbing both forward kernels take from one place: macro -> the file that defines it.
SHARED_MACROS = {
    "loader_warp": "sm90/roles.cuh.j2",             # producer warpgroup's start: registers, warp 0, map prefetches
    "producer_tile_loop": "sm90/roles.cuh.j2",      # loader warp: scheduler loop, K and Q TMA loads
    "load_ring_stage": "sm90/roles.cuh.j2",         # loader warp: a ring stage's wait, arm and TMA load (K, V)
    "consumer_tile_loop": "sm90/roles.cuh.j2",      # consumer warpgroup: scheduler loop, LSE store
    "consumer_mainloop": "sm90/roles.cuh.j2",       # S = Q K^T, softmax, O += P V over the K/V ring
    "gemm_qk_ss": "sm90/gemm_qk.cuh.j2",            # the SS wgmma loop of S = Q K^T
    "shared_state": "sm90/shared_state.cuh.j2",     # struct SharedState: the kernel's barriers, the roles' slots
    "init_ring_barriers": "sm90/shared_state.cuh.j2",   # the rings' and Q's mbarriers
    "tile_buffers": "sm90/tile_layout.cuh.j2",      # setup: dynamic shared memory, the tile buffers' addresses
}
SHARED_INCLUDES = ("sm90/tile_layout.cuh.j2", "sm90/scheduler.cuh.j2", "sm90/load_tile.cuh.j2",
                   "sm90/barriers.cuh.j2", "sm90/tma.cuh.j2", "sm90/pingpong.cuh.j2")


def _parsed(name: str) -> jinja2.nodes.Template:
    env = environment()
    return env.parse((template_dir() / name).read_text())


def _macros_called(tree: jinja2.nodes.Template) -> set[str]:
    called = {node.call.node.name for node in tree.find_all(jinja2.nodes.CallBlock)}
    called |= {node.node.name for node in tree.find_all(jinja2.nodes.Call) if isinstance(node.node, jinja2.nodes.Name)}
    return called


def _imported_from(tree: jinja2.nodes.Template) -> dict[str, str]:
    return {(name if isinstance(name, str) else name[0]): node.template.value
            for node in tree.find_all(jinja2.nodes.FromImport) for name in node.names}


@pytest.mark.parametrize("kernel", KERNELS)
def test_each_forward_kernel_calls_the_shared_plumbing(kernel):
    tree = _parsed(kernel)
    imported = _imported_from(tree)
    assert {m: imported.get(m) for m in SHARED_MACROS} == SHARED_MACROS
    missing = set(SHARED_MACROS) - _macros_called(tree)
    assert not missing, f"{kernel} no longer calls {sorted(missing)}"
    included = {node.template.value for node in tree.find_all(jinja2.nodes.Include)}
    assert set(SHARED_INCLUDES) <= included


def test_no_forward_kernel_keeps_a_copy_of_the_shared_code():
    """gemm_qk's SS form, the tile constants and buffer addresses, SharedState's shared part, the ring barriers' setup and
    the descriptor prefetches live once, in the shared files."""
    for kernel in KERNELS:
        source = (template_dir() / kernel).read_text()
        assert "void gemm_qk(float (&s)[S_REGS], uint32_t q_rows" not in source
        assert "constexpr int KV_TILE_BYTES" not in source
        assert "mbar_init(smem_u32(&state.k_full[s])" not in source
        assert "tma_prefetch_desc(" not in source
        assert "setmaxnreg_dec<PRODUCER_REGS>" not in source
        assert "mbar_arrive_expect_tx(" not in source     # the loads' barrier protocol: load_ring_stage
        assert "smem_raw" not in source and "Q_STAGES * Q_TILE_BYTES;" not in source
        assert "int tile_slot[4];" not in source and "struct SharedState {" not in source


# The kernel locals each role macro takes as an argument; renamed below, none may appear by its own name.
_ROLES = """\
{% from "sm90/roles.cuh.j2" import prefetch_tensor_maps, loader_warp, producer_tile_loop, load_ring_stage,
   consumer_tile_loop, consumer_mainloop with context %}
{% from "sm90/tile_layout.cuh.j2" import tile_buffers %}
{{ tile_buffers("Q_BUF", "K_RING0", [("V_RING0", "V ring")]) }}
{{ prefetch_tensor_maps("IS_LEADER", ["tma_q", "tma_k"]) }}
{% call loader_warp("PRODUCER_WARP", "IS_LEADER", ["tma_q"]) %}
{% call producer_tile_loop(q_smem="Q_BUF", k_smem0="K_RING0", leader="IS_LEADER", group="GQA") %}
{{ load_ring_stage("v_full", "v_empty", "IS_LEADER", "load_kv", ["V_RING0 + stage * KV_TILE_BYTES", "p.tma_v", "v_full",
                   "n * BLOCK_N", "kv_head", "t.batch"]) }}
{% endcall %}
{% endcall %}
{% call consumer_tile_loop(warpgroup="WG_INDEX", q_smem="Q_BUF") %}
{{ mainloop }}
{% endcall %}
"""
_MAINLOOP_16 = ('{{ consumer_mainloop("K_RING0", "v_full", "v_empty", "v_smem0", "softmax_step", '
                '"softmax_step_optimistic", "p.scale_log2") }}')
_MAINLOOP_FP8 = ('{{ consumer_mainloop("K_RING0", "vt_full", "vt_empty", "vt_smem0", none, "softmax_step_fp8_optimistic", '
                 '"scale_log2", exact_halves=("softmax_max_fp8", "softmax_exp2_to_p_fp8"), late_pv_wait=true, '
                 'mask_free_loop=true) }}')


@pytest.mark.parametrize("spec,mainloop", [
    (KernelSpec(arch="sm90", head_dim=128), _MAINLOOP_16),
    (KernelSpec(arch="sm90", head_dim=128, causal=True, l2_prefetch=2, q_stages=2), _MAINLOOP_16),
    (KernelSpec(arch="sm90", head_dim=128, dtype="fp8"), _MAINLOOP_FP8),
    (KernelSpec(arch="sm90", head_dim=128, dtype="fp8", q_in_regs=True), _MAINLOOP_FP8),
], ids=["bf16", "bf16-prefetch-q2", "fp8", "fp8-q-in-regs"])
def test_role_macros_use_the_names_they_are_given(spec, mainloop):
    source = environment().from_string(_ROLES.replace("{{ mainloop }}", mainloop)).render(context(spec))
    code = re.sub(r"//[^\n]*", "", source)                # comments may name the kernel's locals
    for given in ("Q_BUF", "K_RING0", "IS_LEADER", "GQA", "WG_INDEX", "PRODUCER_WARP"):
        assert re.search(rf"\b{given}\b", code), given
    for own in ("q_smem", "k_smem0", "leader", "group", "warpgroup", "producer_warp"):
        assert not re.search(rf"\b{own}\b", code), f"a role macro reads the kernel's `{own}` by name"
