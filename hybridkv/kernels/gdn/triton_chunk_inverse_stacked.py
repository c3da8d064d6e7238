"""The inverse kernel with a group's value heads stacked (`InverseConfig.stacked`): the same outputs as
`triton_chunk_inverse._chunk_inverse_kernel` (A = T, R, G; its docstring has the layouts), with the GROUP
value heads of a program held side by side in `[GROUP, ...]` tensors instead of walked one after another.

Why: in a batch (397B 4x8192) the inverse is ~45% of the call, and it is bound by latency, not by bytes or
FLOPs: each value head runs 15 dependent substitution steps and 16 small merge GEMMs, and at 255 registers
only four two-warp programs fit on an SM, so little else runs while a step waits. Stacked, the 15 steps run
once for all 4 GROUP diagonal blocks of the chunk (`_inv_unit_lower16x4` on `[4 GROUP, 16, 16]`) and every
merge is one batched GEMM over the group, so a program has GROUP times the independent work per dependent
step. The numerics are the shipped kernel's (fp32 substitution, merges at MPREC): the same sums in the
same order per head, so the two agree to rounding.

The gram K K^T and the q and k norms are the key head's, as in the unstacked kernel; GROUP must be a power of
two (`InverseConfig.group_for` picks one). Warps: a batched 16 x 16 GEMM spreads its batch over the warps, so
at four warps and GROUP = 4 each warp owns one head; more warps than heads replicate the 16 x 16 tiles
instead of splitting them. Opt-in until the H200 says it is faster (tools/gdn/inverse_probe.py); offline
sm_90 (`hybridkv kernels report`'s compiler): 255 registers and 24 B spilled at four warps, no spill at eight.
"""

from __future__ import annotations

import triton
import triton.language as tl

from hybridkv.kernels.gdn.triton_chunk_inverse import (_R_STRIDE, _gram_and_norms, _inv_unit_lower16x4,
                                                       _merge_blocks)
from hybridkv.kernels.gdn.triton_chunk_rows import _sequence, _table_row


@triton.jit
def _gates_g(g, beta, bos, T, hv0, row0, HV, GROUP: tl.constexpr):
    """g and beta `[GROUP, 16]` of one 16-token sub-block for value heads hv0.., fp32, zero past the end."""
    o_t = row0 + tl.arange(0, 16)
    o_g = hv0 + tl.arange(0, GROUP)
    m = (o_t < T)[None, :] & (o_g < HV)[:, None]
    off = (bos + o_t)[None, :] * HV + o_g[:, None]
    return (tl.load(g + off, mask=m, other=0.0).to(tl.float32),
            tl.load(beta + off, mask=m, other=0.0).to(tl.float32))


@triton.jit
def _lower_g(gram, ci, cj, bi, ri, rj, DIAG: tl.constexpr):
    """`triton_chunk_inverse._lower_block` for a group: gram `[16, 16]` (the key head's), ci, cj, bi
    `[GROUP, 16]` (each head's decays and beta), ri, rj `[16]`; returns `[GROUP, 16, 16]`."""
    d = ci[:, :, None] - cj[:, None, :]
    a = gram[None, :, :] * (bi * ri[None, :])[:, :, None] * rj[None, None, :]
    if DIAG:
        r = tl.arange(0, 16)
        keep = (r[:, None] > r[None, :])[None, :, :]
        return tl.where(keep, tl.exp(tl.where(keep, d, 0.0)) * a, 0.0)
    return tl.exp(d) * a


@triton.jit
def _stack4g(x0, x1, x2, x3, G: tl.constexpr):
    """Four `[G, 16, 16]` as one `[4 G, 16, 16]`, head-major (index 4 head + block)."""
    x = tl.join(tl.join(x0, x2), tl.join(x1, x3))  # [G, 16, 16, 2, 2]: [..., i, j] is block 2 i + j
    x = tl.permute(tl.reshape(x, (G, 16, 16, 4)), (0, 3, 1, 2))
    return tl.reshape(x, (4 * G, 16, 16))


@triton.jit
def _unstack4g(x, G: tl.constexpr):
    y = tl.reshape(tl.permute(tl.reshape(x, (G, 4, 16, 16)), (0, 2, 3, 1)), (G, 16, 16, 2, 2))
    a, b = tl.split(y)
    x0, x2 = tl.split(a)
    x1, x3 = tl.split(b)
    return x0, x1, x2, x3


@triton.jit
def _store_rows_g(p_r, T, row0, sub: tl.constexpr, c, g_last, b, rq, rk, scale):
    """`triton_chunk_inverse._store_rows` for a group: p_r `[GROUP]` pointers to each head's row scales;
    c, b `[GROUP, 16]`, g_last `[GROUP]`, rq, rk `[16]`."""
    o = tl.arange(0, 16)
    live = (row0 + o < T)[None, :]
    e_c = tl.exp(c)
    p = p_r[:, None] + sub * 16 + o[None, :]
    tl.store(p, tl.where(live, scale * e_c * rq[None, :], 0.0))
    tl.store(p + 64, tl.where(live, b * e_c * rk[None, :], 0.0))
    tl.store(p + 128, tl.where(live, tl.exp(g_last[:, None] - c) * rk[None, :], 0.0))
    tl.store(p + 192, b)
    tl.store(p + 256, c)
    # Head-independent rows: tl.store broadcasts the [1, 16] value to every head's pointer.
    tl.store(p + 320, tl.where(live, scale * rq[None, :], 0.0))
    tl.store(p + 384, tl.where(live, rk[None, :], 0.0))


