"""Triton chunked gated delta rule (forward), two kernels; `reference.chunk_reference` is its oracle.

1. `_chunk_inverse_kernel`, parallel over (chunk, value head): what does not depend on the state.
   T = (I + L)^-1 of the decayed, beta-scaled K K^T (16x16 blocks: the four diagonal ones inverted
   together, block products below), and per-token row scales that fold the l2 norms, beta and the
   decays into the state kernel's GEMM epilogues. T goes to chunk-aligned scratch in bf16 (128 B per
   token and value head), the row scales in fp32 (32 B).
2. `_chunk_state_kernel`, sequential over the chunks of one (sequence, value head, V block) with the
   state in registers. Per chunk: K S and Q S, V' = T (beta V - sk K S), the masked, decayed Q K^T,
   O = sq Q S + P V', S = e^g_last S + K^T (sd V'). Raw q and k go straight into the GEMMs (shared
   by the value heads of a key head, so mostly L2 hits); no w, u, h, v_new or P in HBM.

Measured on one H200 (`hybridkv bench gdn --breakdown`, Triton 3.6): the first version's single prep
kernel (inverse and P together, four warps) took 1.6 ms of 2.2 at 35B 4x8192; its row-by-row
inverse reduced across warps 60 times per chunk. Taking GEMMs off the chain instead (a chain/output
split, FLA's W/U cut) was slower on every shape; that code is in git history (commit d3329ca).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BT = 64
_NROW = 8  # row scales per token: sq, sk, sd, beta, gamma (cumulative log decay), scale rq, rk, unused
_R_STRIDE = tl.constexpr(_NROW * BT)  # floats of row scales per (chunk, value head)
# The inverse kernel's method, precision and warps, picked on the H200 (see _inv_unit_lower16x4).
INVERSE_METHOD = 1
INVERSE_PRECISION = "tf32x3"
INVERSE_WARPS = 2


@triton.jit
def _inv_unit_lower16x4(L, METHOD: tl.constexpr, PREC: tl.constexpr):
    """(I + L)^-1 for four strictly lower 16x16 blocks at once ([4, 16, 16]).

    METHOD 0, forward substitution: step i reads row i of L and the rows < i of T; batching the four
    blocks runs the 15 dependent steps once instead of four times. METHOD 1, the nilpotent product
    (I - L)(I + L^2)(I + L^4)(I + L^8) (L^16 = 0): six batched GEMMs instead of 30 row reductions. Its
    terms grow to C(15, 7) = 6435 times the result when every k in a block is the same and beta = 1,
    so it needs fp32 products (ieee or tf32x3; tf32 alone would lose every digit there).
    """
    r = tl.arange(0, 16)
    rows = r[None, :, None]
    eye = tl.where(rows == r[None, None, :], 1.0, 0.0) + tl.zeros_like(L)
    if METHOD == 0:
        t = eye
        for i in tl.static_range(1, 16):
            l_row = tl.sum(tl.where(rows == i, L, 0.0), 1)
            corr = tl.sum(l_row[:, :, None] * t, 1)
            t = tl.where(rows == i, t - corr[:, None, :], t)
    else:
        l2 = tl.dot(L, L, input_precision=PREC)
        l4 = tl.dot(l2, l2, input_precision=PREC)
        l8 = tl.dot(l4, l4, input_precision=PREC)
        t = eye - L
        t = t + tl.dot(t, l2, input_precision=PREC)
        t = t + tl.dot(t, l4, input_precision=PREC)
        t = t + tl.dot(t, l8, input_precision=PREC)
    return t


@triton.jit
def _stack4(x0, x1, x2, x3):
    """Four [16, 16] tiles as one [4, 16, 16] (join stacks on a new last axis: index 2 i0 + i1)."""
    x = tl.join(tl.join(x0, x2), tl.join(x1, x3))
    return tl.permute(tl.reshape(x, (16, 16, 4)), (2, 0, 1))


@triton.jit
def _unstack4(x):
    y = tl.reshape(tl.permute(x, (1, 2, 0)), (16, 16, 2, 2))
    a, b = tl.split(y)
    x0, x2 = tl.split(a)
    x1, x3 = tl.split(b)
    return x0, x1, x2, x3


@triton.jit
def _load_sub(k, g, beta, bos, T, i_h, i_hv, row0, H, HV, K: tl.constexpr,
              BK: tl.constexpr, L2NORM: tl.constexpr):
    """One 16-token sub-block: k [16, BK] (l2-normalised if asked) in k's dtype, its inverse row norms,
    g and beta [16] fp32 (zero past the end)."""
    p_k = tl.make_block_ptr(k + (bos * H + i_h) * K, (T, K), (H * K, 1), (row0, 0), (16, BK), (1, 0))
    b_k = tl.load(p_k, boundary_check=(0, 1), padding_option="zero")
    if L2NORM:
        kf = b_k.to(tl.float32)
        rk = tl.rsqrt(tl.sum(kf * kf, 1) + 1e-6)
        b_k = (kf * rk[:, None]).to(b_k.dtype)
    else:
        rk = tl.full([16], 1.0, dtype=tl.float32)
    o_t = row0 + tl.arange(0, 16)
    m_t = o_t < T
    b_g = tl.load(g + (bos + o_t) * HV + i_hv, mask=m_t, other=0.0).to(tl.float32)
    b_b = tl.load(beta + (bos + o_t) * HV + i_hv, mask=m_t, other=0.0).to(tl.float32)
    return b_k, rk, b_g, b_b


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
def _store16(p, x, row0: tl.constexpr, col0: tl.constexpr):
    r = tl.arange(0, 16)
    tl.store(p + (row0 + r)[:, None] * 64 + (col0 + r)[None, :], x.to(p.dtype.element_ty))


@triton.jit
def _store_rows(q, R, bos, T, i_h, row0, sub: tl.constexpr, c, g_last, b, rk, scale, H,
                K: tl.constexpr, BK: tl.constexpr, L2NORM: tl.constexpr):
    """The state kernel's row scales for one 16-token sub-block (zero past the end)."""
    if L2NORM:
        p_q = tl.make_block_ptr(q + (bos * H + i_h) * K, (T, K), (H * K, 1), (row0, 0), (16, BK), (1, 0))
        qf = tl.load(p_q, boundary_check=(0, 1), padding_option="zero").to(tl.float32)
        rq = tl.rsqrt(tl.sum(qf * qf, 1) + 1e-6)
    else:
        rq = tl.full([16], 1.0, dtype=tl.float32)
    o = tl.arange(0, 16)
    live = row0 + o < T
    e_c = tl.exp(c)
    p_r = R + sub * 16 + o
    tl.store(p_r, tl.where(live, scale * e_c * rq, 0.0))
    tl.store(p_r + 64, tl.where(live, b * e_c * rk, 0.0))
    tl.store(p_r + 128, tl.where(live, tl.exp(g_last - c) * rk, 0.0))
    tl.store(p_r + 192, b)
    tl.store(p_r + 256, c)
    tl.store(p_r + 320, tl.where(live, scale * rq, 0.0))
    tl.store(p_r + 384, tl.where(live, rk, 0.0))


