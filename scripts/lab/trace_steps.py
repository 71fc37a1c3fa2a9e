#!/usr/bin/env python3
"""Where a consumer step's time goes, read off the SM clock inside the kernel (GPU, sm90 fp8).

    python3 scripts/lab.py trace-steps --cell 256,16384,0 [--variant k=v,...] [--patch FILE] [--out DIR]

Renders the cell's fp8 kernel (as facodegen.ops.api would pick it), adds `%clock` reads to the copy it
compiles (the generated kernel itself is untouched) and runs it on randn inputs. Per step of the
steady loop, thread 0 of each consumer warpgroup of the first TRACE_CTAS CTAs records:
  start (loop top), k (its K tile arrived), vt (Q K^T issued and the V^T tile arrived: the issue
  waits while the tensor pipe is full), s (S ready: the Q K^T wait), pv (the P V wait), and the
  next step's start;
and per K/V block the loader's K TMA issue, and (in-kernel transpose only) its V TMA issue, the V
tile's landing, the transposers' start (V^T slot free, the tile before done) and their V^T arrival;
and per tile of each consumer warpgroup: fetched, Q landed, the first S, the tail's P V done, the
epilogue done (the LSE line; with defer_o_store O packed, its stores left to the next tile's
prologue), with the tile's key blocks.
Prints the medians over the steady steps of the first tile: each phase, the step period, how far
apart the two warpgroups run (0 = lockstep, half a period = alternation), the time from a K load's
issue to its consumers' K wait ending (its latency where they waited, else how early it went
out), the V TMA latency and the transpose time; then per tile the Q wait, the first Q K^T, the epilogue,
the step to the next fetch, and what a tile costs beyond blocks x period. The
traced kernel's TFLOP/s is printed beside the plain kernel's: the stores move ptxas's schedule (the
one after the S wait holds the row max pass ahead of the P V wait, as anchor_softmax does), so
phase boundaries are good to a few hundred cycles and the traced kernel runs 1-10% slower.
--patch times a source patch (exp.py's blocks) beside the plain kernel and traces it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(os.path.dirname(HERE)), HERE]

TRACE_CTAS = 8
TRACE_STEPS = 1024          # ring positions (k_iter) recorded per consumer warpgroup
EVENTS = ("start", "k", "vt", "s", "pv")
# per V tile (kv_iter): the loader issues its TMA, it lands, the transposers start on it, V^T done
# per K/V block (kv_iter): the loader issues V's TMA, V lands, the transposers start on it, V^T
# done (those four with in-kernel transposes only), the loader issues K's TMA
V_EVENTS = ("issue", "landed", "start", "done", "k_issue")
# per tile of a consumer warpgroup (tile_iter): the tile fetched, its Q landed, the prologue's S ready,
# the tail's P V done, O stored; and the tile's key blocks
TRACE_TILES = 128
TILE_EVENTS = ("fetch", "q", "s0", "tail", "stored")

HEADER = f"""
// ---- scripts/lab.py trace-steps: %clock at the consumer step's stages (a traced copy) ----
__device__ unsigned int fcg_trace[{TRACE_CTAS}][2][{TRACE_STEPS}][{len(EVENTS)}];
__device__ unsigned int fcg_trace_vt[{len(V_EVENTS)}][{TRACE_CTAS}][{TRACE_STEPS}];
__device__ __forceinline__ unsigned int fcg_clock() {{
    unsigned int c;
    asm volatile("mov.u32 %0, %%clock;" : "=r"(c) :: "memory");
    return c;
}}
__device__ unsigned int fcg_trace_tile[{TRACE_CTAS}][2][{TRACE_TILES}][{len(TILE_EVENTS) + 1}];
#define FCG_TILE_RECORD(slot, value) do {{ if (release_thread && blockIdx.x < {TRACE_CTAS} && tile_iter < {TRACE_TILES}) \\
    fcg_trace_tile[blockIdx.x][wg][tile_iter][(slot)] = (value); }} while (0)
#define FCG_TRACE_TILE(ev) FCG_TILE_RECORD(ev, fcg_clock())
#define FCG_TRACE_V(idx, ev) do {{ if (threadIdx.x % 32 == 0 && blockIdx.x < {TRACE_CTAS} && (idx) < {TRACE_STEPS}) \
    fcg_trace_vt[(ev)][blockIdx.x][(idx)] = fcg_clock(); }} while (0)
