"""The parallel half of the Triton chunked forward: per (chunk, value head), what does not depend on the
state. Its oracle is `reference.chunk_reference` (through `triton_chunk`, which launches it).

T = (I + L)^-1 of L = the decayed, beta-scaled, strictly lower K K^T of a 64-token chunk, in 16x16
blocks: the four diagonal blocks together (`_inv_unit_lower16x4`), the six below by block forward
substitution. Beside it, the row scales that fold the l2 norms, beta and the decays into the state
kernel's GEMM epilogues. T goes to chunk-aligned scratch in bf16 (128 B per token and value head), the
row scales in fp32 (32 B).

Measured on one H200 (35B 4x8192, kernel alone): 531 us with the defaults below; 596 with ieee
substitution; 1,964 for the first version (inverse and the scores in one four-warp kernel, the four
diagonal blocks inverted one after another).
"""

from __future__ import annotations

import triton
import triton.language as tl

BT = 64
_NROW = 8  # row scales per token: sq, sk, sd, beta, gamma (cumulative log decay), scale rq, rk, unused
_R_STRIDE = tl.constexpr(_NROW * BT)  # floats of row scales per (chunk, value head)
# The inverse kernel's method, precision and warps, picked on the H200 (see _inv_unit_lower16x4 and
# the module docstring).
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
def _chunk_inverse_kernel(q, k, g, beta, A, R, G, cu_seqlens, chunk_table, row0, c_lo, c_hi, scale, H, HV,
                          K: tl.constexpr, BK: tl.constexpr, L2NORM: tl.constexpr, METHOD: tl.constexpr,
                          PREC: tl.constexpr, SEGMENTED: tl.constexpr):
    """T = (I + L)^-1 of one (chunk, value head): the four 16x16 diagonal blocks together
    (`_inv_unit_lower16x4`), the blocks below by block forward substitution,
    T_ij = -T_ii sum_{j <= m < i} L_im T_mj; and the chunk's row scales.

    Launched with two warps: the substitution reduces across rows, and with four warps those
    reductions cross warps (measured 1.5x slower on the H200; one warp spills registers).
    SEGMENTED (a segment of a pipelined call): rows row0 on, and only the chunks c_lo <= i < c_hi of
    each sequence; otherwise every row, with the grid and code measured before segments existed.
    """
    i_c, i_hv = tl.program_id(0), tl.program_id(1)
    if SEGMENTED:
        i_c += row0
    i_n = tl.load(chunk_table + 2 * i_c)
    if i_n < 0:  # past the last chunk: the table is sized by an upper bound (no host sync)
        return
    i_t = tl.load(chunk_table + 2 * i_c + 1)
    if SEGMENTED:
        if (i_t < c_lo) | (i_t >= c_hi):
            return
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


