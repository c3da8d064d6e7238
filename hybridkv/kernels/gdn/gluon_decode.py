"""The in-place slot decode in Gluon, for Hopper: `triton_decode_tma`'s persistent TMA walk with its layout and its
pipeline written out rather than chosen by Triton.

Why: at 64 sequences of a 35B-shaped bf16 state the Triton walk reaches 71-73% of copy bandwidth, and a line through
two batch sizes puts it at 7.0 us + 0.255 us/MB against a copy's 4.1 us + 0.230 us/MB (benchmarks/gdn/README.md,
"Decode"): both the per-call part and the per-byte part are short. Offline sm_90, the Triton walk's loop converts q and
k between layouts through shared memory, reduces across warps (28 bar.sync in the kernel), waits for each tile's TMA
store to finish reading shared memory before the next tile's store (one store buffer), and loads each next tile's
slot index just before addressing its state. Here:

- a [BV, K] tile is spread so that no reduction crosses a warp: a thread holds K / 8 contiguous elements of 4 rows
  per warp's pass, 8 lanes share a row (`_tile_layout`); q and k arrive in the column slice of that layout, so
  nothing is converted and the l2 norms and both row sums are a few shuffles;
- STAGES state tiles in flight per program through an mbarrier ring, and the slot index of the tile to be issued
  next is loaded one tile ahead, so the issue never waits on it;
- two store buffers: a tile's TMA store waits only for the one before the previous (`tma.store_wait(1)`).

Arithmetic: `triton_recurrent._delta_rule_step`'s (decay, both row sums on the decayed state, S q + delta (k . q)),
summed in another order, so equal to the tile kernel to rounding, not bit for bit. Gluon has no CPU interpreter:
checked on a GPU only (tests/kernels/test_gdn_triton.py, against the reference and the tile kernel).
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma

# (BV, num_warps, programs per SM, state tiles in ring): what the probe times (benchmarks/gdn/decode_probe.py --gluon).
# Shared memory per program is the ring plus two store buffers, each a [BV, K] tile (bf16 BV=64: 16 KB), so bf16 at
# BV=64 fits two programs per SM with a ring of 3 or 4 and four at BV=32; fp32 half as many.
GLUON_DECODE_CONFIGS = ((64, 4, 2, 3), (64, 4, 2, 4), (64, 8, 2, 4), (32, 4, 4, 4), (32, 4, 2, 6), (32, 4, 3, 4))
_LANES_K = 8  # lanes along K: a thread holds K / 8 contiguous elements of a row


def _tile_layout(K: int, warps: int) -> gl.BlockedLayout:
    return gl.BlockedLayout([1, K // _LANES_K], [32 // _LANES_K, _LANES_K], [warps, 1], [1, 0])


@gluon.jit
def _issue(desc, bars, bufs, stage, t, slot, HV: gl.constexpr, NV: gl.constexpr, BV: gl.constexpr,
           NBYTES: gl.constexpr):
    """TMA-load tile t's state (slot ``slot``; a pad reads slot 0, dropped later) into ring buffer ``stage``."""
    i_v = t % NV
    i_hv = (t // NV) % HV
    bar = bars.index(stage)
    mbarrier.expect(bar, NBYTES)
    tma.async_copy_global_to_shared(desc, [gl.maximum(slot, 0), i_hv, i_v * BV, 0], bar, bufs.index(stage))


@gluon.jit
def _gluon_decode_kernel(q, k, v, a, b, A_log, dt_bias, o, desc, state_indices, N, progs, scale, softplus_beta,
                         softplus_threshold, H: gl.constexpr, HV: gl.constexpr, K: gl.constexpr, V: gl.constexpr,
                         BV: gl.constexpr, L2NORM: gl.constexpr, STAGES: gl.constexpr, L: gl.constexpr,
                         FLAT: gl.constexpr, NBYTES: gl.constexpr):
    """Grid (progs,): program p takes tiles p, p + progs, ... of the N * HV * (V / BV) [BV, K] tiles, each one
    (sequence, value head, V block), as `triton_decode_tma._decode_tma_kernel`. A pad (slot < 0) writes a zero
    output row and leaves the pool alone. L: the tile's register layout (`_tile_layout`); FLAT: the descriptor's
    shared layout at rank 2 (a [1, 1, BV, K] box is a [BV, K] tile in shared memory); NBYTES: one box's bytes."""
    pid = gl.program_id(0)
    NV: gl.constexpr = V // BV
    n_mine = gl.cdiv(N * HV * NV - pid, progs)
    row: gl.constexpr = gl.SliceLayout(1, L)
    col: gl.constexpr = gl.SliceLayout(0, L)
    o_k = gl.arange(0, K, layout=col)
    o_bv = gl.arange(0, BV, layout=row)

    bufs = gl.allocate_shared_memory(desc.dtype, [STAGES, 1, 1, BV, K], desc.layout)
    outs = gl.allocate_shared_memory(desc.dtype, [2, 1, 1, BV, K], desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(bars.index(s), count=1)
    for s in gl.static_range(STAGES - 1):
        if s < n_mine:
            t = pid + s * progs
            _issue(desc, bars, bufs, s, t, gl.load(state_indices + t // (NV * HV)).to(gl.int32), HV, NV, BV, NBYTES)
    # The slot of the next tile to issue, one tile ahead of its issue.
    t_next = pid + (STAGES - 1) * progs
    slot_next = gl.load(state_indices + gl.minimum(t_next, N * HV * NV - 1) // (NV * HV)).to(gl.int32)
    n_st = 0
    for j in range(n_mine):
        t = pid + j * progs
        stage = j % STAGES
        # The buffer refilled here was read (into registers) by the previous tile: every warp is past that first.
        gl.thread_barrier()
        if j + STAGES - 1 < n_mine:
            _issue(desc, bars, bufs, (j + STAGES - 1) % STAGES, t_next, slot_next, HV, NV, BV, NBYTES)
            t_next += progs
            slot_next = gl.load(state_indices + gl.minimum(t_next, N * HV * NV - 1) // (NV * HV)).to(gl.int32)
        i_v = t % NV
        i_hv = (t // NV) % HV
        i_n = t // (NV * HV)
        row_h = i_n.to(gl.int64) * H + i_hv // (HV // H)
        row_hv = i_n.to(gl.int64) * HV + i_hv
        slot = gl.load(state_indices + i_n).to(gl.int32)
        f_q = gl.load(q + row_h * K + o_k).to(gl.float32)
        f_k = gl.load(k + row_h * K + o_k).to(gl.float32)
        f_v = gl.load(v + row_hv * V + i_v * BV + o_bv).to(gl.float32)
        x = gl.load(a + row_hv).to(gl.float32) + gl.load(dt_bias + i_hv).to(gl.float32)
        beta = 1.0 / (1.0 + gl.exp(-gl.load(b + row_hv).to(gl.float32)))
        neg_a = -gl.exp(gl.load(A_log + i_hv).to(gl.float32))
        bx = softplus_beta * x
        sp = gl.where(bx <= softplus_threshold, gl.log(1.0 + gl.exp(bx)) / softplus_beta, x)
        if L2NORM:
            f_q = f_q * gl.rsqrt(gl.sum(f_q * f_q, 0) + 1e-6)
            f_k = f_k * gl.rsqrt(gl.sum(f_k * f_k, 0) + 1e-6)

        mbarrier.wait(bars.index(stage), (j // STAGES) & 1)
        raw = bufs.index(stage)._reinterpret(desc.dtype, [BV, K], FLAT).load(L)
        s_t = raw.to(gl.float32) * gl.exp(neg_a * sp)
        pred = gl.sum(s_t * f_k[None, :], 1)
        s_q = gl.sum(s_t * f_q[None, :], 1)
        delta = beta * (f_v - pred)
        b_o = (s_q + delta * gl.sum(f_k * f_q, 0)) * scale
        s_t = s_t + delta[:, None] * f_k[None, :]
        gl.store(o + row_hv * V + i_v * BV + o_bv, gl.where(slot >= 0, b_o, 0.0).to(o.dtype.element_ty))
        if slot >= 0:
            out = outs.index(n_st % 2)
            # The store that last read this buffer (two stores ago) is done with it: waited for by the thread that
            # issued it, and every thread past that before any writes.
            tma.store_wait(1)
            gl.thread_barrier()
            out._reinterpret(desc.dtype, [BV, K], FLAT).store(s_t.to(desc.dtype))
            fence_async_shared()
            gl.thread_barrier()
            tma.async_copy_shared_to_global(desc, [slot, i_hv, i_v * BV, 0], out)
            n_st += 1
    tma.store_wait(0)
    for s in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(s))


_sms: dict[int, int] = {}


def _sm_count(device: torch.device) -> int:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _sms:
        _sms[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _sms[index]


def eligible(q: torch.Tensor, v: torch.Tensor, ssm_state: torch.Tensor, v_first: bool) -> bool:
    """`triton_decode_tma.eligible` (a V-first pool a tensor descriptor can describe, on sm_90+), on Hopper only
    (the layouts and the ring are written for it), with K a multiple of 8 lanes x 4 elements."""
    from hybridkv.kernels.gdn import triton_decode_tma

    if not triton_decode_tma.eligible(q, v, ssm_state, v_first):
        return False
    return torch.cuda.get_device_capability(q.device)[0] == 9 and q.shape[-1] % (_LANES_K * 4) == 0


def launch(cfg, q, k, v, a, b, A_log, dt_bias, o, ssm_state, state_indices, scale, l2, softplus_beta,
           softplus_threshold) -> None:
    """One launch at ``cfg`` = (BV, num_warps, programs per SM, state tiles in flight); the caller has checked
    `eligible`. BV is capped at V."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    bv, warps, per_sm, stages = cfg
    N, H, K = q.shape
    HV, V = v.shape[1], v.shape[2]
    bv = min(bv, V)
    if stages < 2:
        raise ValueError(f"the Gluon decode keeps at least 2 state tiles in flight, got {stages}")
    dtype = {torch.float32: gl.float32, torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}[ssm_state.dtype]
    box = [1, 1, bv, K]
    layout = gl.NVMMASharedLayout.get_default_for(box, dtype)
    desc = TensorDescriptor(ssm_state, list(ssm_state.shape), list(ssm_state.stride()), box, layout)
    programs = max(1, min(per_sm * _sm_count(q.device), N * HV * (V // bv)))
    _gluon_decode_kernel[(programs,)](
        q, k, v, a, b, A_log, dt_bias, o, desc, state_indices, N, programs, scale, float(softplus_beta),
        float(softplus_threshold), H=H, HV=HV, K=K, V=V, BV=bv, L2NORM=l2, STAGES=stages,
        L=_tile_layout(K, warps), FLAT=gl.NVMMASharedLayout(layout.swizzle_byte_width, layout.element_bitwidth, 2),
        NBYTES=bv * K * ssm_state.element_size(), num_warps=warps)
