"""What a launch needs besides the kernel: grid geometry, FlashParams bytes, occupancy (plan.py and
driver.py launch).

Nothing here checks user input (api.py does that before anything reaches this module);
what arrives is a resolved KernelSpec and raw device pointers, shapes and strides.
"""

from __future__ import annotations

import ctypes
import math
from dataclasses import dataclass

from . import params as params_mod
from ..spec import KernelSpec

LOG2E = math.log2(math.e)


@dataclass(frozen=True)
class Operand:
    """A device tensor as the kernel sees it: pointer, (b, s, h, d) shape, strides in elements."""
    ptr: int
    shape: tuple[int, int, int, int]
    strides: tuple[int, int, int, int]

    @property
    def bsh_strides(self) -> tuple[int, int, int]:
        """(batch, row, head) strides: the order FlashParams and the tensor maps take."""
        return self.strides[0], self.strides[1], self.strides[2]


def num_m_blocks(spec: KernelSpec, seqlen_q: int) -> int:
    """Query-row blocks per (batch, head), rounded up to whole clusters: with cluster_m=2 an odd
    count gets one block past seqlen_q, whose CTA shares the K/V loads and stores nothing."""
    blocks = math.ceil(seqlen_q / spec.block_m)
    return -(-blocks // spec.cluster_m) * spec.cluster_m


def grid(spec: KernelSpec, batch: int, heads_q: int, seqlen_q: int, resident_ctas: int) -> tuple[int, int, int]:
    """Launch grid; ``resident_ctas`` is how many CTAs of this kernel run at once on the GPU (SMs x
    CTAs per SM, or CTAs in co-resident clusters), the persistent grid's size."""
    m_blocks = num_m_blocks(spec, seqlen_q)
    if spec.arch == "sm90" and spec.persistent:
        return (min(m_blocks * heads_q * batch, resident_ctas), 1, 1)
    if needs_workspace(spec):
        return (1, heads_q, batch)   # FlashAttention-1: one CTA per (batch, head)
    return (m_blocks, heads_q, batch)


def needs_workspace(spec: KernelSpec) -> bool:
    """FlashAttention-1's loop order keeps O, m and l in global memory between K/V blocks."""
    return spec.arch == "sm80" and spec.schedule == "fa1" and spec.loop_order == "kv_outer"


def workspace_floats(spec: KernelSpec, batch: int, heads_q: int, seqlen_q: int, head_dim: int) -> int:
    """fp32 elements of ``p.workspace``: O (head_dim floats), m and l per query row; 0 if unused."""
    return batch * heads_q * seqlen_q * (head_dim + 2) if needs_workspace(spec) else 0


def stream_k_flags(spec: KernelSpec, ctas: int) -> tuple[int, int]:
    """stream_k on a grid of ``ctas`` CTAs: where its flags lie in ``p.workspace``, (first element,
    count). Per CTA and consumer warpgroup a slot of (head_dim / 2 + 4) floats per thread, a PARTIAL
    piece's O, m and l, then one int flag each, which must start at zero (sm90/stream_k.cuh.j2's
    split_slot and split_flag). (0, 0) if off."""
    if not spec.stream_k:
        return 0, 0
    slots = ctas * spec.consumer_warpgroups
    return slots * 128 * (spec.head_dim // 2 + 4), slots


def stream_k_workspace_floats(spec: KernelSpec, ctas: int) -> int:
    """fp32 elements of ``p.workspace`` for stream_k on a grid of ``ctas`` CTAs (0 if off)."""
    return sum(stream_k_flags(spec, ctas))


@dataclass(frozen=True)
class Descale:
    """An fp8 descale factor in device memory: float32 at ptr + batch*batch_stride + kv_head*head_stride."""
    ptr: int
    batch_stride: int = 0
    head_stride: int = 0


@dataclass(frozen=True)
class Variants:
    """Run-time values of the attention variants (spec.local, spec.softcap, spec.sinks): the window in
    the causal mask's bottom-right frame (params.VARIANT_FIELDS; api.window_params makes them), the
    softcap c (0: off) and the address of the fp32 sinks (0: none; patched per call by the plan)."""
    window_left: int = 0
    window_right: int = 0
    softcap: float = 0.0
    sinks_ptr: int = 0


@dataclass(frozen=True)
class Varlen:
    """The sequence boundaries of a varlen call (spec.varlen; params.VARLEN_FIELDS): the int32
    cu_seqlens addresses (patched per call by the plan), the number of sequences, the caller's
    max_seqlen_q / max_seqlen_k (the grid's bound) and the packed query and key tokens (the LSE's head
    stride; what the kernels clamp each sequence into). The operands are then (1, total_tokens, heads,
    head_dim): one row per token."""
    cu_seqlens_q_ptr: int
    cu_seqlens_k_ptr: int
    batch: int
    max_seqlen_q: int
    max_seqlen_k: int
    total_q: int
    total_k: int


def pack_params(spec: KernelSpec, q: Operand, k: Operand, v: Operand, o: Operand, lse_ptr: int,
                tile_counter_ptr: int, softmax_scale: float, workspace_ptr: int = 0,
                descales: dict[str, Descale] | None = None, variants: Variants | None = None,
                varlen: Varlen | None = None) -> bytes:
    """FlashParams bytes. dtype=fp8: ``descales`` = {"q": Descale, "k": ..., "v": ...}, and with
    v_layout=transposed ``v`` is V^T with shape (batch, heads_kv, head_dim, seqlen_k) and strides
    (batch, head, dim, 1). ``variants``: the run-time values of a spec with local/softcap/sinks; with
    softcap c the kernel's softmax_scale is c (scores are tanh(s * softmax_scale / c) by then).
    ``varlen``: the sequence boundaries of a spec with varlen (q, k, v, o packed as one batch)."""
    batch, seqlen_q, heads_q, _ = q.shape
    _, seqlen_k, heads_kv, _ = k.shape
    extents = (batch, seqlen_q, seqlen_k)     # the tensors' own: sm90's TMA maps (varlen: 1, total_q, total_k)
    if spec.varlen:     # the grid's bounds: sequences x the longest sequence's query blocks
        batch, seqlen_q, seqlen_k = varlen.batch, varlen.max_seqlen_q, varlen.max_seqlen_k
    m_blocks = num_m_blocks(spec, seqlen_q)
    values = {
        "q": q.ptr, "k": k.ptr, "v": v.ptr, "o": o.ptr, "lse": lse_ptr, "tile_counter": tile_counter_ptr,
        "workspace": workspace_ptr,
        "batch": batch, "seqlen_q": seqlen_q, "seqlen_k": seqlen_k, "heads_q": heads_q, "heads_kv": heads_kv,
        "num_m_blocks": m_blocks, "num_tiles": m_blocks * heads_q * batch,
        "softmax_scale": softmax_scale, "scale_log2": softmax_scale * LOG2E,
    }
    for name, op in (("q", q), ("k", k), ("v", v), ("o", o)):
        values[f"{name}_batch_stride"], values[f"{name}_row_stride"], values[f"{name}_head_stride"] = op.bsh_strides
    if spec.dtype == "fp8":
        for name in ("q", "k", "v"):
            d = descales[name]
            values[f"{name}_descale"] = d.ptr
            values[f"{name}_descale_batch_stride"] = d.batch_stride
            values[f"{name}_descale_head_stride"] = d.head_stride
    if spec.arch == "sm90":
        from . import tma
        values.update(tma.tensor_maps(spec, q.ptr, k.ptr, v.ptr, o.ptr, *extents, heads_q,
                                      heads_kv, q.bsh_strides, k.bsh_strides, v.bsh_strides, o.bsh_strides))
    has_variants = params_mod.has_variants(spec)
    if has_variants:
        variants = variants or Variants()
        softcap_scale = 0.0
        if spec.softcap:
            if not variants.softcap > 0:
                raise ValueError(f"spec.softcap needs a softcap value > 0, got {variants.softcap!r}")
            softcap_scale = softmax_scale / variants.softcap
            values["softmax_scale"], values["scale_log2"] = variants.softcap, variants.softcap * LOG2E
        values.update(window_left=variants.window_left, window_right=variants.window_right,
                      softcap_scale=softcap_scale, sinks=variants.sinks_ptr)
    if spec.varlen:
        values.update(cu_seqlens_q=varlen.cu_seqlens_q_ptr, cu_seqlens_k=varlen.cu_seqlens_k_ptr,
                      total_q=varlen.total_q, total_k=varlen.total_k)
    return params_mod.pack(spec.arch, values, spec.dtype, has_variants, spec.varlen)


def resident_ctas(spec: KernelSpec, num_sms: int, function=None) -> int:
    """CTAs of this kernel the GPU runs at once: SMs x ctas_per_sm, or for cluster_m > 1 the CTAs of
    the clusters that fit together (cuOccupancyMaxActiveClusters: a GPC whose free SMs do not make a
    whole cluster runs none), so a persistent grid never waits for a second wave."""
    if spec.cluster_m == 1:
        return num_sms * spec.ctas_per_sm
    return spec.cluster_m * max_active_clusters(function, spec.threads, spec.smem_bytes, spec.cluster_m)


class _LaunchConfig(ctypes.Structure):
    """CUlaunchConfig (cuda.h); no launch attributes: the kernel carries its cluster dims."""
    _fields_ = [("gridDimX", ctypes.c_uint), ("gridDimY", ctypes.c_uint), ("gridDimZ", ctypes.c_uint),
                ("blockDimX", ctypes.c_uint), ("blockDimY", ctypes.c_uint), ("blockDimZ", ctypes.c_uint),
                ("sharedMemBytes", ctypes.c_uint), ("hStream", ctypes.c_void_p), ("attrs", ctypes.c_void_p),
                ("numAttrs", ctypes.c_uint)]


def max_active_clusters(function, threads: int, smem_bytes: int, cluster_size: int) -> int:
    """cuOccupancyMaxActiveClusters for a kernel compiled with __cluster_dims__ (libcuda via ctypes)."""
    from .tma import libcuda
    fn = libcuda().cuOccupancyMaxActiveClusters
    fn.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_void_p, ctypes.POINTER(_LaunchConfig)]
    fn.restype = ctypes.c_int
    config = _LaunchConfig(cluster_size, 1, 1, threads, 1, 1, smem_bytes, None, None, 0)
    count = ctypes.c_int(0)
    err = fn(ctypes.byref(count), ctypes.c_void_p(function.ptr), ctypes.byref(config))
    if err != 0 or count.value < 1:
        raise RuntimeError(f"cuOccupancyMaxActiveClusters failed (CUresult {err}, {count.value} clusters) for a "
                           f"cluster of {cluster_size} CTAs of {threads} threads and {smem_bytes} bytes of shared memory")
    return count.value
