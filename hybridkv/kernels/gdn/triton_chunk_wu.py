"""The chunked forward with the chain cut short (`triton_chunk.Form.SPLIT`, opt-in): meant for calls
whose state kernel has fewer programs than the GPU has SMs (one long sequence), where the chain is the
whole call. Its oracle is `reference.chunk_reference` (through `triton_chunk`, which launches it).

The fused state kernel (`triton_chunk._chunk_state_kernel`) runs six GEMMs per chunk on the chain. With
T the chunk's inverse and the row scales of `triton_chunk_inverse` (rq, rk, rb, rd), its V' and O are

    V' = T (rb V) - T (rk K) S = U - W S
    O  = rq Q S + P V' = (rq Q - P W) S + P U = Q' S + U'

so W, Q', U and U' depend on the inputs only. `_chunk_wu_kernel` makes them in parallel over (chunk,
value head, 64 columns), stacked as [W; Q'] `[NC, HV, 128, K]` and [U; U'] `[NC, HV, 128, V]` (64 KB per
chunk and value head in bf16);
`_chunk_chain_kernel` multiplies [W; Q'] S in one GEMM, then K^T (rd V') into the state.

Why nothing picks it: its chain is shorter than the fused state kernel's, but the parallel kernel costs
more than the chain saves, so a whole call is slower than the fused form on every benchmark shape
(tools/gdn/README.md). That kernel is latency-bound, not bandwidth-bound: few programs per SM, each
one chain of dependent GEMMs. Folding it into the inverse kernel, which holds T already, is the open
next step.
"""

from __future__ import annotations

import triton
import triton.language as tl

from hybridkv.kernels.gdn.triton_chunk_inverse import _R_STRIDE
from hybridkv.kernels.gdn.triton_chunk_rows import _chain_program, _initial_state, _scores, _sequence, _table_row


@triton.jit
def _next_uu(UU, G, c_first, i_t, c_end, HV, i_hv, i_v, V: tl.constexpr, BV: tl.constexpr):
    """[U; U'] (128 x BV, as stored) and e^g_last of chunk i_t; zeros past c_end (the last lookahead)."""
    live = i_t < c_end
    i_ch = (c_first + tl.where(live, i_t, 0)) * HV + i_hv
    o_r = tl.arange(0, 128)
    o_v = i_v * BV + tl.arange(0, BV)
    b_uu = tl.load(UU + i_ch * 128 * V + o_r[:, None] * V + o_v[None, :], mask=live & (o_v[None, :] < V), other=0.0)
    return b_uu, tl.load(G + i_ch, mask=live, other=0.0)


@triton.jit
def _chunk_wu_kernel(q, k, v, A, R, WQ, UU, cu_seqlens, chunk_table, row0, c_lo, c_hi, H, HV,
                     K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BC: tl.constexpr,
                     SEGMENTED: tl.constexpr):
    """One (chunk, value head, BC columns): along the grid's last axis, even programs make W = T (rk K)
    and Q' = rq Q - P W (WQ rows 0-63 and 64-127), odd ones U = T (rb V) and U' = P U (UU rows 0-63 and
    64-127). P = the masked, decayed, norm-scaled Q K^T, made by every program. Every load is issued
    before the first GEMM: a program is a chain of dependent GEMMs, and a load waited for between them
    is latency no other work hides."""
    i_c, i_hv, i_p = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_side, i_b = i_p % 2, i_p // 2
    i_c, i_n, i_t, live = _table_row(chunk_table, i_c, row0, c_lo, c_hi, SEGMENTED)
    if not live:
        return
    T, bos = _sequence(cu_seqlens, i_n)
    i_h = i_hv // (HV // H)
    i_ch = i_c.to(tl.int64) * HV + i_hv
    dt = WQ.dtype.element_ty

    o_i = tl.arange(0, 64)
    p_r = R + i_ch * _R_STRIDE + o_i
    base_q, base_k = q + (bos * H + i_h) * K, k + (bos * H + i_h) * K
    p_q = tl.make_block_ptr(base_q, (T, K), (H * K, 1), (i_t * 64, 0), (64, BK), (1, 0))
    p_k = tl.make_block_ptr(base_k, (T, K), (H * K, 1), (i_t * 64, 0), (64, BK), (1, 0))
    b_q = tl.load(p_q, boundary_check=(0, 1), padding_option="zero")
    b_k = tl.load(p_k, boundary_check=(0, 1), padding_option="zero")
    b_a = tl.load(A + i_ch * 4096 + o_i[:, None] * 64 + o_i[None, :]).to(dt)
    r_c = tl.load(p_r + 256)
    r_qn = tl.load(p_r + 320)
    r_kn = tl.load(p_r + 384)
    b_p = _scores(b_q, b_k, r_c, r_qn, r_kn, dt)
    if i_side == 0:
        p_qb = tl.make_block_ptr(base_q, (T, K), (H * K, 1), (i_t * 64, i_b * BC), (64, BC), (1, 0))
        p_kb = tl.make_block_ptr(base_k, (T, K), (H * K, 1), (i_t * 64, i_b * BC), (64, BC), (1, 0))
        b_qb = tl.load(p_qb, boundary_check=(0, 1), padding_option="zero")
        b_kb = tl.load(p_kb, boundary_check=(0, 1), padding_option="zero")
        r_q = tl.load(p_r)
        r_k = tl.load(p_r + 64)
        # The chain multiplies the stored (rounded) W, so Q' subtracts P times that same W.
        b_w = tl.dot(b_a, (b_kb.to(tl.float32) * r_k[:, None]).to(dt)).to(dt)
        b_qp = b_qb.to(tl.float32) * r_q[:, None] - tl.dot(b_p, b_w)
        p_w = tl.make_block_ptr(WQ + i_ch * 128 * K, (128, K), (K, 1), (0, i_b * BC), (64, BC), (1, 0))
        p_qp = tl.make_block_ptr(WQ + i_ch * 128 * K, (128, K), (K, 1), (64, i_b * BC), (64, BC), (1, 0))
        tl.store(p_w, b_w, boundary_check=(1,))
        tl.store(p_qp, b_qp.to(dt), boundary_check=(1,))
    else:
        p_v = tl.make_block_ptr(v + (bos * HV + i_hv) * V, (T, V), (HV * V, 1), (i_t * 64, i_b * BC), (64, BC),
                                (1, 0))
        b_v = tl.load(p_v, boundary_check=(0, 1), padding_option="zero")
        r_b = tl.load(p_r + 192)
        b_u = tl.dot(b_a, (b_v.to(tl.float32) * r_b[:, None]).to(dt)).to(dt)
        b_up = tl.dot(b_p, b_u)
        p_u = tl.make_block_ptr(UU + i_ch * 128 * V, (128, V), (V, 1), (0, i_b * BC), (64, BC), (1, 0))
        p_up = tl.make_block_ptr(UU + i_ch * 128 * V, (128, V), (V, 1), (64, i_b * BC), (64, BC), (1, 0))
        tl.store(p_u, b_u, boundary_check=(1,))
        tl.store(p_up, b_up.to(dt), boundary_check=(1,))


