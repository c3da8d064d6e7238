"""The prefill state chain in Gluon for Hopper: wgmma with the state as its register operand.

Runs the same arithmetic as the Triton chain (`chunk._chunk_state_kernel`: the inverse kernel's A, R, G and raw q,
k, v) the way FlashInfer's SM90 kernel does: everything is computed transposed (value rows x tokens) so that the
fp32 state S^T is always wgmma's left operand and never goes through shared memory, while q, k, v and T arrive by
TMA two chunks deep. A program holds ROWS = 64 of the state's 128 value rows (one warpgroup, two programs per SM),
and keeps two wgmmas in flight where nothing orders them (v_new beside S^T Q^T, the state update beside the
output). `chunk_plan` runs it for long bf16 batches and for one prompt of 397B-shaped heads (serial schedule);
Gluon has no CPU interpreter, so it is checked on a GPU only. SCORES_IN (the scores form): the masked scores P
arrive by TMA with the chunk's tiles instead of being made here.
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


ROWS = 64  # value rows of the state per program


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
def _issue(q_desc, k_desc, v_desc, a_desc, p_desc, bars, qs, ks, vs, as_, ps, stage, t0, i_ch, i_h, v0,
           K: gl.constexpr, BV: gl.constexpr, SCORES_IN: gl.constexpr):
    """Start the TMA copies of one chunk's q, k, its BV columns of v (from column v0), T and (SCORES_IN) its masked
    scores into buffer ``stage``; its barrier completes with them."""
    bar = bars.index(stage)
    mbarrier.expect(bar, 2 * BT * K * 2 + BT * BV * 2 + BT * BT * 2 + (BT * BT * 2 if SCORES_IN else 0))
    tma.async_copy_global_to_shared(q_desc, [t0, i_h * K], bar, qs.index(stage))
    tma.async_copy_global_to_shared(k_desc, [t0, i_h * K], bar, ks.index(stage))
    tma.async_copy_global_to_shared(v_desc, [t0, v0], bar, vs.index(stage))
    tma.async_copy_global_to_shared(a_desc, [i_ch * BT, 0], bar, as_.index(stage))
    if SCORES_IN:
        tma.async_copy_global_to_shared(p_desc, [i_ch * BT, 0], bar, ps.index(stage))


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
def _gluon_chain_kernel(q_desc, k_desc, v_desc, a_desc, p_desc, R, G, o, h_in, h_out, cu_seqlens,
                        chunk_offsets, stride_ik, stride_iv, stride_ok, stride_ov, H, HV, K: gl.constexpr,
                        V: gl.constexpr, HAS_H_IN: gl.constexpr, HAS_H_OUT: gl.constexpr, BV: gl.constexpr = 64,
                        SCORES_IN: gl.constexpr = False):
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

    SCORES_IN (`chunk_plan.Form.SCORES`): the masked scores come from P `[NC * HV * 64, 64]` (the inverse's or the
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
        _issue(q_desc, k_desc, v_desc, a_desc, p_desc, bars, qs, ks, vs, as_, ps, 0, start,
               c_first * HV + i_hv, i_h, v0, K, BV, SCORES_IN)
    for i_t in range(0, n_t):
        stage = i_t % 2
        i_ch = (c_first + i_t).to(gl.int64) * HV + i_hv
        if i_t + 1 < n_t:
            # The other buffer was read by the previous chunk's products: every warp is past them first.
            gl.thread_barrier()
            _issue(q_desc, k_desc, v_desc, a_desc, p_desc, bars, qs, ks, vs, as_, ps, 1 - stage,
                   start + (i_t + 1) * BT, (c_first + i_t + 1) * HV + i_hv, i_h, v0, K, BV, SCORES_IN)
        # Row scales from global memory, issued before the wait for the tiles.
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
        if (i_t + 1) * BT > T:
            # The last chunk runs past the sequence's end into the next sequence's rows, which may hold anything
            # (inf included). The row scales there are zero, but 0 * inf is NaN: those rows of k and v become zero
            # first (q's reach only o's unstored columns; the scores' are masked by a select).
            _zero_rows_past(smem_k, i_t * BT, T, LD)
            _zero_rows_past(smem_v, i_t * BT, T, LD)
            fence_async_shared()

        # P = scale (q_i . k_j) rq_i rk_j e^(gamma_i - gamma_j) for j <= i (`chunk_rows._masked_scores`).
        if not SCORES_IN:
            decay = gl.exp(gl.where(causal, c_i[:, None] - c_j[None, :], 0.0))
            row_scales = sq_i[:, None] * rk_j[None, :]
        # The chain, transposed: (k S)^T = S^T k^T and (q S)^T = S^T q^T with the state as the register operand;
        # v_new^T = y^T T^T; o^T = (q S)^T r_q + v_new^T P^T; S^T = e_last S^T + (v_new r_d)^T k. In this order so
        # that few [V, 64] tiles are alive at once (the state alone takes 64 registers a thread).
        if not SCORES_IN:
            qk = warpgroup_mma(smem_q, smem_k.permute([1, 0]), gl.zeros([BT, BT], gl.float32, layout=QK))
            smem_p.store(gl.where(causal, qk * decay * row_scales, 0.0).to(gl.bfloat16))
            fence_async_shared()
        s_op = gl.convert_layout(s.to(gl.bfloat16), a_op)
        kst = warpgroup_mma(s_op, smem_k.permute([1, 0]), gl.zeros([BV, BT], gl.float32, layout=ACC64))
        vt = smem_v.permute([1, 0]).load(ACC64).to(gl.float32)  # v^T [V, 64]
        yt = gl.convert_layout((vt * r_b[None, :] - kst * r_k[None, :]).to(gl.bfloat16), a_op)
        # v_new and S^T Q^T in flight together.
        vnt_t = warpgroup_mma(yt, smem_a.permute([1, 0]), gl.zeros([BV, BT], gl.float32, layout=ACC64),
                              is_async=True)
        qst_t = warpgroup_mma(s_op, smem_q.permute([1, 0]), gl.zeros([BV, BT], gl.float32, layout=ACC64),
                              is_async=True)
        vnt, qst, yt, s_op = warpgroup_mma_wait(num_outstanding=0, deps=(vnt_t, qst_t, yt, s_op))
        vn_op = gl.convert_layout(vnt.to(gl.bfloat16), a_op)
        upd = gl.convert_layout((vnt * r_d[None, :]).to(gl.bfloat16), gl.DotOperandLayout(0, ACC, 2))
        p_o = o + ((start + i_t * BT + tt).to(gl.int64) * HV + i_hv)[None, :] * V + vv[:, None]
        # The state update does not wait for the output: both in flight, the output stored while the update runs.
        ot_t = warpgroup_mma(vn_op, smem_p.permute([1, 0]), qst * r_q[None, :], is_async=True)
        s_t = warpgroup_mma(upd, smem_k, s * e_last, is_async=True)
        ot, vn_op = warpgroup_mma_wait(num_outstanding=1, deps=(ot_t, vn_op))
        gl.store(p_o, ot.to(o.dtype.element_ty), mask=(i_t * BT + tt < T)[None, :])
        s, upd = warpgroup_mma_wait(num_outstanding=0, deps=(s_t, upd))

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
           P=None) -> None:
    """`_gluon_chain_kernel` over every (sequence, value head) of a serial call (`chunk`'s state call with its tensors;
    `refusal` has been asked), ROWS value rows of the state per program; ``P``: the scores form's masked scores
    `[NC, HV, 64, 64]` bf16 (SCORES_IN), None: made here."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    layout = _SW.value

    def desc(x, height, width, box_width, box_height=64):
        return TensorDescriptor(x, [height, width], [width, 1], [box_height, box_width], layout)

    p_desc = desc(P, P.numel() // 64, 64, 64) if P is not None else None
    _gluon_chain_kernel[(N * HV * (V // ROWS),)](
        desc(q, B * T, H * K, K), desc(k, B * T, H * K, K), desc(v, B * T, HV * V, ROWS),
        desc(A, A.numel() // 64, 64, 64), p_desc, R, G, o, h_in, h_out, cu_seqlens, chunk_offsets,
        *strides_in, *strides_out,
        H, HV, K=K, V=V, HAS_H_IN=h_in is not None, HAS_H_OUT=h_out is not None, BV=ROWS,
        SCORES_IN=P is not None, num_warps=warps_for(ROWS))
