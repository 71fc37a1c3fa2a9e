"""The problems timed: a cell (one attention problem as a dict), the named grids of cells, and
the FLOP count and TFLOP/s of a cell (FLOPs = 4 * batch * heads * seqlen_q * seqlen_k * head_dim,
half of that for causal: the papers' convention). Runs anywhere: no torch, no GPU."""

from __future__ import annotations

from ..verify.reference import dtype_name


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


# The FlashAttention papers' sizes: 16k tokens per batch (batch = 16384 / seqlen) and hidden 2048
# (heads = 2048 / head_dim, rounded down to whole heads for 96 and 192).
TOKENS_PER_BATCH = 16384
HIDDEN = 2048
FA3_SEQLENS = (512, 1024, 2048, 4096, 8192, 16384)


def paper_cell(head_dim: int, causal: bool, seqlen: int, dtype: str = "bf16") -> dict:
    """A cell of the papers' sizes: 16k tokens per batch, hidden 2048."""
    return cell(head_dim, causal, seqlen, TOKENS_PER_BATCH // seqlen, HIDDEN // head_dim, dtype)


def fa3_paper_grid(dtype: str = "bf16") -> list[dict]:
    """The FlashAttention-3 paper's forward grid: head_dim 64/128/256 x causal no/yes x seqlen
    512..16k, 16k tokens per batch (batch = 16384/seqlen), hidden 2048 (heads = 2048/head_dim)."""
    return [paper_cell(d, c, s, dtype) for d in (64, 128, 256) for c in (False, True) for s in FA3_SEQLENS]


def quick_grid(dtype: str = "bf16") -> list[dict]:
    """A handful of FA3-grid cells: every head_dim, both masks, a short and a long sequence."""
    picks = [(128, False, 2048), (128, True, 8192), (64, False, 4096), (64, True, 1024),
             (256, False, 2048), (256, True, 16384)]
    return [paper_cell(d, c, s, dtype) for d, c, s in picks]


def sm80_grid(dtype: str = "bf16") -> list[dict]:
    """Every head_dim the sm80 kernels ship, both masks, seqlen 2k and 8k (16k tokens, hidden 2048
    rounded down to whole heads for 96 and 192)."""
    return [paper_cell(d, c, s, dtype) for d in (64, 96, 128, 192, 256) for c in (False, True) for s in (2048, 8192)]


def fp8_grid(dtype: str = "fp8") -> list[dict]:
    """Issue 6's FP8 grid: head_dim 64/128/256 x causal no/yes x seqlen 2k/8k/16k (16k tokens per
    batch, hidden 2048), always e4m3 inputs (``dtype`` is accepted for the GRIDS signature only)."""
    return [paper_cell(d, c, s, "fp8") for d in (64, 128, 256) for c in (False, True) for s in (2048, 8192, 16384)]


def evolution_grid(dtype: str = "bf16") -> list[dict]:
    """head_dim 128, non-causal, seqlen 512..16k, twice: 16k tokens per batch (batch = 16384/seqlen)
    and batch 1, both with 16 heads (hidden 2048). At batch 1 FlashAttention-1's batch x heads
    parallelism has 16 CTAs for the whole GPU; FA2's grid over Q blocks fills it."""
    return ([dict(paper_cell(128, False, s, dtype), family="16k tokens per batch") for s in FA3_SEQLENS]
            + [dict(cell(128, False, s, 1, HIDDEN // 128, dtype), family="batch 1") for s in FA3_SEQLENS])


# name -> grid (dtype -> cells): scripts/device_run.py's --grid; suites.SUITES names the same grids
GRIDS = {"quick": quick_grid, "fa3": fa3_paper_grid, "sm80": sm80_grid, "fp8": fp8_grid, "evolution": evolution_grid}


def make_grid(name: str, dtype: str = "bf16") -> list[dict]:
    if name not in GRIDS:
        raise ValueError(f"grid: {name!r} is not one of {', '.join(GRIDS)}")
    return GRIDS[name](dtype)