@triton.jit
def _chunk_inverse_kernel(q, k, g, beta, A, R, G, cu_seqlens, chunk_table, scale, H, HV, K: tl.constexpr,
                          BK: tl.constexpr, L2NORM: tl.constexpr, METHOD: tl.constexpr, PREC: tl.constexpr):
    """T = (I + L)^-1 of one (chunk, value head): the four 16x16 diagonal blocks together
    (`_inv_unit_lower16x4`), the blocks below by block forward substitution,
    T_ij = -T_ii sum_{j <= m < i} L_im T_mj; and the chunk's row scales.

    Launched with two warps: the substitution reduces across rows, and with four warps those
    reductions cross warps (measured 1.5x slower on the H200; one warp spills registers).
    """
    i_c, i_hv = tl.program_id(0), tl.program_id(1)
    i_n = tl.load(chunk_table + 2 * i_c)
    if i_n < 0:  # past the last chunk: the table is sized by an upper bound (no host sync)
        return
    i_t = tl.load(chunk_table + 2 * i_c + 1)
    start = tl.load(cu_seqlens + i_n)
    T = tl.load(cu_seqlens + i_n + 1) - start
    bos = start.to(tl.int64)
    i_h = i_hv // (HV // H)
    r0 = i_t * 64
    k0, rk0, g0, b0 = _load_sub(k, g, beta, bos, T, i_h, i_hv, r0, H, HV, K, BK, L2NORM)
    k1, rk1, g1, b1 = _load_sub(k, g, beta, bos, T, i_h, i_hv, r0 + 16, H, HV, K, BK, L2NORM)
    k2, rk2, g2, b2 = _load_sub(k, g, beta, bos, T, i_h, i_hv, r0 + 32, H, HV, K, BK, L2NORM)
    k3, rk3, g3, b3 = _load_sub(k, g, beta, bos, T, i_h, i_hv, r0 + 48, H, HV, K, BK, L2NORM)
    c0 = tl.cumsum(g0, 0)
    c1 = tl.cumsum(g1, 0) + tl.sum(g0, 0)
    c2 = tl.cumsum(g2, 0) + tl.sum(g0, 0) + tl.sum(g1, 0)
    c3 = tl.cumsum(g3, 0) + tl.sum(g0, 0) + tl.sum(g1, 0) + tl.sum(g2, 0)
    g_last = tl.sum(g0, 0) + tl.sum(g1, 0) + tl.sum(g2, 0) + tl.sum(g3, 0)

    i_ch = i_c.to(tl.int64) * HV + i_hv
    p_r = R + i_ch * _R_STRIDE
    _store_rows(q, p_r, bos, T, i_h, r0, 0, c0, g_last, b0, rk0, scale, H, K, BK, L2NORM)
    _store_rows(q, p_r, bos, T, i_h, r0 + 16, 1, c1, g_last, b1, rk1, scale, H, K, BK, L2NORM)
    _store_rows(q, p_r, bos, T, i_h, r0 + 32, 2, c2, g_last, b2, rk2, scale, H, K, BK, L2NORM)
    _store_rows(q, p_r, bos, T, i_h, r0 + 48, 3, c3, g_last, b3, rk3, scale, H, K, BK, L2NORM)
    tl.store(G + i_ch, tl.exp(g_last))

    # All ten blocks of L first, so k's registers are free before the substitution.
    l10 = _lower_block(k1, k0, c1, c0, b1, False)
    l20 = _lower_block(k2, k0, c2, c0, b2, False)
    l21 = _lower_block(k2, k1, c2, c1, b2, False)
    l30 = _lower_block(k3, k0, c3, c0, b3, False)
    l31 = _lower_block(k3, k1, c3, c1, b3, False)
    l32 = _lower_block(k3, k2, c3, c2, b3, False)
    t00, t11, t22, t33 = _unstack4(_inv_unit_lower16x4(_stack4(
        _lower_block(k0, k0, c0, c0, b0, True), _lower_block(k1, k1, c1, c1, b1, True),
        _lower_block(k2, k2, c2, c2, b2, True), _lower_block(k3, k3, c3, c3, b3, True)), METHOD, PREC))
    t10 = -tl.dot(t11, tl.dot(l10, t00, input_precision=PREC), input_precision=PREC)
    t21 = -tl.dot(t22, tl.dot(l21, t11, input_precision=PREC), input_precision=PREC)
    t32 = -tl.dot(t33, tl.dot(l32, t22, input_precision=PREC), input_precision=PREC)
    t20 = -tl.dot(t22, tl.dot(l20, t00, input_precision=PREC) + tl.dot(l21, t10, input_precision=PREC),
                  input_precision=PREC)
    t31 = -tl.dot(t33, tl.dot(l31, t11, input_precision=PREC) + tl.dot(l32, t21, input_precision=PREC),
                  input_precision=PREC)
    t30 = -tl.dot(t33, tl.dot(l30, t00, input_precision=PREC) + tl.dot(l31, t10, input_precision=PREC)
                  + tl.dot(l32, t20, input_precision=PREC), input_precision=PREC)

    p = A + i_ch * 4096
    zero = tl.zeros([16, 16], dtype=tl.float32)
    _store16(p, t00, 0, 0)
    _store16(p, zero, 0, 16)
    _store16(p, zero, 0, 32)
    _store16(p, zero, 0, 48)
    _store16(p, t10, 16, 0)
    _store16(p, t11, 16, 16)
    _store16(p, zero, 16, 32)
    _store16(p, zero, 16, 48)
    _store16(p, t20, 32, 0)
    _store16(p, t21, 32, 16)
    _store16(p, t22, 32, 32)
    _store16(p, zero, 32, 48)
    _store16(p, t30, 48, 0)
    _store16(p, t31, 48, 16)
    _store16(p, t32, 48, 32)
    _store16(p, t33, 48, 48)


