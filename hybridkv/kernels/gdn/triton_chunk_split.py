"""The measured alternatives to the fused state kernel of `triton_chunk` (`Variant.SPLIT`, `Variant.WU`).

Both take GEMMs off the sequential chain: the chain stores the state entering each chunk and V' to
scratch, and `_chunk_output_kernel` then computes O = sq (Q S_in) + P V' for all chunks at once.
SPLIT keeps K S, T y and the state update on the chain; WU precomputes W = T sk K and U = T beta V in
parallel (FLA's cut) so the chain is V' = U - W S and the update. Both read `triton_chunk`'s prep
scratch (T, P, row scales, chunk decays) and are tested against the same reference.
"""

from __future__ import annotations

import triton
import triton.language as tl

from hybridkv.kernels.gdn.triton_chunk import BT, STATE_CONFIGS, Variant, _autotuned, _launch


@triton.jit
def _chunk_chain_kernel(k, v, A, R, G, Hs, VN, h0, ht, cu_seqlens, chunk_offsets, stride_sk, stride_sv,
                        H, HV, WORK_LOG2, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr,
                        BV: tl.constexpr, HAS_H0: tl.constexpr, STORE_FINAL: tl.constexpr):
    """The sequential part only: per chunk K S, V' = T (beta V - sk K S), S = e^g_last S + K^T (sd V').

    The state entering each chunk (in the GEMM dtype, as the fused kernel feeds Q S) and V' go to
    scratch, so Q S and P V' run afterwards in `_chunk_output_kernel`, parallel over all chunks: two of
    the five GEMMs per chunk leave the chain that bounds a long single sequence.
    """
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_hv = i_nh // HV, i_nh % HV
    i_h = i_hv // (HV // H)
    start = tl.load(cu_seqlens + i_n)
    T = tl.load(cu_seqlens + i_n + 1) - start
    bos = start.to(tl.int64)
    c_first = tl.load(chunk_offsets + i_n).to(tl.int64)
    dt = k.dtype.element_ty

    b_s = tl.zeros([BK, BV], dtype=tl.float32)
    if HAS_H0:
        p_h0 = tl.make_block_ptr(h0 + i_nh.to(tl.int64) * K * V, (K, V), (stride_sk, stride_sv), (0, i_v * BV),
                                 (BK, BV), (1, 0))
        b_s = tl.load(p_h0, boundary_check=(0, 1), padding_option="zero").to(tl.float32)

    o_i = tl.arange(0, 64)
    for i_t in range(tl.cdiv(T, 64)):
        i_ch = (c_first + i_t) * HV + i_hv
        p_k = tl.make_block_ptr(k + (bos * H + i_h) * K, (T, K), (H * K, 1), (i_t * 64, 0), (64, BK), (1, 0))
        p_v = tl.make_block_ptr(v + (bos * HV + i_hv) * V, (T, V), (HV * V, 1), (i_t * 64, i_v * BV),
                                (64, BV), (1, 0))
        b_k = tl.load(p_k, boundary_check=(0, 1), padding_option="zero")
        b_v = tl.load(p_v, boundary_check=(0, 1), padding_option="zero").to(tl.float32)
        b_a = tl.load(A + i_ch * 4096 + o_i[:, None] * 64 + o_i[None, :]).to(dt)
        p_r = R + i_ch * (4 * 64) + o_i
        r_k = tl.load(p_r + 64)
        r_d = tl.load(p_r + 128)
        r_b = tl.load(p_r + 192)
        e_last = tl.load(G + i_ch)

        b_sd = b_s.to(dt)
        p_h = tl.make_block_ptr(Hs + i_ch * K * V, (K, V), (V, 1), (0, i_v * BV), (BK, BV), (1, 0))
        tl.store(p_h, b_sd, boundary_check=(0, 1))
        b_ks = tl.dot(b_k, b_sd)
        b_y = (b_v * r_b[:, None] - b_ks * r_k[:, None]).to(dt)
        b_vn = tl.dot(b_a, b_y)
        p_vn = tl.make_block_ptr(VN + i_ch * 64 * V, (64, V), (V, 1), (0, i_v * BV), (64, BV), (1, 0))
        tl.store(p_vn, b_vn.to(dt), boundary_check=(0, 1))
        b_s = b_s * e_last + tl.dot(tl.trans(b_k), (b_vn * r_d[:, None]).to(dt))

    if STORE_FINAL:
        p_ht = tl.make_block_ptr(ht + i_nh.to(tl.int64) * K * V, (K, V), (stride_sk, stride_sv), (0, i_v * BV),
                                 (BK, BV), (1, 0))
        tl.store(p_ht, b_s.to(p_ht.dtype.element_ty), boundary_check=(0, 1))


