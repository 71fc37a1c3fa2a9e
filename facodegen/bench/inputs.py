"""A cell's inputs and the check of an output: how many input sets the calls rotate over (so
together they touch at least twice the L2 and no timing is of a warm cache), fresh randn sets on
the GPU (e4m3 ones quantised per tensor), and the float64 reference on a slice (batch 0, q heads 0
and 1) that every implementation's output is checked against before it is timed."""

from __future__ import annotations

import math

from ..verify.reference import check, compare
from .timing import _torch

L2_BYTES_DEFAULT = 60 * 1024 * 1024
MAX_INPUT_SETS = 8


def input_bytes(c: dict) -> int:
    """Bytes of Q, K, V and O for one cell (2 bytes an element; Q, K, V 1 byte under fp8)."""
    d = c["head_dim"]
    qkv = 1 if c["dtype"] == "fp8" else 2
    return d * c["batch"] * ((qkv + 2) * c["seqlen_q"] * c["heads_q"] + 2 * qkv * c["seqlen_k"] * c["heads_kv"])


def input_sets_needed(bytes_per_set: int, l2_bytes: int = L2_BYTES_DEFAULT, cap: int = MAX_INPUT_SETS) -> int:
    """How many input sets to rotate over so the calls together touch at least twice the L2."""
    return max(1, min(cap, math.ceil(2 * l2_bytes / max(1, bytes_per_set))))


def l2_bytes() -> int:
    try:
        return int(_torch().cuda.get_device_properties(0).L2_cache_size) or L2_BYTES_DEFAULT
    except Exception:  # noqa: BLE001
        return L2_BYTES_DEFAULT


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
    """The e4m3 (per-tensor scale) version of a bf16/fp16 input set (facodegen.ops.quantize)."""
    from ..ops.quantize import quantize_e4m3
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


def _make_inputs(c: dict, n_sets: int) -> list[InputSet]:
    """Fresh randn inputs; fp8 cells quantise bf16 randn to e4m3 per tensor."""
    torch = _torch()
    from ..verify.reference import random_qkv
    dtype = "bf16" if c["dtype"] == "fp8" else c["dtype"]
    sets = []
    for _ in range(n_sets):
        s = InputSet(*random_qkv(c["batch"], c["seqlen_q"], c["seqlen_k"], c["heads_q"], c["heads_kv"],
                                 c["head_dim"], dtype, xp=torch, device="cuda"))
        sets.append(quantized(s) if c["dtype"] == "fp8" else s)
    return sets
