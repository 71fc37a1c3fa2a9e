"""Timing facodegen's kernels against their peers (a benchmark, not a test).

Method (the same as /work/shared/peers/h200-2026-11-29.md, so numbers compare):

* CUDA events on the current torch stream around groups of back-to-back calls: 5 warm-up calls,
  then 7 groups of 20 calls, and the median of the 7 group means. On one cell facodegen and
  every peer take turns group by group (A B C A B C ...): the H200 power-caps under long cells
  and its clock moves 10-15% within one, so timing them one after the other would put that drift
  into their ratio.
* Fresh randn inputs, never zeros. Where one input set is smaller than twice the L2 (60 MB on the
  H200) the calls rotate over several sets, so the timing is not of a warm cache; the FA3-paper
  grid (16k tokens, hidden 2048: 64 MB per tensor) needs one set.
* FLOPs = 4 * batch * heads * seqlen_q * seqlen_k * head_dim, half of that for causal (the papers'
  convention); TFLOP/s = FLOPs / time.
* Every implementation's output is checked against a float64 reference on a slice (batch 0, q heads
  0 and 1) before it is timed; a failing, missing or refusing implementation is reported with the
  reason and not timed.
* facodegen is timed as users call it, ``facodegen.attention(q, k, v, causal=..., **overrides)``
  with out allocated per call (column "facodegen-<arch>", the one with the ratio to the best peer),
  and beside it through a launcher prepared once, ``facodegen.prepare(...)`` then ``run()`` (column
  "facodegen-<arch> (prepared)": the kernel with the least host work). Both rotate over the same
  input sets and take turns with the peers; the peers are timed through their public calls.
* The ``overhead`` suite (run_overhead) times host microseconds per call on a tiny shape instead.

Peers: torch SDPA's FLASH_ATTENTION (FlashAttention-2), CUDNN_ATTENTION and EFFICIENT_ATTENTION
backends (through (b, h, s, d) transposed views of (b, s, h, d) tensors) and FlashAttention-3
(``flash_attn_interface.flash_attn_func``, (b, s, h, d)).

Everything that needs a GPU imports torch lazily; the grid, FLOP and table helpers run anywhere.
"""

from __future__ import annotations

import contextlib
import importlib
import math
import statistics
import time
import traceback

from ..reference import check, compare, dtype_name

WARMUP = 5
GROUPS = 7
CALLS_PER_GROUP = 20
L2_BYTES_DEFAULT = 60 * 1024 * 1024
MAX_INPUT_SETS = 8

PEER_TITLES = {
    "fa3": "FlashAttention-3",
    "cudnn": "cuDNN (SDPA)",
    "fa2": "FlashAttention-2 (SDPA)",
    "efficient": "mem-efficient (SDPA)",
    "flex": "FlexAttention",
}
DEFAULT_PEERS = ("fa3", "cudnn", "fa2")
_SDPA_BACKENDS = {"cudnn": "CUDNN_ATTENTION", "fa2": "FLASH_ATTENTION", "efficient": "EFFICIENT_ATTENTION"}


# ----------------------------------------------------------------------------------------------
# FLOPs, grids
# ----------------------------------------------------------------------------------------------

def attention_flops(batch: int, heads: int, seqlen_q: int, seqlen_k: int, head_dim: int,
                    causal: bool) -> float:
    """Forward FLOPs: two GEMMs of 2*sq*sk*d each per (batch, head); half of that when causal."""
    flops = 4.0 * batch * heads * seqlen_q * seqlen_k * head_dim
    return flops / 2 if causal else flops


def tflops(flops: float, ms: float) -> float:
    return flops / (ms * 1e-3) / 1e12


def cell(head_dim: int, causal: bool, seqlen: int, batch: int, heads: int, dtype: str = "bf16",
         seqlen_k: int | None = None, heads_kv: int | None = None) -> dict:
    """One problem: the keys every row and grid uses. dtype "fp8": Q, K, V in e4m3 (quantised per
    tensor from randn bf16), O in bf16."""
    return {"dtype": "fp8" if dtype == "fp8" else dtype_name(dtype), "head_dim": head_dim, "causal": bool(causal), "seqlen_q": seqlen,
            "seqlen_k": seqlen if seqlen_k is None else seqlen_k, "batch": batch, "heads_q": heads,
            "heads_kv": heads if heads_kv is None else heads_kv}


FA3_SEQLENS = (512, 1024, 2048, 4096, 8192, 16384)


