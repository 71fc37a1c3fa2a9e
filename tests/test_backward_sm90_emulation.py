"""The sm90 backward's main kernel (templates/sm90/flash_bwd.cu.j2, bwd_ops.cuh.j2), transliterated
into NumPy over one CTA: shared memory as bytes with the kernel's offsets, TMA loads that swizzle
and zero-fill as the hardware does, wgmma that reads its operands through the kernel's descriptors
(start address, LBO, SBO, swizzle; K-major and MN-major in the canonical layouts the forward's
GPU-verified operands use) and writes the m64 accumulator layout, the RS A fragments packed from
registers, the masks, the dS^T stores, the dQ split between the warpgroups and the reductions into
dq_accum (or, dq_tma_reduce, the dQ tile in shared memory, its bulk reduce-add into the tiled
dq_accum and the pre/post kernels' dq_accum_element). It checks the kernel's indexing against the float64 reference on the CPU; the hardware
itself (and the proxy and barrier protocol) is left to tests/gpu/test_backward_gpu.py.

Follows the templates step for step: change them together.
"""

from __future__ import annotations

import numpy as np
import pytest

from facodegen.spec.backward import (BackwardSpec, sm90_dq_cols, sm90_dq_m_tiles, sm90_ds_bufs, sm90_kv_split,
                                     sm90_swizzle_bytes)
from backward_emulation_check import check_emulated_backward

E = np.float16     # elem_t (fp16: the emulation rounds where the kernel converts)
WG_ROWS, WG_THREADS = 64, 128
LOG2E = float(np.log2(np.e))


