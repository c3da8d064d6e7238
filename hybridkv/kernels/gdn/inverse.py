"""The parallel half of the chunked forward: per (chunk, value head), everything that does not depend on the state.

T = (I + L)^-1 of L = the decayed, beta-scaled, strictly lower K K^T of a 64-token chunk, in 16x16 blocks: the four
diagonal blocks together by forward substitution (`_inv_unit_lower16x4`), the six below by block forward
substitution. Beside it, the row scales that fold the l2 norms, beta and the decays into the state kernel's GEMM
epilogues. Outputs, NC chunk rows: A = T `[NC, HV, 64, 64]` (bf16, fp32 for fp32 inputs), R = row scales
`[NC, HV, 8, 64]` fp32, G = e^g_last `[NC, HV]` fp32. `naive.chunk_reference` is the oracle (through `chunk`).

- One program takes every value head of a group that shares a key head (`InverseConfig.group`): the raw gram and
  the q and k norms depend on the key head only, so they are made once per group.
- The gram is accumulated BKC columns of k at a time, so the whole 64 x K block of k never sits in registers.
- Numerics are FLA's: fp32 forward substitution on the diagonal blocks, tf32 for the blocks below (all-tf32 turns
  NaN on the worst case, every key of a chunk the same with beta = 1).
- The forward substitution is built transposed (see `_inv_unit_lower16x4`), which keeps every step in the layout a
  reduction leaves it in.

On Hopper the Gluon kernel (`gluon.inverse`) computes the same outputs faster and is the default (`default_inverse`).
"""

from __future__ import annotations

from dataclasses import dataclass

import triton
import triton.language as tl

from hybridkv.kernels.gdn import pdl as _pdl
from hybridkv.kernels.gdn.chunk_rows import _masked_scores, _sequence, _table_row

BT = 64
_NROW = 8  # row scales per token: sq, sk, sd, beta, gamma (cumulative log decay), scale rq, rk, unused
_R_STRIDE = tl.constexpr(_NROW * BT)  # floats of row scales per (chunk, value head)


@dataclass(frozen=True, kw_only=True)
class InverseConfig:
    """Which inverse kernel a call launches: the Triton one, or (``gluon``) `gluon.inverse` on Hopper, which also
    makes the scores form's masked scores. ``group``: value heads per program, at most this many (a divisor of
    HV / H is used)."""

    group: int = 4
    gluon: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.group, int) or self.group < 1:
            raise ValueError(f"InverseConfig.group must be an int >= 1, got {self.group!r}")
        if not isinstance(self.gluon, bool):
            raise ValueError(f"InverseConfig.gluon must be a bool, got {self.gluon!r}")

    def group_for(self, H: int, HV: int) -> int:
        """The largest divisor of HV / H that is at most ``group``."""
        per = HV // H
        return max(d for d in range(1, min(self.group, per) + 1) if per % d == 0)


# The Triton kernel's launch: 64 columns of k per gram step (fewer, larger gram GEMMs), two warps, one stage, tf32
# products for the blocks below the diagonal.
BKC = 64
WARPS = 2
MERGE_PREC = "tf32"
INVERSE_CONFIG = InverseConfig()
GLUON_INVERSE_CONFIG = InverseConfig(gluon=True)


def default_inverse(device_type: str, capability: tuple[int, int] | None, dtype: str, K: int, *,
                    gluon_ready: bool = True) -> InverseConfig:
    """The inverse a call gets: the Gluon kernel on a Hopper GPU (sm_90) for 16-bit q and k with a head size that is
    a multiple of 32 up to 256 (what it was written for); the Triton kernel everywhere else (CPU interpreter, fp32,
    other GPUs, other head sizes). ``dtype``: q's, as ``str(torch dtype)``; ``capability``: the device's (major,
    minor), None off a GPU; ``gluon_ready``: this Triton's Gluon has what the kernel uses (`chunk.gluon_ready`)."""
    if (gluon_ready and device_type == "cuda" and capability is not None and capability[0] == 9
            and dtype in ("torch.bfloat16", "torch.float16") and K % 32 == 0 and K <= 256):
        return GLUON_INVERSE_CONFIG
    return INVERSE_CONFIG


