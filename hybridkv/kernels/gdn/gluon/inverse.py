"""The chunk inverse in Gluon for Hopper: `inverse._chunk_inverse_kernel`'s outputs (A = T, R, G) with the layouts
chosen by hand.

The Triton kernel's forward substitution picks row i of L out of registers with a masked reduction in each of its 15
steps, and Triton's layouts make both reductions cross lanes. Here nothing in the substitution crosses a thread: a
thread owns one column of one diagonal block of T (16 rows in registers), the row of L that each step multiplies in
is a broadcast read from shared memory (all 15 issued ahead, they do not depend on T), and a step is 16 FMAs and a
select. The rest is the Triton kernel's arithmetic: the raw gram K K^T on the tensor cores (16-bit in, fp32 out), the
l2 norms, beta and the decays on the gram's rows and columns, the blocks below the diagonal by block forward
substitution with tf32 products (FLA's numerics), the row scales. All of q and k is loaded before the gram's first
product (one wait for global memory per program), and with SCORES (the scores form) the masked scores P are made here
too, from the q and k already in shared memory, so no scores kernel reads them again. GROUP value heads of a key head
share one program (the gram and the norms are made once for them). Gluon has no CPU interpreter: checked on a GPU
against the Triton kernel.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

BT = gl.constexpr(64)
# The layouts below are written for two warps (the default launch): 64 threads, one per column of T's four diagonal
# blocks. At four (`InverseConfig.warps` 4) the tiles' work is split over twice the threads and the substitution's
# layouts are replicated over the extra warps: fewer registers a thread, the same shared memory.


@gluon.constexpr_function
def _ld(nw):
    """[64, 32] loads of q and k: 8 contiguous bf16 (16 bytes) per thread."""
    return gl.BlockedLayout([1, 8], [8, 4], [nw, 1], [1, 0])


@gluon.constexpr_function
def _b16(nw):
    """A 16 x 16 block of the masked scores, for `_store_scores`: 4 contiguous elements per thread, a warp 8 rows."""
    return gl.BlockedLayout([1, 4], [8, 4], [nw, 1], [1, 0])


@gluon.constexpr_function
def _mma(nw):
    """The 64 x 64 gram: mma.sync tiles, each warp 64 / nw rows."""
    return gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[nw, 1], instr_shape=[16, 8])


@gluon.constexpr_function
def _subst(nw):
    """[4 blocks, 16 rows m, 16 columns c] of T's diagonal blocks: thread (b, c) holds column c of block b."""
    return gl.BlockedLayout([1, 16, 1], [2, 1, 16], [nw, 1, 1], [2, 1, 0])


@gluon.constexpr_function
def _row(nw):
    """Row i of the four diagonal blocks side by side, [1, 64 (16 b + m)]: 16 contiguous elements per thread, those of
    the block b it substitutes in (lanes 0-15 read the same ones, broadcast); reshaped to [4, 16, 1] it is where
    `_subst` wants it (checked at compile)."""
    return gl.BlockedLayout([1, 16], [16, 2], [1, nw], [0, 1])


@gluon.constexpr_function
def _mma16(nw):
    """16 x 16 block products of the merge (tf32 mma.sync)."""
    return gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, nw], instr_shape=[16, 8])


@gluon.constexpr_function
def _vec(nw):
    return gl.BlockedLayout([1], [32], [nw], [0])


