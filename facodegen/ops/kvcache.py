"""``attention_with_kvcache``: decode attention over a contiguous or paged KV cache (issue #39).

FlashAttention-3's ``flash_attn_with_kvcache`` semantics for the arguments listed in the docstring;
``flash_attn_with_kvcache`` is the FlashAttention-signature alias, which refuses by name every
FlashAttention argument not implemented here (never ignores it).

A call runs up to three generated kernels on the caller's current stream: the append
(``flash_append_*``: new k/v into the cache in place, when k/v are given), the decode
(``flash_decode_*``) and, when the keys are split across CTAs, the merge of the splits: by default
the decode kernel's last split CTA of each work item merges them itself (``fused_combine``: an int32
counter per work item in the plan's scratch, zeroed once when the scratch is allocated and left at
zero by every launch); ``fused_combine=False`` runs the combine kernel (``flash_combine_*``) after it
instead (H200, 2026-12-04: fused 1.14x at batch 1, 32k keys, where the combine's launch and its
read of the partials are a tenth of the time; 1.01-1.03x on the larger caches).
Everything that depends only on (shapes, strides, dtypes, device, options) is resolved once into
a ``DecodePlan`` (plan.PlanCache, keyed like the forward's): a later call with the same key packs
the call's pointers into the plan's argument images and launches (driver.Launcher), with no
device->host synchronisation and no data-dependent host work: sequence lengths and page tables
are read on the device only. The split-KV workspace is allocated once per plan and stream, so the
call is CUDA-graph capturable once warm.
"""

from __future__ import annotations

import functools
import math
import struct
import sys
import threading
from dataclasses import dataclass, replace

from ..spec import decode as dec
from ..spec.knobs import head_dim_problem
from ..runtime import driver
from . import api
from .api import (ALIGN_BYTES, ARRAY_META, ARRAY_PTR, DTYPE_NAMES, HEAD_DIM_V_NOTE, _allocate, _check_arch,
                  _check_same_place, _current_device, _current_stream, _empty, _torch, _View, _view, default_arch,
                  device_info, device_target)
from ..runtime.plan import PlanCache, Scratch, StreamScratch, _Image

# Knobs a caller may pass (**knobs): the decode spec's tuning knobs.
CALL_KNOBS = ("block_m", "block_n", "num_warps", "stages", "pack_gqa", "fused_combine", "producer_warps")


# ------------------------------------------------------------------ the plan

@dataclass
class _Kernel:
    """One launch of a plan: its launcher and argument image, and how many leading pointers a call patches."""
    launcher: object            # driver.Launcher (None in CPU tests)
    image: _Image
    pack: struct.Struct         # the call pointers at the start of the image


class DecodePlan:
    """One resolved kvcache call: the append (optional), decode and combine (optional) kernels with
    their argument images, grids and per-stream scratch (the split workspace, an LSE and, with
    fused_combine, the work items' int32 counters)."""

    def __init__(self, specs: dict, kernels: dict, grids: dict, *, lse_floats: int, partial_floats: tuple[int, int],
                 allocate, switch_context: bool, device: int, outputs: tuple, counters: int = 0):
        self.specs, self.kernels, self.grids = specs, kernels, grids
        self.num_splits = 1
        self.outputs = outputs          # (out shape, lse shape)
        self._switch_context = switch_context
        self._device = device
        # an LSE for calls that did not ask for it; a split's fp32 partial O and partial LSE; fused_combine's
        # arrival counter per work item (zeroed once here; every launch leaves them at zero)
        self._counters = counters
        self._scratch = StreamScratch({"lse": 4 * lse_floats, "o_partial": 4 * partial_floats[0],
                                       "lse_partial": 4 * partial_floats[1], "split_counters": 4 * counters},
                                      allocate, self._zero_counters if counters else None)
        self._lock = threading.Lock()
        # launch_step's kernels, in launch order: a plan with no append kernel and no context to switch
        self.step_ready = "append" not in kernels and not switch_context
        self._lse_like = None           # new_lse's template
        self._step_kernels = tuple((name, kernels[name]) for name in ("decode", "combine") if name in kernels)

    def new_lse(self, torch, q):
        """A new float32 LSE of the plan's shape on q's device: empty_like of a template on 4 bytes of
        storage (strides 0), half a torch.empty's host cost (api's plan outputs do the same)."""
        if self._lse_like is None:  # (q.device makes an object: read once, not per call)
            self._lse_like = torch.empty(1, dtype=torch.float32, device=q.device).as_strided(
                self.outputs[1], (0,) * len(self.outputs[1]))
        return torch.empty_like(self._lse_like)

    def _zero_counters(self, scratch: Scratch, stream: int) -> None:
        """fused_combine's counters start at zero; the last split CTA of each work item puts its counter
        back to zero (decode/fused_combine.cuh.j2), so this is the only memset, once per stream."""
        driver.memset_d32_async(scratch.split_counters, 0, self._counters, stream)

    def scratch(self, stream: int) -> Scratch:
        return self._scratch.get(stream)

    def pointer_sets(self, scratch: Scratch, q, k_cache, v_cache, o, lse, cache_seqlens, page_table, k_new, v_new):
        """The call pointers of each kernel, in its argument struct's order (decode.CALL_POINTERS)."""
        lse = lse or scratch.lse
        split = "combine" in self.kernels
        sets = {"decode": (q, k_cache, v_cache, o, 0 if split else lse, scratch.o_partial, scratch.lse_partial,
                           cache_seqlens, page_table)}
        if self._counters:          # fused_combine: the decode kernel writes O and the LSE itself
            sets["decode"] += (scratch.split_counters,)
        if split:
            sets["combine"] = (scratch.o_partial, scratch.lse_partial, o, lse)
        if "append" in self.kernels:
            sets["append"] = (k_new, v_new, k_cache, v_cache, cache_seqlens, page_table)
        return sets

    def launch(self, stream: int, q: int, k_cache: int, v_cache: int, o: int, lse: int, cache_seqlens: int,
               page_table: int = 0, k_new: int = 0, v_new: int = 0) -> None:
        """Launch append (if any), decode, combine (if any) on ``stream`` with these addresses."""
        scratch = self._scratch.get(stream)
        sets = self.pointer_sets(scratch, q, k_cache, v_cache, o, lse, cache_seqlens, page_table, k_new, v_new)
        with self._lock:
            for name in ("append", "decode", "combine"):
                kernel = self.kernels.get(name)
                if kernel is None:
                    continue
                kernel.pack.pack_into(kernel.image.storage, kernel.image.base, *sets[name])
                if kernel.launcher is None:
                    continue
                if self._switch_context:
                    with driver.on_device(self._device):
                        kernel.launcher(scratch.stream, kernel.image.kernel_params)
                else:
                    kernel.launcher(scratch.stream, kernel.image.kernel_params)

    def launch_step(self, stream: int, q: int, k_cache: int, v_cache: int, o: int, lse: int, cache_seqlens: int,
                    page_table: int) -> None:
        """``launch`` of a ``step_ready`` plan (no new tokens to append, no context to switch) with less
        to do: attention_with_kvcache's fast path, a server's decode step."""
        found = self._scratch._streams.get(stream)
        scratch = found if found is not None else self._scratch.get(stream)
        sets = self.pointer_sets(scratch, q, k_cache, v_cache, o, lse, cache_seqlens, page_table, 0, 0)
        lock = self._lock
        lock.acquire()      # (cheaper than `with`)
        try:
            for name, kernel in self._step_kernels:
                image = kernel.image
                kernel.pack.pack_into(image.storage, image.base, *sets[name])
                if kernel.launcher is not None:
                    kernel.launcher(scratch.stream, image.kernel_params)
        finally:
            lock.release()

    def param_bytes(self, name: str) -> bytes:
        return self.kernels[name].image.data()


