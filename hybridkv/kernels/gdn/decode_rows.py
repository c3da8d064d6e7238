"""The in-place slot decode with few state rows a thread: a program loops over its head's rows.

A program takes ROWS of one (sequence, value head)'s V rows, loads q, k and the gates once, then steps through them
BV rows at a time, the [BV, K] loads turned into cp.async STAGES deep by Triton's pipeliner and each updated block
stored straight from registers. Few registers a thread (48 at (8, 64, 4 warps, 3 stages)), so many programs share an
SM and hide each other's load latency; FlashInfer's fp32 pool decode has this shape. The arithmetic is the tile
kernel's (`fused_recurrent._delta_rule_step`) block by block, so it equals it to the order of the row sums (bit for
bit in the CPU interpreter). A decode tuner candidate (`decode_kernels`) where it can run (`eligible`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybridkv.kernels.gdn.fused_recurrent import _delta_rule_step, _head_inputs

# (BV rows a step, ROWS a program, num_warps, stages): the probe's best for fp32 (8, 64) and (4, 32) and for bf16
# (8, 128), (16, 64) and (16, 128 at two stages).
ROWS_CONFIGS = ((8, 64, 4, 3), (4, 32, 4, 3), (16, 64, 4, 3), (8, 128, 4, 3), (16, 128, 4, 2))


@triton.jit
def _decode_rows_kernel(q, k, v, a, b, A_log, dt_bias, o, state, state_indices, scale, stride_slot, stride_head,
                        softplus_beta, softplus_threshold, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr,
                        V: tl.constexpr, BV: tl.constexpr, ROWS: tl.constexpr, STAGES: tl.constexpr,
                        L2NORM: tl.constexpr, STREAM: tl.constexpr):
    """Grid (V / ROWS * N * HV,), row blocks fastest (one axis: a second stops at 65535). A pad (slot < 0) reads
    nothing, writes a zero output and leaves the pool alone."""
    NR: tl.constexpr = V // ROWS
    pid = tl.program_id(0)
    i_r, i_nh = pid % NR, pid // NR
    i_n, i_hv = i_nh // HV, i_nh % HV
    i_h = i_hv // (HV // H)
    o_k = tl.arange(0, K)
    slot = tl.load(state_indices + i_n).to(tl.int64)
    live = slot >= 0
    f_q, f_k, decay, beta = _head_inputs(q, k, a, b, A_log, dt_bias, i_n, i_h, i_hv, i_nh, o_k, softplus_beta,
                                         softplus_threshold, H, K, L2NORM)
    base = state + tl.maximum(slot, 0) * stride_slot + i_hv * stride_head
    for j in tl.range(0, ROWS // BV, num_stages=STAGES):
        rows = i_r * ROWS + j * BV + tl.arange(0, BV)
        p = base + rows[:, None] * K + o_k[None, :]
        # STREAM (16-bit states): each slot is read once and written once; the store streams (.cs) as the tile
        # kernel's does. The load's evict-first hint does not survive Triton's cp.async lowering (offline sm_90 PTX).
        raw = tl.load(p, mask=live, other=0.0, eviction_policy="evict_first" if STREAM else "")
        b_v = tl.load(v + i_nh.to(tl.int64) * V + rows).to(tl.float32)
        b_o, b_s = _delta_rule_step(raw.to(tl.float32) * decay, f_q, f_k, b_v, beta, scale)
        tl.store(o + i_nh.to(tl.int64) * V + rows, tl.where(live, b_o, 0.0).to(o.dtype.element_ty))
        tl.store(p, b_s.to(state.dtype.element_ty), mask=live, cache_modifier=".cs" if STREAM else "")


def eligible(q: torch.Tensor, v: torch.Tensor, ssm_state: torch.Tensor, v_first: bool) -> bool:
    """Whether this kernel can serve a decode call: a CUDA V-first `[slots, HV, V, K]` pool whose V rows are K
    contiguous elements, power-of-two K and V of at least 16 (every config's ROWS, capped at V, divides V)."""
    if ssm_state.device.type != "cuda" or not v_first or ssm_state.dim() != 4:
        return False
    K, V = q.shape[-1], v.shape[-1]
    if K != triton.next_power_of_2(K) or V != triton.next_power_of_2(V) or V < 16:
        return False
    return ssm_state.stride(-1) == 1 and ssm_state.stride(-2) == K


def launch(cfg, q, k, v, a, b, A_log, dt_bias, o, ssm_state, state_indices, scale, l2, softplus_beta,
           softplus_threshold) -> None:
    """One launch at ``cfg`` = (BV, ROWS, num_warps, stages), ROWS capped at V and BV at ROWS; the caller has checked
    `eligible`."""
    bv, rows, warps, stages = cfg
    N, H, K = q.shape
    HV, V = v.shape[1], v.shape[2]
    rows = min(rows, V)
    bv = min(bv, rows)
    _decode_rows_kernel[(V // rows * N * HV,)](
        q, k, v, a, b, A_log, dt_bias, o, ssm_state, state_indices, scale, ssm_state.stride(0), ssm_state.stride(1),
        float(softplus_beta), float(softplus_threshold), H=H, HV=HV, K=K, V=V, BV=bv, ROWS=rows, STAGES=stages,
        L2NORM=l2, STREAM=ssm_state.element_size() == 2, num_warps=warps)