_FLAT = gl.constexpr(gl.SwizzledSharedLayout(1, 1, 1, [0]))  # a [64] row of fp32 in shared memory
# Shared buffers with their rows padded against bank conflicts: fp32 rows of 64 (256 B) or 16 (64 B) elements unpadded
# put every row of a block in the same banks, so the MMA-layout store of L (8 rows per instruction), the tf32 operand
# loads of its blocks (8 rows) and the stores of the diagonal blocks' rows are served one row at a time. Padded, rows
# of 64 are 68 words apart (8 rows: 8 disjoint 4-word bank groups), of 16 20 (8 rows of 16 bytes: disjoint).
_PAD64 = gl.constexpr(gl.PaddedSharedLayout.with_identity_for([[64, 4]], [64, 64], [1, 0]))
_ROWS_PAD = gl.constexpr(gl.PaddedSharedLayout.with_identity_for([[64, 4]], [16, 64], [1, 0]))
_PAD16 = gl.constexpr(gl.PaddedSharedLayout.with_identity_for([[16, 4]], [64, 16], [1, 0]))
# [64, 32] 16-bit columns of k for the gram's operands: 64-byte rows, swizzled for ldmatrix.
_KB = gl.constexpr(gl.NVMMASharedLayout(swizzle_byte_width=64, element_bitwidth=16, rank=2))


@gluon.jit
def _add(a, b):
    return a + b


@gluon.jit
def _rows(x, bos, T, i_h, r0, kc: gl.constexpr, H, K: gl.constexpr, NW: gl.constexpr, W: gl.constexpr = 32):
    """Columns [32 kc, 32 kc + W) of a chunk's 64 rows of q or k `[B, T, H, K]` for key head i_h (zero past the
    sequence's end), layout `_ld(NW)`."""
    LD: gl.constexpr = _ld(NW)
    o_t = r0 + gl.arange(0, BT, layout=gl.SliceLayout(1, LD))
    o_k = 32 * kc + gl.arange(0, W, layout=gl.SliceLayout(0, LD))
    p = x + ((bos + o_t.to(gl.int64)) * H + i_h)[:, None] * K + o_k[None, :]
    return gl.load(p, mask=(o_t < T)[:, None], other=0.0)


@gluon.jit
def _sub(smem, b: gl.constexpr):
    """Block b of a [64, 16] shared buffer of four [16, 16] blocks stacked."""
    return smem.slice(16 * b, 16, dim=0)


@gluon.jit
def _block(smem, i: gl.constexpr, j: gl.constexpr, operand: gl.constexpr, NW: gl.constexpr):
    """Block (i, j) of a 64 x 64 fp32 shared tile as a tf32 mma.sync operand (0: left, 1: right)."""
    view = smem.slice(16 * i, 16, dim=0).slice(16 * j, 16, dim=1)
    return view.load(gl.DotOperandLayout(operand, _mma16(NW), 1))


@gluon.jit
def _dot(a, b, acc):
    return mma_v2(a, b, acc, input_precision="tf32")


@gluon.jit
def _store_block(A, x, i: gl.constexpr, j: gl.constexpr, layout: gl.constexpr):
    r = gl.arange(0, 16, layout=gl.SliceLayout(1, layout))
    c = gl.arange(0, 16, layout=gl.SliceLayout(0, layout))
    gl.store(A + (16 * i + r)[:, None] * BT + (16 * j + c)[None, :], x.to(A.dtype.element_ty))