@triton.jit
def _chunk_state_kernel(q, k, v, A, R, G, o, h0, ht, cu_seqlens, chunk_offsets, stride_sk, stride_sv,
                        H, HV, WORK_LOG2, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr,
                        BV: tl.constexpr, HAS_H0: tl.constexpr, STORE_FINAL: tl.constexpr):
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
    causal = o_i[:, None] >= o_i[None, :]
    for i_t in range(tl.cdiv(T, 64)):
        i_ch = (c_first + i_t) * HV + i_hv
        p_q = tl.make_block_ptr(q + (bos * H + i_h) * K, (T, K), (H * K, 1), (i_t * 64, 0), (64, BK), (1, 0))
        p_k = tl.make_block_ptr(k + (bos * H + i_h) * K, (T, K), (H * K, 1), (i_t * 64, 0), (64, BK), (1, 0))
        p_v = tl.make_block_ptr(v + (bos * HV + i_hv) * V, (T, V), (HV * V, 1), (i_t * 64, i_v * BV),
                                (64, BV), (1, 0))
        b_q = tl.load(p_q, boundary_check=(0, 1), padding_option="zero")
        b_k = tl.load(p_k, boundary_check=(0, 1), padding_option="zero")
        b_v = tl.load(p_v, boundary_check=(0, 1), padding_option="zero").to(tl.float32)
        b_a = tl.load(A + i_ch * 4096 + o_i[:, None] * 64 + o_i[None, :]).to(dt)
        p_r = R + i_ch * _R_STRIDE + o_i
        r_q = tl.load(p_r)
        r_k = tl.load(p_r + 64)
        r_d = tl.load(p_r + 128)
        r_b = tl.load(p_r + 192)
        r_c = tl.load(p_r + 256)
        r_qn = tl.load(p_r + 320)
        r_kn = tl.load(p_r + 384)
        e_last = tl.load(G + i_ch)

        # P = scale (q_i . k_j) rq_i rk_j e^(gamma_i - gamma_j), j <= i: raw q and k, norms in the epilogue.
        b_qk = tl.dot(b_q, tl.trans(b_k))
        decay = tl.exp(tl.where(causal, r_c[:, None] - r_c[None, :], 0.0))
        b_p = tl.where(causal, b_qk * decay * (r_qn[:, None] * r_kn[None, :]), 0.0).to(dt)

        b_sd = b_s.to(dt)
        b_ks = tl.dot(b_k, b_sd)
        b_qs = tl.dot(b_q, b_sd)
        b_y = (b_v * r_b[:, None] - b_ks * r_k[:, None]).to(dt)
        b_vn = tl.dot(b_a, b_y)
        b_o = b_qs * r_q[:, None] + tl.dot(b_p, b_vn.to(dt))
        p_o = tl.make_block_ptr(o + (bos * HV + i_hv) * V, (T, V), (HV * V, 1), (i_t * 64, i_v * BV),
                                (64, BV), (1, 0))
        tl.store(p_o, b_o.to(p_o.dtype.element_ty), boundary_check=(0, 1))
        b_s = b_s * e_last + tl.dot(tl.trans(b_k), (b_vn * r_d[:, None]).to(dt))

    if STORE_FINAL:
        p_ht = tl.make_block_ptr(ht + i_nh.to(tl.int64) * K * V, (K, V), (stride_sk, stride_sv), (0, i_v * BV),
                                 (BK, BV), (1, 0))
        tl.store(p_ht, b_s.to(p_ht.dtype.element_ty), boundary_check=(0, 1))