@triton.jit
def _chunk_output_kernel(q, P, R, Hs, VN, o, cu_seqlens, chunk_table, H, HV, K: tl.constexpr, V: tl.constexpr,
                         BK: tl.constexpr, BV: tl.constexpr):
    """O = sq (Q S_in) + P V' for one (chunk, value head, V block): no dependence between chunks."""
    i_v, i_c, i_hv = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_n = tl.load(chunk_table + 2 * i_c)
    i_t = tl.load(chunk_table + 2 * i_c + 1)
    start = tl.load(cu_seqlens + i_n)
    T = tl.load(cu_seqlens + i_n + 1) - start
    bos = start.to(tl.int64)
    i_h = i_hv // (HV // H)
    i_ch = i_c.to(tl.int64) * HV + i_hv
    dt = q.dtype.element_ty
    o_i = tl.arange(0, 64)
    p_q = tl.make_block_ptr(q + (bos * H + i_h) * K, (T, K), (H * K, 1), (i_t * 64, 0), (64, BK), (1, 0))
    b_q = tl.load(p_q, boundary_check=(0, 1), padding_option="zero")
    p_h = tl.make_block_ptr(Hs + i_ch * K * V, (K, V), (V, 1), (0, i_v * BV), (BK, BV), (1, 0))
    b_h = tl.load(p_h, boundary_check=(0, 1), padding_option="zero")
    p_vn = tl.make_block_ptr(VN + i_ch * 64 * V, (64, V), (V, 1), (0, i_v * BV), (64, BV), (1, 0))
    b_vn = tl.load(p_vn, boundary_check=(0, 1), padding_option="zero")
    b_p = tl.load(P + i_ch * 4096 + o_i[:, None] * 64 + o_i[None, :]).to(dt)
    r_q = tl.load(R + i_ch * (4 * 64) + o_i)
    b_o = tl.dot(b_q, b_h) * r_q[:, None] + tl.dot(b_p, b_vn)
    p_o = tl.make_block_ptr(o + (bos * HV + i_hv) * V, (T, V), (HV * V, 1), (i_t * 64, i_v * BV), (64, BV), (1, 0))
    tl.store(p_o, b_o.to(p_o.dtype.element_ty), boundary_check=(0, 1))