@gluon.jit
def _gluon_inverse_kernel(q, k, g, beta, A, R, G, P, cu_seqlens, chunk_table, row0, c_lo, c_hi, scale, H, HV,
                          K: gl.constexpr, L2NORM: gl.constexpr, GROUP: gl.constexpr, SEGMENTED: gl.constexpr,
                          SCORES: gl.constexpr = False):
    """T = (I + L)^-1 of one chunk for GROUP value heads of one key head, with their row scales. Grid (chunk rows,
    HV // GROUP), two warps. The raw gram and the q and k norms depend on the key head only: made once.
    SEGMENTED (a segment of a pipelined call): rows row0 on, and only the chunks c_lo <= i < c_hi of each sequence,
    as the Triton kernel's `_table_row`. SCORES: also the scores form's masked scores P `[NC, HV, 64, 64]`
    (`inverse._chunk_scores_kernel`'s), q k^T made here from the q and k this program loaded anyway."""
    i_c, i_g = gl.program_id(0), gl.program_id(1)
    if SEGMENTED:
        i_c += row0
    i_n = gl.load(chunk_table + 2 * i_c)
    i_t = gl.load(chunk_table + 2 * i_c + 1)
    live_row = i_n >= 0  # not: a row past the last chunk (the table is sized by an upper bound)
    if SEGMENTED:
        live_row = live_row & (i_t >= c_lo) & (i_t < c_hi)
    if not live_row:
        return
    start = gl.load(cu_seqlens + i_n)
    T = gl.load(cu_seqlens + i_n + 1) - start
    bos = start.to(gl.int64)
    hv0 = i_g * GROUP
    i_h = hv0 // (HV // H)
    r0 = i_t * BT

    # The raw gram and the norms (key head), 32 columns of k at a time (whole, k and its two operand copies would
    # take 192 registers a thread); k's squared norms are the gram's diagonal.
    NW: gl.constexpr = gl.num_warps()
    MMA: gl.constexpr = _mma(NW)
    row: gl.constexpr = gl.SliceLayout(1, MMA)
    col: gl.constexpr = gl.SliceLayout(0, MMA)
    gram = gl.zeros([BT, BT], gl.float32, layout=MMA)
    sq = gl.zeros([BT], gl.float32, layout=gl.SliceLayout(1, _ld(NW)))
    # Both operands of each step are read (ldmatrix, .trans for K^T) from one copy of k's columns in shared memory:
    # converted from registers, each step took 11 bar.sync.
    # All of k and q in one load each, k into one shared tile whose 32-column slabs the products read: a program
    # waits for global memory once, not once per slab. The NVMMA layout stores a tile wider than its swizzle as
    # [64, 32] blocks one after another, so a slab is one block.
    kw = gl.allocate_shared_memory(k.dtype.element_ty, [BT, K], _KB)
    b_k = _rows(k, bos, T, i_h, r0, 0, H, K, NW, K)
    if SCORES:
        # q k^T first, from q's tile beside k's (slabs read as the gram's are), and staged in shared memory until
        # each value head's scores are made from it by 16 x 16 blocks (`_store_scores`): its accumulators and the
        # gram's are never alive together (beside the gram's they spilled, offline sm_90: 16-144 B). q is
        # loaded once, in its own dtype, for its tile and its norms.
        qw = gl.allocate_shared_memory(q.dtype.element_ty, [BT, K], _KB)
        b_q = _rows(q, bos, T, i_h, r0, 0, H, K, NW, K)
        kw.store(b_k)
        qw.store(b_q)
        if L2NORM:
            f_q = b_q.to(gl.float32)
            sq = gl.sum(f_q * f_q, axis=1)
        qk = gl.zeros([BT, BT], gl.float32, layout=MMA)
        for kc in gl.static_range(K // 32):
            qk = mma_v2(qw.slice(32 * kc, 32, dim=1).load(gl.DotOperandLayout(0, MMA, 2)),
                        kw.slice(32 * kc, 32, dim=1).permute([1, 0]).load(gl.DotOperandLayout(1, MMA, 2)), qk)
        qks = gl.allocate_shared_memory(gl.float32, [BT, BT], _PAD64)
        qks.store(qk)
    else:
        if L2NORM:
            b_q = _rows(q, bos, T, i_h, r0, 0, H, K, NW, K).to(gl.float32)
            sq = gl.sum(b_q * b_q, axis=1)
        kw.store(b_k)
    for kc in gl.static_range(K // 32):
        kb = kw.slice(32 * kc, 32, dim=1)
        gram = mma_v2(kb.load(gl.DotOperandLayout(0, MMA, 2)),
                      kb.permute([1, 0]).load(gl.DotOperandLayout(1, MMA, 2)), gram)
    if L2NORM:
        diag = gl.arange(0, BT, layout=row)[:, None] == gl.arange(0, BT, layout=col)[None, :]
        rk = gl.rsqrt(gl.sum(gl.where(diag, gram, 0.0), axis=1) + 1e-6)
        rq = gl.convert_layout(gl.rsqrt(sq + 1e-6), row)
    else:
        rk = gl.full([BT], 1.0, gl.float32, layout=row)
        rq = gl.full([BT], 1.0, gl.float32, layout=row)
    rk_col = gl.convert_layout(rk, col)
    o_t = gl.arange(0, BT, layout=row)
    live = r0 + o_t < T
    o_v = gl.arange(0, BT, layout=_vec(NW))
    lower = o_t[:, None] > gl.arange(0, BT, layout=col)[None, :]
    Ls = gl.allocate_shared_memory(gl.float32, [BT, BT], _PAD64)
    # L's diagonal blocks side by side: [i, 16 b + m] = L_b[i, m].
    Lr = gl.allocate_shared_memory(gl.float32, [16, BT], _ROWS_PAD)
    Td = gl.allocate_shared_memory(gl.float32, [BT, 16], _PAD16)  # T's diagonal blocks: [16 b + m, c] = T_b[m, c]
    if SCORES:
        # The scores' row scales (key head: R's rows 320 and 384, as stored below) and each value head's c.
        s_c = gl.allocate_shared_memory(gl.float32, [BT], _FLAT)
        s_rq = gl.allocate_shared_memory(gl.float32, [BT], _FLAT)
        s_rk = gl.allocate_shared_memory(gl.float32, [BT], _FLAT)
        s_rq.store(gl.where(live, scale * rq, 0.0))
        s_rk.store(gl.where(live, rk, 0.0))
    for j in range(GROUP):
        i_hv = hv0 + j
        # Beta and the decays (value head) on the gram's rows and columns.
        b_b = gl.load(beta + (bos + r0 + o_t) * HV + i_hv, mask=live, other=0.0).to(gl.float32)
        # The gate's cumulative sum in a plain layout (a scan cannot run in `_mma`'s). A masked row sum in `_mma`'s
        # layout instead (no shared memory, no bar.sync) was slower.
        g_vec = gl.load(g + (bos + r0 + o_v) * HV + i_hv, mask=r0 + o_v < T, other=0.0).to(gl.float32)
        c = gl.convert_layout(gl.associative_scan(g_vec, 0, _add), row)
        g_last = gl.sum(g_vec, axis=0)
        c_col = gl.convert_layout(c, col)
        L = gl.where(lower, gl.exp(gl.where(lower, c[:, None] - c_col[None, :], 0.0)) * gram
                     * (b_b * rk)[:, None] * rk_col[None, :], 0.0)

        # Row scales and e^g_last: the Triton kernel's `_store_rows`, for the whole chunk at once.
        i_ch = i_c.to(gl.int64) * HV + i_hv
        p_r = R + i_ch * (8 * BT) + o_t
        e_c = gl.exp(c)
        gl.store(p_r, gl.where(live, scale * e_c * rq, 0.0))
        gl.store(p_r + 64, gl.where(live, b_b * e_c * rk, 0.0))
        gl.store(p_r + 128, gl.where(live, gl.exp(g_last - c) * rk, 0.0))
        gl.store(p_r + 192, b_b)
        gl.store(p_r + 256, c)
        gl.store(p_r + 320, gl.where(live, scale * rq, 0.0))
        gl.store(p_r + 384, gl.where(live, rk, 0.0))
        gl.store(G + i_ch, gl.exp(g_last))
        _invert(L, Ls, Lr, Td, A + i_ch * (BT * BT), NW)
        if SCORES:
            # Here, after the inversion: c's registers held through it, or the scores' beside the gram's, spilled
            # (offline sm_90).
            s_c.store(c)
            _store_scores(qks, s_c, s_rq, s_rk, P + i_ch * (BT * BT), NW)


@gluon.jit
def _store_scores(qks, s_c, s_rq, s_rk, p, NW: gl.constexpr):
    """The masked scores of one value head, `chunk_rows._masked_scores`, into p (64 x 64, row-major), by 16 x 16
    blocks: from q k^T staged in qks and the rows c, scale rq and rk (zero past the sequence's end) in shared memory.
    Blocks above the diagonal are zeros, stored without a product; below it no mask is needed (c does not grow along
    a chunk, so every exponent is <= 0); only the four diagonal blocks are masked: 2,560 exponentials, not 4,096."""
    B16: gl.constexpr = _b16(NW)
    brow: gl.constexpr = gl.SliceLayout(1, B16)
    bcol: gl.constexpr = gl.SliceLayout(0, B16)
    o_r = gl.arange(0, 16, layout=brow)
    o_c = gl.arange(0, 16, layout=bcol)
    diag = o_r[:, None] >= o_c[None, :]
    zero = gl.zeros([16, 16], p.dtype.element_ty, layout=B16)
    for bi in gl.static_range(4):
        c_i = s_c.slice(16 * bi, 16).load(brow)
        rq_i = s_rq.slice(16 * bi, 16).load(brow)
        p_row = p + (16 * bi + o_r)[:, None] * BT
        for bj in gl.static_range(4):
            p_b = p_row + (16 * bj + o_c)[None, :]
            if bj > bi:
                gl.store(p_b, zero)
            else:
                c_j = s_c.slice(16 * bj, 16).load(bcol)
                rk_j = s_rk.slice(16 * bj, 16).load(bcol)
                x = qks.slice(16 * bi, 16, dim=0).slice(16 * bj, 16, dim=1).load(B16) * (rq_i[:, None] * rk_j[None, :])
                if bj == bi:
                    x = gl.where(diag, x * gl.exp(gl.where(diag, c_i[:, None] - c_j[None, :], 0.0)), 0.0)
                else:
                    x = x * gl.exp(c_i[:, None] - c_j[None, :])
                gl.store(p_b, x.to(p.dtype.element_ty))


@gluon.jit
def _invert(L, Ls, Lr, Td, p, NW: gl.constexpr):
    """T = (I + L)^-1 of one 64 x 64 strictly lower L (layout `_mma(NW)`) into p (64 x 64, row-major), through the
    shared buffers Ls (L), Lr (its diagonal blocks side by side) and Td (T's diagonal blocks)."""
    SUB: gl.constexpr = _subst(NW)
    MMA16: gl.constexpr = _mma16(NW)
    # L in shared memory: all of it for the merges, its diagonal blocks side by side for the substitution's rows.
    Ls.store(L)
    for b in gl.static_range(4):
        Lr.slice(16 * b, 16, dim=1).store(Ls.slice(16 * b, 16, dim=0).slice(16 * b, 16, dim=1).load(_ld(NW)))

    # Forward substitution on the four diagonal blocks, column by column in registers: row i of T is
    # e_i - sum_{m < i} L_im T_m, and L's rows beyond the diagonal are zero, so every step sums all 16. Row i of L's
    # blocks is 16 contiguous words per block: four 16-byte reads per thread and step, broadcast to the 16 threads
    # of a block (it was 16 one-word reads from a transposed copy, the kernel's largest share of shared-memory
    # traffic).
    m_ax = gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(2, SUB)))[None, :, None]
    c_ax = gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(1, SUB)))[None, None, :]
    t = gl.where(m_ax == c_ax, 1.0, 0.0) + gl.zeros([4, 16, 16], gl.float32, layout=SUB)
    for i in gl.static_range(1, 16):
        l_row = gl.convert_layout(gl.reshape(Lr.slice(i, 1, dim=0).load(_row(NW)), [4, 16, 1]), SUB,
                                  assert_trivial=True)
        corr = gl.sum(l_row * t, axis=1)  # [4, 16 (c)]
        t = gl.where(m_ax == i, t - gl.expand_dims(corr, 1), t)
    Td.store(gl.reshape(t, [BT, 16]))

    # The blocks below the diagonal: T_ij = -T_ii sum_{j <= m < i} L_im T_mj (tf32 products).
    z = gl.zeros([16, 16], gl.float32, layout=MMA16)
    left: gl.constexpr = gl.DotOperandLayout(0, MMA16, 1)
    right: gl.constexpr = gl.DotOperandLayout(1, MMA16, 1)
    t11, t22, t33 = _sub(Td, 1).load(left), _sub(Td, 2).load(left), _sub(Td, 3).load(left)
    t00_b, t11_b, t22_b = _sub(Td, 0).load(right), _sub(Td, 1).load(right), _sub(Td, 2).load(right)
    l10, l20, l21 = _block(Ls, 1, 0, 0, NW), _block(Ls, 2, 0, 0, NW), _block(Ls, 2, 1, 0, NW)
    l30, l31, l32 = _block(Ls, 3, 0, 0, NW), _block(Ls, 3, 1, 0, NW), _block(Ls, 3, 2, 0, NW)
    t10 = -_dot(t11, gl.convert_layout(_dot(l10, t00_b, z), right), z)
    t21 = -_dot(t22, gl.convert_layout(_dot(l21, t11_b, z), right), z)
    t32 = -_dot(t33, gl.convert_layout(_dot(l32, t22_b, z), right), z)
    t10_b = gl.convert_layout(t10, right)
    t21_b = gl.convert_layout(t21, right)
    t20 = -_dot(t22, gl.convert_layout(_dot(l21, t10_b, _dot(l20, t00_b, z)), right), z)
    t31 = -_dot(t33, gl.convert_layout(_dot(l32, t21_b, _dot(l31, t11_b, z)), right), z)
    t20_b = gl.convert_layout(t20, right)
    t30 = -_dot(t33, gl.convert_layout(_dot(l32, t20_b, _dot(l31, t10_b, _dot(l30, t00_b, z))), right), z)

    zero16 = gl.zeros([16, 16], gl.float32, layout=MMA16)
    for b in gl.static_range(4):
        _store_block(p, _sub(Td, b).load(MMA16), b, b, MMA16)
        for j in gl.static_range(b + 1, 4):
            _store_block(p, zero16, b, j, MMA16)
    _store_block(p, t10, 1, 0, MMA16)
    _store_block(p, t20, 2, 0, MMA16)
    _store_block(p, t21, 2, 1, MMA16)
    _store_block(p, t30, 3, 0, MMA16)
    _store_block(p, t31, 3, 1, MMA16)
    _store_block(p, t32, 3, 2, MMA16)


