"""The sm80 backward's main kernel, transliterated into NumPy over an emulated warp: shared memory as
bytes, ldmatrix(.trans) and mma.sync m16n8k16 with the fragment layouts of the PTX ISA (as
templates/common/ptx.cuh.j2 documents them), the template's swizzle, warp grids, masks, loop
bounds and stores, step for step. It checks the kernel's indexing (which fragment is whose, what
goes where in shared memory, which query blocks a key block visits) against the float64
reference on the CPU; only the hardware itself is left to the GPU tests.

The emulation follows templates/sm80/flash_bwd.cu.j2 and bwd_gemm.cuh.j2: change them together.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from facodegen.spec.backward import BackwardSpec
from backward_emulation_check import check_emulated_backward

E = np.float16     # elem_t (fp16; the emulation rounds like the kernel's cvt.rn)


def swizzle_of(chunks: int, row: int) -> int:
    return (row & 7) if chunks % 8 == 0 else ((row >> 1) & 3)


def swz_offset(chunks: int, row: int, chunk: int) -> int:
    return row * chunks * 16 + ((chunk ^ swizzle_of(chunks, row)) << 4)


class Smem:
    def __init__(self, nbytes):
        self.h = np.zeros(nbytes // 2, dtype=E)     # 16-bit cells

    def ld_pair(self, addr):
        assert addr % 4 == 0
        return self.h[addr // 2], self.h[addr // 2 + 1]

    def st_pair(self, addr, lo, hi):
        assert addr % 4 == 0
        self.h[addr // 2], self.h[addr // 2 + 1] = E(lo), E(hi)

    def ldmatrix_x4(self, addrs, trans=False):
        """addrs[lane] = row address lane % 8 of matrix lane // 8. Returns r[lane][i] = (lo, hi) of matrix i:
        non-trans: row lane/4, cols 2(lane%4), +1; trans: (row 2(lane%4), col lane/4), (row 2(lane%4)+1, col lane/4)."""
        r = [[None] * 4 for _ in range(32)]
        for i in range(4):
            rows = [self.h[addrs[8 * i + j] // 2: addrs[8 * i + j] // 2 + 8] for j in range(8)]
            for lane in range(32):
                g, t = lane // 4, lane % 4
                if trans:
                    r[lane][i] = (rows[2 * t][g], rows[2 * t + 1][g])
                else:
                    r[lane][i] = (rows[g][2 * t], rows[g][2 * t + 1])
        return r


def mma(d, a, b0, b1):
    """d[lane][4] += A (16x16) B (16x8); a[lane][4], b0[lane], b1[lane] pairs, in the m16n8k16 layout."""
    A = np.zeros((16, 16))
    B = np.zeros((16, 8))
    for lane in range(32):
        g, t = lane // 4, lane % 4
        for j, (row, k) in enumerate(((g, 2 * t), (g + 8, 2 * t), (g, 8 + 2 * t), (g + 8, 8 + 2 * t))):
            A[row, k], A[row, k + 1] = a[lane][j]
        B[2 * t, g], B[2 * t + 1, g] = b0[lane]
        B[8 + 2 * t, g], B[9 + 2 * t, g] = b1[lane]
    C = A.astype(np.float32) @ B.astype(np.float32)
    for lane in range(32):
        g, t = lane // 4, lane % 4
        d[lane][0] += C[g, 2 * t]
        d[lane][1] += C[g, 2 * t + 1]
        d[lane][2] += C[g + 8, 2 * t]
        d[lane][3] += C[g + 8, 2 * t + 1]


def k_major_addr(chunks, tile, row, half, kk, unrolled=False):
    """bwd_gemm.cuh.j2's k_major_addr: chunk 2 kk + half of a row, the step as an XOR of kk << 5; ``unrolled``
    (k_unroll 0) with 32-chunk rows or rows of another size than a power of two: only kk's bits within the
    swizzle's reach XOR, the rest add."""
    pow2, low = chunks & (chunks - 1) == 0, 3 if chunks % 8 == 0 else 1
    row_addr, in_row = tile + row * chunks * 16, (half ^ swizzle_of(chunks, row)) << 4
    if unrolled and (chunks >= 32 or not pow2):
        return ((row_addr + in_row) ^ ((kk & low) << 5)) + ((kk & ~low) << 5)
    if pow2:
        return (row_addr + in_row) ^ (kk << 5)
    return row_addr + (in_row ^ (kk << 5))