#define FCG_TRACE(idx, ev) do {{ if (release_thread && blockIdx.x < {TRACE_CTAS} && (idx) < {TRACE_STEPS}) \\
    fcg_trace[blockIdx.x][wg][(idx)][(ev)] = fcg_clock(); }} while (0)
"""

# (anchor in the rendered source, text put after it, or before it where "before" follows); the first
# REQUIRED_PATCHES (the consumers' steps and tiles, and the K issue) must be found
REQUIRED_PATCHES = 11
PATCHES = [
    ("            const uint32_t q_empty = smem_u32(&state.q_empty[q_stage]);\n",
     "            FCG_TRACE_TILE(0);\n"
     f"            FCG_TILE_RECORD({len(TILE_EVENTS)}, t.blocks());\n"),
    ("            mbar_wait(smem_u32(&state.q_full[q_stage]), (tile_iter / Q_STAGES) & 1);\n",
     "            FCG_TRACE_TILE(1);\n"),
    ("                        wgmma_wait<0>();\n                        fence_regs(s_reg);\n"
     "                        const int n = t.n_end - 1;\n",
     "                        FCG_TRACE_TILE(2);\n"),
    ("t.blocks() > 1);  // O += P V\n                        wgmma_commit();\n"
     "                        pingpong_pass(wg);\n                        wgmma_wait<0>();\n",
     "                        FCG_TRACE_TILE(3);\n"),
    # (defer_o_store: where the tile's O words are ready, left for the next tile's prologue to store)
    (("            if (lane % 4 == 0 && !is_partial_piece(t)) {        // the quad's column-0 thread writes LSE\n",
      "                pending_out.valid = true;\n"),
     "            FCG_TRACE_TILE(4);\n", "before"),
    ("                        const int k_stage = k_iter % STAGES;\n",
     "                        const uint32_t fcg_idx = k_iter;\n                        FCG_TRACE(fcg_idx, 0);\n"),
    ("                        mbar_wait(smem_u32(&state.k_full[k_stage]), (k_iter / STAGES) & 1);\n",
     "                        FCG_TRACE(fcg_idx, 1);\n"),
    ("                        wgmma_fence();                              // the wait's branch ends the fenced region\n",
     "                        FCG_TRACE(fcg_idx, 2);\n"),
    ("                        wgmma_wait<1>();                            // S ready, P V still running\n",
     "                        FCG_TRACE(fcg_idx, 3);\n"),
    ("                        wgmma_wait<0>();                            // P V done: O and P free\n",
     "                        FCG_TRACE(fcg_idx, 4);\n"),
    ("                    mbar_wait(smem_u32(&state.k_empty[stage]), lap_parity);\n",
     "                    if (leader) FCG_TRACE_V(kv_iter, 4);\n"),
    ("                        mbar_wait(smem_u32(&state.v_empty[stage]), lap_parity);\n",
     "                        if (leader) FCG_TRACE_V(kv_iter, 0);\n"),
    # vt_in_place: the loader's V issue waits for the V^T slot itself, the transposers start where V landed
    ("                // the loader waited for the V^T slot before V's TMA: transpose where V landed\n",
     "                if (twarp == 0) FCG_TRACE_V(kv_iter, 2);\n"),
    ("                        mbar_wait(smem_u32(&state.vt_empty[stage]), lap_parity);   // V lands in the V^T slot\n",
     "                        if (leader) FCG_TRACE_V(kv_iter, 0);\n"),
    ("                mbar_wait(smem_u32(&state.v_full[stage]), parity);          // V landed (or the end)\n",
     "                if (twarp == 0) FCG_TRACE_V(kv_iter, 1);\n"),
    ("                mbar_wait(smem_u32(&state.vt_empty[stage]), parity ^ 1);    // consumers done with V^T's last lap\n",
     "                if (twarp == 0) FCG_TRACE_V(kv_iter, 2);\n"),
    ("                    mbar_arrive(smem_u32(&state.vt_full[stage]));\n",
     "                    FCG_TRACE_V(kv_iter, 3);\n"),
    # docs/experiments/fp8-kv-pool.patch: its loads issue once a pool slot is taken (the K issue
    # read here comes after the k_empty one above and overwrites it; the V issue has only this
    # anchor there), and its transposers' waits name the V ring position
    ("                    const uint32_t k_tile = take_k_tile(state, k_smem0, kv_iter);\n",
     "                    if (leader) FCG_TRACE_V(kv_iter, 4);\n"),
    ("                        const uint32_t v_tile = KV_POOL ? k_smem0 + pool_take_for(state, state.v_slot, state.v_empty, V_RING, kv_iter) * KV_TILE_BYTES\n"
     "                                                        : v_smem0 + stage * KV_TILE_BYTES;\n",
     "                        if (leader) FCG_TRACE_V(kv_iter, 0);\n"),
    ("                mbar_wait(smem_u32(&state.v_full[v_pos]), (kv_iter / V_RING) & 1);   // V landed (or the end)\n",
     "                if (twarp == 0) FCG_TRACE_V(kv_iter, 1);\n"),
    ("                mbar_wait(smem_u32(&state.vt_empty[stage]), ((kv_iter / STAGES) & 1) ^ 1);   // consumers done with V^T's last lap\n",
     "                if (twarp == 0) FCG_TRACE_V(kv_iter, 2);\n"),
]


def traced(source: str) -> str:
    for number, (anchor, extra, *where) in enumerate(PATCHES):
        if isinstance(anchor, tuple):           # alternatives: the first one the kernel has
            anchor = next((a for a in anchor if a in source), anchor[0])
        if anchor not in source:
            if number >= REQUIRED_PATCHES:      # the V events: only kernels with transposers have them
                continue
            raise SystemExit(f"trace anchor not in the rendered kernel: {anchor.strip()!r}")
        source = source.replace(anchor, extra + anchor if where == ["before"] else anchor + extra)
    first_kernel = source.index('extern "C"')
    return source[:first_kernel] + HEADER + source[first_kernel:]


def apply_patch(source: str, patch: str) -> str:
    for block in patch.split("%%%\n"):
        if "\n===\n" not in block:           # blank, or a comment (a header saying what the patch is)
            continue
        old, new = block.split("\n===\n")
        new = new[:-1] if new.endswith("\n") else new     # the block's last newline ends the block, as OLD's does
        if old not in source:
            raise SystemExit(f"patch text not in the rendered kernel: {old[:80]!r}")
        source = source.replace(old, new)
    return source


def patched_emitters(plain, paths) -> dict:
    """{name: emit(spec) -> source}: ``plain`` as "plain" and, per patch file, plain's source with that patch
    applied (apply_patch), named by the file (patch-ab's and bwd-patch-ab's kernels)."""
    emitters = {"plain": plain}
    for path in paths:
        with open(path) as f:
            emitters[os.path.basename(path)] = lambda spec, text=f.read(): apply_patch(plain(spec), text)
    return emitters


def median(xs):
    return statistics.median(xs) if xs else float("nan")


def analyse(ev, vt, blocks_first_tile: int) -> dict:
    """ev[cta][wg][step][event] and vt[v_event][cta][kv_iter] (uint32 clocks): medians over the
    steady steps of each CTA's first tile."""
    import numpy as np
    rows = {k: [] for k in ("k_wait", "vt_wait", "qk_to_s", "s_to_pv", "softmax", "period", "wg_offset",
                            "vt_ready_before_need", "k_issue_to_use", "v_tma", "v_to_transpose", "transpose")}
    last = min(blocks_first_tile - 1, TRACE_STEPS - 1)

    def d(a, b):                                # clock difference (the clock wraps at 32 bits)
        return int((int(b) - int(a)) % (1 << 32))
    for cta in range(ev.shape[0]):
        for j in range(4, last - 1):            # skip the tile's first steps and its last
            for wg in range(2):
                e, nxt = ev[cta, wg, j].astype(np.int64), ev[cta, wg, j + 1].astype(np.int64)
                if not (e.all() and nxt[0]):
                    continue
                rows["k_wait"].append(d(e[0], e[1]))
                rows["vt_wait"].append(d(e[1], e[2]))
                rows["qk_to_s"].append(d(e[2], e[3]))
                rows["s_to_pv"].append(d(e[3], e[4]))
                rows["softmax"].append(d(e[4], nxt[0]))
                rows["period"].append(d(e[0], nxt[0]))
                if wg == 0 and vt[3, cta, j - 1]:     # this step's P V reads the V^T of load j - 1
                    rows["vt_ready_before_need"].append(d(int(vt[3, cta, j - 1]), int(e[2])))
            if vt[4, cta, j] and ev[cta, 0, j, 1]:
                rows["k_issue_to_use"].append(d(int(vt[4, cta, j]), int(ev[cta, 0, j, 1])))
            v = vt[:4, cta, j].astype(np.int64)
            if v.all():
                rows["v_tma"].append(d(v[0], v[1]))            # V issued -> landed
                rows["v_to_transpose"].append(d(v[1], v[2]))   # landed -> transposers start (V^T slot free, previous tile done)
                rows["transpose"].append(d(v[2], v[3]))        # the transpose itself
            a, b = ev[cta, 0, j, 0], ev[cta, 1, j, 0]
            if a and b:
                rows["wg_offset"].append(min(d(a, b), d(b, a)))   # whichever warpgroup leads
    rows["vt_ready_before_need"] = [x for x in rows["vt_ready_before_need"] if x < 1 << 30]
    return {k: median(v) for k, v in rows.items()} | {"samples": len(rows["period"])}


