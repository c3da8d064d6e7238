"""The state chain in Gluon, FlashInfer's way round (docs/background/gdn_peers.md section 1): one program per
(sequence, value head) holding the whole state, and the state as the register operand of Hopper's wgmma. Run by
`triton_chunk.chunk_gated_delta_rule_fwd(..., gluon_chain=GluonChain(...))` (serial calls), and planned on Hopper at
half the state per program for long bf16 batches (`chunk_plan.BATCH_GLUON_CHAIN`) and for one prompt of 397B-shaped
heads in the scores form (`chunk_plan.PROMPT_GLUON_CHAIN`), beside the Triton chain
(`triton_chunk._chunk_state_kernel`, whose arithmetic and inputs it takes: the inverse kernel's A, R, G and raw q, k,
v); Gluon has no CPU interpreter, so it is checked on a GPU only. On the H200 (2026-12-02, tools/gdn/README.md)
the whole-state variant is 3-6% faster than the Triton chain where the (sequence, value head) pairs fill the SMs
with equal lengths and 11-27% slower on one prompt or a ragged mix (the Triton chain splits V there, halving each
program's chain); each chunk's GEMMs wait for each other, so it is bound by their latency, not by the tensor cores.

What differs from the Triton chain, and why:

- Eight warps own the whole state, S^T `[V, K]` fp32 in registers (64 per thread), instead of a 4-warp program per
  64-column V block: q, k, T and the masked scores are loaded and multiplied once per value head, not once per V
  block.
- Everything is computed transposed (value rows x tokens), so that the state is always the left operand, which
  wgmma takes from registers: S^T K^T, S^T Q^T and S^T += (v_new r_d)^T K never copy the state to shared memory
  (Triton's `tl.dot` stages a register operand through shared memory; offline, this pattern compiles with no
  shared-memory round trip).
- The masked scores P = q k^T (decayed, scaled) are made here, one wgmma per chunk, as the fused Triton chain does.
- q, k, v and T arrive by TMA into two buffers: the next chunk's copies run while this one computes.
- BV (`GluonChain.rows`): 128 as above, or 64 (the batch plan's; 9% faster than the Triton chain at 397B 4x8192,
  and faster on every shape measured): half the state per program, four warps,
  each program loading q, k and T and making the scores for itself (as the Triton chain does at BV = 64). Twice the
  programs for one prompt, and two programs per SM (offline sm_90: 251 registers x 128 threads, 104 KB of shared
  memory), so one program's GEMMs can run while the other's wait.
- OVERLAP (`GluonChain.overlap` 1 or 2; measured slower than 0 at BV = 128, within 1% of it at BV = 64, where the
  batch plan takes 1): some of the chunk's six wgmmas in flight together,
  each wait naming what it needs (`warpgroup_mma_wait`), against that latency. 1: v_new's GEMM beside S^T Q^T, and
  the state update beside the output's (offline sm_90: 253 registers, no spill). 2: also the scores, S^T K^T and
  S^T Q^T together, the scores' masking beside the other two (255 registers, 32 B spilled; ptxas waits for the scores'
  wgmma at once anyway, C7517, because S^T Q^T's accumulator reuses its registers, so only S^T K^T and S^T Q^T
  overlap there; at BV = 64: 249 and no spill, 255 and 48 B). The same products, so the same results as the
  synchronous kernel (a review of the BV = 128 SASS found no register of an unfinished wgmma written, 2026-12-02).

- SCORES_IN (the scores form, `triton_chunk.Form.SCORES`): P made in parallel (by the inverse or the scores kernel)
  arrives by TMA with the chunk's tiles instead of being made on the chain.

Not here (yet): no warp is specialised (FlashInfer's loader and inverse warpgroups); segments (pipelined or scan
schedules) and the split form are refused (`triton_chunk.chunk_gated_delta_rule_fwd`).
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

BT = gl.constexpr(64)
_SW = gl.constexpr(gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2))
# A chunk's row scales ([8, 64] fp32, 2 KB, contiguous) staged by TMA: read back as rows, not as MMA operands.
_ROWS = gl.constexpr(gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2))


def warps_for(bv: int) -> int:
    """Warps of a program holding ``bv`` of the state's value rows: one warpgroup per 64 rows (wgmma's M)."""
    return bv // 16


# Layouts for a program of ``bv`` state rows (`warps_for(bv)` warps, one warpgroup per 64 rows).
@gluon.constexpr_function
def _acc(bv, n):
    """wgmma accumulator of value rows x n columns: S^T `[BV, K]` (n = K) or value rows x tokens `[BV, 64]`."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[bv // 16, 1], instr_shape=[16, n, 16])


