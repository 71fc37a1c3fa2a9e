"""The varlen backward's suite (`facodegen bench --suite varlen --backward`, GPU): gradients of packed
variable-length attention, bf16, over the varlen suite's cells (varlen_suite.cells: mixed lengths 100-8k
summing to ~32k tokens, and 8 x 4096), beside FlashAttention-2's varlen backward (torch SDPA's flash
backend on nested jagged tensors, the packed call torch has) and the padded backward
(facodegen.attention_backward with every sequence padded to the longest), all in turns in one run.

Columns (each timed as torch.autograd.grad of O with retain_graph, or the direct call, between CUDA events):
  facodegen autograd     torch.autograd.grad through facodegen.attention_varlen: the call users make (its
                         backward's default arch: sm90 on H100/H200)
  facodegen sm90 / sm80  facodegen.attention_varlen_backward(..., arch=...) on the forward's O and LSE
  FA2 varlen (NJT)       torch.autograd.grad through SDPA (FLASH_ATTENTION) on nested jagged tensors
  facodegen padded       facodegen.attention_backward on the padded batch (the same code without varlen; its
                         TFLOP/s fall by the padding it computes)
TFLOP/s count the real work: 2.5 x the forward's FLOPs summed over the sequences (varlen_flops). Each
implementation's dQ, dK, dV are checked on the longest sequence against facodegen's autograd (within 2e-2
of the largest) before it is timed: the one sequence the padded batch computes as varlen does without a
causal mask (a shorter sequence's queries see its zero-padded keys there); one that fails or refuses is reported with the reason. The pure parts
(the counting, the table) import without torch.
"""

from __future__ import annotations

import json
import traceback
from pathlib import Path

from . import varlen_suite as vs

BACKWARD_FLOPS = 2.5      # backward FLOPs per forward FLOP
TIMING = {"warmup": 3, "groups": 5, "calls": 10}
QUICK_TIMING = {"warmup": 2, "groups": 3, "calls": 5}
COLUMNS = ("facodegen autograd", "facodegen sm90", "facodegen sm80", "FA2 varlen (NJT)", "facodegen padded")
PEER = "FA2 varlen (NJT)"


def backward_tflops(c: dict, ms: float) -> float:
    """TFLOP/s of a backward over cell ``c`` in ``ms``: 2.5 x its real forward FLOPs."""
    return BACKWARD_FLOPS * c["flops"] / (ms * 1e-3) / 1e12


def format_table(rows: list[dict]) -> str:
    """One line per cell: TFLOP/s of each column (or why it has none) and each's ratio to FA2 varlen."""
    head = "| cell | d | causal | " + " | ".join(COLUMNS) + " | vs FA2 varlen |"
    lines = [head, "|" + "---|" * (len(COLUMNS) + 4)]
    for r in rows:
        got = r["results"]
        cols = [f"{got[n]['tflops']:.1f}" if "tflops" in got.get(n, {}) else got.get(n, {}).get("why", "-")[:40]
                for n in COLUMNS]
        peer = got.get(PEER, {}).get("ms")
        ratios = ", ".join(f"{n.replace('facodegen ', '')} {peer / got[n]['ms']:.2f}x" for n in COLUMNS
                           if n != PEER and peer and "ms" in got.get(n, {}))
        lines.append(f"| {r['cell']} | {r['head_dim']} | {r['causal']} | " + " | ".join(cols) + f" | {ratios or '-'} |")
    return "\n".join(lines)