# ------------------------------------------------------------------ argument checks

def _dims(t: _View, rank: int, what: str) -> None:
    if len(t.shape) != rank:
        raise ValueError(f"{t.name} must be {rank}-D {what}, got shape {t.shape}")


def _check_rows(t: _View) -> None:
    """head_dim contiguous, 16-byte aligned base and strides (cp.async moves 16-byte chunks)."""
    if t.strides[-1] != 1:
        raise ValueError(f"{t.name}'s head_dim must be contiguous (stride 1), got strides {t.strides}")
    if any(s < 0 for s in t.strides):
        raise ValueError(f"{t.name} has a negative stride {t.strides}")
    if t.ptr % ALIGN_BYTES:
        raise ValueError(f"{t.name}'s data pointer is not {ALIGN_BYTES}-byte aligned")
    for axis, stride, size in zip(("first", "second", "third"), t.strides[:3], t.shape[:3]):
        if size > 1 and (stride * 2) % ALIGN_BYTES:
            raise ValueError(f"{t.name}'s {axis} axis stride ({stride} elements) must be a multiple of "
                             f"{ALIGN_BYTES // 2} elements ({ALIGN_BYTES} bytes)")


def _check_int32(t: _View, shape: tuple, what: str, q: _View) -> None:
    _check_same_place(q, (t,))
    if t.dtype != "int32":
        raise TypeError(f"{t.name} has dtype {t.dtype}; it must be int32 {what}")
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{t.name} has shape {t.shape}; expected {what} = {tuple(shape)}")
    if t.strides[-1] != 1:
        raise ValueError(f"{t.name} must be contiguous along its last axis, got strides {t.strides}")


@dataclass(frozen=True)
class _Problem:
    batch: int
    seqlen_q: int
    heads_q: int
    heads_kv: int
    head_dim: int
    dtype: str
    paged: bool
    page_size: int
    num_pages: int
    capacity: int
    seqlen_new: int


