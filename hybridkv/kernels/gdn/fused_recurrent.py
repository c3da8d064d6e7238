"""Token-by-token gated delta rule: FLA-style fused recurrent, and the shared step of every decode kernel.

Fused recurrent: q, k `[B, T, H, K]`, v `[B, T, HV, V]`, g and beta `[B, T, HV]` (either may be absent), states
`[N, HV, K, V]` (`[N, HV, V, K]` V-first); `naive.recurrent_reference` is its oracle. A program owns a [BV, K] tile
of one (sequence, value head) state in fp32 registers and walks that sequence's tokens. The same kernel, with slots,
is the decode tuner's tile candidate and its fallback under CUDA-graph capture (`decode`). The jit helpers here
(`_delta_rule_step`, `_head_inputs`) are shared by the decode kernels so that all agree bit for bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _l2norm(x):
    return x * tl.rsqrt(tl.sum(x * x, 0) + 1e-6)


@triton.jit
def _softplus(x, softplus_beta, softplus_threshold):
    bx = softplus_beta * x
    return tl.where(bx <= softplus_threshold, tl.log(1.0 + tl.exp(bx)) / softplus_beta, x)


@triton.jit
def _delta_rule_step(b_s, b_q, b_k, b_v, b_beta, scale):
    """One token on a decayed fp32 [BV, K] tile: (output row, updated tile). Shared with the TMA decode walk
    (`decode_tma`), so the two kernels agree bit for bit."""
    # Both reductions read the decayed state, so they run side by side; S_new q = S q + delta (k.q).
    pred = tl.sum(b_s * b_k[None, :], 1)
    b_sq = tl.sum(b_s * b_q[None, :], 1)
    delta = b_beta * (b_v - pred)
    b_o = (b_sq + delta * tl.sum(b_k * b_q, 0)) * scale
    return b_o, b_s + delta[:, None] * b_k[None, :]


@triton.jit
def _head_loads(q, k, a, b, A_log, dt_bias, i_n, i_h, i_hv, i_nh, o_k, H: tl.constexpr, K: tl.constexpr):
    """The raw values `_head_math` turns into one (sequence i_n, value head i_hv) step's inputs: q and k of its key head
    i_h, a, dt_bias, A_log and b. Apart from the math so that a kernel can request them before it waits for anything."""
    r_q = tl.load(q + (i_n * H + i_h) * K + o_k)
    r_k = tl.load(k + (i_n * H + i_h) * K + o_k)
    return r_q, r_k, tl.load(a + i_nh), tl.load(dt_bias + i_hv), tl.load(A_log + i_hv), tl.load(b + i_nh)


@triton.jit
def _head_math(r_q, r_k, r_a, r_dt, r_A, r_b, softplus_beta, softplus_threshold, L2NORM: tl.constexpr):
    """fp32 q and k (l2-normed with L2NORM), the decay e^g with g = -exp(A_log) softplus(a + dt_bias), and
    beta = sigmoid(b), from `_head_loads`' values."""
    f_q = r_q.to(tl.float32)
    f_k = r_k.to(tl.float32)
    if L2NORM:
        f_q = _l2norm(f_q)
        f_k = _l2norm(f_k)
    x = r_a.to(tl.float32) + r_dt.to(tl.float32)
    decay = tl.exp(-tl.exp(r_A.to(tl.float32)) * _softplus(x, softplus_beta, softplus_threshold))
    beta = tl.sigmoid(r_b.to(tl.float32))
    return f_q, f_k, decay, beta


@triton.jit
def _head_inputs(q, k, a, b, A_log, dt_bias, i_n, i_h, i_hv, i_nh, o_k, softplus_beta, softplus_threshold,
                 H: tl.constexpr, K: tl.constexpr, L2NORM: tl.constexpr):
    """What one (sequence i_n, value head i_hv) step needs besides its state and v rows, as fp32 (`_head_math` of
    `_head_loads`). Shared by the row-looped kernels (`decode_rows`, `decode_prefetch`), so they agree bit
    for bit."""
    r_q, r_k, r_a, r_dt, r_A, r_b = _head_loads(q, k, a, b, A_log, dt_bias, i_n, i_h, i_hv, i_nh, o_k, H, K)
    return _head_math(r_q, r_k, r_a, r_dt, r_A, r_b, softplus_beta, softplus_threshold, L2NORM)


