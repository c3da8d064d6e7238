"""Triton token-by-token gated delta rule: FLA-style fused recurrent and the in-place slot decode.

One kernel serves both; `reference.recurrent_reference` and `reference.decode_reference` are its
oracles. A program owns a [BV, K] tile of one (sequence, value head) state in fp32 registers and walks
that sequence's tokens. Decode reads the tile from its slot and writes it back to the same place, so
the state crosses HBM exactly once each way, in its own dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _recurrent_kernel(q, k, v, g, beta, a, b, A_log, dt_bias, o, state, state_out, state_indices, cu_seqlens,
                      scale, T, stride_slot, stride_head, softplus_beta, softplus_threshold,
                      H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr,
                      BV: tl.constexpr, HAS_G: tl.constexpr, HAS_BETA: tl.constexpr, GATE_IN_KERNEL: tl.constexpr,
                      L2NORM: tl.constexpr, IS_VARLEN: tl.constexpr, HAS_STATE: tl.constexpr,
                      STORE_STATE: tl.constexpr, USE_SLOTS: tl.constexpr, V_FIRST: tl.constexpr):
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_hv = i_nh // HV, i_nh % HV
    i_h = i_hv // (HV // H)
    if IS_VARLEN:
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    else:
        bos = i_n.to(tl.int64) * T
        eos = bos + T

    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k = o_k < K
    m_v = o_v < V
    m_s = m_v[:, None] & m_k[None, :]
    # Tile [BV, BK] holds S[k, v] transposed; only the addressing depends on the memory layout.
    if V_FIRST:
        o_s = o_v[:, None] * K + o_k[None, :]
    else:
        o_s = o_k[None, :] * V + o_v[:, None]

    live = True
    if USE_SLOTS:
        slot = tl.load(state_indices + i_n).to(tl.int64)
        live = slot >= 0
        p_s = state + tl.maximum(slot, 0) * stride_slot + i_hv * stride_head + o_s
        p_s_out = p_s
    else:
        p_s = state + i_nh.to(tl.int64) * K * V + o_s
        p_s_out = state_out + i_nh.to(tl.int64) * K * V + o_s
    b_s = tl.zeros([BV, BK], dtype=tl.float32)
    if HAS_STATE:
        b_s = tl.load(p_s, mask=m_s & live, other=0.0).to(tl.float32)

    if GATE_IN_KERNEL:
        neg_a = -tl.exp(tl.load(A_log + i_hv).to(tl.float32))
        bias = tl.load(dt_bias + i_hv).to(tl.float32)
    for t in range(bos, eos):
        b_q = tl.load(q + (t * H + i_h) * K + o_k, mask=m_k, other=0.0).to(tl.float32)
        b_k = tl.load(k + (t * H + i_h) * K + o_k, mask=m_k, other=0.0).to(tl.float32)
        b_v = tl.load(v + (t * HV + i_hv) * V + o_v, mask=m_v, other=0.0).to(tl.float32)
        if L2NORM:
            b_q = b_q * tl.rsqrt(tl.sum(b_q * b_q, 0) + 1e-6)
            b_k = b_k * tl.rsqrt(tl.sum(b_k * b_k, 0) + 1e-6)
        if GATE_IN_KERNEL:
            x = tl.load(a + t * HV + i_hv).to(tl.float32) + bias
            bx = softplus_beta * x
            sp = tl.where(bx <= softplus_threshold, tl.log(1.0 + tl.exp(bx)) / softplus_beta, x)
            b_s = b_s * tl.exp(neg_a * sp)
            b_beta = tl.sigmoid(tl.load(b + t * HV + i_hv).to(tl.float32))
        else:
            if HAS_G:
                b_s = b_s * tl.exp(tl.load(g + t * HV + i_hv).to(tl.float32))
            if HAS_BETA:
                b_beta = tl.load(beta + t * HV + i_hv).to(tl.float32)
            else:
                b_beta = 1.0
        pred = tl.sum(b_s * b_k[None, :], 1)
        delta = b_beta * (b_v - pred)
        b_s = b_s + delta[:, None] * b_k[None, :]
        b_o = tl.sum(b_s * b_q[None, :], 1) * scale
        b_o = tl.where(live, b_o, 0.0)
        tl.store(o + (t * HV + i_hv) * V + o_v, b_o.to(o.dtype.element_ty), mask=m_v)
    if STORE_STATE:
        tl.store(p_s_out, b_s.to(p_s_out.dtype.element_ty), mask=m_s & live)


# Decode streams each state once; the tile shape that keeps enough bytes in flight depends on the
# state dtype and head count, so it is tuned per (HV, K, V, dtypes). restore_value keeps tuning from
# applying the update twice to the pool.
_decode_kernel = triton.autotune(
    configs=[triton.Config({"BV": bv}, num_warps=w) for bv in (16, 32, 64) for w in (2, 4, 8)],
    key=["HV", "K", "V"],
    restore_value=["state"],
)(_recurrent_kernel)


def _block_v(V: int) -> int:
    return min(32, triton.next_power_of_2(V))


def fused_recurrent_fwd(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens,
                        use_qk_l2norm_in_kernel, state_v_first):
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    q, k, v = (x.contiguous() for x in (q, k, v))
    g = g.contiguous() if g is not None else None
    beta = beta.contiguous() if beta is not None else None
    N = B if cu_seqlens is None else cu_seqlens.numel() - 1
    o = torch.empty_like(v)
    h0 = initial_state.contiguous() if initial_state is not None else None
    final = None
    if output_final_state:
        final = q.new_empty((N, HV, V, K) if state_v_first else (N, HV, K, V), dtype=torch.float32)
    BV = _block_v(V)
    grid = (triton.cdiv(V, BV), N * HV)
    _recurrent_kernel[grid](
        q, k, v, g, beta, None, None, None, None, o, h0, final, None, cu_seqlens, scale, T, 0, 0, 1.0, 20.0,
        H=H, HV=HV, K=K, V=V, BK=triton.next_power_of_2(K), BV=BV, HAS_G=g is not None,
        HAS_BETA=beta is not None, GATE_IN_KERNEL=False, L2NORM=use_qk_l2norm_in_kernel,
        IS_VARLEN=cu_seqlens is not None, HAS_STATE=h0 is not None, STORE_STATE=final is not None,
        USE_SLOTS=False, V_FIRST=state_v_first, num_warps=4,
    )
    return o, final


def decode_fwd(q, k, v, a, b, A_log, dt_bias, ssm_state, state_indices, scale, use_qk_l2norm_in_kernel,
               state_v_first, softplus_beta, softplus_threshold):
    N, H, K = q.shape
    HV, V = v.shape[1], v.shape[2]
    q, k, v, a, b = (x.contiguous() for x in (q, k, v, a, b))
    o = torch.empty_like(v)
    grid = lambda meta: (triton.cdiv(V, meta["BV"]), N * HV)  # noqa: E731
    _decode_kernel[grid](
        q, k, v, None, None, a, b, A_log, dt_bias, o, ssm_state, None, state_indices, None, scale, 1,
        ssm_state.stride(0), ssm_state.stride(1), float(softplus_beta), float(softplus_threshold),
        H=H, HV=HV, K=K, V=V, BK=triton.next_power_of_2(K), HAS_G=False, HAS_BETA=False,
        GATE_IN_KERNEL=True, L2NORM=use_qk_l2norm_in_kernel, IS_VARLEN=False, HAS_STATE=True,
        STORE_STATE=True, USE_SLOTS=True, V_FIRST=state_v_first,
    )
    return o