def k_rows_addr(chunks, tile, row, chunk, kk):
    """bwd_gemm.cuh.j2's k_rows_addr: row 16 kk + row, the step as an add of 16 rows."""
    return tile + swz_offset(chunks, row, chunk) + kk * 16 * chunks * 16


def warp_gemm(smem, c, m_slabs, n_tiles, k_dim, a_chunks, a_t, a_tile, a_row0, b_chunks, b_kn, b_tile, b_col0,
              unrolled=False):
    """bwd_gemm.cuh.j2's warp_gemm; c[mt][lane] is a list of n_tiles*4 floats; ``unrolled``: k_unroll 0."""
    for kk in range(k_dim // 16):
        a = []
        for mt in range(m_slabs):
            row0 = a_row0 + 16 * mt
            if a_t:
                addrs = [k_rows_addr(a_chunks, a_tile, ln % 8 + 8 * (ln // 16), row0 // 8 + (ln // 8) % 2, kk)
                         for ln in range(32)]
                a.append(smem.ldmatrix_x4(addrs, trans=True))
            else:
                addrs = [k_major_addr(a_chunks, a_tile, a_row0 + ln % 16, ln // 16, kk, unrolled)
                         + 16 * mt * a_chunks * 16 for ln in range(32)]
                a.append(smem.ldmatrix_x4(addrs))
        for np_ in range(n_tiles // 2):
            col0 = b_col0 + 16 * np_
            if b_kn:
                addrs = [k_rows_addr(b_chunks, b_tile, ln % 16, col0 // 8 + ln // 16, kk) for ln in range(32)]
                b = smem.ldmatrix_x4(addrs, trans=True)
            else:
                addrs = [k_major_addr(b_chunks, b_tile, b_col0 + ln % 8 + 8 * (ln // 16), (ln // 8) % 2, kk, unrolled)
                         + 16 * np_ * b_chunks * 16 for ln in range(32)]
                b = smem.ldmatrix_x4(addrs)
            for mt in range(m_slabs):
                for tile, (x, y) in ((2 * np_, (0, 1)), (2 * np_ + 1, (2, 3))):
                    d = [c[mt][ln][4 * tile: 4 * tile + 4] for ln in range(32)]
                    mma(d, a[mt], [b[ln][x] for ln in range(32)], [b[ln][y] for ln in range(32)])
                    for ln in range(32):
                        c[mt][ln][4 * tile: 4 * tile + 4] = d[ln]


def p_tile_addr(pt_s, pc, s_key0, s_col0, ln, mt, i):
    """PTileAddr: the P^T address of element (mt, i) of lane ln's S^T fragment, by the template's XOR form."""
    g, t = ln // 4, ln % 4
    base = pt_s + swz_offset(pc, s_key0 + g, s_col0 // 8) + 4 * t
    return (base ^ ((i >> 2) << 4)) + (16 * mt + 8 * ((i >> 1) & 1)) * pc * 16


def fragment_elements(m_slabs, elems, row0, col0, step=1):
    """(slab, lane, element, row, column) of each element of a warp's mma.sync accumulators: m_slabs
    16-row slabs of ``elems`` floats per lane (every ``step``-th), the warp's tile at (row0, col0)."""
    for mt in range(m_slabs):
        for ln in range(32):
            g, t = ln // 4, ln % 4
            for i in range(0, elems, step):
                yield mt, ln, i, row0 + 16 * mt + g + 8 * ((i >> 1) & 1), col0 + 8 * (i >> 2) + 2 * t + (i & 1)


def zeros(m_slabs, n_tiles):
    return [[[0.0] * (4 * n_tiles) for _ in range(32)] for _ in range(m_slabs)]


def load_tile(smem, dst, chunks, rows_matrix, row_begin, rows, row_end):
    """load_tile: rows [row_begin, row_begin + rows) of a (seqlen, d) matrix, zero past row_end."""
    for r in range(rows):
        src = rows_matrix[row_begin + r] if row_begin + r < row_end else np.zeros(chunks * 8)
        for c in range(chunks):
            off = dst + swz_offset(chunks, r, c)
            smem.h[off // 2: off // 2 + 8] = src[8 * c: 8 * c + 8]


def run_main_kernel(spec, q, k, v, do, lse, dpsum, causal, scale, window=None, softcap=0.0):
    """One launch of the main kernel (every CTA), fp16 storage; returns dq_accum, dk, dv (float). ``window``: a
    LOCAL spec's (window_left, window_right), BwdParams' values; ``softcap``: a SOFTCAP spec's cap c (BwdParams'
    softcap_scale = scale / c, softcap_log2 = c log2(e))."""
    b, sq, hq, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    BM, BN, W = spec.block_m, spec.block_n, spec.num_warps
    rc, pc = d * 2 // 16, BM * 2 // 16
    wsn = spec.key_warps; wsm = W // wsn; wkn = wsn; wkd = W // wkn
    wqm = spec.dq_row_warps; wqd = W // wqm
    s_slabs, s_tiles = BN // (16 * wsn), BM // (8 * wsm)
    kv_slabs, kv_tiles = BN // (16 * wkn), d // (8 * wkd)
    dq_slabs, dq_pairs = BM // (16 * wqm), d // (16 * wqd)
    unrolled = spec.k_unroll == 0
    p_in_fp32 = (s_slabs * s_tiles * 4 <= 32 or s_slabs * s_tiles * 4 + 2 * kv_slabs * kv_tiles * 4 <= 128) \
        and not spec.frag_prefetch and not spec.softcap   # (flash_bwd.cu.j2's P_IN_FP32)
    q_bytes, kv_bytes, p_bytes = BM * d * 2, BN * d * 2, BN * BM * 2
    q_s, do_s = 0, q_bytes
    k_s, v_s = 2 * q_bytes, 2 * q_bytes + kv_bytes
    pt_s, dst_s = 2 * q_bytes + 2 * kv_bytes, 2 * q_bytes + 2 * kv_bytes + p_bytes
    scale_log2 = scale * math.log2(math.e)
    dq_accum = np.zeros((b, hq, sq, d))
    dk, dv = np.zeros(k.shape), np.zeros(v.shape)
    group = hq // hkv
    for batch in range(b):
        for kv_head in range(hkv):
            for n_block in range(-(-sk // BN)):
                smem = Smem(2 * q_bytes + 2 * kv_bytes + 2 * p_bytes)
                key_begin = n_block * BN
                keys_valid = min(BN, sk - key_begin)
                m_blocks = -(-sq // BM)
                if window is not None:      # LOCAL: rows [key_begin - key_hi_off, last key - key_lo_off]
                    key_lo_off, key_hi_off = sk - sq - window[0], sk - sq + window[1]
                    first_row = max(0, key_begin - key_hi_off)
                    last_row = min(sq - 1, key_begin + keys_valid - 1 - key_lo_off)
                    m_first = first_row // BM
                    m_end = last_row // BM + 1 if first_row <= last_row else m_first
                else:
                    first_row = max(0, key_begin - (sk - sq)) if causal else 0
                    m_first = first_row // BM
                    m_end = m_blocks if first_row < sq else m_first
                steps_per_head = m_end - m_first
                load_tile(smem, k_s, rc, k[batch, :, kv_head], key_begin, BN, sk)
                load_tile(smem, v_s, rc, v[batch, :, kv_head], key_begin, BN, sk)
                dv_acc = [zeros(kv_slabs, kv_tiles) for _ in range(W)]
                dk_acc = [zeros(kv_slabs, kv_tiles) for _ in range(W)]
                for step in range(steps_per_head * group):
                    head = kv_head * group + step // steps_per_head
                    row_begin = (m_first + step % steps_per_head) * BM
                    load_tile(smem, q_s, rc, q[batch, :, head], row_begin, BM, sq)
                    load_tile(smem, do_s, rc, do[batch, :, head], row_begin, BM, sq)
                    # (load_rows: LSE as it is, 0 past seqlen_q; softmax_p_tile scales it by log2(e): a row that sees
                    # no key gets exp2(+inf), which only its mask may zero)
                    lse_s = [lse[batch, head, row_begin + r] * math.log2(math.e) if row_begin + r < sq else 0.0
                             for r in range(BM)]
                    dp_s = [dpsum[batch, head, row_begin + r] if row_begin + r < sq else 0.0 for r in range(BM)]
                    cut = key_begin + BN > sk
                    crosses = causal and key_begin + BN - 1 > row_begin + sk - sq
                    if window is not None:
                        crosses |= (key_begin + BN - 1 > row_begin + key_hi_off
                                    or key_begin < row_begin + BM - 1 + key_lo_off)
                    for warp in range(W):       # S^T, P^T, dP^T, dS^T
                        s_key0, s_col0 = (warp % wsn) * 16 * s_slabs, (warp // wsn) * 8 * s_tiles
                        st = zeros(s_slabs, s_tiles)
                        warp_gemm(smem, st, s_slabs, s_tiles, d, rc, False, k_s, s_key0, rc, False, q_s, s_col0,
                                  unrolled)
                        pt = {}     # P^T in registers for dS^T: fp32 (P_IN_FP32) or elem_t pairs (softmax_p_tile)
                        for mt, ln, i, key_row, col in fragment_elements(s_slabs, s_tiles * 4, s_key0, s_col0, 2):
                            pr = []
                            for e in range(2):
                                if softcap:     # (SOFTCAP: the capped logit, from float32 products)
                                    t = math.tanh(st[mt][ln][i + e] * (scale / softcap))
                                    p = 2.0 ** (t * softcap * math.log2(math.e) - lse_s[col + e])
                                else:
                                    p = 2.0 ** (st[mt][ln][i + e] * scale_log2 - lse_s[col + e])
                                if cut or crosses:
                                    key, query = key_begin + key_row, row_begin + col + e
                                    if key >= sk or (causal and key > query + sk - sq) or (window is not None and (
                                            key < query + key_lo_off or key > query + key_hi_off)):
                                        p = 0.0
                                pr.append(p)
                            pt[mt, ln, i] = tuple(pr) if p_in_fp32 else (E(pr[0]), E(pr[1]))
                            smem.st_pair(p_tile_addr(pt_s, pc, s_key0, s_col0, ln, mt, i), *pr)
                        dpt = zeros(s_slabs, s_tiles)
                        warp_gemm(smem, dpt, s_slabs, s_tiles, d, rc, False, v_s, s_key0, rc, False, do_s, s_col0,
                                  unrolled)
                        for mt, ln, i, key_row, col in fragment_elements(s_slabs, s_tiles * 4, s_key0, s_col0, 2):
                            p0, p1 = (float(x) for x in pt[mt, ln, i])
                            if softcap:     # (SOFTCAP: 1 - tanh^2 from S^T, kept in its registers)
                                t0, t1 = (math.tanh(st[mt][ln][i + e] * (scale / softcap)) for e in (0, 1))
                                p0, p1 = p0 * (1 - t0 * t0), p1 * (1 - t1 * t1)
                            smem.st_pair(p_tile_addr(pt_s, pc, s_key0, s_col0, ln, mt, i) + p_bytes,
                                         p0 * (dpt[mt][ln][i] - dp_s[col]),
                                         p1 * (dpt[mt][ln][i + 1] - dp_s[col + 1]))
                    for warp in range(W):       # dV += P^T dO; dK += dS^T Q
                        kv_key0, kv_col0 = (warp % wkn) * 16 * kv_slabs, (warp // wkn) * 8 * kv_tiles
                        warp_gemm(smem, dv_acc[warp], kv_slabs, kv_tiles, BM, pc, False, pt_s, kv_key0, rc, True,
                                  do_s, kv_col0, unrolled)
                        warp_gemm(smem, dk_acc[warp], kv_slabs, kv_tiles, BM, pc, False, dst_s, kv_key0, rc, True,
                                  q_s, kv_col0, unrolled)
                    for warp in range(W):       # dq_accum += dS K
                        dq_row0, dq_col0 = (warp % wqm) * 16 * dq_slabs, (warp // wqm) * 16 * dq_pairs
                        dq_chunk = next(c for c in (4, 3, 2, 1) if dq_pairs % c == 0)
                        for chunk in range(dq_pairs // dq_chunk):
                            acc = zeros(dq_slabs, 2 * dq_chunk)
                            warp_gemm(smem, acc, dq_slabs, 2 * dq_chunk, BN, pc, True, dst_s, dq_row0, rc, True, k_s,
                                      dq_col0 + 16 * dq_chunk * chunk, unrolled)
                            for mt, ln, i in ((mt, ln, i) for mt in range(dq_slabs) for ln in range(32)
                                              for i in range(8 * dq_chunk)):     # add_dq_chunk's addressing
                                g, t = ln // 4, ln % 4
                                row_in, col_in = 16 * mt + 8 * ((i >> 1) & 1), 16 * dq_chunk * chunk + 8 * (i >> 2)
                                if row_in < sq - row_begin - dq_row0 - g:
                                    at = (dq_row0 + g) * d + dq_col0 + 2 * t + row_in * d + col_in + (i & 1)
                                    dq_accum[batch, head].reshape(-1)[row_begin * d + at] += acc[mt][ln][i]
                for warp in range(W):           # finish
                    kv_key0, kv_col0 = (warp % wkn) * 16 * kv_slabs, (warp // wkn) * 8 * kv_tiles
                    for mt, ln, i, row, col in fragment_elements(kv_slabs, kv_tiles * 4, kv_key0, kv_col0):
                        if row < keys_valid:
                            dk[batch, key_begin + row, kv_head, col] = E(dk_acc[warp][mt][ln][i] * scale)
                            dv[batch, key_begin + row, kv_head, col] = E(dv_acc[warp][mt][ln][i])
    return dq_accum, dk, dv


@pytest.mark.parametrize("fields, sq, sk, hq, hkv, causal", [
    (dict(head_dim=64, block_m=64, block_n=64, num_warps=4), 70, 100, 2, 1, True),     # GQA, ragged, diagonal
    (dict(head_dim=64, block_m=32, block_n=64, num_warps=8), 45, 30, 2, 2, True),      # seqlen_q > seqlen_k: empty rows
    (dict(head_dim=96, block_m=64, block_n=32, num_warps=4), 33, 40, 1, 1, False),     # swizzle over 12 chunks
    (dict(head_dim=96, block_m=64, block_n=32, num_warps=4, k_unroll=0), 33, 40, 1, 1, True),   # kk's split add
    (dict(head_dim=64, block_m=128, block_n=128, num_warps=8), 20, 9, 1, 1, False),    # the default d64 tile
    (dict(head_dim=128), 70, 200, 2, 1, True),     # the default d128 kernel: FA2's warp grid (key_warps 4, dq_row_warps 2)
])
def test_emulated_kernel_matches_the_reference(fields, sq, sk, hq, hkv, causal):
    spec = BackwardSpec(dtype="fp16", causal=causal, **fields)
    check_emulated_backward(run_main_kernel, spec, sq, sk, hq, hkv, causal, seed=sq + sk)


@pytest.mark.parametrize("fields, sq, sk, causal, window_size", [
    (dict(head_dim=64, block_m=32, block_n=32, num_warps=4), 100, 130, True, (20, -1)),    # causal window, ragged
    (dict(head_dim=64, block_m=32, block_n=32, num_warps=4), 100, 70, False, (9, 25)),     # both edges, sq > sk
    (dict(head_dim=64, block_m=32, block_n=64, num_warps=8), 90, 90, False, (0, 0)),       # the diagonal alone
    (dict(head_dim=64, block_m=32, block_n=32, num_warps=4), 70, 60, False, (-1, 5)),      # right edge only
    (dict(head_dim=64, block_m=32, block_n=32, num_warps=4), 90, 40, True, (10, -1)),      # rows that see no key
    (dict(head_dim=128), 150, 200, True, (60, -1)),    # the default d128 kernel (FA2's warp grid, two stages)
])
def test_emulated_window_kernel_matches_the_reference(fields, sq, sk, causal, window_size):
    """LOCAL: each key block's query blocks (first_row, last_row) and the window masks, against the float64
    reference with the window."""
    from facodegen.ops.api import window_params
    local, kernel_causal, _, _ = window_params(*window_size, causal, sq, sk)
    assert local
    spec = BackwardSpec(dtype="fp16", causal=kernel_causal, local=True, **fields)
    check_emulated_backward(run_main_kernel, spec, sq, sk, 2, 1, causal, seed=sq + 3 * sk, window_size=window_size)


@pytest.mark.parametrize("block_m, block_n, num_warps", [(bm, bn, w) for bm in (32, 64, 128) for bn in (64, 128)
                                                      for w in (4, 8)])
def test_p_tile_xor_address_is_the_swizzled_one(block_m, block_n, num_warps):
    """PTileAddr's XOR form (the chunk c0 + j as c0 ^ j, one swizzle term per thread) gives every element of
    every warp's S^T fragment the address swz_offset gives it, for every warp grid the knobs allow."""
    pc = block_m * 2 // 16
    pt_s = 3 * 16384          # a tile start on a row-size boundary, as in the kernel's shared memory
    for wsn in (1, 2, 4, 8):
        if num_warps % wsn or block_n % (16 * wsn) or block_m % (16 * (num_warps // wsn)):
            continue
        s_slabs, s_tiles = block_n // (16 * wsn), block_m // (8 * (num_warps // wsn))
        for warp in range(num_warps):
            s_key0, s_col0 = (warp % wsn) * 16 * s_slabs, (warp // wsn) * 8 * s_tiles
            for mt, ln, i, key_row, col in fragment_elements(s_slabs, s_tiles * 4, s_key0, s_col0, 2):
                assert p_tile_addr(pt_s, pc, s_key0, s_col0, ln, mt, i) == \
                    pt_s + swz_offset(pc, key_row, col // 8) + 2 * (col % 8), (wsn, warp, ln, mt, i)


@pytest.mark.parametrize("unrolled", [False, True], ids=["looped", "unrolled"])
@pytest.mark.parametrize("chunks", [4, 8, 12, 16, 24, 32])
def test_warp_gemm_step_addresses_are_the_swizzled_ones(chunks, unrolled):
    """k_major_addr (a step as an XOR of kk << 5; unrolled, as k_unroll 0 has it: kk's bits past the swizzle's
    reach added) and k_rows_addr (a step as 16 rows' add), slab or pair offsets added after, give every lane
    at every k16 step the address swz_offset gives, for the row sizes of every tile the backward reads
    (head_dim 32-256 as 4-32 chunks; P^T/dS^T of block_m 32-128)."""
    tile = 5 * 16384        # tiles start on 1024-byte boundaries
    for kk in range(chunks // 2):
        for row0 in range(0, 64, 16):
            for ln in range(32):
                for slab in range(3):
                    row = row0 + ln % 16
                    assert k_major_addr(chunks, tile, row, ln // 16, kk, unrolled) + 16 * slab * chunks * 16 == \
                        tile + swz_offset(chunks, row + 16 * slab, 2 * kk + ln // 16)
        for ln in range(32):
            for chunk in range(chunks):
                if 16 * kk + 16 <= 16 * chunks:     # (rows of a [K x cols] tile: any K)
                    assert k_rows_addr(chunks, tile, ln % 16, chunk, kk) == \
                        tile + swz_offset(chunks, 16 * kk + ln % 16, chunk)


@pytest.mark.parametrize("fields, sq, sk, causal, window_size, softcap", [
    (dict(head_dim=64, block_m=32, block_n=32, num_warps=4), 70, 90, True, None, 2.0),        # a cap that bites
    (dict(head_dim=64, block_m=32, block_n=64, num_warps=8), 60, 60, False, (9, 5), 5.0),     # with a window
    (dict(head_dim=128), 150, 200, True, None, 30.0),      # the default d128 tile (P^T in pairs, S^T kept)
])
def test_emulated_softcap_kernel_matches_the_reference(fields, sq, sk, causal, window_size, softcap):
    """SOFTCAP: P^T from c tanh(scale s / c), dS^T through 1 - tanh^2, against the float64 reference (whose
    gradient agrees with finite differences of the forward)."""
    local = window_size is not None
    spec = BackwardSpec(dtype="fp16", causal=causal, softcap=True, local=local, **fields)
    check_emulated_backward(run_main_kernel, spec, sq, sk, 2, 1, causal, seed=sq + 5 * sk, window_size=window_size,
                            softcap=softcap)
