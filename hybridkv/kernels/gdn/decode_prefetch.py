"""The in-place slot decode with its state and v rows prefetched into registers two blocks ahead.

`decode_rows` leaves two global-memory latencies on every program's critical path: a block's v rows (too narrow for
cp.async) are loaded in the loop and used at once, and the pipeliner issues the first state loads after the prologue
that loads and l2-norms q and k. Here each block's state and v rows are plain loads into registers, issued two blocks
before their use (loop-carried values), the first two before q and k are normed; q, k and the gate inputs are
requested even before the slot index the state loads wait for. No shared-memory staging, no cp.async group waits.
Two blocks of registers do not ask DRAM far enough ahead, so a config may also ask L2 for each block L2AHEAD blocks
before its use by one thread's bulk prefetch (`_l2_prefetch`: no register, nothing waits for it); only four-warp
configs take it (at one warp it cost more than it gained).

The arithmetic and block layout are `decode_rows`', so the two agree bit for bit (CPU interpreter). A decode tuner
candidate (`decode_kernels`) on the pools `decode_rows.eligible` takes.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

from hybridkv.kernels.gdn import pdl as _pdl
from hybridkv.kernels.gdn.fused_recurrent import _delta_rule_step, _head_loads, _head_math

# (BV rows a block, ROWS a program, num_warps[, L2AHEAD]): the probe's best for 35B bf16 at 64 sequences, for bf16 at
# 256 sequences, and for 397B bf16 at 64 sequences; then the four-warp ones with each block also asked into L2 three
# blocks before its use (`_l2_prefetch`). Not the one-warp config: there the prefetch cost more than it gained.
PREFETCH_CONFIGS = ((4, 128, 1), (8, 128, 4), (16, 128, 4), (16, 128, 4, 3), (8, 128, 4, 3))
# The interpreter (tests) records what `_l2_prefetch` asks for by this text in its asm.
L2_PREFETCH = "cp.async.bulk.prefetch.L2.global"
_L2_PREFETCH_ASM = tl.constexpr("{ .reg .pred p; .reg .u32 t; mov.u32 t, %tid.x; setp.eq.u32 p, t, 0; "
                                f"@p {L2_PREFETCH} [$1], $2; mov.u32 $0, 0; }}")


@triton.jit
def _l2_prefetch(ptr, nbytes):
    """Thread 0 of the program asks L2 for ``nbytes`` (a multiple of 16) from ``ptr`` (16-byte aligned): one
    cp.async.bulk.prefetch, which takes no register and nothing waits for; the data reaches L2 without the program."""
    tl.inline_asm_elementwise(
        _L2_PREFETCH_ASM, "=r,l,r", [ptr.to(tl.int64, bitcast=True), nbytes], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _block(base, v, i_nh, j, row0, o_r, o_k, live, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr,
           NB: tl.constexpr, STREAM: tl.constexpr):
    """Block j's state [BV, K] (the pool's dtype) and v rows [BV]: nothing read past the program's last block, nor a
    pad's state."""
    rows = row0 + j * BV + o_r
    inside = j < NB
    raw = tl.load(base + rows[:, None] * K + o_k[None, :], mask=live & inside, other=0.0,
                  eviction_policy="evict_first" if STREAM else "")
    b_v = tl.load(v + i_nh.to(tl.int64) * V + rows, mask=inside, other=0.0)
    return raw, b_v