@triton.jit
def _chunk_wu_kernel(k, v, A, R, W, U, cu_seqlens, chunk_table, H, HV, K: tl.constexpr, V: tl.constexpr,
                     BK: tl.constexpr, BV: tl.constexpr):
    """W = T (sk K) and U = T (beta V) per (chunk, value head), so the chain's V' = U - W S is one GEMM."""
    i_c, i_hv = tl.program_id(0), tl.program_id(1)
    i_n = tl.load(chunk_table + 2 * i_c)
    i_t = tl.load(chunk_table + 2 * i_c + 1)
    start = tl.load(cu_seqlens + i_n)
    T = tl.load(cu_seqlens + i_n + 1) - start
    bos = start.to(tl.int64)
    i_h = i_hv // (HV // H)
    i_ch = i_c.to(tl.int64) * HV + i_hv
    dt = k.dtype.element_ty
    o_i = tl.arange(0, 64)
    b_a = tl.load(A + i_ch * 4096 + o_i[:, None] * 64 + o_i[None, :]).to(dt)
    r_k = tl.load(R + i_ch * (4 * 64) + 64 + o_i)
    r_b = tl.load(R + i_ch * (4 * 64) + 192 + o_i)
    p_k = tl.make_block_ptr(k + (bos * H + i_h) * K, (T, K), (H * K, 1), (i_t * 64, 0), (64, BK), (1, 0))
    b_k = tl.load(p_k, boundary_check=(0, 1), padding_option="zero").to(tl.float32)
    b_w = tl.dot(b_a, (b_k * r_k[:, None]).to(dt))
    p_w = tl.make_block_ptr(W + i_ch * 64 * K, (64, K), (K, 1), (0, 0), (64, BK), (1, 0))
    tl.store(p_w, b_w.to(dt), boundary_check=(0, 1))
    for i_v in range(tl.cdiv(V, BV)):
        p_v = tl.make_block_ptr(v + (bos * HV + i_hv) * V, (T, V), (HV * V, 1), (i_t * 64, i_v * BV), (64, BV),
                                (1, 0))
        b_v = tl.load(p_v, boundary_check=(0, 1), padding_option="zero").to(tl.float32)
        b_u = tl.dot(b_a, (b_v * r_b[:, None]).to(dt))
        p_u = tl.make_block_ptr(U + i_ch * 64 * V, (64, V), (V, 1), (0, i_v * BV), (64, BV), (1, 0))
        tl.store(p_u, b_u.to(dt), boundary_check=(0, 1))


@triton.jit
def _chunk_chain_wu_kernel(k, W, U, R, G, Hs, VN, h0, ht, cu_seqlens, chunk_offsets, stride_sk, stride_sv,
                           H, HV, WORK_LOG2, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr,
                           BV: tl.constexpr, HAS_H0: tl.constexpr, STORE_FINAL: tl.constexpr):
    """The chain with W and U precomputed (FLA's split): per chunk V' = U - W S and the state update only."""
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_hv = i_nh // HV, i_nh % HV
    i_h = i_hv // (HV // H)
    start = tl.load(cu_seqlens + i_n)
    T = tl.load(cu_seqlens + i_n + 1) - start
    bos = start.to(tl.int64)
    c_first = tl.load(chunk_offsets + i_n).to(tl.int64)
    dt = k.dtype.element_ty

    b_s = tl.zeros([BK, BV], dtype=tl.float32)
    if HAS_H0:
        p_h0 = tl.make_block_ptr(h0 + i_nh.to(tl.int64) * K * V, (K, V), (stride_sk, stride_sv), (0, i_v * BV),
                                 (BK, BV), (1, 0))
        b_s = tl.load(p_h0, boundary_check=(0, 1), padding_option="zero").to(tl.float32)

    o_i = tl.arange(0, 64)
    for i_t in range(tl.cdiv(T, 64)):
        i_ch = (c_first + i_t) * HV + i_hv
        p_k = tl.make_block_ptr(k + (bos * H + i_h) * K, (T, K), (H * K, 1), (i_t * 64, 0), (64, BK), (1, 0))
        p_w = tl.make_block_ptr(W + i_ch * 64 * K, (64, K), (K, 1), (0, 0), (64, BK), (1, 0))
        p_u = tl.make_block_ptr(U + i_ch * 64 * V, (64, V), (V, 1), (0, i_v * BV), (64, BV), (1, 0))
        b_k = tl.load(p_k, boundary_check=(0, 1), padding_option="zero")
        b_w = tl.load(p_w, boundary_check=(0, 1), padding_option="zero")
        b_u = tl.load(p_u, boundary_check=(0, 1), padding_option="zero").to(tl.float32)
        r_d = tl.load(R + i_ch * (4 * 64) + 128 + o_i)
        e_last = tl.load(G + i_ch)

        b_sd = b_s.to(dt)
        p_h = tl.make_block_ptr(Hs + i_ch * K * V, (K, V), (V, 1), (0, i_v * BV), (BK, BV), (1, 0))
        tl.store(p_h, b_sd, boundary_check=(0, 1))
        b_vn = b_u - tl.dot(b_w, b_sd)
        p_vn = tl.make_block_ptr(VN + i_ch * 64 * V, (64, V), (V, 1), (0, i_v * BV), (64, BV), (1, 0))
        tl.store(p_vn, b_vn.to(dt), boundary_check=(0, 1))
        b_s = b_s * e_last + tl.dot(tl.trans(b_k), (b_vn * r_d[:, None]).to(dt))

    if STORE_FINAL:
        p_ht = tl.make_block_ptr(ht + i_nh.to(tl.int64) * K * V, (K, V), (stride_sk, stride_sv), (0, i_v * BV),
                                 (BK, BV), (1, 0))
        tl.store(p_ht, b_s.to(p_ht.dtype.element_ty), boundary_check=(0, 1))