@triton.jit
def _recurrent_kernel(q, k, v, g, beta, a, b, A_log, dt_bias, o, state, state_out, state_indices, cu_seqlens,
                      scale, T, stride_slot, stride_head, softplus_beta, softplus_threshold, H, HV,
                      K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr,
                      BV: tl.constexpr, HAS_G: tl.constexpr, HAS_BETA: tl.constexpr, GATE_IN_KERNEL: tl.constexpr,
                      L2NORM: tl.constexpr, IS_VARLEN: tl.constexpr, HAS_STATE: tl.constexpr,
                      STORE_STATE: tl.constexpr, USE_SLOTS: tl.constexpr, V_FIRST: tl.constexpr,
                      EVEN: tl.constexpr, STREAM: tl.constexpr = False):
    """The gated delta rule over one sequence's tokens for one [BV, K] state tile: grid
    (cdiv(V, BV) * N * HV,). Per token, with S `[K, V]`: S = e^g S, S = S + k (beta (v - S^T k))^T,
    o = scale S^T q (q and k l2-normed first with L2NORM).

    USE_SLOTS (decode): the state is read from and written back to slot state_indices[n] of the pool
    (-1: pool untouched, output zero); otherwise it comes from ``state`` (if HAS_STATE) and goes to
    ``state_out``. GATE_IN_KERNEL: g = -exp(A_log) softplus(a + dt_bias), beta = sigmoid(b)."""
    # One grid axis, V blocks fastest (the order a 2-D grid would run them in): a second axis stops at 65535, which
    # N * HV passes at 1,025 sequences of 64 value heads.
    NV: tl.constexpr = (V + BV - 1) // BV
    pid = tl.program_id(0)
    i_v, i_nh = pid % NV, pid // NV
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
        # Without an initial state (or a final one) that pointer is None: address only what the call passes.
        if HAS_STATE:
            p_s = state + i_nh.to(tl.int64) * K * V + o_s
        if STORE_STATE:
            p_s_out = state_out + i_nh.to(tl.int64) * K * V + o_s
    b_s = tl.zeros([BV, BK], dtype=tl.float32)
    if HAS_STATE:
        # EVEN: the tile covers K and V exactly; unmasked, the state moves in full-width vectors.
        if EVEN and USE_SLOTS:
            # STREAM: each slot is read once and written once; keep it out of the way of q, k, v in L2.
            b_s = tl.load(p_s, mask=live, other=0.0, eviction_policy="evict_first" if STREAM else "").to(tl.float32)
        elif EVEN:
            b_s = tl.load(p_s).to(tl.float32)
        else:
            b_s = tl.load(p_s, mask=m_s & live, other=0.0).to(tl.float32)

    if GATE_IN_KERNEL:
        neg_a = -tl.exp(tl.load(A_log + i_hv).to(tl.float32))
        bias = tl.load(dt_bias + i_hv).to(tl.float32)
    for t in range(bos, eos):
        b_q = tl.load(q + (t * H + i_h) * K + o_k, mask=m_k, other=0.0).to(tl.float32)
        b_k = tl.load(k + (t * H + i_h) * K + o_k, mask=m_k, other=0.0).to(tl.float32)
        b_v = tl.load(v + (t * HV + i_hv) * V + o_v, mask=m_v, other=0.0).to(tl.float32)
        if L2NORM:
            b_q = _l2norm(b_q)
            b_k = _l2norm(b_k)
        if GATE_IN_KERNEL:
            x = tl.load(a + t * HV + i_hv).to(tl.float32) + bias
            b_s = b_s * tl.exp(neg_a * _softplus(x, softplus_beta, softplus_threshold))
            b_beta = tl.sigmoid(tl.load(b + t * HV + i_hv).to(tl.float32))
        else:
            if HAS_G:
                b_s = b_s * tl.exp(tl.load(g + t * HV + i_hv).to(tl.float32))
            if HAS_BETA:
                b_beta = tl.load(beta + t * HV + i_hv).to(tl.float32)
            else:
                b_beta = 1.0
        b_o, b_s = _delta_rule_step(b_s, b_q, b_k, b_v, b_beta, scale)
        b_o = tl.where(live, b_o, 0.0)
        tl.store(o + (t * HV + i_hv) * V + o_v, b_o.to(o.dtype.element_ty), mask=m_v)
    if STORE_STATE:
        if EVEN and USE_SLOTS:
            tl.store(p_s_out, b_s.to(p_s_out.dtype.element_ty), mask=live, cache_modifier=".cs" if STREAM else "")
        elif EVEN:
            tl.store(p_s_out, b_s.to(p_s_out.dtype.element_ty))
        else:
            tl.store(p_s_out, b_s.to(p_s_out.dtype.element_ty), mask=m_s & live)


def _block_v(V: int) -> int:
    return min(32, triton.next_power_of_2(V))


def fused_recurrent_fwd(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens,
                        use_qk_l2norm_in_kernel, state_v_first):
    """o `[B, T, HV, V]` and the fp32 final state (None unless asked) of
    `api.fused_recurrent_gated_delta_rule`, whose arguments these are (validated there)."""
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
    grid = (triton.cdiv(V, BV) * N * HV,)
    _recurrent_kernel[grid](
        q, k, v, g, beta, None, None, None, None, o, h0, final, None, cu_seqlens, scale, T, 0, 0, 1.0, 20.0, H, HV,
        K=K, V=V, BK=triton.next_power_of_2(K), BV=BV, HAS_G=g is not None,
        HAS_BETA=beta is not None, GATE_IN_KERNEL=False, L2NORM=use_qk_l2norm_in_kernel,
        IS_VARLEN=cu_seqlens is not None, HAS_STATE=h0 is not None, STORE_STATE=final is not None,
        USE_SLOTS=False, V_FIRST=state_v_first, EVEN=False, num_warps=4,
    )
    return o, final


