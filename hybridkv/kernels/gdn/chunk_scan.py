"""Intra-sequence parallelism for the chunked forward (`chunk_plan.Schedule.SCAN`): a sequence's chunks cut into
segments whose chains run at the same time.

With few value heads (Qwen3.5-397B at TP8: HV = 8) one sequence gives the state chain a few dozen programs, each
walking every chunk in turn; the call is as long as one chain. The state update of a chunk is affine in the state it
starts from,

    S' = e^g_last S + K^T D_d T (D_b V - D_k K S) = M S + B,

with M `[K, K]` independent of V, so a segment of chunks maps its start state to its end state by
S_end = M_seg S_start + B_seg. Three launches after the parallel kernels (inverse, scores):

1. `_segment_summary_kernel` runs every segment but the last from zero on an augmented state `[K, V + K]`: the first
   V columns take the segment's values (they end as B_seg), the last K start as the identity and take no values
   (they end as M_seg). Three GEMMs per chunk (no output), on V + K columns.
2. `_segment_scan_kernel` walks the segments of one (sequence, value head, V block): S_0 = the initial state,
   S_{j+1} = M_j S_j + B_j, in `SCAN_PRECISION` (tf32), writing each segment's start state.
3. The state kernel (`chunk._chunk_state_kernel` with SCAN) runs every segment at once from its start state, writing
   o, and the last segment the final state.

The chain work about doubles, traded for a chain that is a segment long; `chunk_plan.plan` picks it only where the
output chain's programs leave most SMs idle.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybridkv.kernels.gdn import pdl as _pdl
from hybridkv.kernels.gdn.inverse import _R_STRIDE
from hybridkv.kernels.gdn.chunk_rows import _chain_program

# Summary programs: BV columns of the augmented state each, four warps; two stages when many (sequence, value head)
# pairs fill the SMs, three when at most SUMMARY_FEW_HEADS do (each program then walks a long segment alone, and
# deeper load pipelining pays); beside an output chain at BV=64 (`chunk_plan.SCAN_WIDE_CONFIG`) with few pairs, BV=64
# too: half the programs, one wave.
SUMMARY_MANY_HEADS = (32, 4, 2)
SUMMARY_FEW_HEADS_CONFIG = (32, 4, 3)
SUMMARY_WIDE_FEW_HEADS_CONFIG = (64, 4, 3)
SUMMARY_FEW_HEADS = 8
# The scan kernel: SCAN_BV state columns per program, M's columns in slabs of SCAN_SLAB, its products in
# SCAN_PRECISION: tf32 (its rounding, 2^-11, is finer than that of the bf16 state operand every chunk of the chain
# takes) at 16 columns: the scan is a chain of dependent loads and products, so shorter steps pay.
SCAN_BV = 16
SCAN_SLAB = 32
SCAN_PRECISION = "tf32"


def summary_config(pairs: int, state_bv: int = 32) -> tuple[int, int, int]:
    """(BV, warps, stages) of the summary kernel for ``pairs`` (sequence, value head) pairs beside an output chain of
    ``state_bv`` columns per program (see above)."""
    if pairs > SUMMARY_FEW_HEADS:
        return SUMMARY_MANY_HEADS
    return SUMMARY_WIDE_FEW_HEADS_CONFIG if state_bv >= 64 else SUMMARY_FEW_HEADS_CONFIG


@triton.jit
def _segment_summary_kernel(k, v, A, R, G, summary, cu_seqlens, chunk_offsets, seg_chunks, seg0, H, HV,
                            K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                            PDL: tl.constexpr = False):
    """(B_seg | M_seg) of one (segment, sequence x value head, column block): grid
    (cdiv(V, BV) + cdiv(BK, BV), N * HV, segments) for the segments seg0, seg0 + 1, .. (a launch may take
    them all, or one as soon as its inverse is done). Column blocks below cdiv(V, BV) are B's, from
    zeros with the values; the rest M's, from the identity without values. Writes summary
    `[segments - 1, N * HV, BK, W]` fp32, W = (cdiv(V, BV) + cdiv(BK, BV)) * BV: B in the first
    cdiv(V, BV) * BV columns, M after them."""
    _pdl.wait(PDL)
    i_v, i_nh, i_hv, i_h, T, bos, c_first = _chain_program(cu_seqlens, chunk_offsets, H, HV)
    i_seg = seg0 + tl.program_id(2)
    dt = k.dtype.element_ty
    n_vb = tl.cdiv(V, BV)
    is_m = i_v >= n_vb
    o_i = tl.arange(0, 64)
    o_k = tl.arange(0, BK)
    o_c = tl.arange(0, BV)
    # M's columns start as the identity's (column c of M_seg is M_seg e_c); B's as zeros.
    eye_col = (i_v - n_vb) * BV + o_c
    b_s = tl.where(is_m & (o_k[:, None] == eye_col[None, :]), 1.0, 0.0).to(tl.float32)
    col = i_v * BV + o_c
    col_ok = (col < V) & (i_v < n_vb)

    n_t = tl.cdiv(T, 64)
    c_lo = i_seg * seg_chunks
    for i_t in range(c_lo, tl.minimum(n_t, c_lo + seg_chunks)):
        i_ch = (c_first + i_t) * HV + i_hv
        p_k = tl.make_block_ptr(k + (bos * H + i_h) * K, (T, K), (H * K, 1), (i_t * 64, 0), (64, BK), (1, 0))
        b_k = tl.load(p_k, boundary_check=(0, 1), padding_option="zero")
        rows = i_t * 64 + o_i
        p_v = v + (bos + rows.to(tl.int64))[:, None] * (HV * V) + i_hv * V + col[None, :]
        b_v = tl.load(p_v, mask=(rows < T)[:, None] & col_ok[None, :], other=0.0).to(tl.float32)
        b_a = tl.load(A + i_ch * 4096 + o_i[:, None] * 64 + o_i[None, :]).to(dt)
        p_r = R + i_ch * _R_STRIDE + o_i
        r_k = tl.load(p_r + 64)
        r_d = tl.load(p_r + 128)
        r_b = tl.load(p_r + 192)
        e_last = tl.load(G + i_ch)
        # The state kernel's chain without its output: the same operands in the same precision, so a
        # segment summed here and the same segment walked there agree.
        b_ks = tl.dot(b_k, b_s.to(dt))
        b_y = (b_v * r_b[:, None] - b_ks * r_k[:, None]).to(dt)
        b_vn = tl.dot(b_a, b_y)
        b_s = b_s * e_last + tl.dot(tl.trans(b_k), (b_vn * r_d[:, None]).to(dt))

    W = (n_vb + tl.cdiv(BK, BV)) * BV
    base = (i_seg.to(tl.int64) * tl.num_programs(1) + i_nh) * BK * W
    tl.store(summary + base + o_k[:, None] * W + col[None, :], b_s)


@triton.jit
def _segment_scan_kernel(summary, h_in, starts, stride_ik, stride_iv, n_seg, NH, W, MCOL, K: tl.constexpr,
                         V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, SLAB: tl.constexpr,
                         HAS_H_IN: tl.constexpr, PREC: tl.constexpr = "tf32x3",
                         PDL: tl.constexpr = False):
    """Start states of every segment of one (sequence x value head, V block): grid (cdiv(V, BV), N * HV).
    starts `[n_seg, N * HV, K, V]` fp32: segment 0's is h_in's (zeros without it), segment j + 1's is
    M_j S_j + B_j from summary (M_j in columns MCOL.. of its row block). Each S_j is read back from
    starts in SLAB-row slabs, so no [K, K] operand sits in registers."""
    _pdl.wait(PDL)
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    o_k = tl.arange(0, BK)
    o_s = tl.arange(0, SLAB)
    col = i_v * BV + tl.arange(0, BV)
    ok = (o_k[:, None] < K) & (col[None, :] < V)
    b_s = tl.zeros([BK, BV], dtype=tl.float32)
    if HAS_H_IN:
        b_s = tl.load(h_in + i_nh.to(tl.int64) * K * V + o_k[:, None] * stride_ik + col[None, :] * stride_iv,
                      mask=ok, other=0.0).to(tl.float32)
    p_start = starts + i_nh.to(tl.int64) * K * V + o_k[:, None] * V + col[None, :]
    tl.store(p_start, b_s, mask=ok)
    for j in range(0, n_seg - 1):
        # The stores above (this program's own threads) must be visible before the slabs are read back.
        tl.debug_barrier()
        blk = summary + (j * NH + i_nh).to(tl.int64) * BK * W
        acc = tl.load(blk + o_k[:, None] * W + col[None, :], mask=ok, other=0.0)
        prev = starts + (j * NH + i_nh).to(tl.int64) * K * V
        for s in tl.static_range(0, BK, SLAB):
            b_m = tl.load(blk + o_k[:, None] * W + MCOL + s + o_s[None, :])
            b_x = tl.load(prev + (s + o_s)[:, None] * V + col[None, :],
                          mask=((s + o_s)[:, None] < K) & (col[None, :] < V), other=0.0)
            acc = tl.dot(b_m, b_x, acc, input_precision=PREC)
        tl.store(starts + ((j + 1) * NH + i_nh).to(tl.int64) * K * V + o_k[:, None] * V + col[None, :], acc,
                 mask=ok)


def scan_call(run_inverse, run_scores, k, v, A, P, R, G, q, o, h0, final, strides, cu, chunk_offsets, NC, N, H, HV,
              K, V, BK, segments, config, scores_in, work_log2, *, pdl, state_kernel):
    """This schedule's launches: the parallel kernels (``run_inverse(c_lo, c_hi, segmented)`` and
    ``run_scores(c_lo, c_hi, segmented, pdl)``, the launches of `chunk.chunk_gated_delta_rule_fwd`), the summaries,
    the scan, the output chain (``state_kernel``, `chunk._chunk_state_kernel`) over every segment at once. ``pdl``
    (the caller's `pdl.enabled`): every launch after the inverse is a programmatic dependent launch."""
    launch = _pdl.launch_kwargs(pdl)

    seg_chunks = triton.cdiv(NC, segments)  # NC bounds every sequence's chunk count
    NH = N * HV
    sbv, swarps, sstages = summary_config(NH, config[0])
    n_vb, n_mb = triton.cdiv(V, sbv), triton.cdiv(BK, sbv)
    W = (n_vb + n_mb) * sbv
    starts = q.new_empty((segments, NH, K, V), dtype=torch.float32)
    # Never read with one segment: no segment follows the first.
    summary = q.new_empty((segments - 1, NH, BK, W), dtype=torch.float32) if segments > 1 else starts

    def summarize(seg0, count):
        _segment_summary_kernel[(n_vb + n_mb, NH, count)](
            k, v, A, R, G, summary, cu, chunk_offsets, seg_chunks, seg0, H, HV, K=K, V=V, BK=BK, BV=sbv,
            num_warps=swarps, num_stages=sstages, **launch)

    run_inverse(0, NC, False)
    run_scores(0, NC, False, pdl)
    if segments > 1:
        summarize(0, segments - 1)
    _segment_scan_kernel[(triton.cdiv(V, SCAN_BV), NH)](
        summary, h0, starts, *strides, segments, NH, W, n_vb * sbv, K=K, V=V, BK=BK, BV=SCAN_BV,
        SLAB=min(SCAN_SLAB, BK), HAS_H_IN=h0 is not None, PREC=SCAN_PRECISION, num_warps=4, num_stages=1,
        **launch)
    bv, warps, stages = config
    state_kernel[(triton.cdiv(V, bv), NH, segments)](
        q, k, v, A, P, R, G, o, starts, final, cu, chunk_offsets, 0, seg_chunks, V, 1, *strides, H, HV,
        WORK_LOG2=work_log2, K=K, V=V, BK=BK, BV=bv, HAS_H_IN=True, HAS_H_OUT=final is not None,
        SEGMENTED=False, SCORES_IN=scores_in, SCAN=True, num_warps=warps, num_stages=stages, **launch)
