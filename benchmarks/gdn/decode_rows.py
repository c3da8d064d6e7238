"""Probe (twelfth session): a decode kernel that holds a few state rows per thread and loops over its head's rows.

FlashInfer 0.7.2's fp32 pool decode (`gated_delta_rule_decode_pretranspose`) ran 4-5% ahead of hybridkv's at every
fp32 shape of `bench gdn` in the same run (results/bench_gdn_fi_decode_twelfth_h200.txt: 92.3% of copy bandwidth at
35B with 256 sequences against 87.8). Its kernel is not persistent and keeps little in registers: a program takes one
(sequence, value head) or an eighth of one, loads q and k once, and streams its V rows through shared memory a few rows
at a time (cp.async, two stages), a warp a row with four K elements a lane, storing each updated row straight from
registers. Few registers a thread means many programs an SM to hide the load latency behind, where hybridkv's TMA walk
holds a [64, 128] tile in 128 registers and keeps 16 warps an SM.

This is that shape in Triton: grid (V / ROWS, N * HV), q, k and the gates once a program, then ROWS / BV steps of a
[BV, K] block whose loads Triton's pipeliner turns into cp.async STAGES deep. The arithmetic is the tile kernel's
(`triton_recurrent._delta_rule_step`), row by row, so it equals it to rounding (the sums' order follows the layout).
`decode_probe --rows` times it beside the shipped choice.
"""

from __future__ import annotations

import triton
import triton.language as tl

from hybridkv.kernels.gdn.triton_recurrent import _delta_rule_step, _l2norm, _softplus

# (BV rows a step, ROWS a program, num_warps, stages)
CONFIGS = ((4, 128, 4, 3), (8, 128, 4, 3), (8, 64, 4, 3), (4, 32, 4, 3), (16, 128, 4, 2), (8, 128, 8, 3),
           (4, 128, 4, 4), (16, 64, 4, 3))


@triton.jit
def _decode_rows_kernel(q, k, v, a, b, A_log, dt_bias, o, state, state_indices, scale, stride_slot, stride_head,
                        softplus_beta, softplus_threshold, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr,
                        V: tl.constexpr, BV: tl.constexpr, ROWS: tl.constexpr, STAGES: tl.constexpr,
                        STREAM: tl.constexpr):
    i_r, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_hv = i_nh // HV, i_nh % HV
    i_h = i_hv // (HV // H)
    o_k = tl.arange(0, K)
    slot = tl.load(state_indices + i_n).to(tl.int64)
    live = slot >= 0
    f_q = _l2norm(tl.load(q + (i_n * H + i_h) * K + o_k).to(tl.float32))
    f_k = _l2norm(tl.load(k + (i_n * H + i_h) * K + o_k).to(tl.float32))
    x = tl.load(a + i_nh).to(tl.float32) + tl.load(dt_bias + i_hv).to(tl.float32)
    decay = tl.exp(-tl.exp(tl.load(A_log + i_hv).to(tl.float32)) * _softplus(x, softplus_beta, softplus_threshold))
    beta = tl.sigmoid(tl.load(b + i_nh).to(tl.float32))
    base = state + tl.maximum(slot, 0) * stride_slot + i_hv * stride_head
    for j in tl.range(0, ROWS // BV, num_stages=STAGES):
        rows = i_r * ROWS + j * BV + tl.arange(0, BV)
        p = base + rows[:, None] * K + o_k[None, :]
        raw = tl.load(p, mask=live, other=0.0, eviction_policy="evict_first" if STREAM else "")
        b_v = tl.load(v + i_nh.to(tl.int64) * V + rows).to(tl.float32)
        b_o, b_s = _delta_rule_step(raw.to(tl.float32) * decay, f_q, f_k, b_v, beta, scale)
        tl.store(o + i_nh.to(tl.int64) * V + rows, tl.where(live, b_o, 0.0).to(o.dtype.element_ty))
        tl.store(p, b_s.to(state.dtype.element_ty), mask=live, cache_modifier=".cs" if STREAM else "")


def launch(cfg, q, k, v, a, b, A_log, dt_bias, o, pool, idx, scale=None, softplus_beta=1.0, softplus_threshold=20.0):
    """One launch at cfg = (BV, ROWS, num_warps, stages) on a V-first pool [slots, HV, V, K] with contiguous rows."""
    bv, rows, warps, stages = cfg
    N, H, K = q.shape
    HV, V = v.shape[1], v.shape[2]
    rows = min(rows, V)
    if V % rows or rows % bv or pool.stride(-1) != 1 or pool.stride(-2) != K:
        raise ValueError(f"decode_rows needs V % ROWS == ROWS % BV == 0 and rows of K contiguous elements; got "
                         f"V={V}, cfg={cfg}, pool strides {pool.stride()}")
    _decode_rows_kernel[(V // rows, N * HV)](
        q, k, v, a, b, A_log, dt_bias, o, pool, idx, K**-0.5 if scale is None else scale, pool.stride(0),
        pool.stride(1), float(softplus_beta), float(softplus_threshold), H=H, HV=HV, K=K, V=V, BV=bv, ROWS=rows,
        STAGES=stages, STREAM=pool.element_size() == 2, num_warps=warps)