_STATE_KEY = ["H", "HV", "WORK_LOG2", "K", "V"]
# The chain kernels rewrite their scratch and final state from inputs alone, so reruns are safe.
_chunk_chain_tuned = _autotuned(_chunk_chain_kernel, STATE_CONFIGS, _STATE_KEY)
_chunk_chain_wu_tuned = _autotuned(_chunk_chain_wu_kernel, STATE_CONFIGS, _STATE_KEY)
OUTPUT_CONFIGS = ((64, 4, 2), (128, 8, 2), (64, 4, 3), (128, 4, 2))
_chunk_output_tuned = _autotuned(_chunk_output_kernel, OUTPUT_CONFIGS, ["H", "HV", "K", "V"])


def run(variant, q, k, v, A, Pm, R, G, o, h0, final, cu, chunk_table, chunk_offsets, stride_sk, stride_sv,
        H, HV, work_log2, flags, config) -> None:
    """The state and output passes of ``variant`` over `triton_chunk`'s prep scratch; writes o and final."""
    NC, K, V, BK = A.shape[0], flags["K"], flags["V"], flags["BK"]
    N = chunk_offsets.shape[0] - 1
    Hs = q.new_empty((NC, HV, K, V))
    VN = q.new_empty((NC, HV, BT, V))
    if variant is Variant.SPLIT:
        chain = (k, v, A, R, G, Hs, VN, h0, final, cu, chunk_offsets, stride_sk, stride_sv, H, HV, work_log2)
        _launch(_chunk_chain_kernel, _chunk_chain_tuned, chain, flags, config, V, N * HV)
    elif variant is Variant.WU:
        W = q.new_empty((NC, HV, BT, K))
        U = q.new_empty((NC, HV, BT, V))
        _chunk_wu_kernel[(NC, HV)](k, v, A, R, W, U, cu, chunk_table, H, HV, K=K, V=V, BK=BK, BV=min(64, BK),
                                   num_warps=4)
        chain = (k, W, U, R, G, Hs, VN, h0, final, cu, chunk_offsets, stride_sk, stride_sv, H, HV, work_log2)
        _launch(_chunk_chain_wu_kernel, _chunk_chain_wu_tuned, chain, flags, config, V, N * HV)
    else:
        raise ValueError(f"variant {variant}; expected Variant.SPLIT or Variant.WU here")
    out = (q, Pm, R, Hs, VN, o, cu, chunk_table, H, HV)
    if config is None:
        _chunk_output_tuned[lambda meta: (triton.cdiv(V, meta["BV"]), NC, HV)](*out, K=K, V=V, BK=BK)
    else:
        _chunk_output_kernel[(triton.cdiv(V, 64), NC, HV)](*out, K=K, V=V, BK=BK, BV=64, num_warps=4, num_stages=2)