def check_arguments(qv, kc, vc, sl, pt, kn, vn, outv, num_splits) -> _Problem:
    """Everything the host can check without a sync; each error names the argument."""
    _dims(qv, 4, "(batch, seqlen_q, heads_q, head_dim)")
    batch, seqlen_q, heads_q, head_dim = qv.shape
    if qv.dtype not in DTYPE_NAMES:
        raise TypeError(f"q has dtype {qv.dtype}; supported: {', '.join(DTYPE_NAMES)}")
    paged = pt is not None
    layout = "(num_pages, page_size, heads_kv, head_dim)" if paged else "(batch, seqlen_cache, heads_kv, head_dim)"
    for t in (kc, vc):
        _dims(t, 4, layout)
    _check_same_place(qv, [t for t in (kc, vc, kn, vn, outv) if t is not None])
    for t in (kc, vc, kn, vn, outv):
        if t is not None and t.dtype != qv.dtype:
            raise TypeError(f"{t.name} has dtype {t.dtype} but q has {qv.dtype}; they must share one dtype")
    if tuple(kc.shape) != tuple(vc.shape):
        raise ValueError(f"k_cache and v_cache must have the same shape, got {kc.shape} and {vc.shape}"
                         + (f" ({HEAD_DIM_V_NOTE})" if tuple(kc.shape[:3]) == tuple(vc.shape[:3]) else ""))
    if head_dim not in dec.DECODE_HEAD_DIMS and head_dim_problem(head_dim) is not None:
        raise ValueError(f"head_dim (q.shape[3]) {head_dim_problem(head_dim)}")
    if kc.shape[3] != head_dim:
        raise ValueError(f"k_cache has head_dim {kc.shape[3]} but q has head_dim {head_dim}")
    for name, value in (("batch (q.shape[0])", batch), ("seqlen_q (q.shape[1])", seqlen_q),
                        ("heads_q (q.shape[2])", heads_q), ("heads_kv (k_cache.shape[2])", kc.shape[2]),
                        ("k_cache.shape[0]", kc.shape[0]), ("k_cache.shape[1]", kc.shape[1])):
        if value < 1:
            raise ValueError(f"{name} is {value}; it must be at least 1")
    heads_kv = kc.shape[2]
    if heads_q % heads_kv:
        raise ValueError(f"heads_kv={heads_kv} (k_cache.shape[2]) must divide heads_q={heads_q} (q.shape[2])")
    if seqlen_q > dec.MAX_SEQLEN_Q:
        raise ValueError(f"seqlen_q={seqlen_q} (q.shape[1]): attention_with_kvcache takes 1 to "
                         f"{dec.MAX_SEQLEN_Q} query tokens per sequence in this version; run longer chunks "
                         f"through facodegen.attention")
    if paged:
        _dims(pt, 2, "(batch, max_pages_per_sequence)")
        if pt.shape[0] != batch:
            raise ValueError(f"page_table has {pt.shape[0]} rows but q has batch {batch}; page_table is "
                             f"(batch, max_pages_per_sequence) int32")
        _check_int32(pt, (batch, pt.shape[1]), "(batch, max_pages_per_sequence)", qv)
        page_size = kc.shape[1]
        if page_size & (page_size - 1):
            raise ValueError(f"page size {page_size} (k_cache.shape[1]) must be a power of two (16 to 256 are "
                             f"the sizes measured)")
        num_pages, capacity = kc.shape[0], pt.shape[1] * page_size
    else:
        if kc.shape[0] != batch:
            raise ValueError(f"k_cache has batch {kc.shape[0]} but q has batch {batch} (without page_table the "
                             f"cache is (batch, seqlen_cache, heads_kv, head_dim))")
        page_size, num_pages, capacity = 0, 0, kc.shape[1]
    _check_int32(sl, (batch,), "(batch,)", qv)
    seqlen_new = 0
    if (kn is None) != (vn is None):
        raise ValueError("k and v (new tokens to append) must be given together")
    if kn is not None:
        _dims(kn, 4, "(batch, seqlen_new, heads_kv, head_dim)")
        want = (batch, kn.shape[1], heads_kv, head_dim)
        for t in (kn, vn):
            if tuple(t.shape) != want:
                raise ValueError(f"{t.name} has shape {t.shape}; expected (batch, seqlen_new, heads_kv, head_dim) "
                                 f"= {want}")
        seqlen_new = kn.shape[1]
        if seqlen_new > capacity:
            raise ValueError(f"k has {seqlen_new} new tokens per sequence but the cache holds {capacity} "
                             f"(cache capacity: {'max_pages x page_size' if paged else 'k_cache.shape[1]'})")
    if outv is not None and tuple(outv.shape) != tuple(qv.shape):
        raise ValueError(f"out has shape {outv.shape}, q has {qv.shape}; they must match")
    for t in (qv, kc, vc, kn, vn, outv):
        if t is not None:
            _check_rows(t)
    if isinstance(num_splits, bool) or not isinstance(num_splits, int) or not 0 <= num_splits <= dec.MAX_SPLITS:
        raise ValueError(f"num_splits={num_splits!r}: an integer from 0 (heuristic) to {dec.MAX_SPLITS}")
    return _Problem(batch, seqlen_q, heads_q, heads_kv, head_dim, DTYPE_NAMES[qv.dtype], paged, page_size,
                    num_pages, capacity, seqlen_new)