# (BV, num_warps, num_stages) of the state kernel. The kernel only writes o and the final state, so
# Triton's autotuner may rerun it freely. Narrow V blocks give a short single sequence more programs.
STATE_CONFIGS = ((64, 4, 2), (64, 8, 2), (64, 4, 1), (32, 4, 2), (128, 8, 2))


def _autotuned(kernel, configs, key):
    """``kernel`` autotuned over (BV, num_warps, num_stages) triples."""
    return triton.autotune(
        configs=[triton.Config({"BV": bv}, num_warps=w, num_stages=st) for bv, w, st in configs], key=key,
    )(kernel)


_chunk_state_tuned = _autotuned(_chunk_state_kernel, STATE_CONFIGS, ["H", "HV", "WORK_LOG2", "K", "V"])


def _chunk_tables(cu_seqlens: torch.Tensor | None, B: int, T: int, device: torch.device
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """(cu_seqlens, chunk table, chunk offsets, table rows), made on the device with no host sync.

    Reading the offsets on the host would wait for every kernel queued before this call (a stall of the
    whole stream per layer); instead the table gets an upper bound of rows, sum ceil(len / 64) <=
    (T + 63 N) // 64, and rows past the last chunk hold sequence -1 (their programs return at once).
    """
    if cu_seqlens is None:
        cu = torch.arange(B + 1, dtype=torch.int32, device=device) * T
        rows = B * triton.cdiv(T, BT)
    else:
        cu = cu_seqlens.to(device=device, dtype=torch.int32)
        rows = (T + (BT - 1) * (cu.numel() - 1)) // BT
    N = cu.numel() - 1
    counts = (cu[1:] - cu[:-1] + (BT - 1)) // BT
    offsets = torch.zeros(N + 1, dtype=torch.int32, device=device)
    torch.cumsum(counts, 0, out=offsets[1:])
    idx = torch.arange(rows, dtype=torch.int32, device=device)
    seq = torch.searchsorted(offsets[1:], idx, right=True).to(torch.int32)
    chunk = idx - offsets[seq.clamp(max=max(N - 1, 0))]
    table = torch.stack((torch.where(seq < N, seq, -1), chunk), 1).contiguous()
    return cu, table, offsets, rows


class _TableCache:
    """The last call's chunk tables: every GDN layer of a forward pass passes the same cu_seqlens, and
    rebuilding the tables costs ~10 small launches per layer. Keyed by the tensor object and its
    version counter (an in-place edit of cu_seqlens bumps it), as FLA's tensor_cache does by identity."""

    def __init__(self) -> None:
        self._key: tuple | None = None
        self._ref: torch.Tensor | None = None
        self._value: tuple | None = None

    def get(self, cu_seqlens: torch.Tensor | None, B: int, T: int, device: torch.device):
        key = (B, T, device, None if cu_seqlens is None else cu_seqlens._version)
        if self._value is not None and key == self._key and self._ref is cu_seqlens:
            return self._value
        value = _chunk_tables(cu_seqlens, B, T, device)
        self._key, self._ref, self._value = key, cu_seqlens, value
        return value


_tables = _TableCache()


def chunk_gated_delta_rule_fwd(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens,
                               use_qk_l2norm_in_kernel, state_v_first, config: tuple[int, int, int] | None = None):
    """``config``: a fixed (BV, num_warps, num_stages) for the state kernel instead of the autotuner."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    if K > 256 or V > 256:
        raise ValueError(f"head dims up to 256 are supported, got K={K}, V={V}")
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    cu, chunk_table, chunk_offsets, NC = _tables.get(cu_seqlens, B, T, q.device)
    N = cu.numel() - 1
    o = torch.empty_like(v)
    final = None
    if output_final_state:
        final = q.new_empty((N, HV, V, K) if state_v_first else (N, HV, K, V), dtype=torch.float32)
    if NC == 0:  # no tokens at all: the final state is the initial one
        if final is not None:
            final.copy_(initial_state if initial_state is not None else torch.zeros_like(final))
        return o, final
    sdt = torch.bfloat16 if q.dtype != torch.float32 else torch.float32
    A = q.new_empty((NC, HV, BT, BT), dtype=sdt)
    R = q.new_empty((NC, HV, _NROW, BT), dtype=torch.float32)
    G = q.new_empty((NC, HV), dtype=torch.float32)
    BK = triton.next_power_of_2(K)
    _chunk_inverse_kernel[(NC, HV)](q, k, g, beta, A, R, G, cu, chunk_table, scale, H, HV, K=K, BK=BK,
                                    L2NORM=use_qk_l2norm_in_kernel, METHOD=INVERSE_METHOD,
                                    PREC=INVERSE_PRECISION, num_warps=INVERSE_WARPS)
    h0 = initial_state.contiguous() if initial_state is not None else None
    # The state kernel indexes K rows and V columns; a V-first state is the transposed view.
    stride_sk, stride_sv = (1, K) if state_v_first else (V, 1)
    args = (q, k, v, A, R, G, o, h0, final, cu, chunk_offsets, stride_sk, stride_sv, H, HV,
            max(N * HV, 1).bit_length())
    flags = dict(K=K, V=V, BK=BK, HAS_H0=h0 is not None, STORE_FINAL=final is not None)
    if config is None:
        _chunk_state_tuned[lambda meta: (triton.cdiv(V, meta["BV"]), N * HV)](*args, **flags)
    else:
        bv, warps, stages = config
        _chunk_state_kernel[(triton.cdiv(V, bv), N * HV)](*args, **flags, BV=bv, num_warps=warps,
                                                           num_stages=stages)
    return o, final