@triton.jit
def _store16g(p, x, row0: tl.constexpr, col0: tl.constexpr):
    """A `[GROUP, 16, 16]` block at (row0, col0) of each head's 64 x 64 T; p `[GROUP]` pointers."""
    r = tl.arange(0, 16)
    off = (row0 + r)[None, :, None] * 64 + (col0 + r)[None, None, :]
    tl.store(p[:, None, None] + off, x.to(p.dtype.element_ty))


@triton.jit
def _chunk_inverse_stacked_kernel(q, k, g, beta, A, R, G, cu_seqlens, chunk_table, row0, c_lo, c_hi, scale, H, HV,
                                  K: tl.constexpr, BK: tl.constexpr, BKC: tl.constexpr, GROUP: tl.constexpr,
                                  L2NORM: tl.constexpr, METHOD: tl.constexpr, PREC: tl.constexpr,
                                  MPREC: tl.constexpr, SEGMENTED: tl.constexpr):
    """`_chunk_inverse_kernel`'s outputs for GROUP value heads of one key head at once. Grid (chunk rows,
    HV // GROUP); arguments as there."""
    i_c, i_g = tl.program_id(0), tl.program_id(1)
    i_c, i_n, i_t, live = _table_row(chunk_table, i_c, row0, c_lo, c_hi, SEGMENTED)
    if not live:
        return
    T, bos = _sequence(cu_seqlens, i_n)
    hv0 = i_g * GROUP
    i_h = hv0 // (HV // H)
    r0 = i_t * 64

    (a00, a10, a11, a20, a21, a22, a30, a31, a32, a33,
     rk0, rk1, rk2, rk3, rq0, rq1, rq2, rq3) = _gram_and_norms(q, k, bos, T, i_h, r0, H, K, BK, BKC, L2NORM)

    g0, b0 = _gates_g(g, beta, bos, T, hv0, r0, HV, GROUP)
    g1, b1 = _gates_g(g, beta, bos, T, hv0, r0 + 16, HV, GROUP)
    g2, b2 = _gates_g(g, beta, bos, T, hv0, r0 + 32, HV, GROUP)
    g3, b3 = _gates_g(g, beta, bos, T, hv0, r0 + 48, HV, GROUP)
    s0, s1, s2 = tl.sum(g0, 1), tl.sum(g1, 1), tl.sum(g2, 1)
    c0 = tl.cumsum(g0, 1)
    c1 = tl.cumsum(g1, 1) + s0[:, None]
    c2 = tl.cumsum(g2, 1) + (s0 + s1)[:, None]
    c3 = tl.cumsum(g3, 1) + (s0 + s1 + s2)[:, None]
    g_last = s0 + s1 + s2 + tl.sum(g3, 1)

    i_ch = i_c.to(tl.int64) * HV + hv0 + tl.arange(0, GROUP)
    p_r = R + i_ch * _R_STRIDE
    _store_rows_g(p_r, T, r0, 0, c0, g_last, b0, rq0, rk0, scale)
    _store_rows_g(p_r, T, r0 + 16, 1, c1, g_last, b1, rq1, rk1, scale)
    _store_rows_g(p_r, T, r0 + 32, 2, c2, g_last, b2, rq2, rk2, scale)
    _store_rows_g(p_r, T, r0 + 48, 3, c3, g_last, b3, rq3, rk3, scale)
    tl.store(G + i_ch, tl.exp(g_last))

    l10 = _lower_g(a10, c1, c0, b1, rk1, rk0, False)
    l20 = _lower_g(a20, c2, c0, b2, rk2, rk0, False)
    l21 = _lower_g(a21, c2, c1, b2, rk2, rk1, False)
    l30 = _lower_g(a30, c3, c0, b3, rk3, rk0, False)
    l31 = _lower_g(a31, c3, c1, b3, rk3, rk1, False)
    l32 = _lower_g(a32, c3, c2, b3, rk3, rk2, False)
    t00, t11, t22, t33 = _unstack4g(_inv_unit_lower16x4(_stack4g(
        _lower_g(a00, c0, c0, b0, rk0, rk0, True), _lower_g(a11, c1, c1, b1, rk1, rk1, True),
        _lower_g(a22, c2, c2, b2, rk2, rk2, True), _lower_g(a33, c3, c3, b3, rk3, rk3, True), GROUP),
        METHOD, PREC), GROUP)
    t10, t20, t21, t30, t31, t32 = _merge_blocks(t00, t11, t22, t33, l10, l20, l21, l30, l31, l32, MPREC)

    p = A + i_ch * 4096
    zg = tl.zeros([GROUP, 16, 16], dtype=tl.float32)
    _store16g(p, t00, 0, 0)
    _store16g(p, zg, 0, 16)
    _store16g(p, zg, 0, 32)
    _store16g(p, zg, 0, 48)
    _store16g(p, t10, 16, 0)
    _store16g(p, t11, 16, 16)
    _store16g(p, zg, 16, 32)
    _store16g(p, zg, 16, 48)
    _store16g(p, t20, 32, 0)
    _store16g(p, t21, 32, 16)
    _store16g(p, t22, 32, 32)
    _store16g(p, zg, 32, 48)
    _store16g(p, t30, 48, 0)
    _store16g(p, t31, 48, 16)
    _store16g(p, t32, 48, 32)
    _store16g(p, t33, 48, 48)