def choose(problem: _Problem, arch: str, sms: int, num_splits: int, knobs: dict,
           smem_per_sm: int = 233472, window: "DecodeWindow | None" = None) -> tuple[dec.DecodeSpec, int]:
    """(decode spec, num_splits) of a call: the default spec with the caller's knobs, and the split
    heuristic on the cache's capacity when num_splits is 0 (a pure function of the shapes; with a
    window whose left side is bounded, on the keys one M tile can see through it instead).
    fused_combine applies to split calls only (with one split there is nothing to combine).
    ``window``: the call's window and softcap (decode_window), whose switches the spec takes."""
    unknown = sorted(set(knobs) - set(CALL_KNOBS))
    if unknown:
        raise TypeError(f"attention_with_kvcache got unknown argument(s) {', '.join(unknown)}; knobs it takes: "
                        f"{', '.join(CALL_KNOBS)}")
    knobs = dict(knobs)
    fused = knobs.pop("fused_combine", dec.FUSED_COMBINE_DEFAULT)
    if fused not in (True, False):
        raise TypeError(f"fused_combine={fused!r}: must be True or False")
    group = problem.heads_q // problem.heads_kv
    variant = dict(local=window.local, softcap=window.softcap > 0) if window is not None else {}
    base = dec.default_decode_spec(arch, problem.dtype, problem.head_dim, seqlen_q=problem.seqlen_q, group=group,
                                   paged=problem.paged, **variant, **knobs)
    heads_per_cta = group if base.pack_gqa else 1
    rows = problem.seqlen_q * heads_per_cta
    m_blocks = -(-rows // base.block_m)
    keys = problem.capacity if window is None else min(problem.capacity, window.visible_keys(problem))
    n_blocks = -(-keys // base.block_n) + (keys < problem.capacity)    # (a window's keys may straddle a block more)
    if num_splits == 0:
        work = problem.batch * (problem.heads_q // heads_per_cta) * m_blocks
        num_splits = dec.num_splits_heuristic(work, n_blocks, sms, dec.ctas_per_sm(base, smem_per_sm))
    stages = dec.split_stages(base, -(-n_blocks // max(num_splits, 1)), knobs, problem.page_size)
    if stages != base.stages:
        base = replace(base, stages=stages)
    if num_splits > 1:
        split = {"split": True, "fused_combine": bool(fused)}
        if "producer_warps" not in knobs:     # (its default follows the split)
            split["producer_warps"] = dec.default_producer_warps(arch, problem.head_dim, True)
        base = replace(base, **split)
    return base, num_splits


def plan_specs(problem: _Problem, arch: str, sms: int, num_splits: int, knobs: dict,
               smem_per_sm: int = 233472, window: "DecodeWindow | None" = None) -> tuple[dict, int]:
    """({"decode": spec[, "combine": spec][, "append": spec]}, num_splits): the kernels a call
    launches, in order: the combine when the keys are split (and the decode does not combine them
    itself, fused_combine), the append (first) when new tokens come."""
    spec, splits = choose(problem, arch, sms, num_splits, knobs, smem_per_sm, window)
    specs = {"decode": spec}
    if splits > 1 and not spec.fused_combine:
        specs["combine"] = dec.CombineSpec(dtype=problem.dtype, head_dim=problem.head_dim)
    if problem.seqlen_new:
        specs["append"] = dec.AppendSpec(dtype=problem.dtype, head_dim=problem.head_dim, paged=problem.paged)
    return specs, splits


def device_plan_specs(problem: _Problem, device: int = 0, num_splits: int = 0, knobs: dict | None = None,
                      arch: str | None = None, window: "DecodeWindow | None" = None) -> list:
    """plan_specs' kernels, in launch order, for ``device`` (its SM count and shared memory; ``arch``
    None: its default): what a call of ``problem`` compiles there (the fuzzer's and the decode
    suite's precompile lists)."""
    info = api.device_info(device)     # (api's, as case_specs read it before: the one tests replace)
    specs, _ = plan_specs(problem, arch or default_arch(info), info.sms, num_splits, knobs or {}, _smem_per_sm(info),
                          window)
    return list(specs.values())


@dataclass(frozen=True)
class DecodeWindow:
    """A call's window_size and softcap as the decode kernel takes them (decode_window): ``local``, the
    window in the bottom-right frame (query i of seqlen_q sees keys i + seqlen_k - seqlen_q - window_left ..
    i + seqlen_k - seqlen_q + window_right; an unbounded side as more keys than the cache and the new tokens
    hold), the softcap c (0: off) and ``left``, the caller's left side (-1: unbounded), which bounds the keys a
    tile sees."""
    local: bool
    window_left: int
    window_right: int
    softcap: float
    left: int

    def visible_keys(self, problem: _Problem) -> int:
        """Keys an M tile's rows see at most: the left side plus its queries, where the left is bounded."""
        return problem.capacity if self.left < 0 else self.left + problem.seqlen_q + 1


def decode_window(window_size, softcap, causal: bool, problem: _Problem) -> DecodeWindow | None:
    """The call's window_size and softcap checked (errors name them, as attention()'s) and resolved:
    None where neither is on, so the plain kernels run. A window cuts nothing when its left side is
    unbounded and its right one is too or causal already ends the rows there; else the LOCAL kernel
    runs, with causal as a right side of 0 (FlashAttention's rule), an unbounded side as more keys than
    the cache and the new tokens hold."""
    left, right = api._check_window(window_size)
    cap = api._check_softcap(softcap)
    if causal:
        right = 0
    local = not (left < 0 and (right < 0 or causal))
    if not local and not cap:
        return None
    unbounded = problem.capacity + problem.seqlen_q + 1
    return DecodeWindow(local, unbounded if left < 0 else min(left, unbounded),
                        unbounded if right < 0 else min(right, unbounded), cap, left)


# ------------------------------------------------------------------ building a plan

def _grid_decode(spec, problem, num_splits):
    heads_per_cta = problem.heads_q // problem.heads_kv if spec.pack_gqa else 1
    m_blocks = -(-(problem.seqlen_q * heads_per_cta) // spec.block_m)
    return (m_blocks * num_splits, problem.heads_q // heads_per_cta, problem.batch), m_blocks, heads_per_cta


def _values_decode(spec, problem, num_splits, m_blocks, heads_per_cta, qv, kc, vc, outv, pt, scale):
    z = dict.fromkeys(dec.CALL_POINTERS[dec.args_of(spec)], 0)
    return {**z,
            "q_batch_stride": qv.strides[0], "q_row_stride": qv.strides[1], "q_head_stride": qv.strides[2],
            "k_page_stride": kc.strides[0], "k_row_stride": kc.strides[1], "k_head_stride": kc.strides[2],
            "v_page_stride": vc.strides[0], "v_row_stride": vc.strides[1], "v_head_stride": vc.strides[2],
            "o_batch_stride": outv[0], "o_row_stride": outv[1], "o_head_stride": outv[2],
            "page_table_stride": pt.strides[0] if pt is not None else 0,
            "batch": problem.batch, "seqlen_q": problem.seqlen_q, "heads_q": problem.heads_q,
            "heads_kv": problem.heads_kv, "group": problem.heads_q // problem.heads_kv,
            "causal": 0, "rows_per_item": problem.seqlen_q * heads_per_cta, "num_m_blocks": m_blocks,
            "num_splits": num_splits, "seqlen_new": problem.seqlen_new, "capacity": problem.capacity,
            "num_pages": problem.num_pages,
            "page_shift": problem.page_size.bit_length() - 1 if problem.paged else 0,
            "softmax_scale": scale, "scale_log2": scale * math.log2(math.e)}


def build_plan(qv, kc, vc, sl, pt, kn, vn, out_strides, *, causal, softmax_scale, num_splits, arch, knobs,
               device: int, sms: int, load, allocate, switch_context=False,
               smem_per_sm: int = 233472, window_size=(-1, -1), softcap: float = 0.0) -> DecodePlan:
    """A DecodePlan for checked views. ``load(spec) -> LoadedFunction`` (None in CPU tests);
    ``out_strides``: O's (batch, row, head) strides in elements; ``window_size``, ``softcap``: the
    call's (decode_window)."""
    problem = check_arguments(qv, kc, vc, sl, pt, kn, vn, None, num_splits)
    window = decode_window(window_size, softcap, causal, problem)
    chosen, splits = plan_specs(problem, arch, sms, num_splits, knobs, smem_per_sm, window)
    spec = chosen["decode"]
    scale = float(softmax_scale) if softmax_scale is not None else 1.0 / math.sqrt(problem.head_dim)
    specs, kernels, grids = {}, {}, {}
    grid, m_blocks, heads_per_cta = _grid_decode(spec, problem, splits)
    values = _values_decode(spec, problem, splits, m_blocks, heads_per_cta, qv, kc, vc, out_strides, pt,
                            window.softcap if window is not None and window.softcap else scale)
    values["causal"] = int(bool(causal))
    if window is not None:      # (the fields of a LOCAL / SOFTCAP kernel: softmax_scale is then c)
        values.update(window_left=window.window_left, window_right=window.window_right,
                      softcap_scale=scale / window.softcap if window.softcap else 0.0)
    specs["decode"], grids["decode"] = spec, grid
    kernels["decode"] = _kernel(load, spec, grid, dec.pack(dec.args_of(spec), values), dec.args_of(spec))
    if "combine" in chosen:
        cspec = chosen["combine"]
        rows = problem.batch * problem.seqlen_q * problem.heads_q
        cgrid = (-(-rows // cspec.num_warps), 1, 1)
        cvalues = {**dict.fromkeys(dec.COMBINE_CALL_POINTERS, 0),
                   "o_batch_stride": out_strides[0], "o_row_stride": out_strides[1], "o_head_stride": out_strides[2],
                   "batch": problem.batch, "seqlen_q": problem.seqlen_q, "heads_q": problem.heads_q,
                   "num_splits": splits}
        specs["combine"], grids["combine"] = cspec, cgrid
        kernels["combine"] = _kernel(load, cspec, cgrid, dec.pack("combine", cvalues), "combine")
    if problem.seqlen_new:
        aspec = chosen["append"]
        chunks = problem.seqlen_new * problem.heads_kv * problem.head_dim * 2 // 16
        agrid = (-(-chunks // aspec.threads), problem.batch, 1)
        avalues = {**dict.fromkeys(dec.APPEND_CALL_POINTERS, 0),
                   **{f"kn_{a}_stride": s for a, s in zip(("batch", "row", "head"), kn.strides[:3])},
                   **{f"vn_{a}_stride": s for a, s in zip(("batch", "row", "head"), vn.strides[:3])},
                   **{f"k_{a}_stride": s for a, s in zip(("page", "row", "head"), kc.strides[:3])},
                   **{f"v_{a}_stride": s for a, s in zip(("page", "row", "head"), vc.strides[:3])},
                   "page_table_stride": pt.strides[0] if pt is not None else 0,
                   "batch": problem.batch, "seqlen_new": problem.seqlen_new, "heads_kv": problem.heads_kv,
                   "capacity": problem.capacity, "num_pages": problem.num_pages,
                   "page_shift": values["page_shift"]}
        specs["append"], grids["append"] = aspec, agrid
        kernels["append"] = _kernel(load, aspec, agrid, dec.pack("append", avalues), "append")
    lse_floats = problem.batch * problem.heads_q * problem.seqlen_q
    partial = (splits * problem.batch * problem.seqlen_q * problem.heads_q * problem.head_dim,
               splits * lse_floats) if splits > 1 else (0, 0)
    counters = grid[0] // splits * grid[1] * grid[2] if spec.fused_combine else 0     # one per work item
    plan = DecodePlan(specs, kernels, grids, lse_floats=lse_floats, partial_floats=partial, allocate=allocate,
                      switch_context=switch_context, device=device,
                      outputs=(tuple(qv.shape), (problem.batch, problem.heads_q, problem.seqlen_q)),
                      counters=counters)
    plan.num_splits = splits
    return plan


def _kernel(load, spec, grid, param_bytes: bytes, name: str) -> _Kernel:
    function = load(spec) if load is not None else None
    launcher = driver.Launcher(function, grid, spec.threads, spec.smem_bytes) if function is not None else None
    return _Kernel(launcher, _Image(param_bytes), struct.Struct(f"<{len(dec.CALL_POINTERS[name])}Q"))


def compile_for_device(spec, device: int = 0):
    """A decode, combine or append spec's kernel compiled for ``device``'s real target (combine and
    append are arch-neutral: sm80 code for the device), from the compile cache when it is there."""
    info = device_info(device)
    sm = device_target("sm80", info) if spec.kernel != "decode" else device_target(spec.arch, info)
    return dec.compile_spec(spec, sm=sm)


@functools.lru_cache(maxsize=256)
def _load(spec, device: int):
    """The spec's kernel loaded on ``device`` (compiled for its target, or read from the compile cache)."""
    kernel = compile_for_device(spec, device)
    return driver.load_function(kernel.cubin, spec.variant, device,
                                max_dynamic_smem=spec.smem_bytes if spec.smem_bytes > 48 * 1024 else 0)


# ------------------------------------------------------------------ the public call

_PLANS = PlanCache()


def check_values(cache_seqlens, page_table, *, seqlen_new: int, capacity: int, num_pages: int) -> None:
    """check_inputs=True: the values the host cannot see without a device sync, as host arrays
    (cache_seqlens (batch,), page_table (batch, max_pages) or None). Raises ValueError naming the
    argument: a negative length, a length plus the new tokens past the capacity, a page index out
    of [0, num_pages) among the pages a sequence uses. (The kernels clamp all of these; this says
    the caller has a bug instead of computing on clamped values.)"""
    import numpy as np
    lengths = np.asarray(cache_seqlens, dtype=np.int64)
    bad = np.flatnonzero(lengths < 0)
    if bad.size:
        raise ValueError(f"cache_seqlens[{bad[0]}] = {lengths[bad[0]]} is negative")
    bad = np.flatnonzero(lengths + seqlen_new > capacity)
    if bad.size:
        raise ValueError(f"cache_seqlens[{bad[0]}] = {lengths[bad[0]]} plus {seqlen_new} new token(s) exceeds the "
                         f"cache capacity {capacity}")
    if page_table is None:
        return
    table = np.asarray(page_table, dtype=np.int64)
    page_size = capacity // table.shape[1]
    for b, length in enumerate(lengths):
        used = table[b, :-(-(int(length) + seqlen_new) // page_size)]
        wrong = np.flatnonzero((used < 0) | (used >= num_pages))
        if wrong.size:
            raise ValueError(f"page_table[{b}, {wrong[0]}] = {used[wrong[0]]} is not a page of the cache "
                             f"(0 .. {num_pages - 1}), and sequence {b} uses it")


def _check_values_on_device(cache_seqlens, page_table, k, k_cache) -> None:
    """check_inputs=True: copy the lengths and the page table to the host (a sync) and check_values."""
    def host(x):
        return None if x is None else (x.cpu().numpy() if hasattr(x, "cpu") else x.get())
    seqlen_new = 0 if k is None else int(k.shape[1])
    if page_table is not None:
        num_pages, capacity = int(k_cache.shape[0]), int(page_table.shape[1]) * int(k_cache.shape[1])
    else:
        num_pages, capacity = 0, int(k_cache.shape[1])
    check_values(host(cache_seqlens), host(page_table), seqlen_new=seqlen_new, capacity=capacity,
                 num_pages=num_pages)


_NO_WINDOW = (-1, -1)      # attention_with_kvcache's default window_size: unbounded on both sides


def attention_with_kvcache(q, k_cache, v_cache, cache_seqlens, *, page_table=None, k=None, v=None,
                           causal: bool = True, softmax_scale: float | None = None, window_size=_NO_WINDOW,
                           softcap: float = 0.0, num_splits: int = 0, return_lse: bool = False, out=None,
                           arch: str | None = None, check_inputs: bool = False, **knobs):
    """Decode attention over a KV cache, FlashAttention-3's ``flash_attn_with_kvcache`` semantics.

    q: (batch, seqlen_q, heads_q, head_dim), seqlen_q 1..16, fp16/bf16, head_dim 64/96/128/192/256 or any other
    multiple of 8 in [8, 256] (the next one's tile, padded inside the kernel: its loads zero-fill the columns
    past head_dim and its stores stop there).
    k_cache, v_cache: (batch, seqlen_cache, heads_kv, head_dim), or with ``page_table`` the pages
    (num_pages, page_size, heads_kv, head_dim) (page_size a power of two) and page_table
    (batch, max_pages) int32: key j of sequence b is row j % page_size of page page_table[b][j // page_size].
    cache_seqlens: (batch,) int32, the keys already in each sequence's cache.
    k, v: (batch, seqlen_new, heads_kv, head_dim) new tokens, written into the cache in place at
    cache_seqlens[b] before the attention (cache_seqlens itself is not changed, as in FlashAttention);
    the attention then runs over cache_seqlens[b] + seqlen_new keys.
    causal: bottom-right per sequence (query i of seqlen_q sees keys <= seqlen_k - seqlen_q + i).
    window_size=(left, right): FlashAttention's sliding window on that diagonal (query i sees keys
    i' - left .. i' + right, i' = seqlen_k - seqlen_q + i; -1 = unbounded; with causal the right side is 0):
    the blocks left of every row's window are not read. softcap: > 0, logits c * tanh(scale * s / c).
    num_splits: key splits per sequence (0: a heuristic on the shapes; 1: no split).
    heads_kv divides heads_q (GQA/MQA). Returns O like q (and the float32 LSE (batch, heads_q,
    seqlen_q), natural log, with ``return_lse``). Knobs: block_m, block_n, num_warps, stages, pack_gqa,
    fused_combine (split calls: True, the default, has the decode kernel merge the splits itself;
    False runs the combine kernel after it).

    Hostile values never make a kernel read or write out of bounds: cache_seqlens are clamped to
    [0, capacity] (capacity: seqlen_cache, or max_pages x page_size), keys and appended tokens past
    the capacity are dropped, page indices are clamped into [0, num_pages). A sequence with no key
    gets O = 0 and LSE = -inf. ``check_inputs=True`` checks those values on the host first (a
    device sync per call; ValueError naming cache_seqlens or page_table: see check_values).

    On torch tensors under ``torch.compile``/``torch.export`` the call goes through the
    ``facodegen::attention_with_kvcache`` custom op (``_out`` with ``out=``; facodegen.ops.torch_op),
    which marks k_cache and v_cache mutated. There is no backward: a call on tensors that require
    grad (with grad enabled) raises NotImplementedError.
    """
    torch = api._TORCH or _torch()
    # The decode step of a server on torch tensors (no new tokens, knob, out= or value check; eager;
    # nothing to record): its plan-cache hit in this one frame (_eager's, with the same key).
    if (torch is not None and q.__class__ is torch.Tensor and k is None and v is None and out is None
            and not knobs and not check_inputs and not torch.compiler.is_compiling()):
        try:
            if torch.is_grad_enabled() and (q.requires_grad or k_cache.requires_grad or v_cache.requires_grad):
                plan = None     # (the op records the refusal below)
            else:
                device = q.get_device()
                plan = _PLANS._plans.get(_step_key(torch, q, k_cache, v_cache, cache_seqlens, page_table, device,
                                                   causal, softmax_scale, num_splits, return_lse, arch, window_size,
                                                   softcap))
        except (AttributeError, TypeError):   # cache_seqlens or page_table not a torch tensor, an unhashable scale or
            plan = None                       # window
            plan = None
        if plan is not None and plan.step_ready:
            out = torch.empty_like(q)
            lse = plan.new_lse(torch, q) if return_lse else None
            qp, kp, vp, op = q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr()
            if not (qp | kp | vp | op) & 15:    # (a misaligned view: the checked path says so)
                plan.launch_step(torch._C._cuda_getCurrentRawStream(device), qp, kp, vp, op,
                                 0 if lse is None else lse.data_ptr(), cache_seqlens.data_ptr(),
                                 0 if page_table is None else page_table.data_ptr())
                return (out, lse) if return_lse else out
    if torch is not None and isinstance(q, torch.Tensor) and (torch.compiler.is_compiling() or (
            torch.is_grad_enabled() and _requires_grad(q, k_cache, v_cache, k, v))):
        from . import torch_op
        return torch_op.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens, page_table=page_table, k=k, v=v,
                                               causal=causal, softmax_scale=softmax_scale, window_size=window_size,
                                               softcap=softcap, num_splits=num_splits, return_lse=return_lse, out=out,
                                               arch=arch, check_inputs=check_inputs, **knobs)
    return _eager(q, k_cache, v_cache, cache_seqlens, page_table, k, v, causal, softmax_scale, num_splits, return_lse,
                  out, arch, check_inputs, knobs, window_size=window_size, softcap=softcap)


def _step_key(torch, q, k_cache, v_cache, cache_seqlens, page_table, device: int, causal, softmax_scale, num_splits,
              return_lse, arch, window_size, softcap) -> tuple:
    """The plan key of a decode step on torch tensors (no k/v, out=, knob or lse_out): what
    attention_with_kvcache's fast path and _eager both build (``device``: q.get_device(), read by both;
    the window and softcap values are in the plan's images, so they key it too)."""
    return (q.dtype, q.shape, q.stride(), k_cache.dtype, k_cache.shape, k_cache.stride(), k_cache.get_device(),
            v_cache.dtype, v_cache.shape, v_cache.stride(), v_cache.get_device(),
            cache_seqlens.dtype, cache_seqlens.shape, cache_seqlens.stride(), cache_seqlens.get_device(),
            None if page_table is None else (page_table.dtype, page_table.shape, page_table.stride(),
                                             page_table.get_device()),
            device, torch._C._cuda_getDevice(), causal.__class__, causal, softmax_scale.__class__, softmax_scale,
            num_splits.__class__, num_splits, bool(return_lse), arch, tuple(window_size), softcap.__class__, softcap)


def _requires_grad(*tensors) -> bool:
    return any(getattr(t, "requires_grad", False) for t in tensors)


def check_options(cache_seqlens, causal, softmax_scale, num_splits, knobs: dict) -> None:
    """The arguments that are not arrays (and cache_seqlens' kind): each error names the argument."""
    if cache_seqlens is None or isinstance(cache_seqlens, int):
        raise TypeError("cache_seqlens must be a (batch,) int32 device tensor on q's device (an int or None is "
                        "not taken: the call never syncs or allocates per call)")
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be True or False, got {causal!r}")
    if softmax_scale is not None and not (isinstance(softmax_scale, (int, float)) and math.isfinite(softmax_scale)):
        raise ValueError(f"softmax_scale must be a finite number or None, got {softmax_scale!r}")
    if isinstance(num_splits, bool) or not isinstance(num_splits, int) or not 0 <= num_splits <= dec.MAX_SPLITS:
        raise ValueError(f"num_splits={num_splits!r}: an integer from 0 (heuristic) to {dec.MAX_SPLITS}")
    unknown = sorted(set(knobs) - set(CALL_KNOBS))
    if unknown:
        raise TypeError(f"attention_with_kvcache got unknown argument(s) {', '.join(unknown)}; knobs it takes: "
                        f"{', '.join(CALL_KNOBS)}")


def _eager(q, k_cache, v_cache, cache_seqlens, page_table, k, v, causal, softmax_scale, num_splits, return_lse, out,
           arch, check_inputs, knobs, lse_out=None, window_size=_NO_WINDOW, softcap=0.0):
    """attention_with_kvcache launched from its plan (the torch operators' CUDA implementations run this
    too; ``lse_out``, theirs only: a contiguous float32 (batch, heads_q, seqlen_q) tensor the LSE goes to)."""
    if check_inputs:
        _check_values_on_device(cache_seqlens, page_table, k, k_cache)
    torch = _torch()
    kind = "torch" if torch is not None and isinstance(q, torch.Tensor) else "other"
    key = None
    try:
        knob_key = tuple(sorted(knobs.items())) if knobs else ()
        variant = (tuple(window_size), softcap.__class__, softcap)     # (their values are in the plan's images)
        if kind == "torch":
            meta = ARRAY_META["torch"]
            device = q.get_device()
            current = torch._C._cuda_getDevice()
            if k is None and v is None and out is None and not knobs and lse_out is None:   # a step: the fast path's key
                key = _step_key(torch, q, k_cache, v_cache, cache_seqlens, page_table, device, causal, softmax_scale,
                                num_splits, return_lse, arch, window_size, softcap)
        else:
            meta = ARRAY_META["cupy"]
            cupy = sys.modules.get("cupy")
            device = q.device.id if cupy is not None and isinstance(q, cupy.ndarray) else -1
            current = cupy.cuda.runtime.getDevice() if device >= 0 else -1
        if key is None:
            key = (kind, meta(q), meta(k_cache), meta(v_cache), meta(cache_seqlens), meta(page_table), meta(k),
                   meta(v), meta(out), device, current, causal.__class__, causal, softmax_scale.__class__,
                   softmax_scale, num_splits.__class__, num_splits, bool(return_lse), arch, knob_key, variant)
        plan = _PLANS.get(key) if device >= 0 else None
    except (AttributeError, TypeError):   # not all arrays of one library, an unhashable knob: the checked path
        plan = key = None
    if plan is None:
        return _miss(key, q, k_cache, v_cache, cache_seqlens, page_table, k, v, causal, softmax_scale, num_splits,
                     return_lse, out, arch, knobs, lse_out, window_size, softcap)
    out_shape, lse_shape = plan.outputs
    if kind == "torch":
        if out is None:
            out = torch.empty_like(q)
        lse = lse_out if lse_out is not None else \
            torch.empty(lse_shape, dtype=torch.float32, device=q.device) if return_lse else None
        stream = torch._C._cuda_getCurrentRawStream(device)
        ptr = ARRAY_PTR["torch"]
    else:
        import cupy
        with cupy.cuda.Device(device):
            if out is None:
                out = cupy.empty(out_shape, dtype=q.dtype)
            lse = cupy.empty(lse_shape, dtype=cupy.float32) if return_lse else None
            stream = cupy.cuda.get_current_stream().ptr
        ptr = ARRAY_PTR["cupy"]
    pointers = (ptr(q), ptr(k_cache), ptr(v_cache), ptr(out))
    if (pointers[0] | pointers[1] | pointers[2] | pointers[3]) & 15 or \
            (k is not None and (ptr(k) | ptr(v)) & 15):    # a misaligned view: the checked path says so
        return _miss(None, q, k_cache, v_cache, cache_seqlens, page_table, k, v, causal, softmax_scale, num_splits,
                     return_lse, out, arch, knobs, lse_out, window_size, softcap)
    plan.launch(stream, *pointers, ptr(lse) if lse is not None else 0, ptr(cache_seqlens),
                ptr(page_table) if page_table is not None else 0,
                ptr(k) if k is not None else 0, ptr(v) if v is not None else 0)
    return (out, lse) if return_lse else out


def _miss(key, q, k_cache, v_cache, cache_seqlens, page_table, k, v, causal, softmax_scale, num_splits, return_lse,
          out, arch, knobs, lse_out=None, window_size=_NO_WINDOW, softcap=0.0):
    """The checked path: every argument checked (errors name it), the plan built and remembered."""
    qv = _view("q", q)
    views = {name: (_view(name, x) if x is not None else None) for name, x in
             (("k_cache", k_cache), ("v_cache", v_cache), ("page_table", page_table), ("k", k), ("v", v),
              ("out", out))}
    check_options(cache_seqlens, causal, softmax_scale, num_splits, knobs)   # (before cache_seqlens' view)
    slv = _view("cache_seqlens", cache_seqlens)
    problem = check_arguments(qv, views["k_cache"], views["v_cache"], slv, views["page_table"], views["k"],
                              views["v"], views["out"], num_splits)
    info = device_info(qv.device)
    arch = arch or default_arch(info)
    if arch not in dec.DECODE_ARCHS:
        raise ValueError(f"arch={arch!r}: choose one of {', '.join(dec.DECODE_ARCHS)}")
    _check_arch(arch, info)
    if out is None:     # as a plan hit makes it (torch: empty_like, q's layout where q is dense)
        out = _torch().empty_like(q) if qv.kind == "torch" else _empty(qv, qv.shape, qv.dtype)
    outv = _view("out", out)
    if views["out"] is None:
        check_arguments(qv, views["k_cache"], views["v_cache"], slv, views["page_table"], views["k"], views["v"],
                        outv, num_splits)
    plan = build_plan(qv, views["k_cache"], views["v_cache"], slv, views["page_table"], views["k"], views["v"],
                      outv.strides[:3], causal=causal, softmax_scale=softmax_scale, num_splits=num_splits,
                      arch=arch, knobs=knobs, device=qv.device, sms=info.sms, smem_per_sm=_smem_per_sm(info),
                      load=functools.partial(_load_on, qv.device),
                      allocate=functools.partial(_allocate, qv.kind, qv.device),
                      switch_context=qv.device != _current_device(qv.kind), window_size=window_size, softcap=softcap)
    if key is not None:
        _PLANS.put(key, plan)
    lse = lse_out if lse_out is not None else \
        _empty(qv, (problem.batch, problem.heads_q, problem.seqlen_q), "float32") if return_lse else None
    plan.launch(_current_stream(qv.kind, qv.device), qv.ptr, views["k_cache"].ptr, views["v_cache"].ptr, outv.ptr,
                _view("lse", lse).ptr if lse is not None else 0, slv.ptr,
                views["page_table"].ptr if page_table is not None else 0,
                views["k"].ptr if k is not None else 0, views["v"].ptr if v is not None else 0)
    return (out, lse) if return_lse else out


def _smem_per_sm(info) -> int:
    """Shared memory of one SM (the budget model's; an A100-class GPU without one: its per-block
    opt-in plus the 1 KB reserved, i.e. one decode CTA of ~100 KB per SM)."""
    from ..spec import GPUS

    limits = GPUS.get(info.budget_gpu)
    return (limits.smem_per_sm if limits and limits.smem_per_sm else
            max(info.smem_per_block_optin, limits.smem_per_block if limits else 0) + 1024)


def _load_on(device: int, spec):
    return _load(spec, device)


# ------------------------------------------------------------------ FlashAttention's signature

# FlashAttention arguments with their "not used" values; anything else is refused by name.
_FA_UNSUPPORTED = {
    "rotary_cos": None, "rotary_sin": None, "cache_batch_idx": None, "cache_leftpad": None, "alibi_slopes": None,
    "qv": None, "cu_seqlens_q": None, "cu_seqlens_k_new": None, "max_seqlen_q": None, "rotary_seqlens": None,
    "q_descale": None, "k_descale": None, "v_descale": None, "scheduler_metadata": None, "attention_chunk": 0,
    "sm_margin": 0,
}


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, *, cache_seqlens=None, block_table=None,
                            page_table=None, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                            rotary_interleaved=True, num_splits=0, pack_gqa=None, return_softmax_lse=False,
                            out=None, **fa_args):
    """FlashAttention's ``flash_attn_with_kvcache`` (FA2 and FA3 spellings: ``block_table`` or
    ``page_table``) on facodegen's kernels. Implemented: q, k_cache, v_cache, k, v, cache_seqlens
    ((batch,) int32 tensor), block_table/page_table, softmax_scale, causal, window_size (any negative
    side unbounded, as FlashAttention's), softcap (<= 0: off, as FlashAttention's), num_splits,
    pack_gqa, return_softmax_lse, out. Refused with an error naming it: rotary_cos/rotary_sin,
    cache_batch_idx, cache_leftpad, alibi_slopes, qv, cu_seqlens_q/cu_seqlens_k_new/max_seqlen_q,
    rotary_seqlens, descales, scheduler_metadata, attention_chunk, sm_margin; any other keyword is an
    error too. Arguments after v are keyword-only (FA2 and FA3 order them differently: a positional
    rotary_cos must never land in cache_seqlens)."""
    for name, value in fa_args.items():
        if name not in _FA_UNSUPPORTED:
            raise TypeError(f"flash_attn_with_kvcache got an unexpected argument {name!r}")
        unused = _FA_UNSUPPORTED[name]
        if not (value is None if unused is None else value == unused):
            raise NotImplementedError(f"flash_attn_with_kvcache: {name} is not implemented by facodegen yet "
                                      f"(got {type(value).__name__}); leave it at its default ({unused!r})")
    if block_table is not None and page_table is not None:
        raise ValueError("give block_table or page_table, not both (they are the same argument)")
    if cache_seqlens is None:
        raise TypeError("flash_attn_with_kvcache: cache_seqlens is required here, a (batch,) int32 tensor")
    knobs = {} if pack_gqa is None else {"pack_gqa": bool(pack_gqa)}
    from .adapters import _variant_kwargs
    return attention_with_kvcache(q, k_cache, v_cache, cache_seqlens, page_table=block_table if block_table is not None
                                  else page_table, k=k, v=v, causal=bool(causal), softmax_scale=softmax_scale,
                                  num_splits=num_splits, return_lse=bool(return_softmax_lse), out=out,
                                  **_variant_kwargs(window_size, softcap), **knobs)
