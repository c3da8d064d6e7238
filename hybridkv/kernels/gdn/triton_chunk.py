"""Triton chunked gated delta rule (forward), two kernels; `reference.chunk_reference` is its oracle.

1. `_wy_inverse_kernel`, parallel over (chunk, value head): T = (I + L)^-1 of the decayed, beta-scaled
   K K^T of each 64-token chunk, by 16x16 blocks (forward substitution on the diagonal blocks, block
   products below). T is the only intermediate that reaches HBM: 64 bf16 per token and value head.
2. `_chunk_fwd_kernel`, sequential over the chunks of one (sequence, value head, V block): the state
   stays in registers for the whole sequence; each chunk forms W = T diag(beta e^gamma) K and
   U = T diag(beta) V on the fly, V' = U - W S, writes O and updates S. No w, u, h or v_new in HBM.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BT = 64


@triton.jit
def _inv_unit_lower16(L):
    """(I + L)^-1 for a strictly lower 16x16 L, by forward substitution (row i of T reads rows < i)."""
    r = tl.arange(0, 16)
    t = (r[:, None] == r[None, :]).to(tl.float32)
    for i in tl.static_range(1, 16):
        l_row = tl.sum(tl.where(r[:, None] == i, L, 0.0), 0)
        corr = tl.sum(l_row[:, None] * t, 0)
        t = tl.where(r[:, None] == i, t - corr[None, :], t)
    return t


@triton.jit
def _load_sub(k, g, beta, bos, T, i_h, i_hv, row0, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr,
              BK: tl.constexpr, L2NORM: tl.constexpr):
    """One 16-token sub-block: k [16, BK] in k's dtype, g and beta [16] fp32 (zero past the end)."""
    p_k = tl.make_block_ptr(k + (bos * H + i_h) * K, (T, K), (H * K, 1), (row0, 0), (16, BK), (1, 0))
    b_k = tl.load(p_k, boundary_check=(0, 1), padding_option="zero")
    if L2NORM:
        kf = b_k.to(tl.float32)
        kf = kf * tl.rsqrt(tl.sum(kf * kf, 1) + 1e-6)[:, None]
        b_k = kf.to(b_k.dtype)
    o_t = row0 + tl.arange(0, 16)
    m_t = o_t < T
    b_g = tl.load(g + (bos + o_t) * HV + i_hv, mask=m_t, other=0.0).to(tl.float32)
    b_b = tl.load(beta + (bos + o_t) * HV + i_hv, mask=m_t, other=0.0).to(tl.float32)
    return b_k, b_g, b_b


@triton.jit
def _lower_block(ki, kj, ci, cj, bi, DIAG: tl.constexpr):
    """L_ij = beta_i e^(gamma_i - gamma_j) k_i . k_j, strictly lower when i == j."""
    a = tl.dot(ki, tl.trans(kj))
    d = ci[:, None] - cj[None, :]
    if DIAG:
        r = tl.arange(0, 16)
        keep = r[:, None] > r[None, :]
        return tl.where(keep, bi[:, None] * tl.exp(tl.where(keep, d, 0.0)) * a, 0.0)
    return bi[:, None] * tl.exp(d) * a


@triton.jit
def _store_block(p, x, T, row0, col0, HV: tl.constexpr):
    ptr = tl.make_block_ptr(p, (T, 64), (HV * 64, 1), (row0, col0), (16, 16), (1, 0))
    tl.store(ptr, x.to(ptr.dtype.element_ty), boundary_check=(0, 1))


