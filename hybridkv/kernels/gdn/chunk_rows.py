"""Helpers the Triton chunk kernels share: which chunk a program of a parallel kernel has, where its
sequence starts, the state a chain program starts from, and a chunk's masked scores. Triton inlines
them, so sharing them costs the kernels nothing."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _table_row(chunk_table, i_c, row0, c_lo, c_hi, SEGMENTED: tl.constexpr):
    """(row, sequence, chunk within it, live) of a parallel kernel's program i_c: row i_c of the chunk
    table, or row0 + i_c in a segment of a pipelined call. Not live: a row past the last chunk (the
    table is sized by an upper bound, no host sync) or, in a segment, a chunk outside c_lo <= i < c_hi."""
    if SEGMENTED:
        i_c += row0
    i_n = tl.load(chunk_table + 2 * i_c)
    i_t = tl.load(chunk_table + 2 * i_c + 1)
    live = i_n >= 0
    if SEGMENTED:
        live = live & (i_t >= c_lo) & (i_t < c_hi)
    return i_c, i_n, i_t, live


@triton.jit
def _sequence(cu_seqlens, i_n):
    """(length, first token as int64) of sequence i_n."""
    start = tl.load(cu_seqlens + i_n)
    return tl.load(cu_seqlens + i_n + 1) - start, start.to(tl.int64)


@triton.jit
def _chain_program(cu_seqlens, chunk_offsets, H, HV):
    """(V block, sequence x value head, value head, key head, sequence length, first token, first chunk
    row) of a chain program: grid (V blocks, sequences x value heads)."""
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_hv = i_nh // HV, i_nh % HV
    T, bos = _sequence(cu_seqlens, i_n)
    c_first = tl.load(chunk_offsets + i_n).to(tl.int64)
    return i_v, i_nh, i_hv, i_hv // (HV // H), T, bos, c_first


@triton.jit
def _initial_state(h_in, i_nh, i_v, stride_k, stride_v, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr,
                   BV: tl.constexpr, HAS_H_IN: tl.constexpr):
    """The fp32 [BK, BV] state block a chain program starts from: h_in's, or zeros without it."""
    b_s = tl.zeros([BK, BV], dtype=tl.float32)
    if HAS_H_IN:
        p_h0 = tl.make_block_ptr(h_in + i_nh.to(tl.int64) * K * V, (K, V), (stride_k, stride_v), (0, i_v * BV),
                                 (BK, BV), (1, 0))
        b_s = tl.load(p_h0, boundary_check=(0, 1), padding_option="zero").to(tl.float32)
    return b_s


@triton.jit
def _scores(b_q, b_k, r_c, r_qn, r_kn, dt):
    """P = scale (q_i . k_j) rq_i rk_j e^(gamma_i - gamma_j) for j <= i, else 0, in dt: raw q and k,
    the norms and the decays in the epilogue."""
    return _masked_scores(tl.dot(b_q, tl.trans(b_k)), r_c, r_qn, r_kn, dt)


@triton.jit
def _masked_scores(b_qk, r_c, r_qn, r_kn, dt):
    """`_scores` from the raw q k^T (shared by the value heads of a key head)."""
    o_i = tl.arange(0, 64)
    causal = o_i[:, None] >= o_i[None, :]
    decay = tl.exp(tl.where(causal, r_c[:, None] - r_c[None, :], 0.0))
    return tl.where(causal, b_qk * decay * (r_qn[:, None] * r_kn[None, :]), 0.0).to(dt)