def _implementations(c: dict, torch, facodegen):
    """{column: (function, grads)}: each a callable of no argument that runs one backward, and the (dQ,
    dK, dV) of its last run (for the check)."""
    heads, d, causal, lengths = c["heads"], c["head_dim"], c["causal"], c["lengths"]
    gen = torch.Generator(device="cuda").manual_seed(0)
    total = c["tokens"]
    q, k, v, do = (torch.randn(total, heads, d, generator=gen, device="cuda", dtype=torch.bfloat16)
                   for _ in range(4))
    cu = torch.tensor(vs.cu_seqlens(lengths), dtype=torch.int32, device="cuda")
    longest = c["max_seqlen"]
    impls = {}

    leaves = [x.detach().clone().requires_grad_(True) for x in (q, k, v)]
    out_ag = facodegen.attention_varlen(*leaves, cu, cu, longest, longest, causal=causal)
    impls["facodegen autograd"] = lambda: torch.autograd.grad(out_ag, leaves, do, retain_graph=True)
    with torch.no_grad():
        out, lse = facodegen.attention_varlen(q, k, v, cu, cu, longest, longest, causal=causal, return_lse=True)
    for arch in ("sm90", "sm80"):
        impls[f"facodegen {arch}"] = (lambda arch=arch: facodegen.attention_varlen_backward(
            do, q, k, v, out, lse, cu, cu, longest, longest, causal=causal, arch=arch))

    def fa2():
        from torch.nn.attention import SDPBackend, sdpa_kernel
        offsets = cu.to(torch.int64)
        nested = [torch.nested.nested_tensor_from_jagged(x, offsets=offsets).transpose(1, 2) for x in leaves_fa2]
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            o = torch.nn.functional.scaled_dot_product_attention(*nested, is_causal=causal)
        return o.transpose(1, 2).values()
    leaves_fa2 = [x.detach().clone().requires_grad_(True) for x in (q, k, v)]
    out_fa2 = fa2()
    impls[PEER] = lambda: torch.autograd.grad(out_fa2, leaves_fa2, do, retain_graph=True)

    batch = len(lengths)
    padded = [torch.zeros(batch, longest, heads, d, device="cuda", dtype=torch.bfloat16) for _ in range(4)]
    for x, p in zip((q, k, v, do), padded):
        for b, (a, e) in enumerate(zip(vs.cu_seqlens(lengths), vs.cu_seqlens(lengths)[1:])):
            p[b, :e - a] = x[a:e]
    with torch.no_grad():
        out_p, lse_p = facodegen.attention(*padded[:3], causal=causal, return_lse=True)
    impls["facodegen padded"] = lambda: facodegen.attention_backward(padded[3], *padded[:3], out_p, lse_p,
                                                                     causal=causal)
    longest_seq = max(range(batch), key=lengths.__getitem__)
    return impls, (q, k, v, do, cu, longest_seq)


def measure(c: dict, timing: dict) -> dict:
    import torch

    import facodegen
    from .timing import time_cuda_interleaved
    results = {}
    try:
        impls, (q, k, v, do, cu, seq) = _implementations(c, torch, facodegen)
    except Exception as err:    # noqa: BLE001 (a setup failure is the row's result)
        return {**c, "results": {n: {"why": f"setup: {type(err).__name__}: {err}"} for n in COLUMNS}}
    reference = None
    runnable = {}
    for name, fn in impls.items():
        try:
            grads = fn()
            torch.cuda.synchronize()
            start, length = vs.cu_seqlens(c["lengths"])[seq], c["lengths"][seq]
            got = [g[start:start + length] if g.dim() == 3 else g[seq, :length] for g in grads]
            if reference is None:
                reference = got
            worst = max(((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-6)).item()
                        for a, b in zip(got, reference))
            if not worst <= 2e-2:
                results[name] = {"why": f"gradients off by {worst:.2e} of the largest"}
                continue
            runnable[name] = fn
        except Exception as err:    # noqa: BLE001 (a refusing implementation is reported, not timed)
            results[name] = {"why": f"{type(err).__name__}: {err}".splitlines()[0]}
            traceback.print_exc(limit=2)
    timed = time_cuda_interleaved(list(runnable.values()), **timing) if runnable else []
    for name, t in zip(runnable, timed):
        results[name] = {"ms": t["ms"], "tflops": backward_tflops(c, t["ms"]), "host_ms": t["host_ms"]}
    torch.cuda.empty_cache()
    return {**c, "results": results}


def run(todo: list[dict], quick: bool = False, log=print) -> list[dict]:
    """measure() each cell in turn (QUICK_TIMING with ``quick``)."""
    rows = []
    for c in todo:
        log(f"cell {c['cell']} d{c['head_dim']} causal={c['causal']}: {c['sequences']} sequences, {c['tokens']} tokens")
        rows.append(measure(c, QUICK_TIMING if quick else TIMING))
    return rows


def write_results(rows: list[dict], out_dir, stem: str = "bench-varlen-backward") -> dict:
    """The table (.md) and the rows (.json) under ``out_dir``: {kind: path}."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"md": out / f"{stem}.md", "json": out / f"{stem}.json"}
    paths["md"].write_text(format_table(rows) + "\n")
    paths["json"].write_text(json.dumps(rows, indent=1, default=str))
    return paths