@triton.jit
def _decode_prefetch_kernel(q, k, v, a, b, A_log, dt_bias, o, state, state_indices, scale, stride_slot, stride_head,
                            softplus_beta, softplus_threshold, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr,
                            V: tl.constexpr, BV: tl.constexpr, ROWS: tl.constexpr, L2NORM: tl.constexpr,
                            STREAM: tl.constexpr, L2AHEAD: tl.constexpr):
    """Grid (V / ROWS * N * HV,), row blocks fastest (one axis: a second stops at 65535). A pad (slot < 0) reads
    nothing, writes a zero output and leaves the pool alone. L2AHEAD (> 2, or 0 for off): each block from the third
    on is also asked into L2 (`_l2_prefetch`) L2AHEAD blocks before its use, so DRAM is asked further ahead than two
    blocks of registers reach."""
    NR: tl.constexpr = V // ROWS
    NB: tl.constexpr = ROWS // BV
    pid = tl.program_id(0)
    i_r, i_nh = pid % NR, pid // NR
    i_n, i_hv = i_nh // HV, i_nh % HV
    i_h = i_hv // (HV // H)
    o_k = tl.arange(0, K)
    o_r = tl.arange(0, BV)
    row0 = i_r * ROWS
    # q, k and the gate inputs are requested before the slot index: the state loads wait for the index, and loads
    # issued after them would queue behind that wait.
    r_q, r_k, r_a, r_dt, r_A, r_b = _head_loads(q, k, a, b, A_log, dt_bias, i_n, i_h, i_hv, i_nh, o_k, H, K)
    slot = tl.load(state_indices + i_n).to(tl.int64)
    live = slot >= 0
    base = state + tl.maximum(slot, 0) * stride_slot + i_hv * stride_head
    # The first two blocks are requested before anything is waited for.
    s0, v0 = _block(base, v, i_nh, 0, row0, o_r, o_k, live, K, V, BV, NB, STREAM)
    s1, v1 = _block(base, v, i_nh, 1, row0, o_r, o_k, live, K, V, BV, NB, STREAM)
    BLOCK_BYTES: tl.constexpr = BV * K * state.dtype.element_ty.primitive_bitwidth // 8
    if L2AHEAD:
        for i in tl.static_range(2, min(L2AHEAD, NB)):
            if live:
                _l2_prefetch(base + (row0 + i * BV) * K, BLOCK_BYTES)
    f_q, f_k, decay, beta = _head_math(r_q, r_k, r_a, r_dt, r_A, r_b, softplus_beta, softplus_threshold, L2NORM)
    # Unrolled by two so that ptxas renames the rotated registers instead of moving them (offline sm_90: 99 SASS
    # instructions a block at BV 8 against 129).
    for j in tl.range(0, NB, loop_unroll_factor=2):
        if L2AHEAD:
            if live & (j + L2AHEAD < NB):
                _l2_prefetch(base + (row0 + (j + L2AHEAD) * BV) * K, BLOCK_BYTES)
        raw, b_v = s0, v0
        s0, v0 = s1, v1
        s1, v1 = _block(base, v, i_nh, j + 2, row0, o_r, o_k, live, K, V, BV, NB, STREAM)
        rows = row0 + j * BV + o_r
        b_o, b_s = _delta_rule_step(raw.to(tl.float32) * decay, f_q, f_k, b_v.to(tl.float32), beta, scale)
        tl.store(o + i_nh.to(tl.int64) * V + rows, tl.where(live, b_o, 0.0).to(o.dtype.element_ty))
        # STREAM (16-bit states): each slot is read once and written once, as in the tile kernel.
        tl.store(base + rows[:, None] * K + o_k[None, :], b_s.to(state.dtype.element_ty), mask=live,
                 cache_modifier=".cs" if STREAM else "")


def l2_prefetchable(ssm_state) -> bool:
    """Whether `_l2_prefetch` may ask for this pool's blocks: a pool on a Hopper or later GPU (cp.async.bulk is sm_90's)
    whose base and two leading strides are 16-byte aligned (so is every block's first byte: rows are K elements, and
    K * 2 bytes is a multiple of 16 for the power-of-two K >= 16 the kernel takes). A misaligned address faults."""
    elt = ssm_state.element_size()
    if ssm_state.data_ptr() % 16 or any(ssm_state.stride(i) * elt % 16 for i in (0, 1)):
        return False
    if ssm_state.device.type == "cpu":  # Triton's CPU interpreter (tests), which runs no asm unless told how
        return os.environ.get("TRITON_INTERPRET") == "1"
    return ssm_state.device.type == "cuda" and _pdl._major(ssm_state.device.index) >= 9


def l2_ahead(cfg: tuple[int, ...]) -> int:
    """A config's L2AHEAD: its fourth field, 0 (no L2 prefetch) for a three-field config."""
    return cfg[3] if len(cfg) > 3 else 0


def launch(cfg, q, k, v, a, b, A_log, dt_bias, o, ssm_state, state_indices, scale, l2, softplus_beta,
           softplus_threshold) -> None:
    """One launch at ``cfg`` = (BV, ROWS, num_warps[, L2AHEAD]), ROWS capped at V and BV at ROWS; the caller has
    checked `decode_rows.eligible` (a V-first pool of contiguous K-element rows, power-of-two K and V >= 16)."""
    bv, rows, warps = cfg[:3]
    ahead = l2_ahead(cfg)
    if ahead and ahead <= 2:
        raise ValueError(f"L2AHEAD must be 0 (off) or more than the two blocks held in registers, got {ahead}")
    if ahead and not l2_prefetchable(ssm_state):
        raise ValueError(f"L2AHEAD={ahead} needs a pool on an sm_90+ GPU with a 16-byte aligned base and leading "
                         f"strides; got {ssm_state.device}, base {ssm_state.data_ptr():#x}, strides "
                         f"{ssm_state.stride()[:2]} of {ssm_state.element_size()}-byte elements")
    N, H, K = q.shape
    HV, V = v.shape[1], v.shape[2]
    rows = min(rows, V)
    bv = min(bv, rows)
    # num_stages=1: the loop's loads are prefetched by hand; the pipeliner must not turn them into cp.async.
    _decode_prefetch_kernel[(V // rows * N * HV,)](
        q, k, v, a, b, A_log, dt_bias, o, ssm_state, state_indices, scale, ssm_state.stride(0), ssm_state.stride(1),
        float(softplus_beta), float(softplus_threshold), H=H, HV=HV, K=K, V=V, BV=bv, ROWS=rows, L2NORM=l2,
        STREAM=ssm_state.element_size() == 2, L2AHEAD=ahead, num_warps=warps, num_stages=1)