@triton.jit
def _inv_unit_lower16x4(L):
    """(I + L)^-1 for four strictly lower 16x16 blocks at once ([4, 16, 16]), by forward substitution.

    Step i reads row i of L and the rows < i of T; batching the four blocks runs the 15 dependent steps once instead
    of four times. It builds T transposed: row i of T is column i of T^T, so row i of L (a reduction over L's rows)
    multiplies T^T's columns in the layout it comes out of the reduction in. Built as T, that row would have to move
    to the other slice layout first: a shared-memory round trip with barriers in each of the 15 steps.
    """
    r = tl.arange(0, 16)
    rows = r[None, :, None]
    t_t = tl.where(rows == r[None, None, :], 1.0, 0.0) + tl.zeros_like(L)
    cols = r[None, None, :]
    for i in tl.static_range(1, 16):
        l_row = tl.sum(tl.where(rows == i, L, 0.0), 1)
        corr = tl.sum(l_row[:, None, :] * t_t, 2)
        t_t = tl.where(cols == i, t_t - corr[:, :, None], t_t)
    return tl.permute(t_t, (0, 2, 1))


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
def _sub_rows(x, bos, T, i_h, row0, i_k, H, K: tl.constexpr, BKC: tl.constexpr):
    """Columns [i_k BKC, (i_k + 1) BKC) of one 16-token sub-block of q or k (zero past the ends)."""
    p = tl.make_block_ptr(x + (bos * H + i_h) * K, (T, K), (H * K, 1), (row0, i_k * BKC), (16, BKC), (1, 0))
    return tl.load(p, boundary_check=(0, 1), padding_option="zero")


@triton.jit
def _gates(g, beta, bos, T, i_hv, row0, HV):
    """g and beta of one 16-token sub-block, fp32, zero past the end."""
    o_t = row0 + tl.arange(0, 16)
    m_t = o_t < T
    b_g = tl.load(g + (bos + o_t) * HV + i_hv, mask=m_t, other=0.0).to(tl.float32)
    b_b = tl.load(beta + (bos + o_t) * HV + i_hv, mask=m_t, other=0.0).to(tl.float32)
    return b_g, b_b


@triton.jit
def _lower_block(gram, ci, cj, bi, ri, rj, DIAG: tl.constexpr):
    """L_ij = beta_i e^(gamma_i - gamma_j) k_i . k_j / (|k_i| |k_j|) from the raw gram block, strictly
    lower when i == j."""
    d = ci[:, None] - cj[None, :]
    a = gram * (bi * ri)[:, None] * rj[None, :]
    if DIAG:
        r = tl.arange(0, 16)
        keep = r[:, None] > r[None, :]
        return tl.where(keep, tl.exp(tl.where(keep, d, 0.0)) * a, 0.0)
    return tl.exp(d) * a


@triton.jit
def _store16(p, x, row0: tl.constexpr, col0: tl.constexpr):
    r = tl.arange(0, 16)
    tl.store(p + (row0 + r)[:, None] * 64 + (col0 + r)[None, :], x.to(p.dtype.element_ty))


@triton.jit
def _store_rows(R, T, row0, sub: tl.constexpr, c, g_last, b, rq, rk, scale):
    """The state kernel's row scales for one 16-token sub-block (zero past the end)."""
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
def _merge_blocks(t00, t11, t22, t33, l10, l20, l21, l30, l31, l32, MPREC: tl.constexpr):
    """The blocks of T below its diagonal by block forward substitution, T_ij = -T_ii sum_{j <= m < i} L_im T_mj,
    from the inverted diagonal blocks and L's blocks below it: (t10, t20, t21, t30, t31, t32). [16, 16] blocks,
    """
    t10 = -tl.dot(t11, tl.dot(l10, t00, input_precision=MPREC), input_precision=MPREC)
    t21 = -tl.dot(t22, tl.dot(l21, t11, input_precision=MPREC), input_precision=MPREC)
    t32 = -tl.dot(t33, tl.dot(l32, t22, input_precision=MPREC), input_precision=MPREC)
    t20 = -tl.dot(t22, tl.dot(l20, t00, input_precision=MPREC) + tl.dot(l21, t10, input_precision=MPREC),
                  input_precision=MPREC)
    t31 = -tl.dot(t33, tl.dot(l31, t11, input_precision=MPREC) + tl.dot(l32, t21, input_precision=MPREC),
                  input_precision=MPREC)
    t30 = -tl.dot(t33, tl.dot(l30, t00, input_precision=MPREC) + tl.dot(l31, t10, input_precision=MPREC)
                  + tl.dot(l32, t20, input_precision=MPREC), input_precision=MPREC)
    return t10, t20, t21, t30, t31, t32