WARPS = 2  # what the layouts are written for: 64 threads, one per column of T's four diagonal blocks


def launch(q, k, g, beta, A, R, G, cu_seqlens, chunk_table, rows: int, scale: float, l2norm: bool,
           group: int = 1, row0: int = 0, c_lo: int = 0, c_hi: int = 0, segmented: bool = False, P=None) -> None:
    """`_gluon_inverse_kernel` over ``rows`` chunk rows and every value head (the arguments of `chunk`'s inverse call),
    ``group`` value heads of a key head per program (a divisor of HV / H). Refuses what it was not written for: a CPU
    tensor (Gluon has no interpreter), inputs other than bf16 or fp16 (the gram's operands are 16-bit), or a head size
    that is not a multiple of 32 up to 256. ``P``: the scores form's masked scores `[NC, HV, 64, 64]`, made here as
    well (SCORES); None: not made."""
    H, K = q.shape[2], q.shape[3]
    HV = beta.shape[-1]
    if not q.is_cuda:
        raise ValueError(f"the Gluon inverse runs on a CUDA GPU only, got q on {q.device}")
    if q.dtype != k.dtype or str(q.dtype) not in ("torch.bfloat16", "torch.float16"):
        raise ValueError(f"the Gluon inverse takes bf16 or fp16 q and k, got {q.dtype} and {k.dtype}")
    if K % 32 or K > 256:
        raise ValueError(f"the Gluon inverse takes a head size that is a multiple of 32 up to 256, got K={K}")
    if group < 1 or (HV // H) % group:
        raise ValueError(f"group must divide the value heads per key head ({HV // H}), got {group}")
    _gluon_inverse_kernel[(rows, HV // group)](q, k, g, beta, A, R, G, P, cu_seqlens, chunk_table, row0, c_lo, c_hi,
                                               scale, H, HV, K=K, L2NORM=l2norm, GROUP=group, SEGMENTED=segmented,
                                               SCORES=P is not None, num_warps=WARPS)