@triton.jit
def _chunk_chain_kernel(k, WQ, UU, R, G, o, h_in, h_out, cu_seqlens, chunk_offsets, c_lo, c_hi,
                        stride_ik, stride_iv, stride_ok, stride_ov, H, HV, WORK_LOG2, K: tl.constexpr, V: tl.constexpr,
                        BK: tl.constexpr, BV: tl.constexpr, HAS_H_IN: tl.constexpr, HAS_H_OUT: tl.constexpr,
                        SEGMENTED: tl.constexpr):
    """Per chunk: [W; Q'] S in one GEMM (M = 128), then V' = U - W S, O = Q' S + U', and
    S = e^g_last S + K^T (rd V'): two GEMMs on the dependency path. Launched and segmented as
    `_chunk_state_kernel` is (same grid, same state hand-over)."""
    i_v, i_nh, i_hv, i_h, T, bos, c_first = _chain_program(cu_seqlens, chunk_offsets, H, HV)
    dt = WQ.dtype.element_ty
    b_s = _initial_state(h_in, i_nh, i_v, stride_ik, stride_iv, K, V, BK, BV, HAS_H_IN)

    o_i = tl.arange(0, 64)
    # V' = U - (W S) on rows 0-63, O = (Q' S) + U' on rows 64-127: one signed add over the stacked tile.
    sign = tl.where(tl.arange(0, 128) < 64, -1.0, 1.0)
    n_t = tl.cdiv(T, 64)
    c_end = tl.minimum(n_t, c_hi) if SEGMENTED else n_t
    # [U; U'] and e^g_last of the next chunk are loaded one chunk ahead by hand: Triton's pipeliner
    # leaves them (U' became the GEMM's accumulator, the scalar is not a tile), and each then cost a
    # global-load latency inside the chain (offline TTGIR; W, Q', k and rd arrive by cp.async).
    b_uu, e_last = _next_uu(UU, G, c_first, c_lo if SEGMENTED else 0, c_end, HV, i_hv, i_v, V, BV)
    for i_t in range(c_lo if SEGMENTED else 0, c_end):
        i_ch = (c_first + i_t) * HV + i_hv
        b_uu_next, e_next = _next_uu(UU, G, c_first, i_t + 1, c_end, HV, i_hv, i_v, V, BV)
        p_k = tl.make_block_ptr(k + (bos * H + i_h) * K, (T, K), (H * K, 1), (i_t * 64, 0), (64, BK), (1, 0))
        p_wq = tl.make_block_ptr(WQ + i_ch * 128 * K, (128, K), (K, 1), (0, 0), (128, BK), (1, 0))
        b_k = tl.load(p_k, boundary_check=(0, 1), padding_option="zero")
        b_wq = tl.load(p_wq, boundary_check=(1,), padding_option="zero")
        r_d = tl.load(R + i_ch * _R_STRIDE + 128 + o_i)

        b_y = b_uu.to(tl.float32) + sign[:, None] * tl.dot(b_wq, b_s.to(dt))
        b_vn, b_o = tl.split(tl.permute(tl.reshape(b_y, (2, 64, BV)), (1, 2, 0)))
        p_o = tl.make_block_ptr(o + (bos * HV + i_hv) * V, (T, V), (HV * V, 1), (i_t * 64, i_v * BV),
                                (64, BV), (1, 0))
        tl.store(p_o, b_o.to(p_o.dtype.element_ty), boundary_check=(0, 1))
        b_s = b_s * e_last + tl.dot(tl.trans(b_k), (b_vn * r_d[:, None]).to(dt))
        b_uu, e_last = b_uu_next, e_next

    if HAS_H_OUT:
        p_ht = tl.make_block_ptr(h_out + i_nh.to(tl.int64) * K * V, (K, V), (stride_ok, stride_ov), (0, i_v * BV),
                                 (BK, BV), (1, 0))
        tl.store(p_ht, b_s.to(p_ht.dtype.element_ty), boundary_check=(0, 1))