@triton.jit
def _wy_inverse_kernel(k, g, beta, A, cu_seqlens, chunk_table, H: tl.constexpr, HV: tl.constexpr,
                       K: tl.constexpr, BK: tl.constexpr, L2NORM: tl.constexpr):
    i_c, i_hv = tl.program_id(0), tl.program_id(1)
    i_n = tl.load(chunk_table + 2 * i_c)
    i_t = tl.load(chunk_table + 2 * i_c + 1)
    bos = tl.load(cu_seqlens + i_n).to(tl.int32)
    T = tl.load(cu_seqlens + i_n + 1).to(tl.int32) - bos
    i_h = i_hv // (HV // H)
    r0 = i_t * 64
    k0, g0, b0 = _load_sub(k, g, beta, bos, T, i_h, i_hv, r0, H, HV, K, BK, L2NORM)
    k1, g1, b1 = _load_sub(k, g, beta, bos, T, i_h, i_hv, r0 + 16, H, HV, K, BK, L2NORM)
    k2, g2, b2 = _load_sub(k, g, beta, bos, T, i_h, i_hv, r0 + 32, H, HV, K, BK, L2NORM)
    k3, g3, b3 = _load_sub(k, g, beta, bos, T, i_h, i_hv, r0 + 48, H, HV, K, BK, L2NORM)
    c0 = tl.cumsum(g0, 0)
    c1 = tl.cumsum(g1, 0) + tl.sum(g0, 0)
    c2 = tl.cumsum(g2, 0) + tl.sum(g0, 0) + tl.sum(g1, 0)
    c3 = tl.cumsum(g3, 0) + tl.sum(g0, 0) + tl.sum(g1, 0) + tl.sum(g2, 0)

    t00 = _inv_unit_lower16(_lower_block(k0, k0, c0, c0, b0, True))
    t11 = _inv_unit_lower16(_lower_block(k1, k1, c1, c1, b1, True))
    t22 = _inv_unit_lower16(_lower_block(k2, k2, c2, c2, b2, True))
    t33 = _inv_unit_lower16(_lower_block(k3, k3, c3, c3, b3, True))
    l10 = _lower_block(k1, k0, c1, c0, b1, False)
    l20 = _lower_block(k2, k0, c2, c0, b2, False)
    l21 = _lower_block(k2, k1, c2, c1, b2, False)
    l30 = _lower_block(k3, k0, c3, c0, b3, False)
    l31 = _lower_block(k3, k1, c3, c1, b3, False)
    l32 = _lower_block(k3, k2, c3, c2, b3, False)
    # Block forward substitution: T_ij = -T_ii sum_{j <= m < i} L_im T_mj.
    t10 = -tl.dot(t11, tl.dot(l10, t00, input_precision="ieee"), input_precision="ieee")
    t21 = -tl.dot(t22, tl.dot(l21, t11, input_precision="ieee"), input_precision="ieee")
    t32 = -tl.dot(t33, tl.dot(l32, t22, input_precision="ieee"), input_precision="ieee")
    t20 = -tl.dot(t22, tl.dot(l20, t00, input_precision="ieee") + tl.dot(l21, t10, input_precision="ieee"),
                  input_precision="ieee")
    t31 = -tl.dot(t33, tl.dot(l31, t11, input_precision="ieee") + tl.dot(l32, t21, input_precision="ieee"),
                  input_precision="ieee")
    t30 = -tl.dot(t33, tl.dot(l30, t00, input_precision="ieee") + tl.dot(l31, t10, input_precision="ieee")
                  + tl.dot(l32, t20, input_precision="ieee"), input_precision="ieee")

    p = A + (bos * HV + i_hv) * 64
    zero = tl.zeros([16, 16], dtype=tl.float32)
    _store_block(p, t00, T, r0, 0, HV)
    _store_block(p, zero, T, r0, 16, HV)
    _store_block(p, zero, T, r0, 32, HV)
    _store_block(p, zero, T, r0, 48, HV)
    _store_block(p, t10, T, r0 + 16, 0, HV)
    _store_block(p, t11, T, r0 + 16, 16, HV)
    _store_block(p, zero, T, r0 + 16, 32, HV)
    _store_block(p, zero, T, r0 + 16, 48, HV)
    _store_block(p, t20, T, r0 + 32, 0, HV)
    _store_block(p, t21, T, r0 + 32, 16, HV)
    _store_block(p, t22, T, r0 + 32, 32, HV)
    _store_block(p, zero, T, r0 + 32, 48, HV)
    _store_block(p, t30, T, r0 + 48, 0, HV)
    _store_block(p, t31, T, r0 + 48, 16, HV)
    _store_block(p, t32, T, r0 + 48, 32, HV)
    _store_block(p, t33, T, r0 + 48, 48, HV)