@triton.jit
def _gram_and_norms(q, k, bos, T, i_h, r0, H, K: tl.constexpr, BK: tl.constexpr, BKC: tl.constexpr,
                    L2NORM: tl.constexpr):
    """The key head's part of a chunk's inverse, shared by its value heads: the lower blocks of the raw gram
    K K^T (16 x 16: a00, a10, a11, .., a33), accumulated BKC columns of k at a time, and the reciprocal l2 norms
    of k's and q's rows per 16-token sub-block (ones without L2NORM)."""
    z = tl.zeros([16, 16], dtype=tl.float32)
    a00, a10, a11, a20, a21, a22, a30, a31, a32, a33 = z, z, z, z, z, z, z, z, z, z
    zr = tl.zeros([16], dtype=tl.float32)
    sk0, sk1, sk2, sk3, sq0, sq1, sq2, sq3 = zr, zr, zr, zr, zr, zr, zr, zr
    for i_k in tl.static_range(BK // BKC):
        k0 = _sub_rows(k, bos, T, i_h, r0, i_k, H, K, BKC)
        k1 = _sub_rows(k, bos, T, i_h, r0 + 16, i_k, H, K, BKC)
        k2 = _sub_rows(k, bos, T, i_h, r0 + 32, i_k, H, K, BKC)
        k3 = _sub_rows(k, bos, T, i_h, r0 + 48, i_k, H, K, BKC)
        a00 = tl.dot(k0, tl.trans(k0), a00)
        a10 = tl.dot(k1, tl.trans(k0), a10)
        a11 = tl.dot(k1, tl.trans(k1), a11)
        a20 = tl.dot(k2, tl.trans(k0), a20)
        a21 = tl.dot(k2, tl.trans(k1), a21)
        a22 = tl.dot(k2, tl.trans(k2), a22)
        a30 = tl.dot(k3, tl.trans(k0), a30)
        a31 = tl.dot(k3, tl.trans(k1), a31)
        a32 = tl.dot(k3, tl.trans(k2), a32)
        a33 = tl.dot(k3, tl.trans(k3), a33)
        if L2NORM:
            sk0 += tl.sum(k0.to(tl.float32) * k0.to(tl.float32), 1)
            sk1 += tl.sum(k1.to(tl.float32) * k1.to(tl.float32), 1)
            sk2 += tl.sum(k2.to(tl.float32) * k2.to(tl.float32), 1)
            sk3 += tl.sum(k3.to(tl.float32) * k3.to(tl.float32), 1)
            q0 = _sub_rows(q, bos, T, i_h, r0, i_k, H, K, BKC).to(tl.float32)
            q1 = _sub_rows(q, bos, T, i_h, r0 + 16, i_k, H, K, BKC).to(tl.float32)
            q2 = _sub_rows(q, bos, T, i_h, r0 + 32, i_k, H, K, BKC).to(tl.float32)
            q3 = _sub_rows(q, bos, T, i_h, r0 + 48, i_k, H, K, BKC).to(tl.float32)
            sq0 += tl.sum(q0 * q0, 1)
            sq1 += tl.sum(q1 * q1, 1)
            sq2 += tl.sum(q2 * q2, 1)
            sq3 += tl.sum(q3 * q3, 1)
    if L2NORM:
        rk0, rk1, rk2, rk3 = tl.rsqrt(sk0 + 1e-6), tl.rsqrt(sk1 + 1e-6), tl.rsqrt(sk2 + 1e-6), tl.rsqrt(sk3 + 1e-6)
        rq0, rq1, rq2, rq3 = tl.rsqrt(sq0 + 1e-6), tl.rsqrt(sq1 + 1e-6), tl.rsqrt(sq2 + 1e-6), tl.rsqrt(sq3 + 1e-6)
    else:
        one = tl.full([16], 1.0, dtype=tl.float32)
        rk0, rk1, rk2, rk3, rq0, rq1, rq2, rq3 = one, one, one, one, one, one, one, one
    return a00, a10, a11, a20, a21, a22, a30, a31, a32, a33, rk0, rk1, rk2, rk3, rq0, rq1, rq2, rq3


@triton.jit
def _chunk_inverse_kernel(q, k, g, beta, A, R, G, cu_seqlens, chunk_table, row0, c_lo, c_hi, scale, H, HV,
                          K: tl.constexpr, BK: tl.constexpr, BKC: tl.constexpr, GROUP: tl.constexpr,
                          L2NORM: tl.constexpr, MPREC: tl.constexpr, SEGMENTED: tl.constexpr):
    """T = (I + L)^-1 of one chunk for GROUP value heads of one key head: the four 16x16 diagonal blocks
    together (`_inv_unit_lower16x4`), the blocks below by block forward substitution,
    T_ij = -T_ii sum_{j <= m < i} L_im T_mj; and the chunk's row scales. Grid (chunk rows, HV // GROUP).

    Reads q, k `[B, T, H, K]` and g, beta `[B, T, HV]`; writes A `[NC, HV, 64, 64]`, R `[NC, HV, 8, 64]`
    and G `[NC, HV]` at the chunk's row. The raw gram K K^T and the q and k norms depend on the key head
    only: made once, BKC columns at a time (the whole 64 x K block of k never sits in registers), then
    every value head of the group scales its own copy by beta and the decays.
    SEGMENTED (a segment of a pipelined call): rows row0 on, and only the chunks c_lo <= i < c_hi of
    each sequence; otherwise every row.
    """
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

    z = tl.zeros([16, 16], dtype=tl.float32)
    for j in range(GROUP):
        i_hv = hv0 + j
        g0, b0 = _gates(g, beta, bos, T, i_hv, r0, HV)
        g1, b1 = _gates(g, beta, bos, T, i_hv, r0 + 16, HV)
        g2, b2 = _gates(g, beta, bos, T, i_hv, r0 + 32, HV)
        g3, b3 = _gates(g, beta, bos, T, i_hv, r0 + 48, HV)
        s0, s1, s2 = tl.sum(g0, 0), tl.sum(g1, 0), tl.sum(g2, 0)
        c0 = tl.cumsum(g0, 0)
        c1 = tl.cumsum(g1, 0) + s0
        c2 = tl.cumsum(g2, 0) + (s0 + s1)
        c3 = tl.cumsum(g3, 0) + (s0 + s1 + s2)
        g_last = s0 + s1 + s2 + tl.sum(g3, 0)

        i_ch = i_c.to(tl.int64) * HV + i_hv
        p_r = R + i_ch * _R_STRIDE
        _store_rows(p_r, T, r0, 0, c0, g_last, b0, rq0, rk0, scale)
        _store_rows(p_r, T, r0 + 16, 1, c1, g_last, b1, rq1, rk1, scale)
        _store_rows(p_r, T, r0 + 32, 2, c2, g_last, b2, rq2, rk2, scale)
        _store_rows(p_r, T, r0 + 48, 3, c3, g_last, b3, rq3, rk3, scale)
        tl.store(G + i_ch, tl.exp(g_last))

        l10 = _lower_block(a10, c1, c0, b1, rk1, rk0, False)
        l20 = _lower_block(a20, c2, c0, b2, rk2, rk0, False)
        l21 = _lower_block(a21, c2, c1, b2, rk2, rk1, False)
        l30 = _lower_block(a30, c3, c0, b3, rk3, rk0, False)
        l31 = _lower_block(a31, c3, c1, b3, rk3, rk1, False)
        l32 = _lower_block(a32, c3, c2, b3, rk3, rk2, False)
        t00, t11, t22, t33 = _unstack4(_inv_unit_lower16x4(_stack4(
            _lower_block(a00, c0, c0, b0, rk0, rk0, True), _lower_block(a11, c1, c1, b1, rk1, rk1, True),
            _lower_block(a22, c2, c2, b2, rk2, rk2, True), _lower_block(a33, c3, c3, b3, rk3, rk3, True))))
        t10, t20, t21, t30, t31, t32 = _merge_blocks(t00, t11, t22, t33, l10, l20, l21, l30, l31, l32, MPREC)

        p = A + i_ch * 4096
        _store16(p, t00, 0, 0)
        _store16(p, z, 0, 16)
        _store16(p, z, 0, 32)
        _store16(p, z, 0, 48)
        _store16(p, t10, 16, 0)
        _store16(p, t11, 16, 16)
        _store16(p, z, 16, 32)
        _store16(p, z, 16, 48)
        _store16(p, t20, 32, 0)
        _store16(p, t21, 32, 16)
        _store16(p, t22, 32, 32)
        _store16(p, z, 32, 48)
        _store16(p, t30, 48, 0)
        _store16(p, t31, 48, 16)
        _store16(p, t32, 48, 32)
        _store16(p, t33, 48, 48)


# Warps of the scores kernel. It moves q, k and P at well under copy bandwidth (bound by load latency, not
# bytes), and eight warps keep more loads in flight per program than four.
SCORES_WARPS = 8


@triton.jit
def _chunk_scores_kernel(q, k, R, P, cu_seqlens, chunk_table, row0, c_lo, c_hi, H, HV, K: tl.constexpr,
                         BK: tl.constexpr, GROUP: tl.constexpr, SEGMENTED: tl.constexpr, PDL: tl.constexpr = False):
    """The masked scores of one chunk for GROUP value heads of one key head (`chunk_plan.Form.SCORES`),
    from the row scales the inverse kernel left in R: the `_scores` the state kernel would run on its
    chain, q k^T made once for the group. Writes P `[NC, HV, 64, 64]` in k's dtype; grid (chunk rows,
    HV // GROUP). A kernel of its own rather than a part of the Triton inverse kernel: there, beside the gram's
    accumulators at two warps, its q k^T accumulators would spill (sm_90). The Gluon inverse makes P itself
    (its SCORES), so this kernel runs after the Triton inverse only. PDL: a programmatic
    dependent launch (`pdl`)."""
    _pdl.wait(PDL)
    i_c, i_g = tl.program_id(0), tl.program_id(1)
    i_c, i_n, i_t, live = _table_row(chunk_table, i_c, row0, c_lo, c_hi, SEGMENTED)
    if not live:
        return
    T, bos = _sequence(cu_seqlens, i_n)
    hv0 = i_g * GROUP
    i_h = hv0 // (HV // H)
    p_q = tl.make_block_ptr(q + (bos * H + i_h) * K, (T, K), (H * K, 1), (i_t * 64, 0), (64, BK), (1, 0))
    p_k = tl.make_block_ptr(k + (bos * H + i_h) * K, (T, K), (H * K, 1), (i_t * 64, 0), (64, BK), (1, 0))
    b_q = tl.load(p_q, boundary_check=(0, 1), padding_option="zero")
    b_k = tl.load(p_k, boundary_check=(0, 1), padding_option="zero")
    b_qk = tl.dot(b_q, tl.trans(b_k))
    o_i = tl.arange(0, 64)
    for j in range(GROUP):
        i_ch = i_c.to(tl.int64) * HV + hv0 + j
        p_r = R + i_ch * _R_STRIDE + o_i
        b_p = _masked_scores(b_qk, tl.load(p_r + 256), tl.load(p_r + 320), tl.load(p_r + 384), P.dtype.element_ty)
        tl.store(P + i_ch * 4096 + o_i[:, None] * 64 + o_i[None, :], b_p)