def swizzle(addr, sw):
    """sm90/tma.cuh.j2 swizzle_xor on an absolute address (tiles start on 1024-byte boundaries)."""
    return addr ^ (((addr >> 7) & (sw // 16 - 1)) << 4)


class Smem:
    def __init__(self, nbytes):
        self.h = np.zeros(nbytes // 2, dtype=E)

    def tma_load(self, dst, slab_bytes, sw, x, row0, rows):
        """load_tile: rows [row0, row0 + rows) of x (seqlen, d) in slabs of sw/2 columns, rows past
        the end read as zeros."""
        cols = sw // 2
        for s in range(x.shape[1] // cols):
            for r in range(rows):
                for c in range(0, cols, 8):                  # 16-byte chunks
                    src = x[row0 + r, s * cols + c: s * cols + c + 8] if row0 + r < x.shape[0] else np.zeros(8)
                    addr = swizzle(dst + s * slab_bytes + r * sw + 2 * c, sw)
                    self.h[addr // 2: addr // 2 + 8] = src

    def read(self, addrs):
        return self.h[np.asarray(addrs) // 2].astype(np.float64)


def operand(smem, start, lbo, sbo, sw, mn_size, k_major):
    """The [mn_size x 16] operand a wgmma reads from a descriptor (start, LBO, SBO, swizzle sw)."""
    mn = np.arange(mn_size)[:, None]
    k = np.arange(16)[None, :]
    if k_major:     # 8-row groups SBO apart, a row of sw bytes holds the k elements
        lin = start + (mn // 8) * sbo + (mn % 8) * sw + 2 * k
    else:           # MN-major: sw/2-element MN slabs LBO apart, 8-row k groups SBO apart
        lin = start + (mn // (sw // 2)) * lbo + (k // 8) * sbo + (k % 8) * sw + 2 * (mn % (sw // 2))
    return smem.read(swizzle(lin, sw))


def acc_index(n):
    """(row, col) of register i of thread t in an m64 x n fp32 accumulator: arrays (128, n/2)."""
    t = np.arange(WG_THREADS)[:, None]
    i = np.arange(n // 2)[None, :]
    warp, lane = t // 32, t % 32
    return 16 * warp + lane // 4 + 8 * ((i >> 1) & 1), 8 * (i >> 2) + 2 * (lane % 4) + (i & 1)


def to_regs(mat):
    rows, cols = acc_index(mat.shape[1])
    return mat[rows, cols]


def from_regs(regs, n):
    rows, cols = acc_index(n)
    out = np.zeros((WG_ROWS, n))
    out[rows, cols] = regs
    return out


def dq_accum_element(spec, offset):
    """bwd_ops.cuh.j2 dq_accum_element (dq_tma_reduce): the dQ element (row, col) of one (batch,
    head_q) at float ``offset`` (even) of the tiled dq_accum; offset + 1 holds (row, col + 1)."""
    bm, d = spec.block_m, spec.head_dim
    dq_cols = sm90_dq_cols(d)
    tile, in_tile = offset // (bm * d), offset % (bm * d)
    part, in_part = in_tile // (bm * dq_cols), in_tile % (bm * dq_cols)
    m_tile, in_m_tile = in_part // (WG_ROWS * dq_cols), in_part % (WG_ROWS * dq_cols)   # (block_m 128: 2)
    i = 4 * (in_m_tile // (WG_THREADS * 4)) + in_m_tile % 4
    thread = (in_m_tile // 4) % WG_THREADS
    lane = thread % 32
    row = tile * bm + m_tile * WG_ROWS + 16 * (thread // 32) + lane // 4 + 8 * ((i >> 1) & 1)
    col = part * dq_cols + 8 * (i >> 2) + 2 * (lane % 4) + (i & 1)
    return row, col


def tiled_dq_accum(spec, batch, hq, sq):
    """The preprocess on the tiled dq_accum: (batch, hq, m_blocks x block_m x d) float32, NaN (a
    place nobody zeroes would poison what reads it) but for the HEAD_DIM floats at row x HEAD_DIM
    that the warp of each row up to the padded end zeroes."""
    rows = -(-sq // spec.block_m) * spec.block_m
    acc = np.full((batch, hq, rows * spec.head_dim + 64), np.nan, dtype=np.float32)   # + a next head's start
    for row in range(rows):
        acc[:, :, row * spec.head_dim: (row + 1) * spec.head_dim] = 0.0
    return acc


def convert_tiled(spec, acc, sq):
    """The postprocess: the warp of row r reads the HEAD_DIM floats at r x HEAD_DIM (rows up to the
    padded end) and writes each pair to dQ's (row, col) of dq_accum_element, if row < seqlen_q:
    (batch, hq, sq, d), NaN where nothing was written."""
    d = spec.head_dim
    out = np.full(acc.shape[:2] + (sq, d), np.nan)
    for r in range(-(-sq // spec.block_m) * spec.block_m):
        for c in range(0, d, 2):
            row, col = dq_accum_element(spec, r * d + c)
            if row < sq:
                out[:, :, row, col: col + 2] = acc[:, :, r * d + c: r * d + c + 2]
    return out


def run_main_kernel(spec, q, k, v, do, lse, dpsum, causal, scale):
    """dq_accum (batch, heads_q, seqlen_q, d) and dK, dV (batch, seqlen_k, heads_kv, d) as the
    main kernel leaves them (dK already times softmax_scale); dq_tma_reduce: the tiled dq_accum
    read back through the postprocess's dq_accum_offset. KV_SPLIT_COLS (head_dim 192, 256): both
    warpgroups on the same 64 keys, S^T, dP^T split by queries, dV, dK, dQ by columns, P^T and dS^T
    through shared memory."""
    batch, sq, hq, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    bm, bn, stages = spec.block_m, spec.block_n, spec.stages
    sw = sm90_swizzle_bytes(d)
    split = sm90_kv_split(d)
    sdp_n = bm // 2 if split else bm            # queries of S^T, dP^T per warpgroup
    kv_cols = d // 2 if split else d            # columns of dK, dV per warpgroup
    slab_cols = sw // 2
    q_slab, kv_slab, q_tile, kv_tile = bm * sw, bn * sw, bm * d * 2, bn * d * 2
    # dS^T (and P^T) tiles: dq_m_tiles slabs of 64 queries, each bn key rows of one 128-byte swizzled
    # row; block_m 128: dQ in two m64 tiles, one dS^T tile (no turns: sm90_ds_bufs)
    dq_m_tiles = sm90_dq_m_tiles(bm)
    ds_row, ds_sw = WG_ROWS * 2, 128
    ds_slab = bn * ds_row
    ds_tile_bytes = dq_m_tiles * ds_slab
    ds_bufs = 4 if split else sm90_ds_bufs(bm)   # (split: two dS^T, two P^T tiles)
    dq_cols = sm90_dq_cols(d)
    split_keys = dq_cols == d
    dq_k_steps = (WG_ROWS if split_keys else bn) // 16
    k_smem, v_smem = 0, kv_tile
    q_smem0 = v_smem + kv_tile
    do_smem0 = q_smem0 + stages * q_tile
    ds_smem0 = do_smem0 + stages * q_tile
    dq_accum = np.zeros((batch, hq, sq, d))
    tiled = tiled_dq_accum(spec, batch, hq, sq) if spec.dq_tma_reduce else None
    dk_out, dv_out = np.zeros(k.shape), np.zeros(v.shape)
    group = hq // hkv
    m_blocks = -(-sq // bm)
    for b in range(batch):
        for kv_head in range(hkv):
            for n_block in range(-(-sk // bn)):
                pt_smem0 = ds_smem0 + 2 * ds_tile_bytes     # (split: the P^T tiles)
                smem = Smem(ds_smem0 + ds_bufs * ds_tile_bytes)
                key_begin = n_block * bn
                first_row = max(0, key_begin - (sk - sq)) if causal else 0
                m_first = first_row // bm
                steps_per_head = m_blocks - m_first if first_row < sq else 0
                steps = steps_per_head * group
                smem.tma_load(k_smem, kv_slab, sw, k[b, :, kv_head], key_begin, bn)
                smem.tma_load(v_smem, kv_slab, sw, v[b, :, kv_head], key_begin, bn)
                dv_acc = [np.zeros((WG_THREADS, kv_cols // 2)) for _ in range(2)]
                dk_acc = [np.zeros((WG_THREADS, kv_cols // 2)) for _ in range(2)]

                def dq_out(wg, ds_tile, head, row_begin):
                    """One warpgroup's dQ of a step (the dS^T tile it wrote to, its head and first row)."""
                    # dQ = dS K (gemm_dq), then dq_accum += dQ
                    dq_col0 = 0 if split_keys else wg * dq_cols
                    k_dq = k_smem + wg * WG_ROWS * sw if split_keys else k_smem + (dq_col0 // slab_cols) * kv_slab
                    ds_rows = ds_tile + (wg * WG_ROWS * ds_row if split_keys else 0)
                    # (block_m 128: one m64 tile of queries per dS^T slab, m_tile * 64 rows on)
                    buf = np.zeros(bm * dq_cols, dtype=np.float32)
                    for m_tile in range(dq_m_tiles):
                        dq = np.zeros((WG_ROWS, dq_cols))
                        for kk in range(dq_k_steps):
                            a = operand(smem, ds_rows + m_tile * ds_slab + kk * 16 * ds_row, ds_tile_bytes,
                                        8 * ds_sw, ds_sw, WG_ROWS, False)
                            bmat = operand(smem, k_dq + kk * 16 * sw, kv_slab, 8 * sw, sw, dq_cols, False)
                            dq += a @ bmat.T
                        row, col = acc_index(dq_cols)
                        row = row + m_tile * WG_ROWS
                        regs = to_regs(dq)
                        if spec.dq_tma_reduce:
                            # registers -> dq_smem (float4 j of thread t at (j * 128 + t) * 4 in the
                            # m64 tile's part), then one bulk reduce-add of the whole tile (below)
                            for i in range(0, dq_cols // 2, 4):
                                for t in range(WG_THREADS):
                                    at = m_tile * WG_ROWS * dq_cols + ((i // 4) * WG_THREADS + t) * 4
                                    buf[at: at + 4] = regs[t, i: i + 4]
                            continue
                        keep = row_begin + row < sq
                        np.add.at(dq_accum[b, head], (row_begin + row[keep], dq_col0 + col[keep]), regs[keep])
                    if spec.dq_tma_reduce:
                        # rows past seqlen_q go in too
                        tile = (row_begin // bm) * bm * d + (0 if split_keys else wg * bm * dq_cols)
                        tiled[b, head, tile: tile + bm * dq_cols] += buf
                for step in range(steps):
                    stage = step % stages
                    head = kv_head * group + step // steps_per_head
                    row_begin = (m_first + step % steps_per_head) * bm
                    q_t, do_t = q_smem0 + stage * q_tile, do_smem0 + stage * q_tile
                    smem.tma_load(q_t, q_slab, sw, q[b, :, head], row_begin, bm)
                    smem.tma_load(do_t, q_slab, sw, do[b, :, head], row_begin, bm)
                    rows = row_begin + np.arange(bm)
                    lse_rows = np.where(rows < sq, lse[b, head, np.minimum(rows, sq - 1)], -np.inf)
                    lse_rows = np.where(lse_rows == -np.inf, np.inf, lse_rows * LOG2E)
                    d_rows = np.where(rows < sq, dpsum[b, head, np.minimum(rows, sq - 1)], 0.0)
                    ds_tile = ds_smem0 + (step & 1) * ds_tile_bytes if ds_bufs > 1 else ds_smem0
                    pt_tile = pt_smem0 + (step & 1) * ds_tile_bytes
                    frags = []
                    for wg in range(2):
                        # S^T = K Q^T, dP^T = V dO^T (gemm_keys_rows)
                        key0 = 0 if split else wg * WG_ROWS      # the warpgroup's keys (split: all 64)
                        query0 = wg * sdp_n if split else 0      # and queries of S^T, dP^T
                        k_rows, v_rows = k_smem + key0 * sw, v_smem + key0 * sw
                        q_sdp, do_sdp = q_t + query0 * sw, do_t + query0 * sw
                        st, dpt = np.zeros((WG_ROWS, sdp_n)), np.zeros((WG_ROWS, sdp_n))
                        for kk in range(d // 16):
                            in_row, slab = (kk % (slab_cols // 16)) * 32, kk // (slab_cols // 16)
                            for acc, key_rows, tile in ((st, k_rows, q_sdp), (dpt, v_rows, do_sdp)):
                                a = operand(smem, key_rows + slab * kv_slab + in_row, 16, 8 * sw, sw, WG_ROWS, True)
                                bt = operand(smem, tile + slab * q_slab + in_row, 16, 8 * sw, sw, sdp_n, True)
                                acc += a @ bt.T
                        st, dpt = to_regs(st), to_regs(dpt)
                        # P^T = exp2(S^T scale log2(e) - LSE log2(e)), masked; dS^T = P^T (dP^T - D)
                        key_rows_i, col = acc_index(sdp_n)
                        key = key_begin + key0 + key_rows_i
                        query = row_begin + query0 + col
                        p = np.exp2(st * scale * LOG2E - lse_rows[query0 + col])
                        hidden = (key >= sk) | ((key > query + sk - sq) if causal else False)
                        p = np.where(hidden, 0.0, p)
                        p_frag = p.astype(E).astype(np.float64)
                        ds = (p * (dpt - d_rows[query0 + col])).astype(E)
                        # dS^T (split: and P^T) -> shared memory (128-byte swizzled rows of 64 queries)
                        qcol = query0 + col
                        offset = (qcol // WG_ROWS) * ds_slab + (key0 + key_rows_i) * ds_row + 2 * (qcol % WG_ROWS)
                        smem.h[(ds_tile + swizzle(offset, ds_sw)) // 2] = ds
                        if split:
                            smem.h[(pt_tile + swizzle(offset, ds_sw)) // 2] = p.astype(E)
                        frags.append((p_frag, ds.astype(np.float64)))
                    for wg in range(2):
                        p_frag, ds_frag = frags[wg]
                        kv_b_slab = (wg * kv_cols // slab_cols) * q_slab if split else 0
                        for acc, score_tile, tile in ((dv_acc, pt_tile, do_t), (dk_acc, ds_tile, q_t)):
                            if not split:
                                break
                            # split: dV += P^T dO, dK += dS^T Q (gemm_tile_rows: A = the P^T / dS^T tile
                            # K-major, B = this warpgroup's columns of dO / Q, MN-major)
                            total = from_regs(acc[wg], kv_cols)
                            for kk in range(bm // 16):
                                a = operand(smem, score_tile + kk * 32, 16, 8 * ds_sw, ds_sw, WG_ROWS, True)
                                bmat = operand(smem, tile + kv_b_slab + kk * 16 * sw, q_slab, 8 * sw, sw, kv_cols, False)
                                total += a @ bmat.T
                            acc[wg] = to_regs(total)
                        # dV += P^T dO, dK += dS^T Q (gemm_frag_rows: A from registers, B MN-major)
                        for acc, frag, tile in (() if split else ((dv_acc, p_frag, do_t), (dk_acc, ds_frag, q_t))):
                            a_full = from_regs(frag, bm)
                            total = from_regs(acc[wg], d)
                            for kk in range(bm // 16):
                                bmat = operand(smem, tile + kk * 16 * sw, q_slab, 8 * sw, sw, d, False)   # [d x 16]
                                total += a_full[:, 16 * kk: 16 * kk + 16] @ bmat.T
                            acc[wg] = to_regs(total)
                        if not spec.dq_lag:
                            dq_out(wg, ds_tile, head, row_begin)
                            continue
                        # dq_lag: the previous step's dQ (its buffer, head and rows); the tile's last step its own too
                        if step > 0:
                            prev = step - 1
                            dq_out(wg, ds_smem0 + (prev & 1) * ds_tile_bytes, kv_head * group + prev // steps_per_head,
                                   (m_first + prev % steps_per_head) * bm)
                        if step + 1 == steps:
                            dq_out(wg, ds_tile, head, row_begin)
                # finish: dK *= scale, rows below seqlen_k
                for wg in range(2):
                    row, col = acc_index(kv_cols)
                    key = key_begin + (0 if split else wg * WG_ROWS) + row
                    col = col + (wg * kv_cols if split else 0)
                    keep = key < sk
                    dk_out[b, key[keep], kv_head, col[keep]] = (dk_acc[wg] * scale)[keep].astype(E)
                    dv_out[b, key[keep], kv_head, col[keep]] = dv_acc[wg][keep].astype(E)
    if spec.dq_tma_reduce:
        # the padding rows (seqlen_q up to the last tile's end) received exact zeros: P = 0 there
        rows = -(-sq // bm) * bm
        pad = [off + j for off in range(0, rows * d, 2) if dq_accum_element(spec, off)[0] >= sq for j in (0, 1)]
        assert not np.any(tiled[:, :, pad]), "rows past seqlen_q must add zeros"
        assert np.isnan(tiled[:, :, rows * d:]).all(), "no tile reaches past the head's padded rows"
        return convert_tiled(spec, tiled, sq), dk_out, dv_out
    return dq_accum, dk_out, dv_out


@pytest.mark.parametrize("d, sq, sk, hq, hkv, causal", [
    (64, 70, 150, 2, 1, True),      # dQ split by keys; GQA; seqlen_k cut inside the second key block
    (64, 130, 40, 1, 1, False),     # three query blocks, one short key block
    (96, 65, 129, 2, 2, True),      # 64-byte swizzle, dQ split by keys
    (128, 100, 130, 2, 1, True),    # dQ split by 64-column slabs; causal diagonal inside blocks
    (128, 200, 60, 1, 1, True),     # seqlen_q > seqlen_k: rows that see no key
    (192, 70, 100, 2, 1, True),     # KV_SPLIT_COLS, 64-byte swizzle: 3 slabs per warpgroup; GQA
    (256, 65, 130, 1, 1, False),    # KV_SPLIT_COLS: 2 slabs per warpgroup; three key blocks, the last cut
    (256, 130, 70, 2, 2, True),     # seqlen_q > seqlen_k, causal diagonal inside the 64-key blocks
])
@pytest.mark.parametrize("dq_tma_reduce", [False, True], ids=["red", "dqtma"])
def test_emulated_sm90_kernel_matches_the_reference(d, sq, sk, hq, hkv, causal, dq_tma_reduce):
    spec = BackwardSpec(arch="sm90", head_dim=d, dtype="fp16", causal=causal, dq_tma_reduce=dq_tma_reduce)
    check_emulated_backward(run_main_kernel, spec, sq, sk, hq, hkv, causal, seed=sq + sk + d)


@pytest.mark.parametrize("sq, sk, hq, hkv, causal", [
    (70, 150, 2, 1, True),      # one query block (cut at 70), two key blocks (the second cut); GQA
    (200, 130, 1, 1, False),    # two query blocks, the second cut inside its second m64 tile
    (130, 260, 1, 1, True),     # causal diagonal inside blocks; seqlen_k > seqlen_q; three query blocks' worth of keys
    (300, 100, 2, 2, True),     # seqlen_q > seqlen_k: rows that see no key
])
@pytest.mark.parametrize("dq_tma_reduce", [False, True], ids=["red", "dqtma"])
def test_emulated_sm90_block_m_128(sq, sk, hq, hkv, causal, dq_tma_reduce):
    """block_m=128 at head_dim 64: S^T, dP^T of 128 queries, dQ in two m64 tiles read from the two
    64-query slabs of the one dS^T tile, dq_accum tiles of 128 rows (two m64 parts each)."""
    spec = BackwardSpec(arch="sm90", head_dim=64, block_m=128, dtype="fp16", causal=causal,
                        dq_tma_reduce=dq_tma_reduce)
    check_emulated_backward(run_main_kernel, spec, sq, sk, hq, hkv, causal, seed=sq + sk + 128)


@pytest.mark.parametrize("d, block_m", [(64, 64), (96, 64), (128, 64), (192, 64), (256, 64), (64, 128)])
def test_tiled_dq_accum_is_the_warpgroups_register_order(d, block_m):
    """dq_tma_reduce: dq_accum_element maps two query blocks' tiles one to one onto their BLOCK_M x d
    elements, and the float4 i // 4 of thread t in m64 tile m of part p of a tile (where the warpgroup's
    bulk reduce puts its register i) holds the element that register holds in the accumulator layout
    (acc_index), 64 m rows on."""
    spec = BackwardSpec(arch="sm90", head_dim=d, block_m=block_m, dq_tma_reduce=True)
    bm, dq_cols = spec.block_m, sm90_dq_cols(d)
    elements = sorted((r, c + j) for off in range(0, 2 * bm * d, 2)
                      for (r, c) in [dq_accum_element(spec, off)] for j in (0, 1))
    assert elements == [(r, c) for r in range(2 * bm) for c in range(d)]
    row, col = acc_index(dq_cols)
    for part in range(d // dq_cols):     # (in the second query block's tile)
        for m in range(bm // WG_ROWS):
            for t in range(WG_THREADS):
                for i in range(0, dq_cols // 2, 2):
                    off = bm * d + part * bm * dq_cols + m * WG_ROWS * dq_cols + ((i // 4) * WG_THREADS + t) * 4 + i % 4
                    assert dq_accum_element(spec, off) == (bm + m * WG_ROWS + row[t, i], part * dq_cols + col[t, i])


def test_the_descriptor_model_reads_back_what_tma_wrote():
    """The emulation's own check: an MN-major and a K-major read of a TMA-written tile give the tile."""
    rng = np.random.default_rng(0)
    for sw in (64, 128):
        x = rng.standard_normal((64, 128)).astype(E)
        smem = Smem(64 * 128 * 2)
        smem.tma_load(0, 64 * sw, sw, x, 0, 64)
        for kk in range(4):     # K-major over the first slab: rows x 16 columns
            got = operand(smem, (kk % (sw // 32)) * 32 + (kk // (sw // 32)) * 64 * sw, 16, 8 * sw, sw, 64, True)
            np.testing.assert_array_equal(got, x[:, 16 * kk: 16 * kk + 16])
        for kk in range(4):     # MN-major: k = rows 16kk.., mn = all 128 columns
            got = operand(smem, kk * 16 * sw, 64 * sw, 8 * sw, sw, 128, False)
            np.testing.assert_array_equal(got, x[16 * kk: 16 * kk + 16].T)


@pytest.mark.parametrize("sq, sk, hq, hkv, causal", [
    (100, 130, 2, 1, True),     # GQA: a tile's steps over two query heads (the lagged dQ's head changes)
    (200, 60, 1, 1, True),      # seqlen_q > seqlen_k
    (300, 129, 1, 1, False),    # five steps a tile, the last key block one key long
    (64, 64, 1, 1, False),      # one step a tile: only the last step's own dQ
])
def test_emulated_dq_lag_matches_the_reference(sq, sk, hq, hkv, causal):
    """dq_lag (head_dim 128): each step's dQ from the previous step's dS^T buffer into its head's and query
    block's dq_accum tile, and a tile's last step its own: the same gradients."""
    spec = BackwardSpec(arch="sm90", head_dim=128, dtype="fp16", causal=causal, dq_lag=True)
    check_emulated_backward(run_main_kernel, spec, sq, sk, hq, hkv, causal, seed=sq + sk)