def _fwd_configs_all() -> list[triton.Config]:
    return [
        triton.Config({"BV": bv}, num_warps=w, num_stages=s)
        for bv in (32, 64)
        for w in (4, 8)
        for s in (1, 2)
    ]


def _fwd_configs() -> list[triton.Config]:
    # BV = 32 miscompiles on sm_90 with Triton 3.6: wrong results with 4 warps and 1 stage, shared
    # memory read out of bounds (compute-sanitizer) otherwise; the Triton interpreter gets it right.
    return [c for c in _fwd_configs_all() if c.kwargs["BV"] == 64]


@triton.autotune(configs=_fwd_configs(), key=["H", "HV", "K", "V", "WORK_LOG2"])
@triton.jit
def _chunk_fwd_kernel(q, k, v, g, beta, A, o, h0, ht, cu_seqlens, scale, WORK_LOG2,
                      stride_sk, stride_sv, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr,
                      V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, L2NORM: tl.constexpr,
                      HAS_H0: tl.constexpr, STORE_FINAL: tl.constexpr):
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_hv = i_nh // HV, i_nh % HV
    i_h = i_hv // (HV // H)
    bos = tl.load(cu_seqlens + i_n).to(tl.int32)
    T = tl.load(cu_seqlens + i_n + 1).to(tl.int32) - bos
    dt = k.dtype.element_ty

    b_s = tl.zeros([BK, BV], dtype=tl.float32)
    if HAS_H0:
        p_h0 = tl.make_block_ptr(h0 + i_nh * K * V, (K, V), (stride_sk, stride_sv), (0, i_v * BV), (BK, BV),
                                 (1, 0))
        b_s = tl.load(p_h0, boundary_check=(0, 1), padding_option="zero").to(tl.float32)

    o_i = tl.arange(0, 64)
    causal = o_i[:, None] >= o_i[None, :]
    for i_t in range(tl.cdiv(T, 64)):
        p_q = tl.make_block_ptr(q + (bos * H + i_h) * K, (T, K), (H * K, 1), (i_t * 64, 0), (64, BK), (1, 0))
        p_k = tl.make_block_ptr(k + (bos * H + i_h) * K, (T, K), (H * K, 1), (i_t * 64, 0), (64, BK), (1, 0))
        p_v = tl.make_block_ptr(v + (bos * HV + i_hv) * V, (T, V), (HV * V, 1), (i_t * 64, i_v * BV),
                                (64, BV), (1, 0))
        p_a = tl.make_block_ptr(A + (bos * HV + i_hv) * 64, (T, 64), (HV * 64, 1), (i_t * 64, 0), (64, 64),
                                (1, 0))
        b_q = tl.load(p_q, boundary_check=(0, 1), padding_option="zero")
        b_k = tl.load(p_k, boundary_check=(0, 1), padding_option="zero")
        b_v = tl.load(p_v, boundary_check=(0, 1), padding_option="zero")
        b_a = tl.load(p_a, boundary_check=(0, 1), padding_option="zero").to(dt)
        if L2NORM:
            qf = b_q.to(tl.float32)
            kf = b_k.to(tl.float32)
            b_q = (qf * tl.rsqrt(tl.sum(qf * qf, 1) + 1e-6)[:, None]).to(dt)
            b_k = (kf * tl.rsqrt(tl.sum(kf * kf, 1) + 1e-6)[:, None]).to(dt)
        o_t = i_t * 64 + o_i
        m_t = o_t < T
        b_g = tl.load(g + (bos + o_t) * HV + i_hv, mask=m_t, other=0.0).to(tl.float32)
        b_b = tl.load(beta + (bos + o_t) * HV + i_hv, mask=m_t, other=0.0).to(tl.float32)
        b_c = tl.cumsum(b_g, 0)
        g_last = tl.sum(b_g, 0)

        b_w = tl.dot(b_a, (b_k * (b_b * tl.exp(b_c))[:, None]).to(dt))
        b_u = tl.dot(b_a, (b_v * b_b[:, None]).to(dt))
        b_sd = b_s.to(dt)
        b_vn = (b_u - tl.dot(b_w.to(dt), b_sd)).to(dt)

        b_qk = tl.dot(b_q, tl.trans(b_k))
        decay = tl.exp(tl.where(causal, b_c[:, None] - b_c[None, :], 0.0))
        b_p = tl.where(causal, b_qk * decay, 0.0).to(dt)
        b_o = tl.dot(b_q, b_sd) * tl.exp(b_c)[:, None] + tl.dot(b_p, b_vn)
        p_o = tl.make_block_ptr(o + (bos * HV + i_hv) * V, (T, V), (HV * V, 1), (i_t * 64, i_v * BV),
                                (64, BV), (1, 0))
        tl.store(p_o, (b_o * scale).to(p_o.dtype.element_ty), boundary_check=(0, 1))

        b_kd = (b_k * tl.exp(g_last - b_c)[:, None]).to(dt)
        b_s = b_s * tl.exp(g_last) + tl.dot(tl.trans(b_kd), b_vn)

    if STORE_FINAL:
        p_ht = tl.make_block_ptr(ht + i_nh * K * V, (K, V), (stride_sk, stride_sv), (0, i_v * BV), (BK, BV),
                                 (1, 0))
        tl.store(p_ht, b_s.to(p_ht.dtype.element_ty), boundary_check=(0, 1))