@gluon.constexpr_function
def _qk(bv):
    """The scores `[64, 64]`: one warpgroup, or two side by side along N."""
    if bv == 128:
        return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, 32, 16])
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 64, 16])


@gluon.constexpr_function
def _ld(bv):
    """[rows, 64 or 128] bf16 tiles: 8 contiguous elements (16 bytes) per thread."""
    return gl.BlockedLayout([1, 8], [4, 8], [bv // 16, 1], [1, 0])


@gluon.jit
def _issue(q_desc, k_desc, v_desc, a_desc, r_desc, p_desc, bars, qs, ks, vs, as_, rs, ps, stage, t0, i_ch, i_h, v0,
           K: gl.constexpr, BV: gl.constexpr, STAGED_SCALES: gl.constexpr, SCORES_IN: gl.constexpr):
    """Start the TMA copies of one chunk's q, k, its BV columns of v (from column v0), T, (STAGED_SCALES) its row
    scales and (SCORES_IN) its masked scores into buffer ``stage``; its barrier completes with them."""
    bar = bars.index(stage)
    mbarrier.expect(bar, 2 * BT * K * 2 + BT * BV * 2 + BT * BT * 2 + (8 * BT * 4 if STAGED_SCALES else 0)
                    + (BT * BT * 2 if SCORES_IN else 0))
    tma.async_copy_global_to_shared(q_desc, [t0, i_h * K], bar, qs.index(stage))
    tma.async_copy_global_to_shared(k_desc, [t0, i_h * K], bar, ks.index(stage))
    tma.async_copy_global_to_shared(v_desc, [t0, v0], bar, vs.index(stage))
    tma.async_copy_global_to_shared(a_desc, [i_ch * BT, 0], bar, as_.index(stage))
    if STAGED_SCALES:
        tma.async_copy_global_to_shared(r_desc, [i_ch * 8, 0], bar, rs.index(stage))
    if SCORES_IN:
        tma.async_copy_global_to_shared(p_desc, [i_ch * BT, 0], bar, ps.index(stage))


@gluon.jit
def _row(buf, r: gl.constexpr, layout: gl.constexpr):
    """Row r of a chunk's row scales staged in shared memory (an unswizzled [8, 64] buffer, plain row-major: seen
    flat, a row is a slice)."""
    flat = buf._reinterpret(gl.float32, [8 * BT], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    return flat.slice(r * BT, BT).load(layout)


@gluon.jit
def _zero_rows_past(tile, row0, T, LD: gl.constexpr):
    """Rows of a [64, 64 or 128] shared tile whose token (row0 + row) is at or past T set to zero, 32 rows at a time
    (the state already holds most of the registers)."""
    for half in gl.static_range(2):
        rows = tile.slice(32 * half, 32, dim=0)
        x = rows.load(LD)
        gl.thread_barrier()
        past = row0 + 32 * half + gl.arange(0, 32, layout=gl.SliceLayout(1, LD)) >= T
        rows.store(gl.where(past[:, None], 0.0, x.to(gl.float32)).to(gl.bfloat16))


@gluon.jit
def _gluon_chain_kernel(q_desc, k_desc, v_desc, a_desc, r_desc, p_desc, R, G, o, h_in, h_out, cu_seqlens,
                        chunk_offsets, stride_ik, stride_iv, stride_ok, stride_ov, H, HV, K: gl.constexpr,
                        V: gl.constexpr, HAS_H_IN: gl.constexpr, HAS_H_OUT: gl.constexpr, OVERLAP: gl.constexpr = 0,
                        BV: gl.constexpr = 128, STAGED_SCALES: gl.constexpr = False, SCORES_IN: gl.constexpr = False):
    """The chain of BV value rows of one (sequence, value head)'s state: grid (N * HV * V // BV,), `warps_for(BV)`
    warps (BV = V = 128: the whole state, eight warps; BV = 64: half, four warps, twice the programs, each loading q,
    k and T and making the scores for itself). Inputs as `_chunk_state_kernel`'s (A, R, G from the inverse kernel; q,
    k `[B * T, H * K]` and v `[B * T, HV * V]` raw, and A `[NC * HV * 64, 64]`, through TMA descriptors of 64-row
    boxes, v's BV columns wide); writes o `[B, T, HV, V]` and, with HAS_H_OUT, the final state `[K, V]` at the strides
    given (a V-first state is the transposed view).

    Rows of a box past the sequence's end belong to the next sequence (TMA zero-fills only past the tensor), whose
    values may be anything, inf included: k's and v's rows there are zeroed in the last chunk (the row scales there
    are zero and the inverse made T the identity there, so y's and v_new's columns are exactly zero), the scores'
    are masked by a select, and o's stores are masked; q's rows there reach only o's unstored columns.

    SCORES_IN (`triton_chunk.Form.SCORES`): the masked scores come from P `[NC * HV * 64, 64]` (the inverse's or the
    scores kernel's, zero past the sequence's end), by TMA with the chunk's tiles, two buffers deep, instead of a
    wgmma and the decays here: one wgmma and 4,096 exponentials fewer per chunk on the chain."""
    ACC: gl.constexpr = _acc(BV, K)
    ACC64: gl.constexpr = _acc(BV, BT)
    QK: gl.constexpr = _qk(BV)
    LD: gl.constexpr = _ld(BV)
    NV: gl.constexpr = V // BV
    i_p = gl.program_id(0)
    i_nh, i_v = i_p // NV, i_p % NV
    i_n, i_hv = i_nh // HV, i_nh % HV
    i_h = i_hv // (HV // H)
    start = gl.load(cu_seqlens + i_n)
    T = gl.load(cu_seqlens + i_n + 1) - start
    c_first = gl.load(chunk_offsets + i_n)
    n_t = gl.cdiv(T, BT)

    v_rows = i_v * BV + gl.arange(0, BV, layout=gl.SliceLayout(1, ACC))
    k_cols = gl.arange(0, K, layout=gl.SliceLayout(0, ACC))
    p_state = i_nh.to(gl.int64) * K * V
    if HAS_H_IN:
        s = gl.load(h_in + p_state + k_cols[None, :] * stride_ik + v_rows[:, None] * stride_iv).to(gl.float32)
    else:
        s = gl.zeros([BV, K], gl.float32, layout=ACC)

    qs = gl.allocate_shared_memory(gl.bfloat16, [2, BT, K], _SW)
    ks = gl.allocate_shared_memory(gl.bfloat16, [2, BT, K], _SW)
    vs = gl.allocate_shared_memory(gl.bfloat16, [2, BT, BV], _SW)
    as_ = gl.allocate_shared_memory(gl.bfloat16, [2, BT, BT], _SW)  # T [i, j]
    rs = gl.allocate_shared_memory(gl.float32, [2 if STAGED_SCALES else 1, 8, BT], _ROWS)  # row scales
    # The masked scores P [i, j]: made here into one buffer, or (SCORES_IN) copied into two with the tiles.
    ps = gl.allocate_shared_memory(gl.bfloat16, [2 if SCORES_IN else 1, BT, BT], _SW)
    bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    mbarrier.init(bars.index(0), count=1)
    mbarrier.init(bars.index(1), count=1)

    vv = i_v * BV + gl.arange(0, BV, layout=gl.SliceLayout(1, ACC64))
    tt = gl.arange(0, BT, layout=gl.SliceLayout(0, ACC64))
    ii = gl.arange(0, BT, layout=gl.SliceLayout(1, QK))
    jj = gl.arange(0, BT, layout=gl.SliceLayout(0, QK))
    causal = ii[:, None] >= jj[None, :]
    a_op: gl.constexpr = gl.DotOperandLayout(0, ACC64, 2)
    v0 = i_hv * V + i_v * BV

    if n_t > 0:
        _issue(q_desc, k_desc, v_desc, a_desc, r_desc, p_desc, bars, qs, ks, vs, as_, rs, ps, 0, start,
               c_first * HV + i_hv, i_h, v0, K, BV, STAGED_SCALES, SCORES_IN)
    for i_t in range(0, n_t):
        stage = i_t % 2
        i_ch = (c_first + i_t).to(gl.int64) * HV + i_hv
        if i_t + 1 < n_t:
            # The other buffer was read by the previous chunk's products: every warp is past them first.
            gl.thread_barrier()
            _issue(q_desc, k_desc, v_desc, a_desc, r_desc, p_desc, bars, qs, ks, vs, as_, rs, ps, 1 - stage,
                   start + (i_t + 1) * BT, (c_first + i_t + 1) * HV + i_hv, i_h, v0, K, BV, STAGED_SCALES, SCORES_IN)
        if not STAGED_SCALES:  # from global memory, issued before the wait for the tiles
            p_r = R + i_ch * (8 * BT)
            r_q = gl.load(p_r + tt)
            r_k = gl.load(p_r + 64 + tt)
            r_d = gl.load(p_r + 128 + tt)
            r_b = gl.load(p_r + 192 + tt)
            if not SCORES_IN:
                c_i = gl.load(p_r + 256 + ii)
                c_j = gl.load(p_r + 256 + jj)
                sq_i = gl.load(p_r + 320 + ii)
                rk_j = gl.load(p_r + 384 + jj)
        e_last = gl.load(G + i_ch)
        # Every warpgroup has finished reading the previous chunk's P (its output wgmma) before this barrier, and this
        # chunk's P is stored after it. Triton's barrier pass would put one here anyway (for the mbarrier), but it counts
        # an async wgmma's read of shared memory done at issue, not at its wait, so the ordering is written out.
        gl.thread_barrier()
        mbarrier.wait(bars.index(stage), (i_t // 2) & 1)
        smem_q, smem_k, smem_v, smem_a = qs.index(stage), ks.index(stage), vs.index(stage), as_.index(stage)
        smem_p = ps.index(stage) if SCORES_IN else ps.index(0)
        if STAGED_SCALES:  # arrived with the tiles; each row is read where it is used (registers are scarce)
            sr = rs.index(stage)
            if not SCORES_IN:
                c_i, c_j = _row(sr, 4, gl.SliceLayout(1, QK)), _row(sr, 4, gl.SliceLayout(0, QK))
                sq_i, rk_j = _row(sr, 5, gl.SliceLayout(1, QK)), _row(sr, 6, gl.SliceLayout(0, QK))
        if (i_t + 1) * BT > T:
            # The last chunk runs past the sequence's end into the next sequence's rows, which may hold anything
            # (inf included). The row scales there are zero, but 0 * inf is NaN: those rows of k and v become zero
            # first (q's reach only o's unstored columns; the scores' are masked by a select).
            _zero_rows_past(smem_k, i_t * BT, T, LD)
            _zero_rows_past(smem_v, i_t * BT, T, LD)
            fence_async_shared()

        # P = scale (q_i . k_j) rq_i rk_j e^(gamma_i - gamma_j) for j <= i (`triton_chunk_rows._masked_scores`).
        if not SCORES_IN:
            decay = gl.exp(gl.where(causal, c_i[:, None] - c_j[None, :], 0.0))
            row_scales = sq_i[:, None] * rk_j[None, :]
        # The chain, transposed: (k S)^T = S^T k^T and (q S)^T = S^T q^T with the state as the register operand;
        # v_new^T = y^T T^T; o^T = (q S)^T r_q + v_new^T P^T; S^T = e_last S^T + (v_new r_d)^T k. In this order so
        # that few [V, 64] tiles are alive at once (the state alone takes 64 registers a thread).
        if OVERLAP == 2:
            # The three products that need only the state and this chunk's tiles, in flight together; waits are in
            # issue order (num_outstanding 2: the scores are done, S^T K^T and S^T Q^T may not be).
            qk_t = warpgroup_mma(smem_q, smem_k.permute([1, 0]), gl.zeros([BT, BT], gl.float32, layout=QK),
                                 is_async=True)
            s_op = gl.convert_layout(s.to(gl.bfloat16), a_op)
            kst_t = warpgroup_mma(s_op, smem_k.permute([1, 0]), gl.zeros([BV, BT], gl.float32, layout=ACC64),
                                  is_async=True)
            qst_t = warpgroup_mma(s_op, smem_q.permute([1, 0]), gl.zeros([BV, BT], gl.float32, layout=ACC64),
                                  is_async=True)
            qk = warpgroup_mma_wait(num_outstanding=2, deps=(qk_t,))
            smem_p.store(gl.where(causal, qk * decay * row_scales, 0.0).to(gl.bfloat16))
            fence_async_shared()
            kst, s_op = warpgroup_mma_wait(num_outstanding=1, deps=(kst_t, s_op))
            vt = smem_v.permute([1, 0]).load(ACC64).to(gl.float32)
            if STAGED_SCALES:
                r_b, r_k = _row(sr, 3, gl.SliceLayout(0, ACC64)), _row(sr, 1, gl.SliceLayout(0, ACC64))
            yt = gl.convert_layout((vt * r_b[None, :] - kst * r_k[None, :]).to(gl.bfloat16), a_op)
            vnt_t = warpgroup_mma(yt, smem_a.permute([1, 0]), gl.zeros([BV, BT], gl.float32, layout=ACC64),
                                  is_async=True)
            qst, vnt, yt, s_op = warpgroup_mma_wait(num_outstanding=0, deps=(qst_t, vnt_t, yt, s_op))
        else:
            if not SCORES_IN:
                qk = warpgroup_mma(smem_q, smem_k.permute([1, 0]), gl.zeros([BT, BT], gl.float32, layout=QK))
                smem_p.store(gl.where(causal, qk * decay * row_scales, 0.0).to(gl.bfloat16))
                fence_async_shared()
            s_op = gl.convert_layout(s.to(gl.bfloat16), a_op)
            kst = warpgroup_mma(s_op, smem_k.permute([1, 0]), gl.zeros([BV, BT], gl.float32, layout=ACC64))
            vt = smem_v.permute([1, 0]).load(ACC64).to(gl.float32)  # v^T [V, 64]
            if STAGED_SCALES:
                r_b, r_k = _row(sr, 3, gl.SliceLayout(0, ACC64)), _row(sr, 1, gl.SliceLayout(0, ACC64))
            yt = gl.convert_layout((vt * r_b[None, :] - kst * r_k[None, :]).to(gl.bfloat16), a_op)
            if OVERLAP == 1:  # v_new and S^T Q^T in flight together
                vnt_t = warpgroup_mma(yt, smem_a.permute([1, 0]), gl.zeros([BV, BT], gl.float32, layout=ACC64),
                                      is_async=True)
                qst_t = warpgroup_mma(s_op, smem_q.permute([1, 0]), gl.zeros([BV, BT], gl.float32, layout=ACC64),
                                      is_async=True)
                vnt, qst, yt, s_op = warpgroup_mma_wait(num_outstanding=0, deps=(vnt_t, qst_t, yt, s_op))
            else:
                vnt = warpgroup_mma(yt, smem_a.permute([1, 0]), gl.zeros([BV, BT], gl.float32, layout=ACC64))
                qst = warpgroup_mma(s_op, smem_q.permute([1, 0]), gl.zeros([BV, BT], gl.float32, layout=ACC64))
        vn_op = gl.convert_layout(vnt.to(gl.bfloat16), a_op)
        if STAGED_SCALES:
            r_d, r_q = _row(sr, 2, gl.SliceLayout(0, ACC64)), _row(sr, 0, gl.SliceLayout(0, ACC64))
        upd = gl.convert_layout((vnt * r_d[None, :]).to(gl.bfloat16), gl.DotOperandLayout(0, ACC, 2))
        p_o = o + ((start + i_t * BT + tt).to(gl.int64) * HV + i_hv)[None, :] * V + vv[:, None]
        if OVERLAP:
            # The state update does not wait for the output: both in flight, the output stored while the update runs.
            ot_t = warpgroup_mma(vn_op, smem_p.permute([1, 0]), qst * r_q[None, :], is_async=True)
            s_t = warpgroup_mma(upd, smem_k, s * e_last, is_async=True)
            ot, vn_op = warpgroup_mma_wait(num_outstanding=1, deps=(ot_t, vn_op))
            gl.store(p_o, ot.to(o.dtype.element_ty), mask=(i_t * BT + tt < T)[None, :])
            s, upd = warpgroup_mma_wait(num_outstanding=0, deps=(s_t, upd))
        else:
            ot = warpgroup_mma(vn_op, smem_p.permute([1, 0]), qst * r_q[None, :])
            gl.store(p_o, ot.to(o.dtype.element_ty), mask=(i_t * BT + tt < T)[None, :])
            s = warpgroup_mma(upd, smem_k, s * e_last)

    mbarrier.invalidate(bars.index(0))
    mbarrier.invalidate(bars.index(1))
    if HAS_H_OUT:
        gl.store(h_out + p_state + k_cols[None, :] * stride_ok + v_rows[:, None] * stride_ov, s)


def refusal(q, k, v, t_rows: int) -> str | None:
    """Why the Gluon chain cannot take these inputs (None: it can): a CPU tensor (Gluon has no interpreter), a GPU
    other than Hopper (wgmma), inputs other than bf16, head sizes other than K = V = 128, inputs its TMA copies cannot
    address (16-byte alignment), or more rows of T (``t_rows``: chunk rows x value heads x 64) than an int32 holds."""
    if not q.is_cuda:
        return f"the Gluon chain runs on a CUDA GPU only, got q on {q.device}"
    import torch

    major, minor = torch.cuda.get_device_capability(q.device)
    if major != 9:
        return f"the Gluon chain uses Hopper's wgmma (sm_90), this GPU is sm_{major}{minor}"
    if not all(x.dtype == torch.bfloat16 for x in (q, k, v)):
        return f"the Gluon chain takes bf16 q, k, v, got {q.dtype}, {k.dtype}, {v.dtype}"
    if (q.shape[-1], v.shape[-1]) != (128, 128):
        return f"the Gluon chain is written for K = V = 128, got K={q.shape[-1]}, V={v.shape[-1]}"
    return addressing_refusal(q, k, v, t_rows)


def addressing_refusal(q, k, v, t_rows: int) -> str | None:
    """`refusal`'s part that only the tensors can answer (a planned call has checked the device, dtypes and head sizes
    already, `chunk_plan.gluon_chain_fits`): 16-byte alignment for the TMA copies, and T's rows within an int32."""
    misaligned = [name for name, x in (("q", q), ("k", k), ("v", v)) if x.data_ptr() % 16]
    if misaligned:
        return f"the Gluon chain's TMA copies need 16-byte aligned {', '.join(misaligned)}"
    if t_rows >= 2**31:
        return f"the Gluon chain addresses T by 32-bit rows, and this call has {t_rows}"
    return None


def launch(q, k, v, A, R, G, o, h_in, h_out, cu_seqlens, chunk_offsets, strides_in, strides_out, N: int,
           overlap: int = 0, rows: int = 128, staged_scales: bool = False, P=None) -> None:
    """`_gluon_chain_kernel` over every (sequence, value head) of a serial call (`triton_chunk`'s state call with its
    tensors; `refusal` has been asked); ``overlap``: 0, or its asynchronous-wgmma variants 1 and 2 (OVERLAP);
    ``rows``: the state's value rows per program (BV: 128, the whole state, or 64); ``staged_scales``: R by TMA with
    the chunk's tiles (STAGED_SCALES); ``P``: the scores form's masked scores `[NC, HV, 64, 64]` bf16 (SCORES_IN),
    None: made here."""
    if overlap not in (0, 1, 2):
        raise ValueError(f"overlap is 0, 1 or 2 (the kernel's OVERLAP), got {overlap!r}")
    if rows not in (64, 128):
        raise ValueError(f"rows is 64 or 128 (the state's value rows per program), got {rows!r}")
    if P is not None and overlap == 2:
        raise ValueError("overlap 2 puts the scores' wgmma in flight with two others; with the scores loaded (P) there "
                         "is none: overlap 0 or 1")
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    layout = _SW.value

    def desc(x, height, width, box_width, box_height=64, tile=layout):
        return TensorDescriptor(x, [height, width], [width, 1], [box_height, box_width], tile)

    # R's descriptor only where the kernel reads R by TMA (None is a constexpr there: nothing is built per call).
    r_desc = desc(R, R.numel() // 64, 64, 64, 8, _ROWS.value) if staged_scales else None
    p_desc = desc(P, P.numel() // 64, 64, 64) if P is not None else None
    _gluon_chain_kernel[(N * HV * (V // rows),)](
        desc(q, B * T, H * K, K), desc(k, B * T, H * K, K), desc(v, B * T, HV * V, rows),
        desc(A, A.numel() // 64, 64, 64), r_desc, p_desc, R, G, o, h_in, h_out, cu_seqlens, chunk_offsets,
        *strides_in, *strides_out,
        H, HV, K=K, V=V, HAS_H_IN=h_in is not None, HAS_H_OUT=h_out is not None, OVERLAP=overlap, BV=rows,
        STAGED_SCALES=staged_scales, SCORES_IN=P is not None, num_warps=warps_for(rows))