def fa3_paper_grid(dtype: str = "bf16") -> list[dict]:
    """The FlashAttention-3 paper's forward grid: head_dim 64/128/256 x causal no/yes x seqlen
    512..16k, 16k tokens per batch (batch = 16384/seqlen), hidden 2048 (heads = 2048/head_dim)."""
    return [cell(d, c, s, 16384 // s, 2048 // d, dtype)
            for d in (64, 128, 256) for c in (False, True) for s in FA3_SEQLENS]


def quick_grid(dtype: str = "bf16") -> list[dict]:
    """A handful of FA3-grid cells: every head_dim, both masks, a short and a long sequence."""
    picks = [(128, False, 2048), (128, True, 8192), (64, False, 4096), (64, True, 1024),
             (256, False, 2048), (256, True, 16384)]
    return [cell(d, c, s, 16384 // s, 2048 // d, dtype) for d, c, s in picks]


def sm80_grid(dtype: str = "bf16") -> list[dict]:
    """Every head_dim the sm80 kernels ship, both masks, seqlen 2k and 8k (16k tokens, hidden 2048
    rounded down to whole heads for 96 and 192)."""
    return [cell(d, c, s, 16384 // s, 2048 // d, dtype)
            for d in (64, 96, 128, 192, 256) for c in (False, True) for s in (2048, 8192)]


def fp8_grid(dtype: str = "fp8") -> list[dict]:
    """Issue 6's FP8 grid: head_dim 64/128/256 x causal no/yes x seqlen 2k/8k/16k (16k tokens per
    batch, hidden 2048), always e4m3 inputs (``dtype`` is accepted for the GRIDS signature only)."""
    return [cell(d, c, s, 16384 // s, 2048 // d, "fp8")
            for d in (64, 128, 256) for c in (False, True) for s in (2048, 8192, 16384)]


GRIDS = {"quick": quick_grid, "fa3": fa3_paper_grid, "sm80": sm80_grid, "fp8": fp8_grid}


def make_grid(name: str, dtype: str = "bf16") -> list[dict]:
    if name not in GRIDS:
        raise ValueError(f"grid: {name!r} is not one of {', '.join(GRIDS)}")
    return GRIDS[name](dtype)


def input_bytes(c: dict) -> int:
    """Bytes of Q, K, V and O for one cell (2 bytes an element; Q, K, V 1 byte under fp8)."""
    d = c["head_dim"]
    qkv = 1 if c["dtype"] == "fp8" else 2
    return d * c["batch"] * ((qkv + 2) * c["seqlen_q"] * c["heads_q"] + 2 * qkv * c["seqlen_k"] * c["heads_kv"])


def input_sets_needed(bytes_per_set: int, l2_bytes: int = L2_BYTES_DEFAULT, cap: int = MAX_INPUT_SETS) -> int:
    """How many input sets to rotate over so the calls together touch at least twice the L2."""
    return max(1, min(cap, math.ceil(2 * l2_bytes / max(1, bytes_per_set))))


# ----------------------------------------------------------------------------------------------
# rows and tables
# ----------------------------------------------------------------------------------------------

def facodegen_name(arch: str) -> str:
    return f"facodegen-{arch}"


def is_facodegen(name: str) -> bool:
    return name.startswith("facodegen")


# facodegen is timed twice per cell: through the public call (``facodegen.attention``, what users
# run: the name as given, e.g. "facodegen-sm90") and through a launcher prepared once (the kernel
# with the least host work: the same name + this suffix), shown beside it, never instead of it.
PREPARED_SUFFIX = " (prepared)"


def prepared_name(name: str) -> str:
    return name + PREPARED_SUFFIX


def is_prepared(name: str) -> bool:
    return is_facodegen(name) and name.endswith(PREPARED_SUFFIX)


def has_ratio(name: str) -> bool:
    """Whether an implementation gets a ratio to the best peer: facodegen's public call only (the
    peers are timed through their public calls too, so that is the like-for-like figure)."""
    return is_facodegen(name) and not is_prepared(name)


def best_peer(row: dict) -> tuple[str | None, float | None]:
    """(name, TFLOP/s) of the fastest peer that passed its check, or (None, None)."""
    best = (None, None)
    for name, r in row.get("results", {}).items():
        t = r.get("tflops")
        if is_facodegen(name) or t is None:
            continue
        if best[1] is None or t > best[1]:
            best = (name, t)
    return best


def ratio_to_best_peer(row: dict, name: str) -> float | None:
    t = row.get("results", {}).get(name, {}).get("tflops")
    _, best = best_peer(row)
    if t is None or not best:
        return None
    return t / best


def implementations(rows: list[dict], facodegen_first: bool = True) -> list[str]:
    """Every implementation in the rows, facodegen's first (table columns) or last (plot bars)."""
    names: list[str] = []
    for row in rows:
        for name in row.get("results", {}):
            if name not in names:
                names.append(name)
    ours = [n for n in names if is_facodegen(n)]
    peers = [n for n in names if not is_facodegen(n)]
    return ours + peers if facodegen_first else peers + ours


def _fmt_result(r: dict | None, ceiling: float | None = None) -> str:
    """TFLOP/s, with the fraction of the GEMM ceiling when the row carries one."""
    if r is None:
        return "–"
    if r.get("tflops") is not None:
        return f"{r['tflops']:.1f}" + (f" ({r['tflops'] / ceiling:.0%})" if ceiling else "")
    note = (r.get("note") or "").lower()
    if note.startswith("skipped") or note.startswith("unavailable"):
        return "–"
    return "fail"


def format_table(rows: list[dict]) -> str:
    """Markdown: one line per cell, TFLOP/s of each implementation (and the fraction of the bf16
    GEMM rate where a row carries ``gemm_tflops``), the best peer and the ratio of each facodegen
    arch's public call to it; the prepared launcher's column stands beside its public call with no
    ratio of its own ("fail" = ran but failed its check or raised; "–" = not run)."""
    impls = implementations(rows)
    ours = [n for n in impls if has_ratio(n)]
    head = ["dtype", "head_dim", "causal", "seqlen", "batch", "heads"]
    head += [n if is_facodegen(n) else PEER_TITLES.get(n, n) for n in impls]
    head += ["best peer"] + [f"{n.removeprefix('facodegen-')}/best" for n in ours]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        seqlen = str(row["seqlen_q"]) if row["seqlen_q"] == row["seqlen_k"] else f"{row['seqlen_q']}/{row['seqlen_k']}"
        heads = str(row["heads_q"]) if row["heads_q"] == row["heads_kv"] else f"{row['heads_q']}/{row['heads_kv']}"
        cells = [row["dtype"], str(row["head_dim"]), "yes" if row["causal"] else "no", seqlen,
                 str(row["batch"]), heads]
        cells += [_fmt_result(row.get("results", {}).get(n), row.get("gemm_tflops")) for n in impls]
        name, _ = best_peer(row)
        cells.append(PEER_TITLES.get(name, name) if name else "–")
        for n in ours:
            r = ratio_to_best_peer(row, n)
            cells.append(f"{r:.2f}" if r is not None else "–")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def format_notes(rows: list[dict]) -> str:
    """One line per implementation that was not timed, or timed with a remark, with the reason."""
    out = []
    for row in rows:
        tag = (f"{row['dtype']} d{row['head_dim']} {'causal' if row['causal'] else 'full'} "
               f"s{row['seqlen_q']}x{row['seqlen_k']} b{row['batch']} h{row['heads_q']}/{row['heads_kv']}")
        for name, r in row.get("results", {}).items():
            extra = [r["note"]] if r.get("note") else []
            if r.get("err") is not None:
                extra.append(f"rel_fro {r['err']:.2e}")
            if r.get("variant"):
                extra.append(r["variant"])
            if r.get("note"):
                out.append(f"- {tag} {name}: " + "; ".join(extra))
    return "\n".join(out)


# ----------------------------------------------------------------------------------------------
# timing (GPU)
# ----------------------------------------------------------------------------------------------

def _torch():
    import torch
    return torch


def time_cuda_interleaved(fns: list, warmup: int = WARMUP, groups: int = GROUPS,
                          calls: int = CALLS_PER_GROUP, spans: list | None = None,
                          contexts: list | None = None) -> list[dict]:
    """time_cuda for several callables at once, group by group in turn (A B C A B C ...), so a
    drift of the GPU's clocks or temperature over the run falls on all of them alike. ``spans``
    (a list per callable) receives every group as (wall start, wall end, ms per call).
    ``contexts`` (a factory per callable, e.g. an SDPA backend choice) is entered around each
    callable's warm-up and each of its groups, outside the CUDA events."""
    torch = _torch()
    contexts = contexts or [contextlib.nullcontext] * len(fns)
    for fn, context in zip(fns, contexts):
        with context():
            for _ in range(warmup):
                fn()
    torch.cuda.synchronize()
    means = [[] for _ in fns]
    host = [[] for _ in fns]
    for _ in range(groups):
        for i, fn in enumerate(fns):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            with contexts[i]():
                wall0 = time.time()
                start.record()
                t0 = time.perf_counter()
                for _ in range(calls):
                    fn()
                t1 = time.perf_counter()
                end.record()
                end.synchronize()
            means[i].append(start.elapsed_time(end) / calls)
            host[i].append((t1 - t0) * 1e3 / calls)
            if spans is not None:
                spans[i].append((wall0, time.time(), means[i][-1]))
    return [{"ms": statistics.median(m), "min_ms": min(m), "max_ms": max(m), "host_ms": statistics.median(h)}
            for m, h in zip(means, host)]


def time_cuda(fn, warmup: int = WARMUP, groups: int = GROUPS, calls: int = CALLS_PER_GROUP) -> dict:
    """Median over ``groups`` of the mean time of ``calls`` back-to-back calls, between two CUDA
    events on the current torch stream. Also the host time per call: when it is near the device
    time, the calls were launch-bound and the number measures the host, not the kernel."""
    return time_cuda_interleaved([fn], warmup, groups, calls)[0]


def l2_bytes() -> int:
    try:
        return int(_torch().cuda.get_device_properties(0).L2_cache_size) or L2_BYTES_DEFAULT
    except Exception:  # noqa: BLE001
        return L2_BYTES_DEFAULT


def gemm_ceiling(n: int = 8192) -> float:
    """TFLOP/s of a bf16 n^3 torch matmul on random data (the context for attention numbers)."""
    torch = _torch()
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    t = time_cuda(lambda: torch.mm(a, b), warmup=3, groups=5, calls=5)
    return tflops(2.0 * n ** 3, t["ms"])


def fp8_gemm_ceiling(n: int = 8192) -> float:
    """TFLOP/s of an e4m3 n^3 ``torch._scaled_mm`` (bf16 out): the FP8 ceiling issue 6 reports against."""
    torch = _torch()
    a = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn)
    b = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn).t()      # column-major, as cuBLASLt wants
    one = torch.ones((), device="cuda")
    t = time_cuda(lambda: torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16),
                  warmup=3, groups=5, calls=5)
    return tflops(2.0 * n ** 3, t["ms"])


def copy_bandwidth(nbytes: int = 2 << 30) -> float:
    """TB/s of a device-to-device copy, counting bytes read plus bytes written."""
    torch = _torch()
    src = torch.empty(nbytes, device="cuda", dtype=torch.uint8).random_()
    dst = torch.empty_like(src)
    t = time_cuda(lambda: dst.copy_(src), warmup=3, groups=5, calls=5)
    return 2 * nbytes / (t["ms"] * 1e-3) / 1e12


def reference_torch(q, k, v, causal: bool, softmax_scale: float | None = None):
    """Float64 attention on the GPU (torch), (b, s, h, d) in and out: for checking slices of
    large problems where NumPy would take minutes. Same semantics as reference.attention_reference."""
    torch = _torch()
    b, sq, hq, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    group = hq // hkv
    scale = 1.0 / math.sqrt(d) if softmax_scale is None else float(softmax_scale)
    out = torch.zeros(b, sq, hq, d, dtype=torch.float64, device=q.device)
    if sq == 0 or sk == 0:
        return out
    chunk = max(1, min(sq, (1 << 26) // sk))
    cols = torch.arange(sk, device=q.device)
    for bi in range(b):
        for h in range(hq):
            kh = k[bi, :, h // group].double()
            vh = v[bi, :, h // group].double()
            for r0 in range(0, sq, chunk):
                r1 = min(sq, r0 + chunk)
                s = scale * (q[bi, r0:r1, h].double() @ kh.T)
                if causal:
                    rows = torch.arange(r0, r1, device=q.device)
                    s.masked_fill_(cols[None, :] > rows[:, None] + (sk - sq), -math.inf)
                m = s.amax(dim=1, keepdim=True)
                m = torch.where(torch.isneginf(m), torch.zeros_like(m), m)
                p = torch.exp(s - m)
                l = p.sum(dim=1, keepdim=True)
                out[bi, r0:r1, h] = (p @ vh) / torch.where(l > 0, l, torch.ones_like(l))
    return out


class InputSet:
    """One cell's inputs as the implementations take them: q, k, v (bf16/fp16, or e4m3 with
    per-tensor float32 descale scalars in ``descales``: {"q_descale": t, "k_descale": t, "v_descale": t})."""

    def __init__(self, q, k, v, descales: dict | None = None):
        self.q, self.k, self.v, self.descales = q, k, v, descales or {}

    @property
    def fp8(self) -> bool:
        return bool(self.descales)

    def real(self, name: str, x):
        """The values an fp8 tensor stands for (e4m3 x descale, float32); x itself otherwise."""
        return x.float() * self.descales[f"{name}_descale"] if self.fp8 else x


def quantized(s: InputSet) -> InputSet:
    """The e4m3 (per-tensor scale) version of a bf16/fp16 input set (facodegen.quantize)."""
    from ..quantize import quantize_e4m3
    (q8, qd), (k8, kd), (v8, vd) = (quantize_e4m3(x) for x in (s.q, s.k, s.v))
    return InputSet(q8, k8, v8, {"q_descale": qd, "k_descale": kd, "v_descale": vd})


def _slice_check(o, s: InputSet, causal: bool, dtype: str) -> tuple[bool, str, float]:
    """Check batch 0, q heads 0..1 of an output against the float64 reference (for e4m3 inputs:
    the reference of the dequantised values, within reference.FP8_TOLERANCE)."""
    torch = _torch()
    hq, hkv = s.q.shape[2], s.k.shape[2]
    heads = list(range(min(2, hq)))
    kv_idx = torch.tensor([h // (hq // hkv) for h in heads], device=s.q.device)
    qs = s.real("q", s.q[:1, :, heads[0]:heads[-1] + 1])
    ks = s.real("k", s.k[:1].index_select(2, kv_idx))
    vs = s.real("v", s.v[:1].index_select(2, kv_idx))
    ref = reference_torch(qs, ks, vs, causal)
    got = o[:1, :, heads[0]:heads[-1] + 1]
    ok, msg = check(got, ref, "fp8" if s.fp8 else dtype)
    return ok, msg, compare(got, ref)["rel_fro"]


# ----------------------------------------------------------------------------------------------
# implementations: each returns (fn, context, variant) for one input set
# ----------------------------------------------------------------------------------------------

def _fa3_module():
    errors = []
    for name in ("flash_attn_interface", "flash_attn_3.flash_attn_interface"):
        try:
            import importlib
            return importlib.import_module(name), None
        except Exception as err:  # noqa: BLE001
            errors.append(f"{name}: {type(err).__name__}: {err}")
    return None, "; ".join(errors)


def peer_available(name: str) -> tuple[bool, str]:
    """(available, note) without running anything."""
    if name not in PEER_TITLES:
        return False, f"unknown peer {name!r} (known: {', '.join(PEER_TITLES)})"
    try:
        torch = _torch()
    except Exception as err:  # noqa: BLE001
        return False, f"torch cannot be imported: {err}"
    if name == "fa3":
        mod, err = _fa3_module()
        if mod is None:
            return False, f"flash_attn_interface not importable ({err})"
        return True, getattr(mod, "__file__", "") or "flash_attn_interface"
    if name == "flex":
        try:
            importlib.import_module("torch.nn.attention.flex_attention")
        except Exception as err:  # noqa: BLE001
            return False, f"torch {torch.__version__} has no FlexAttention: {err}"
        return True, f"torch {torch.__version__} (torch.compile'd)"
    try:
        from torch.nn.attention import SDPBackend  # noqa: F401
        getattr(SDPBackend, _SDPA_BACKENDS[name])
    except Exception as err:  # noqa: BLE001
        return False, f"torch {torch.__version__} has no SDPA backend {_SDPA_BACKENDS[name]}: {err}"
    return True, f"torch {torch.__version__}"


def _peer_fn(name: str, s: InputSet, causal: bool):
    q, k, v = s.q, s.k, s.v
    if name == "fa3":
        mod, err = _fa3_module()
        if mod is None:
            raise RuntimeError(f"unavailable: {err}")
        # FlashAttention-3 takes fp8 descales per (batch, kv head)
        descales = {n: t.reshape(1, 1).expand(k.shape[0], k.shape[2]).contiguous() for n, t in s.descales.items()}

        def fn():
            r = mod.flash_attn_func(q, k, v, causal=causal, **descales)
            return r[0] if isinstance(r, (tuple, list)) else r
        return fn, contextlib.nullcontext
    if s.fp8:
        raise RuntimeError(f"skipped: {PEER_TITLES[name]} has no e4m3 path")
    if name == "flex":
        return _flex_fn(q, k, v, causal), contextlib.nullcontext
    from torch.nn.attention import SDPBackend, sdpa_kernel
    import torch.nn.functional as F
    if causal and q.shape[1] != k.shape[1]:
        raise RuntimeError("skipped: SDPA's is_causal is top-left aligned, facodegen's bottom-right")
    backend = getattr(SDPBackend, _SDPA_BACKENDS[name])
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    extra = {"enable_gqa": True} if q.shape[2] != k.shape[2] else {}

    def fn():
        return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, **extra).transpose(1, 2)
    return fn, lambda: sdpa_kernel(backend)


_FLEX_COMPILED = {}


def _flex_fn(q, k, v, causal: bool):
    """FlexAttention (torch.compile'd once per process) on (b, h, s, d) views, with facodegen's
    bottom-right causal alignment expressed as a block mask."""
    torch = _torch()
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    if "fn" not in _FLEX_COMPILED:
        _FLEX_COMPILED["fn"] = torch.compile(flex_attention, dynamic=False)
    compiled = _FLEX_COMPILED["fn"]
    seqlen_q, seqlen_k = q.shape[1], k.shape[1]
    offset = seqlen_k - seqlen_q
    block_mask = None
    if causal:
        def bottom_right(b, h, q_idx, kv_idx):
            return kv_idx <= q_idx + offset
        block_mask = create_block_mask(bottom_right, None, None, seqlen_q, seqlen_k, device=q.device)
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    gqa = q.shape[2] != k.shape[2]

    def fn():
        return compiled(qt, kt, vt, block_mask=block_mask, enable_gqa=gqa).transpose(1, 2)
    return fn


def _split_overrides(spec_overrides, arch: str) -> dict:
    """A flat dict applies to every arch; {"sm80": {...}, "sm90": {...}} per arch."""
    if not spec_overrides:
        return {}
    if any(key in ("sm80", "sm90") for key in spec_overrides):
        return dict(spec_overrides.get(arch, {}))
    return dict(spec_overrides)


def _facodegen_operands(overrides: dict, s: InputSet):
    """(overrides without dtype, input set to check against, q, k, v) of a facodegen variant: a
    ``dtype=fp8`` variant on a bf16/fp16 cell quantises the inputs once (per tensor) and is checked
    against their dequantised values; a ``v_layout=transposed`` variant gets V^T made before timing
    (api.transpose_v), as a caller who keeps V^T across calls would have it."""
    from .. import api
    overrides = dict(overrides)
    if overrides.pop("dtype", None) == "fp8" and not s.fp8:
        s = quantized(s)
    v = api.transpose_v(s.v) if overrides.get("v_layout") == "transposed" else s.v
    return overrides, s, s.q, s.k, v


def _facodegen_fn(arch: str, overrides: dict, s: InputSet, causal: bool):
    """The prepared path: a zero-argument launcher through ``facodegen.api.prepare`` (argument
    checks, spec resolution and parameter packing done once, out and lse allocated once), so its
    time is the kernel's with the least host work. Returns (fn, context, variant, the input set
    to check against); tune and the scripts time kernels through it too."""
    torch = _torch()
    from .. import api
    overrides, s, q, k, v = _facodegen_operands(overrides, s)
    out = torch.empty(q.shape, dtype=torch.bfloat16 if s.fp8 else q.dtype, device=q.device)
    lse = torch.empty(q.shape[0], q.shape[2], q.shape[1], dtype=torch.float32, device=q.device)
    launcher = api.prepare(q, k, v, causal=causal, arch=arch, out=out, lse_out=lse, **s.descales, **overrides)

    def fn(_operands=(q, k, v)):     # the launcher points into these (v may be a V^T made here)
        launcher()
        return out
    return fn, contextlib.nullcontext, launcher.spec.variant, s


def _facodegen_call_fn(arch: str, overrides: dict, s: InputSet, causal: bool):
    """The public call, as users make it: ``facodegen.attention(q, k, v, causal=..., **overrides)``
    every time, its argument checks, kernel lookup and out allocation included. Returns (fn,
    context, variant, the input set to check against) like _facodegen_fn. The variant is read
    off one ``facodegen.prepare`` of the same arguments, which also makes a refused variant fail
    here, before anything is timed."""
    import facodegen
    overrides, s, q, k, v = _facodegen_operands(overrides, s)
    kwargs = dict(causal=causal, arch=arch, **s.descales, **overrides)
    variant = getattr(getattr(facodegen.prepare(q, k, v, **kwargs), "spec", None), "variant", None)

    def fn():
        return facodegen.attention(q, k, v, **kwargs)
    return fn, contextlib.nullcontext, variant, s


def _facodegen_makers(name: str, arch: str, overrides: dict, causal: bool, prepared: bool = True) -> list:
    """[(name, make: InputSet -> (fn, context, variant, checked set))] of one facodegen column:
    the public call under ``name`` and, unless ``prepared`` is False, the prepared launcher beside
    it under prepared_name(name). Both run over the same rotated input sets and take turns with the
    peers, so the two differ only by the host work of the public call."""
    makers = [(name, lambda s: _facodegen_call_fn(arch, overrides, s, causal))]
    if prepared:
        makers.append((prepared_name(name), lambda s: _facodegen_fn(arch, overrides, s, causal)))
    return makers


def _facodegen_names(archs, variants: dict | None, prepared: bool) -> list[str]:
    """The facodegen result names of a cell (for rows of cells that never ran)."""
    names = list(variants or [facodegen_name(a) for a in archs])
    return [x for n in names for x in ([n, prepared_name(n)] if prepared else [n])]


def _make_inputs(c: dict, n_sets: int) -> list[InputSet]:
    """Fresh randn inputs; fp8 cells quantise bf16 randn to e4m3 per tensor."""
    torch = _torch()
    from ..reference import random_qkv
    dtype = "bf16" if c["dtype"] == "fp8" else c["dtype"]
    sets = []
    for _ in range(n_sets):
        s = InputSet(*random_qkv(c["batch"], c["seqlen_q"], c["seqlen_k"], c["heads_q"], c["heads_kv"],
                                 c["head_dim"], dtype, xp=torch, device="cuda"))
        sets.append(quantized(s) if c["dtype"] == "fp8" else s)
    return sets


_LOGGED: set = set()


def _build_impl(make, input_sets):
    """Build the callables (one per input set). Returns (result, fns, context, checked_set):
    context is a factory of the context the calls need (an SDPA backend choice), checked_set the
    inputs fns[0] runs on; fns is None when the implementation refused or failed to build (the
    reason is in result["note"])."""
    result: dict = {"tflops": None, "ms": None, "err": None, "note": None}
    try:
        built = [make(s) for s in input_sets]
    except Exception as err:  # noqa: BLE001
        msg = str(err)
        result["note"] = msg if msg.startswith(("skipped", "unavailable")) else f"setup failed: {type(err).__name__}: {msg}"
        return result, None, None, None
    if len(built[0]) > 2:
        result["variant"] = built[0][2]
    checked_set = built[0][3] if len(built[0]) > 3 else input_sets[0]
    return result, [b[0] for b in built], built[0][1], checked_set


def _check_impl(name: str, result: dict, fns, checked_set, c: dict, log) -> bool:
    """Run fns[0] once (the caller enters its context) and compare with the float64 reference on a slice; False
    with the reason in result["note"] when it fails or raises."""
    torch = _torch()
    try:
        o = fns[0]()
        torch.cuda.synchronize()
        ok, msg, err = _slice_check(o, checked_set, c["causal"], c["dtype"])
    except Exception as err:  # noqa: BLE001
        _note_failure(name, result, err, log)
        return False
    result["err"] = err
    if not ok:
        result["note"] = f"check failed: {msg}"
    return ok


def _rotation(fns):
    """A callable that calls the next input set's callable each time."""
    state = {"i": 0}

    def rotate():
        fns[state["i"] % len(fns)]()
        state["i"] += 1
    return rotate


def _note_failure(name: str, result: dict, err: Exception, log) -> None:
    first = str(err).strip().splitlines()[0] if str(err).strip() else ""
    result["note"] = f"failed: {type(err).__name__}: {first[:300]}"
    log(f"    {name}: {result['note']}")
    key = (name, result["note"])
    if key not in _LOGGED:            # the whole traceback once per distinct failure
        _LOGGED.add(key)
        log("    " + traceback.format_exc().strip().replace("\n", "\n    ")[-2000:])


def _record_time(result: dict, t: dict, c: dict) -> dict:
    flops = attention_flops(c["batch"], c["heads_q"], c["seqlen_q"], c["seqlen_k"], c["head_dim"], c["causal"])
    result.update(ms=t["ms"], tflops=tflops(flops, t["ms"]), min_ms=t["min_ms"], max_ms=t["max_ms"],
                  host_ms=t["host_ms"])
    if t["host_ms"] >= 0.9 * t["ms"]:
        result["note"] = (f"launch-bound: {t['host_ms'] * 1e3:.0f} us of host time per call vs "
                          f"{t['ms'] * 1e3:.0f} us on the device")
    return result


def _build_and_check(name: str, make, input_sets, c: dict, check_first: bool, log, then=None):
    """Build the implementation, enter its context once, check set 0 and, still inside that entry
    (SDPA's backend choice is a single-use context manager), run ``then(result, rotate)`` if given.
    Returns (result, rotate, context); rotate is None when it refused, failed to build or failed
    the check (the reason in result["note"])."""
    result, fns, context, checked_set = _build_impl(make, input_sets)
    if fns is None:
        return result, None, None
    with context():
        if check_first and not _check_impl(name, result, fns, checked_set, c, log):
            return result, None, None
        rotate = _rotation(fns)
        if then is not None:
            then(result, rotate)
    return result, rotate, context


def _time_alone(name: str, result: dict, rotate, c: dict, timing: dict, log, context=contextlib.nullcontext) -> None:
    """time_cuda of one implementation inside ``context()``, recorded into result (a failure: its note)."""
    try:
        with context():
            _record_time(result, time_cuda(rotate, **timing), c)
    except Exception as err:  # noqa: BLE001
        _note_failure(name, result, err, log)


def _run_impl(name: str, make, input_sets, c: dict, check_first: bool, timing: dict, log) -> dict:
    """Build, check set 0, then time rotating over the sets, all inside one entry of the
    implementation's context (one implementation at a time: run_cell's sequential mode)."""
    def time_in_check_entry(result: dict, rotate) -> None:
        _time_alone(name, result, rotate, c, timing, log)
    return _build_and_check(name, make, input_sets, c, check_first, log, then=time_in_check_entry)[0]


def _time_in_turns(prepared: list, row: dict, c: dict, timing: dict, log) -> None:
    """Time the checked implementations [(name, rotate, context)] group by group in turn. Should
    one raise while they take turns, each is timed alone so the others still get a number."""
    try:
        times = time_cuda_interleaved([rotate for _, rotate, _ in prepared],
                                      contexts=[context for _, _, context in prepared], **timing)
    except Exception as err:  # noqa: BLE001
        log(f"    taking turns failed ({type(err).__name__}: {str(err)[:200]}); timing each alone")
        for name, rotate, context in prepared:
            _time_alone(name, row["results"][name], rotate, c, timing, log, context)
        return
    for (name, _, _), t in zip(prepared, times):
        _record_time(row["results"][name], t, c)


def run_cell(c: dict, archs=("sm90",), peers=DEFAULT_PEERS, spec_overrides=None, check_first: bool = True,
             timing: dict | None = None, log=print, variants: dict | None = None, prepared: bool = True) -> dict:
    """Time facodegen (each arch, or each named variant: {name: "arch:field=value,..."}, names
    starting with "facodegen") and each peer on one cell, all on the same inputs. facodegen is
    timed through its public call under that name and, unless ``prepared`` is False, through a
    launcher prepared once beside it (prepared_name). Every implementation is built and checked
    first; then they all take turns group by group (time_cuda_interleaved), so the GPU's clock
    drift over the cell falls on each alike. ``timing={"interleave": False}`` times them one after
    the other instead."""
    torch = _torch()
    timing = dict(timing or {})
    interleave = timing.pop("interleave", True)
    row = dict(c)
    row["flops"] = attention_flops(c["batch"], c["heads_q"], c["seqlen_q"], c["seqlen_k"], c["head_dim"], c["causal"])
    row["results"] = {}
    try:
        n_sets = input_sets_needed(input_bytes(c), l2_bytes())
        input_sets = _make_inputs(c, n_sets)
    except Exception as err:  # noqa: BLE001
        for name in _facodegen_names(archs, variants, prepared):
            row["results"][name] = {"tflops": None, "note": f"inputs failed: {err}"}
        return row
    row["input_sets"] = n_sets
    makers = []                       # (name, make: InputSet -> (fn, context factory, ...))
    for name, text in (variants or {facodegen_name(arch): arch + ":" for arch in archs}).items():
        arch, fields = parse_variant(text)
        overrides = {**_split_overrides(spec_overrides, arch), **fields}
        makers += _facodegen_makers(name, arch, overrides, c["causal"], prepared)
    for name in peers:
        available, note = peer_available(name)
        if not available:
            makers.append((name, f"unavailable: {note}"))
            continue
        makers.append((name, (lambda n: lambda s: _peer_fn(n, s, c["causal"]))(name)))
    prepared = []
    for name, make in makers:
        if isinstance(make, str):
            row["results"][name] = {"tflops": None, "note": make}
            continue
        if not interleave:
            row["results"][name] = _run_impl(name, make, input_sets, c, check_first, timing, log)
            continue
        result, rotate, context = _build_and_check(name, make, input_sets, c, check_first, log)
        row["results"][name] = result
        if rotate is not None:
            prepared.append((name, rotate, context))
    if prepared:
        _time_in_turns(prepared, row, c, timing, log)
    del input_sets
    torch.cuda.synchronize()
    return row


def _cell_tag(c: dict) -> str:
    return (f"{c['dtype']} d{c['head_dim']} {'causal' if c['causal'] else 'full'} s{c['seqlen_q']}"
            f"{'' if c['seqlen_q'] == c['seqlen_k'] else 'x' + str(c['seqlen_k'])} b{c['batch']} h{c['heads_q']}")


def run_grid(cells: list[dict], archs=("sm90",), peers=DEFAULT_PEERS, spec_overrides=None,
             budget_s: float | None = None, check_first: bool = True, timing: dict | None = None,
             log=print, variants: dict | None = None, prepared: bool = True) -> list[dict]:
    """run_cell over a grid. A cell that raises is reported in its row and the grid goes on;
    once ``budget_s`` seconds have passed, the remaining cells are listed as skipped."""
    if isinstance(archs, str):
        archs = (archs,)
    t0 = time.monotonic()
    rows = []
    for i, c in enumerate(cells):
        elapsed = time.monotonic() - t0
        if budget_s is not None and elapsed > budget_s:
            row = dict(c, results={n: {"tflops": None, "note": "skipped: time budget spent"}
                                   for n in _facodegen_names(archs, variants, prepared)})
            rows.append(row)
            continue
        log(f"[{i + 1}/{len(cells)}] {_cell_tag(c)}  ({elapsed:.0f} s)")
        try:
            row = run_cell(c, archs, peers, spec_overrides, check_first, timing, log, variants, prepared)
        except Exception as err:  # noqa: BLE001
            log("    " + traceback.format_exc().strip().replace("\n", "\n    "))
            row = dict(c, results={n: {"tflops": None, "note": f"cell failed: {err}"}
                                   for n in _facodegen_names(archs, variants, prepared)})
        summary = ", ".join(f"{n} {r['tflops']:.1f}" if r.get("tflops") is not None else f"{n} -"
                            for n, r in row["results"].items())
        log(f"    {summary}")
        rows.append(row)
    return rows


def run_cli_bench(spec, arch: str | None = None, head_dim: int | None = None, dtype: str | None = None,
                  causal: bool | None = None, seqlen: int = 4096, batch: int = 4, heads: int = 16,
                  peers=DEFAULT_PEERS, seqlen_k: int | None = None, heads_kv: int | None = None,
                  prepared: bool = True) -> str:
    """``facodegen bench``: one cell, facodegen's public call (and, unless ``prepared`` is False,
    its prepared launcher beside it) against the peers, as a markdown table plus notes.

    ``spec`` is a KernelSpec (its tile fields are passed to the launcher as overrides) or a dict
    of spec overrides, with arch/head_dim/dtype/causal given separately."""
    if hasattr(spec, "as_dict"):
        fields = spec.as_dict()
        arch = arch or fields["arch"]
        head_dim = head_dim or fields["head_dim"]
        dtype = dtype or fields["dtype"]
        causal = fields["causal"] if causal is None else causal
        overrides = {k: v for k, v in fields.items() if k not in ("arch", "head_dim", "dtype", "causal")}
    else:
        overrides = dict(spec or {})
    c = cell(head_dim or 128, bool(causal), seqlen, batch, heads, dtype or "bf16", seqlen_k, heads_kv)
    row = run_cell(c, (arch or "sm90",), peers, overrides, prepared=prepared)
    notes = format_notes([row])
    return format_table([row]) + ("\n\n" + notes if notes else "")


# ----------------------------------------------------------------------------------------------
# suites (`facodegen bench --suite`): a grid, every importable peer, table + CSV + JSON + plot
# ----------------------------------------------------------------------------------------------

SUITES = {"fa3-paper": fa3_paper_grid, "quick": quick_grid, "sm80": sm80_grid, "fp8": fp8_grid}
SUITE_PEERS = ("fa3", "cudnn", "fa2", "efficient")
CSV_FIELDS = ("dtype", "head_dim", "causal", "seqlen_q", "seqlen_k", "batch", "heads_q", "heads_kv", "impl",
              "tflops", "ms", "ratio_to_best_peer", "best_peer", "err", "variant", "note")


def suite_cells(suite: str, dtype: str = "bf16", head_dim: int | None = None,
                causal: bool | None = None) -> list[dict]:
    """The cells of a suite, optionally only one head_dim and/or one mask."""
    if suite == OVERHEAD_SUITE:
        raise ValueError(f"suite: {suite!r} times host microseconds per call (run_overhead), not a grid of cells")
    if suite not in SUITES:
        raise ValueError(f"suite: {suite!r} is not one of {', '.join(SUITES)}")
    cells = SUITES[suite](dtype)
    if head_dim is not None:
        cells = [c for c in cells if c["head_dim"] == head_dim]
    if causal is not None:
        cells = [c for c in cells if c["causal"] == causal]
    return cells


def csv_rows(rows: list[dict]) -> list[dict]:
    """One flat record per (cell, implementation), facodegen's public call with its ratio to the
    best peer (the prepared launcher's record has none, as in the table)."""
    out = []
    for row in rows:
        peer, _ = best_peer(row)
        for name, r in row.get("results", {}).items():
            rec = {k: row.get(k) for k in CSV_FIELDS[:8]}
            ratio = ratio_to_best_peer(row, name) if has_ratio(name) else None
            rec.update(impl=name, tflops=r.get("tflops"), ms=r.get("ms"), ratio_to_best_peer=ratio,
                       best_peer=peer, err=r.get("err"), variant=r.get("variant"), note=r.get("note"))
            out.append(rec)
    return out


def to_csv(rows: list[dict]) -> str:
    import csv
    import io

    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=CSV_FIELDS, lineterminator="\n")
    writer.writeheader()
    for rec in csv_rows(rows):
        writer.writerow({k: ("" if v is None else (f"{v:.6g}" if isinstance(v, float) else v)) for k, v in rec.items()})
    return buf.getvalue()


def environment() -> dict:
    """What a benchmark result needs to be read later: GPU, versions, commit, date."""
    import datetime
    import os
    import subprocess

    from .. import __version__
    env: dict = {"facodegen": __version__, "date": datetime.date.today().isoformat()}
    if os.environ.get("FACODEGEN_COMMIT"):
        # a copied checkout whose .git lags the tree (e.g. a lent GPU machine) says which commit it is
        env["commit"] = os.environ["FACODEGEN_COMMIT"]
    try:
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        done = subprocess.run(["git", "-C", root, "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=10)
        if done.returncode == 0 and "commit" not in env:
            env["commit"] = done.stdout.strip()
            dirty = subprocess.run(["git", "-C", root, "status", "--porcelain", "--untracked-files=no"],
                                   capture_output=True, text=True, timeout=10)
            env["dirty"] = bool(dirty.stdout.strip())
    except Exception:  # noqa: BLE001
        pass
    try:
        from ..compiler import nvrtc_identity
        env["nvrtc"] = nvrtc_identity()
    except Exception:  # noqa: BLE001
        pass
    try:
        torch = _torch()
        env["torch"] = torch.__version__
        if torch.cuda.is_available():
            p = torch.cuda.get_device_properties(0)
            env.update(gpu=p.name, cc=f"{p.major}.{p.minor}", sms=p.multi_processor_count)
    except Exception:  # noqa: BLE001
        pass
    env["peers"] = {name: list(peer_available(name)) for name in PEER_TITLES}
    return env


def write_results(rows: list[dict], out_dir, stem: str, env: dict | None = None, plot: bool = True,
                  title: str | None = None) -> dict:
    """Write <stem>.md (table + notes), .csv, .json (rows + environment) and .png into ``out_dir``;
    returns {"md": path, "csv": ..., "json": ..., "png": path or None, "plot_error": text or None}."""
    import json
    from pathlib import Path

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths: dict = {}
    notes = format_notes(rows)
    paths["md"] = out / f"{stem}.md"
    paths["md"].write_text(format_table(rows) + ("\n\nNotes:\n" + notes if notes else "") + "\n")
    paths["csv"] = out / f"{stem}.csv"
    paths["csv"].write_text(to_csv(rows))
    paths["json"] = out / f"{stem}.json"
    paths["json"].write_text(json.dumps({"env": env or {}, "rows": rows}, indent=1, default=str) + "\n")
    paths["png"], paths["plot_error"] = None, None
    if plot:
        from .plot import PlotUnavailable, plot_rows
        env = env or {}
        subtitle = ", ".join(x for x in (env.get("gpu"), env.get("date"),
                                         f"commit {env['commit']}{'+' if env.get('dirty') else ''}"
                                         if env.get("commit") else None) if x)
        try:
            paths["png"] = plot_rows(rows, out / f"{stem}.png", title=title, subtitle=subtitle or None)
        except (PlotUnavailable, ValueError) as err:
            paths["plot_error"] = str(err)
    return paths


# ----------------------------------------------------------------------------------------------
# the evolution suite: FlashAttention-1 -> 2 -> 3 on one GPU (issue 7, docs/evolution.md)
# ----------------------------------------------------------------------------------------------

def evolution_grid(dtype: str = "bf16") -> list[dict]:
    """head_dim 128, non-causal, seqlen 512..16k, twice: 16k tokens per batch (batch = 16384/seqlen)
    and batch 1, both with 16 heads (hidden 2048). At batch 1 FlashAttention-1's batch x heads
    parallelism has 16 CTAs for the whole GPU; FA2's grid over Q blocks fills it."""
    return ([dict(cell(128, False, s, 16384 // s, 16, dtype), family="16k tokens per batch") for s in FA3_SEQLENS]
            + [dict(cell(128, False, s, 1, 16, dtype), family="batch 1") for s in FA3_SEQLENS])


# facodegen variants of the evolution suite (name -> variant, see parse_variant): FA1's schedule,
# each FA2 idea switched on alone, all of them in the fa1 template, the fa2 kernel, the sm90 (FA3)
# kernel. One table column (and plot bar) each.
EVOLUTION_VARIANTS = {
    "facodegen FA1": "sm80:schedule=fa1",
    "facodegen FA1 + seq. parallel": "sm80:schedule=fa1,loop_order=q_outer",
    "facodegen FA1 + split Q": "sm80:schedule=fa1,warp_split=q",
    "facodegen FA1 + rescale once": "sm80:schedule=fa1,rescale=once",
    "facodegen FA1 + all three": "sm80:schedule=fa1,loop_order=q_outer,warp_split=q,rescale=once",
    "facodegen FA2 (sm80)": "sm80:",
    "facodegen FA3 (sm90)": "sm90:",
    "facodegen FA3 fp8 (sm90)": "sm90:dtype=fp8",
}
# FA1 at batch 1 runs on 16 CTAs (~0.5 s a call at 16k): few calls per cell.
EVOLUTION_TIMING = {"warmup": 2, "groups": 3, "calls": 3}

def _field_types() -> dict:
    """KernelSpec field name -> "int" | "bool" | "str", read off the dataclass (one source of truth)."""
    import dataclasses

    from ..spec import KernelSpec
    return {f.name: str(f.type).split(" |")[0] for f in dataclasses.fields(KernelSpec)}


def parse_variant(text: str) -> tuple[str, dict]:
    """``arch:field=value,...`` -> (arch, spec fields typed as KernelSpec declares them); an empty
    field list means that arch's defaults (e.g. ``sm90:pingpong=0,block_n=128``)."""
    arch, _, rest = text.partition(":")
    types = _field_types()
    fields: dict = {}
    for item in filter(None, rest.split(",")):
        key, _, value = item.partition("=")
        if key not in types:
            raise ValueError(f"variant {text!r}: {key!r} is not a KernelSpec field")
        kind = types[key]
        fields[key] = bool(int(value)) if kind == "bool" else int(value) if kind == "int" else value
    return arch, fields


GRIDS["evolution"] = evolution_grid
SUITES["evolution"] = evolution_grid


# ----------------------------------------------------------------------------------------------
# the overhead suite (`facodegen bench --suite overhead`): host microseconds per call
# ----------------------------------------------------------------------------------------------
#
# Where the kernels' suites divide FLOPs by device time, this one asks what a call costs the
# host: argument checks, kernel lookup, allocation, launch. The shape is tiny, so the GPU's few
# microseconds per call stay below the host's and the clock on the host measures the host.

OVERHEAD_SUITE = "overhead"
OVERHEAD_SHAPE = (1, 128, 8, 128)                 # (batch, seqlen, heads, head_dim), q, k and v alike
OVERHEAD_CASES = (("bf16", True), ("fp16", False), ("fp8", True))   # (dtype, causal); fp8 with descales
OVERHEAD_OPTIONS = ("plain", "return_lse", "out=")
OVERHEAD_SDPA = "torch SDPA"                      # the reference of the ratio column
OVERHEAD_FA3 = "FlashAttention-3"
OVERHEAD_IMPLS = ("facodegen.attention", "facodegen.attention (CuPy)", "facodegen.prepare()()",
                  OVERHEAD_SDPA, OVERHEAD_FA3)
OVERHEAD_PEERS = ("fa3",)                         # optional peers besides SDPA (always timed: the reference)
# warm-up calls, calls timed per repeat, repeats (medians over these), calls per synchronize for the
# pure host figure: 100 calls (a few launches each) stay far below the ~1000 launches a stream queues
# before a launch blocks, so no call of a chunk waits for the GPU.
OVERHEAD_TIMING = {"warmup": 200, "calls": 2000, "repeats": 5, "chunk": 100}
OVERHEAD_CSV_FIELDS = ("impl", "dtype", "causal", "options", "host_us", "loop_us", "ratio_to_sdpa", "note")


def suite_names() -> tuple[str, ...]:
    """Every `facodegen bench --suite` name: the TFLOP/s grids (SUITES) and the overhead suite."""
    return (*SUITES, OVERHEAD_SUITE)


def time_host_per_call(fn, synchronize, warmup: int = 200, calls: int = 2000, repeats: int = 5,
                       chunk: int = 100) -> dict:
    """Host cost of one call of ``fn`` in microseconds, after ``warmup`` calls, two ways, each the
    median over ``repeats``:

    * ``loop_us``: ``calls`` back-to-back calls with time.perf_counter() around the loop and one
      ``synchronize()`` after it, divided by ``calls``: a call's steady-state cost in a loop (the
      host's as long as the GPU keeps up, else the GPU's).
    * ``host_us``: the same number of calls in chunks of ``chunk``, a ``synchronize()`` before each
      chunk and only the chunk's loop on the clock, divided by ``calls``: the pure host time, the GPU
      never the bottleneck (a chunk never fills the launch queue, so no launch waits for the GPU).
    """
    for _ in range(warmup):
        fn()
    synchronize()
    loop, host = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        synchronize()
        loop.append((time.perf_counter() - t0) / calls)
    chunks = max(1, calls // chunk)
    for _ in range(repeats):
        spent = 0.0
        for _ in range(chunks):
            synchronize()
            t0 = time.perf_counter()
            for _ in range(chunk):
                fn()
            spent += time.perf_counter() - t0
        host.append(spent / (chunks * chunk))
    synchronize()
    return {"host_us": statistics.median(host) * 1e6, "loop_us": statistics.median(loop) * 1e6}


def overhead_row(impl: str, dtype: str, causal: bool, options: str, host_us: float | None = None,
                 loop_us: float | None = None, note: str | None = None) -> dict:
    """One (implementation, case, options) record of the overhead suite."""
    return {"impl": impl, "dtype": dtype, "causal": bool(causal), "options": options,
            "host_us": host_us, "loop_us": loop_us, "ratio_to_sdpa": None, "note": note}


def _sdpa_host_us(rows: list[dict], row: dict) -> float | None:
    """SDPA's plain-call host time for the case of ``row``: same mask, same dtype; fp8 rows take
    SDPA on bf16 (it has no e4m3 path, and bf16 is what the fp8 inputs were quantised from).
    The options of ``row`` (return_lse, out=) have no SDPA counterpart: their ratio says what the
    option costs against SDPA's plain call."""
    dtype = "bf16" if row["dtype"] == "fp8" else row["dtype"]
    for r in rows:
        if (r["impl"], r["options"], r["dtype"], r["causal"]) == (OVERHEAD_SDPA, "plain", dtype, row["causal"]):
            return r["host_us"]
    return None


def with_sdpa_ratios(rows: list[dict]) -> list[dict]:
    """The rows with ``ratio_to_sdpa`` = host_us / SDPA's (see _sdpa_host_us), where both exist."""
    out = []
    for row in rows:
        ref = _sdpa_host_us(rows, row)
        ratio = row["host_us"] / ref if row["host_us"] is not None and ref else None
        out.append(dict(row, ratio_to_sdpa=ratio))
    return out


def _not_run(row: dict) -> bool:
    """A row that was skipped or whose implementation is unavailable (not a failure)."""
    return row["host_us"] is None and str(row.get("note") or "").startswith(("skipped", "unavailable"))


def format_overhead_table(rows: list[dict]) -> str:
    """Markdown: one line per (implementation, dtype, mask, options) that ran, with the pure host
    µs per call, the back-to-back loop's µs per call and the host time's ratio to SDPA's ("fail":
    it raised). Rows not run (an option or dtype a peer lacks, a peer not installed) stay out of
    the table; format_overhead_notes gives their reasons."""
    head = ["implementation", "dtype", "causal", "options", "host µs/call", "loop µs/call", "ratio to SDPA"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        if _not_run(r):
            continue
        cells = [r["impl"], r["dtype"], "yes" if r["causal"] else "no", r["options"],
                 "fail" if r["host_us"] is None else f"{r['host_us']:.1f}",
                 "–" if r["loop_us"] is None else f"{r['loop_us']:.1f}",
                 "–" if r.get("ratio_to_sdpa") is None else f"{r['ratio_to_sdpa']:.2f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def format_overhead_notes(rows: list[dict]) -> str:
    """One line per implementation and note (skipped, unavailable, failed, GPU-bound loop) with the
    rows it applies to: a missing peer is one line, not one per case and option."""
    groups: dict = {}
    for r in rows:
        if r.get("note"):
            tag = f"{r['dtype']} {'causal' if r['causal'] else 'full'} {r['options']}"
            groups.setdefault((r["impl"], r["note"]), []).append(tag)
    return "\n".join(f"- {impl} ({', '.join(tags) if len(tags) <= 3 else f'{len(tags)} rows'}): {note}"
                     for (impl, note), tags in groups.items())


def overhead_csv(rows: list[dict]) -> str:
    import csv
    import io

    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=OVERHEAD_CSV_FIELDS, lineterminator="\n", extrasaction="ignore")
    writer.writeheader()
    for r in rows:
        writer.writerow({k: ("" if r.get(k) is None else (f"{r[k]:.6g}" if isinstance(r[k], float) else r[k]))
                         for k in OVERHEAD_CSV_FIELDS})
    return buf.getvalue()


def write_overhead_results(rows: list[dict], out_dir, stem: str, env: dict | None = None) -> dict:
    """Write <stem>.md (table + notes), .csv and .json (rows, shape, timing, environment) into
    ``out_dir`` (no plot: a table of microseconds reads better); returns {"md": path, ...}."""
    import json
    from pathlib import Path

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    notes = format_overhead_notes(rows)
    paths = {"md": out / f"{stem}.md", "csv": out / f"{stem}.csv", "json": out / f"{stem}.json"}
    paths["md"].write_text(format_overhead_table(rows) + ("\n\nNotes:\n" + notes if notes else "") + "\n")
    paths["csv"].write_text(overhead_csv(rows))
    paths["json"].write_text(json.dumps({"env": env or {}, "shape": OVERHEAD_SHAPE, "timing": OVERHEAD_TIMING,
                                         "rows": rows}, indent=1, default=str) + "\n")
    return paths


def _overhead_inputs(dtype: str, causal: bool) -> InputSet:
    """One input set of the tiny shape (fp8: quantised per tensor from bf16 randn, with descales).
    One set is enough: the kernel's time is not what is measured."""
    batch, seqlen, heads, head_dim = OVERHEAD_SHAPE
    return _make_inputs(cell(head_dim, causal, seqlen, batch, heads, dtype), 1)[0]


def _out_like(s: InputSet):
    """A torch out buffer for an ``out=`` call: q's shape, bf16 for e4m3 inputs (facodegen's default)."""
    torch = _torch()
    return torch.empty(s.q.shape, dtype=torch.bfloat16 if s.fp8 else s.q.dtype, device=s.q.device)


def _facodegen_kwargs(s: InputSet, causal: bool, options: str, kwargs: dict, out) -> dict:
    """facodegen's keyword arguments of one overhead row: mask, descales, the CLI's arch and spec
    fields, then the option (return_lse=True, or out= an array allocated once)."""
    extra = {"plain": {}, "return_lse": {"return_lse": True}, "out=": {"out": out}}[options]
    return dict(causal=causal, **s.descales, **kwargs, **extra)


def _overhead_attention(s: InputSet, causal: bool, options: str, kwargs: dict):
    """``facodegen.attention`` on torch tensors, every call from scratch (what users write)."""
    import facodegen
    q, k, v = s.q, s.k, s.v
    call = _facodegen_kwargs(s, causal, options, kwargs, _out_like(s) if options == "out=" else None)
    return lambda: facodegen.attention(q, k, v, **call)


def _overhead_attention_cupy(s: InputSet, causal: bool, options: str, kwargs: dict):
    """``facodegen.attention`` on CuPy arrays (zero-copy views of the torch tensors). CuPy has neither
    bfloat16 nor e4m3, so only the fp16 case runs."""
    if s.fp8 or str(s.q.dtype) != "torch.float16":
        raise RuntimeError(f"skipped: CuPy has no {'e4m3' if s.fp8 else 'bfloat16'} dtype")
    import cupy

    import facodegen
    q, k, v = (cupy.asarray(x) for x in (s.q, s.k, s.v))
    out = cupy.empty(q.shape, dtype=q.dtype) if options == "out=" else None
    call = _facodegen_kwargs(s, causal, options, kwargs, out)
    return lambda: facodegen.attention(q, k, v, **call)


def _overhead_prepared(s: InputSet, causal: bool, options: str, kwargs: dict):
    """``facodegen.prepare(...)`` once, then the prepared call: the least host work per launch."""
    import facodegen
    call = _facodegen_kwargs(s, causal, options, kwargs, _out_like(s) if options == "out=" else None)
    return facodegen.prepare(s.q, s.k, s.v, **call)


def _overhead_sdpa(s: InputSet, causal: bool, options: str, kwargs: dict):
    """torch SDPA with torch's own backend choice on (b, h, s, d) views made once (no transpose
    back: the least a caller holding (b, h, s, d) tensors would pay)."""
    if s.fp8:
        raise RuntimeError("skipped: SDPA has no e4m3 path")
    if options != "plain":
        raise RuntimeError(f"skipped: SDPA has no {'LSE output' if options == 'return_lse' else 'out= argument'}")
    import torch.nn.functional as F
    qt, kt, vt = (x.transpose(1, 2) for x in (s.q, s.k, s.v))
    return lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)


def _overhead_fa3(s: InputSet, causal: bool, options: str, kwargs: dict):
    """FlashAttention-3's ``flash_attn_func`` ((b, s, h, d), fp8 with (batch, heads_kv) descales)."""
    import inspect

    mod, err = _fa3_module()
    if mod is None:
        raise RuntimeError(f"unavailable: flash_attn_interface not importable ({err})")
    if options == "out=":
        raise RuntimeError("skipped: flash_attn_func takes no out=")
    extra = {}
    if options == "return_lse":
        try:
            takes_probs = "return_attn_probs" in inspect.signature(mod.flash_attn_func).parameters
        except (TypeError, ValueError):
            takes_probs = False
        if not takes_probs:
            raise RuntimeError("skipped: this flash_attn_func has no return_attn_probs (LSE) switch")
        extra["return_attn_probs"] = True
    q, k, v = s.q, s.k, s.v
    descales = {n: t.reshape(1, 1).expand(k.shape[0], k.shape[2]).contiguous() for n, t in s.descales.items()}
    return lambda: mod.flash_attn_func(q, k, v, causal=causal, **descales, **extra)


OVERHEAD_BUILDERS = {
    "facodegen.attention": _overhead_attention,
    "facodegen.attention (CuPy)": _overhead_attention_cupy,
    "facodegen.prepare()()": _overhead_prepared,
    OVERHEAD_SDPA: _overhead_sdpa,
    OVERHEAD_FA3: _overhead_fa3,
}


def _overhead_impls(peers) -> list[str]:
    """The implementations timed: facodegen's three ways and SDPA always, FlashAttention-3 if asked."""
    return [n for n in OVERHEAD_IMPLS if n != OVERHEAD_FA3 or "fa3" in peers]


def _time_overhead_row(impl: str, s: InputSet, causal: bool, options: str, kwargs: dict, dtype: str,
                       timing: dict, timer, log) -> dict:
    """Build one implementation for one case and options, call it once (compiles, or raises before
    any timing), then time it. A refusal ("skipped: ...", "unavailable: ...") or a failure becomes
    the row's note, and the suite goes on."""
    torch = _torch()
    row = overhead_row(impl, dtype, causal, options)
    try:
        fn = OVERHEAD_BUILDERS[impl](s, causal, options, kwargs)
        fn()
        torch.cuda.synchronize()
    except Exception as err:  # noqa: BLE001
        msg = str(err).strip().splitlines()[0] if str(err).strip() else ""
        row["note"] = msg if msg.startswith(("skipped", "unavailable")) else f"failed: {type(err).__name__}: {msg[:300]}"
        return row
    t = timer(fn, torch.cuda.synchronize, **timing)
    row.update(host_us=t["host_us"], loop_us=t["loop_us"])
    if t["loop_us"] > 1.25 * t["host_us"]:
        # back to back, the calls waited for something other than the host (the GPU or a full queue)
        row["note"] = f"back-to-back loop {t['loop_us']:.1f} µs/call vs {t['host_us']:.1f} host: GPU-bound there"
    log(f"    {impl} {dtype} {'causal' if causal else 'full'} {options}: {t['host_us']:.1f} µs/call host, "
        f"{t['loop_us']:.1f} in the loop")
    return row


def run_overhead(arch: str | None = None, overrides: dict | None = None, peers=OVERHEAD_PEERS,
                 timing: dict | None = None, timer=time_host_per_call, log=print) -> list[dict]:
    """Host µs per call (time_host_per_call) of facodegen.attention on torch tensors and on CuPy
    arrays, facodegen.prepare(...)(), torch SDPA and (``"fa3" in peers``, if importable)
    FlashAttention-3's flash_attn_func, on OVERHEAD_SHAPE for each of OVERHEAD_CASES and
    OVERHEAD_OPTIONS, one implementation after the other (host time does not drift with the GPU's
    clock), with each row's ratio to SDPA's plain call (with_sdpa_ratios). ``arch`` and
    ``overrides`` (spec fields) are passed to facodegen's calls when given."""
    timing = {**OVERHEAD_TIMING, **(timing or {})}
    kwargs = {**({"arch": arch} if arch else {}), **(overrides or {})}
    impls = _overhead_impls(peers)
    rows = []
    for dtype, causal in OVERHEAD_CASES:
        try:
            s = _overhead_inputs(dtype, causal)
        except Exception as err:  # noqa: BLE001 (e.g. no e4m3 in this torch: the other cases still run)
            rows += [overhead_row(i, dtype, causal, o, note=f"skipped: inputs failed: {type(err).__name__}: {err}")
                     for o in OVERHEAD_OPTIONS for i in impls]
            continue
        for options in OVERHEAD_OPTIONS:
            for impl in impls:
                rows.append(_time_overhead_row(impl, s, causal, options, kwargs, dtype, timing, timer, log))
        del s
    return with_sdpa_ratios(rows)