def _sequences(cu_seqlens: torch.Tensor | None, B: int, T: int, device: torch.device
               ) -> tuple[torch.Tensor, list[int]]:
    """Offsets as a device int32 tensor and as host ints (the chunk table needs them on the host)."""
    if cu_seqlens is None:
        offs = [i * T for i in range(B + 1)]
        return torch.tensor(offs, dtype=torch.int32, device=device), offs
    offs = cu_seqlens.tolist()
    return cu_seqlens.to(device=device, dtype=torch.int32), offs


def chunk_gated_delta_rule_fwd(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens,
                               use_qk_l2norm_in_kernel, state_v_first):
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    if K > 256 or V > 256:
        raise ValueError(f"head dims up to 256 are supported, got K={K}, V={V}")
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    cu, offs = _sequences(cu_seqlens, B, T, q.device)
    N = len(offs) - 1
    table = [(n, c) for n in range(N) for c in range(triton.cdiv(offs[n + 1] - offs[n], BT))]
    o = torch.empty_like(v)
    final = None
    if output_final_state:
        final = q.new_empty((N, HV, V, K) if state_v_first else (N, HV, K, V), dtype=torch.float32)
    if not table:
        if final is not None:
            final.copy_(initial_state if initial_state is not None else torch.zeros_like(final))
        return o, final
    chunk_table = torch.tensor(table, dtype=torch.int32, device=q.device)
    A = q.new_empty((B * T, HV, BT), dtype=torch.bfloat16 if q.dtype != torch.float32 else torch.float32)
    BK = triton.next_power_of_2(K)
    _wy_inverse_kernel[(len(table), HV)](k, g, beta, A, cu, chunk_table, H=H, HV=HV, K=K, BK=BK,
                                         L2NORM=use_qk_l2norm_in_kernel, num_warps=4)
    h0 = initial_state.contiguous() if initial_state is not None else None
    # The state kernels index K rows and V columns; a V-first state is the transposed view.
    stride_sk, stride_sv = (1, K) if state_v_first else (V, 1)
    grid = lambda meta: (triton.cdiv(V, meta["BV"]), N * HV)  # noqa: E731
    _chunk_fwd_kernel[grid](q, k, v, g, beta, A, o, h0, final, cu, scale, max(N * HV, 1).bit_length(),
                            stride_sk, stride_sv, H=H, HV=HV, K=K, V=V, BK=BK, L2NORM=use_qk_l2norm_in_kernel,
                            HAS_H0=h0 is not None, STORE_FINAL=final is not None)
    return o, final