def analyse_tiles(tiles, period: float) -> dict:
    """tiles[cta][wg][tile_iter][TILE_EVENTS..., blocks]: medians per tile of the Q wait, the prologue's
    Q K^T, the epilogue and the step from one tile's O store to the next fetch, and the share of the
    traced CTAs' time that is not steady steps (tile time - blocks x period, summed)."""
    import numpy as np
    rows = {k: [] for k in ("q_wait", "first_qk", "epilogue", "to_next_fetch", "tile_extra")}
    extra = busy = 0

    def d(a, b):
        return int((int(b) - int(a)) % (1 << 32))
    for cta in range(tiles.shape[0]):
        for wg in range(2):
            for i in range(tiles.shape[2] - 1):
                e, nxt = tiles[cta, wg, i].astype(np.int64), tiles[cta, wg, i + 1].astype(np.int64)
                if not (e[:len(TILE_EVENTS)].all() and nxt[0]):
                    continue
                rows["q_wait"].append(d(e[0], e[1]))
                rows["first_qk"].append(d(e[1], e[2]))
                rows["epilogue"].append(d(e[3], e[4]))
                rows["to_next_fetch"].append(d(e[4], nxt[0]))
                tile_time = d(e[0], nxt[0])
                rows["tile_extra"].append(tile_time - e[len(TILE_EVENTS)] * period)
                extra += rows["tile_extra"][-1]
                busy += tile_time
    return {k: median(v) for k, v in rows.items()} | {"tiles": len(rows["tile_extra"]),
                                                      "extra_share": extra / busy if busy else float("nan")}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cell", default="256,16384,0", help="head_dim,seqlen,causal (16k tokens, hidden 2048)")
    p.add_argument("--variant", default="", help="spec overrides k=v,... (as scripts/lab.py sweep's)")
    p.add_argument("--out", default=None)
    p.add_argument("--patch", default=None,
                   help="a source patch to try (blocks 'OLD\\n===\\nNEW' separated by lines '%%%%'): "
                        "the patched kernel is timed beside the plain one, and traced")
    args = p.parse_args(argv)
    import numpy as np
    import torch
    from facodegen.ops import api
    from facodegen import bench
    from facodegen.runtime import compiler
    from facodegen.codegen import render
    from facodegen.bench.inputs import _make_inputs
    from facodegen.bench.variants import _facodegen_fn
    from sweep import parse_cell
    c = parse_cell(args.cell, "fp8")
    overrides = bench.parse_variant("sm90:" + args.variant)[1]
    s = _make_inputs(c, 1)[0]
    compiler.spec_index = False     # the kernels compiled here are patched renderings: not the index's
    plain_emit = render.emit
    patched = (lambda source: apply_patch(source, open(args.patch).read())) if args.patch else (lambda x: x)
    transforms = {"plain": lambda source: source}
    if args.patch:
        transforms["patched"] = patched
    transforms["traced"] = lambda source: traced(patched(source))
    results = {}
    for mode, transform in transforms.items():
        render.emit = lambda spec, transform=transform: transform(plain_emit(spec))
        compiler.clear_memo()
        api._prepare.cache_clear()
        fn, _, variant, _ = _facodegen_fn("sm90", dict(overrides, dtype="fp8"), s, c["causal"])
        t = bench.time_cuda(fn)
        flops = bench.attention_flops(c["batch"], c["heads_q"], c["seqlen_q"], c["seqlen_k"], c["head_dim"],
                                      c["causal"])
        results[mode] = bench.tflops(flops, t["ms"])
        print(f"{mode}: {variant} {results[mode]:.1f} TFLOP/s", flush=True)
    (spec, _), kernel = next(iter(compiler._spec_memo.items()))
    if kernel.resources.spill_stores:
        print(f"note: the traced kernel spills {kernel.resources.spill_stores} bytes (the plain one's "
              "registers are tight); its phases carry the spills' cost too")
    module = kernel._lazy[("function", torch.cuda.current_device())][0]
    import cupy

    def global_ptr(name, nbytes):          # cupy returns a MemoryPointer (an address in some versions)
        ptr = module.get_global_var(name)
        if isinstance(ptr, int):
            ptr = cupy.cuda.MemoryPointer(cupy.cuda.UnownedMemory(ptr, nbytes, module), 0)
        return ptr
    ev_ptr = global_ptr("fcg_trace", TRACE_CTAS * 2 * TRACE_STEPS * len(EVENTS) * 4)
    vt_ptr = global_ptr("fcg_trace_vt", len(V_EVENTS) * TRACE_CTAS * TRACE_STEPS * 4)
    tile_shape = (TRACE_CTAS, 2, TRACE_TILES, len(TILE_EVENTS) + 1)
    tile_ptr = global_ptr("fcg_trace_tile", int(np.prod(tile_shape)) * 4)
    tiles = cupy.ndarray(tile_shape, dtype=cupy.uint32, memptr=tile_ptr)
    tiles.fill(0)
    ev = cupy.ndarray((TRACE_CTAS, 2, TRACE_STEPS, len(EVENTS)), dtype=cupy.uint32, memptr=ev_ptr)
    vt = cupy.ndarray((len(V_EVENTS), TRACE_CTAS, TRACE_STEPS), dtype=cupy.uint32, memptr=vt_ptr)
    ev.fill(0)
    vt.fill(0)
    torch.cuda.synchronize()
    fn()
    torch.cuda.synchronize()
    ev_h, vt_h, tiles_h = cupy.asnumpy(ev), cupy.asnumpy(vt), cupy.asnumpy(tiles)
    blocks = -(-c["seqlen_k"] // spec.block_n)
    summary = analyse(ev_h, vt_h, blocks)
    tile_summary = analyse_tiles(tiles_h, summary["period"])
    summary.update(results)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        np.savez_compressed(os.path.join(args.out, f"trace_{args.cell.replace(',', '_')}.npz"), ev=ev_h, vt=vt_h,
                            tiles=tiles_h)
        with open(os.path.join(args.out, f"trace_{args.cell.replace(',', '_')}.json"), "w") as f:
            json.dump(summary | {"tile_" + k: v for k, v in tile_summary.items()}, f, indent=1)
    print("| cell | variant | plain | traced | period | k wait | vt wait | QK->S | S->PV | softmax | WG offset | V^T slack "
          "| K issue->use | V TMA | V wait | transpose | n |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    label = (args.variant or "default") + (f" + {os.path.basename(args.patch)} ({results['patched']:.0f})"
                                           if args.patch else "")
    print(f"| {args.cell} | {label} | {results['plain']:.0f} | {results['traced']:.0f} | "
          + " | ".join(f"{summary[k]:.0f}" for k in ("period", "k_wait", "vt_wait", "qk_to_s", "s_to_pv", "softmax",
                                                    "wg_offset", "vt_ready_before_need", "k_issue_to_use", "v_tma",
                                                    "v_to_transpose", "transpose"))
          + f" | {summary['samples']} |")
    print("| cell | variant | Q wait | first Q K^T | epilogue | O stored -> next fetch | tile - blocks x period "
          "| share of the time not in steady steps | tiles |")
    print("|---|---|---|---|---|---|---|---|---|")
    print(f"| {args.cell} | {label} | "
          + " | ".join(f"{tile_summary[k]:.0f}" for k in ("q_wait", "first_qk", "epilogue", "to_next_fetch", "tile_extra"))
          + f" | {tile_summary['extra_share']:.3f} | {tile_summary['tiles']} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
