"""GPUs with 99 KB of shared memory per block (compute capability 8.6: A10, A40, RTX 30; 8.9: L4,
L40, RTX 40) get sm80 kernels that fit them, picked from their own limits, not the A100's."""

from __future__ import annotations

import pytest

from facodegen.runtime import compiler
from facodegen.runtime.driver import DeviceInfo
from facodegen.spec import GPUS, HEAD_DIMS, KernelSpec


@pytest.mark.parametrize("name, cc, budget", [
    ("NVIDIA A10", (8, 6), "sm86"), ("NVIDIA GeForce RTX 3090", (8, 6), "sm86"), ("NVIDIA L4", (8, 9), "sm89"),
    ("NVIDIA GeForce RTX 4090", (8, 9), "sm89"), ("NVIDIA GeForce RTX 5090", (12, 0), "sm89"),
    ("NVIDIA A100-SXM4-80GB", (8, 0), "a100"), ("NVIDIA H200", (9, 0), "h200"), ("NVIDIA GH200", (9, 0), "h200"),
    ("Jetson AGX Orin", (8, 7), "a100"),
])
def test_each_gpu_gets_the_budget_of_its_limits(name, cc, budget):
    assert DeviceInfo(0, name, cc, 1, 0).budget_gpu == budget


@pytest.mark.parametrize("gpu", ["sm86", "sm89"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_defaults_fit_99_kb(gpu, head_dim, causal):
    spec = KernelSpec(arch="sm80", head_dim=head_dim, causal=causal, gpu=gpu)
    assert spec.smem_bytes <= GPUS[gpu].smem_per_block


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_sm86_defaults_compile_without_spills(head_dim):
    spec = KernelSpec(arch="sm80", head_dim=head_dim, dtype="fp16", gpu="sm86")
    kernel = compiler.compile(spec, sm="sm_86", verbose=False)
    assert kernel.target == "sm_86"
    assert (kernel.resources.spill_stores, kernel.resources.spill_loads) == (0, 0), kernel.resources
