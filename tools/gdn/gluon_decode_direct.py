"""A probe candidate for issue #23's decode goal (35B bf16 state at 64 sequences): the TMA decode walk in Gluon, its
layout chosen so that no reduction crosses a warp, and its updated tiles stored straight from registers.

The first Gluon walk (46c6401, reverted; tools/gdn/README.md, "Decode") had that layout and an mbarrier ring, and
was 6-20 points of copy bandwidth behind the Triton walk at 64 sequences. What it also had: two TMA store buffers (so
bf16 at BV 64 fitted two programs per SM, not four) and three CTA barriers per tile around each store. Here the store
is 16-byte `st.global.cs` from the registers that hold the tile (as `triton_decode_tma.Store.DIRECT`), so shared memory
is the ring alone (bf16, BV 64, three tiles: 48 KB, four programs per SM) and one barrier per tile remains, the one
that keeps the ring's refill behind every warp's read of that buffer. A pad (slot -1) asks for a box out of bounds:
TMA zero-fills it and reads nothing, as in the shipped walk.

Arithmetic: `triton_recurrent._delta_rule_step`'s, summed in another order (8 lanes share a row), so equal to the
shipped walk to rounding. Gluon has no CPU interpreter: `decode_probe --store` checks it against the shipped walk on
the GPU (its err column) and `hybridkv kernels report`-style offline compiles (see `compile`) check its registers.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma

_LANES_K = 8  # lanes along K: a thread holds K / 8 contiguous elements of a row (16 bf16 = two 16-byte stores)


def tile_layout(K: int, warps: int) -> gl.BlockedLayout:
    return gl.BlockedLayout([1, K // _LANES_K], [32 // _LANES_K, _LANES_K], [warps, 1], [1, 0])


@gluon.jit
def _issue(desc, bars, bufs, stage, t, slot, HV: gl.constexpr, NV: gl.constexpr, BV: gl.constexpr,
           NBYTES: gl.constexpr):
    """TMA-load tile t's state (slot ``slot``; a pad's -1 is out of bounds: zeros, nothing read) into ``stage``."""
    i_v = t % NV
    i_hv = (t // NV) % HV
    bar = bars.index(stage)
    mbarrier.expect(bar, NBYTES)
    tma.async_copy_global_to_shared(desc, [slot, i_hv, i_v * BV, 0], bar, bufs.index(stage))


@gluon.jit
def _decode_kernel(q, k, v, a, b, A_log, dt_bias, o, desc, state, stride_slot, stride_head, state_indices, N, progs,
                   scale, softplus_beta, softplus_threshold, H: gl.constexpr, HV: gl.constexpr, K: gl.constexpr,
                   V: gl.constexpr, BV: gl.constexpr, STAGES: gl.constexpr, L: gl.constexpr, FLAT: gl.constexpr,
                   NBYTES: gl.constexpr):
    """Grid (progs,): program p takes tiles p, p + progs, ... of the N * HV * (V / BV) [BV, K] tiles, as
    `triton_decode_tma._decode_tma_kernel` (l2norm on). ``state``: the pool's base, rows of K contiguous elements,
    for the stores; ``desc`` describes the same pool for the loads."""
    pid = gl.program_id(0)
    NV: gl.constexpr = V // BV
    n_tiles = N * HV * NV
    n_mine = gl.cdiv(n_tiles - pid, progs)
    row: gl.constexpr = gl.SliceLayout(1, L)
    col: gl.constexpr = gl.SliceLayout(0, L)
    o_k = gl.arange(0, K, layout=col)
    o_bv = gl.arange(0, BV, layout=row)

    bufs = gl.allocate_shared_memory(desc.dtype, [STAGES, 1, 1, BV, K], desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(bars.index(s), count=1)
    for s in gl.static_range(STAGES - 1):
        if s < n_mine:
            t = pid + s * progs
            _issue(desc, bars, bufs, s, t, gl.load(state_indices + t // (NV * HV)).to(gl.int32), HV, NV, BV, NBYTES)
    # The slot of the next tile to issue, loaded one tile ahead of its issue.
    t_next = pid + (STAGES - 1) * progs
    slot_next = gl.load(state_indices + gl.minimum(t_next, n_tiles - 1) // (NV * HV)).to(gl.int32)
    for j in range(n_mine):
        t = pid + j * progs
        stage = j % STAGES
        # The buffer refilled here was read into registers by the previous tile: every warp is past that first.
        gl.thread_barrier()
        if j + STAGES - 1 < n_mine:
            _issue(desc, bars, bufs, (j + STAGES - 1) % STAGES, t_next, slot_next, HV, NV, BV, NBYTES)
            t_next += progs
            slot_next = gl.load(state_indices + gl.minimum(t_next, n_tiles - 1) // (NV * HV)).to(gl.int32)
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
            tile = state + slot.to(gl.int64) * stride_slot + i_hv * stride_head + i_v * BV * K
            gl.store(tile + o_bv[:, None] * K + o_k[None, :], s_t.to(state.dtype.element_ty), cache_modifier=".cs")
    for s in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(s))


# (BV, num_warps, programs per SM, state tiles in the ring): what `decode_probe --store` times.
CONFIGS = ((64, 4, 4, 3), (64, 4, 3, 4), (64, 8, 2, 4), (32, 4, 4, 4), (32, 4, 6, 4), (32, 4, 8, 3))


def launch(cfg, q, k, v, a, b, A_log, dt_bias, o, pool, idx) -> None:
    """One launch at ``cfg`` on a V-first pool with contiguous rows (`triton_decode_tma.eligible`), on Hopper."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    bv, warps, per_sm, stages = cfg
    N, H, K = q.shape
    HV, V = v.shape[1], v.shape[2]
    if stages < 2:
        raise ValueError(f"the ring keeps at least 2 state tiles, got {stages}")
    if pool.stride(2) != K or pool.stride(3) != 1:
        raise ValueError(f"the stores need rows of K={K} contiguous elements, got strides {pool.stride()}")
    dtype = {torch.float32: gl.float32, torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}[pool.dtype]
    box = [1, 1, bv, K]
    layout = gl.NVMMASharedLayout.get_default_for(box, dtype)
    desc = TensorDescriptor(pool, list(pool.shape), list(pool.stride()), box, layout)
    sms = torch.cuda.get_device_properties(q.device).multi_processor_count
    programs = max(1, min(per_sm * sms, N * HV * (V // bv)))
    _decode_kernel[(programs,)](
        q, k, v, a, b, A_log, dt_bias, o, desc, pool, pool.stride(0), pool.stride(1), idx, N, programs, K**-0.5, 1.0,
        20.0, H=H, HV=HV, K=K, V=V, BV=bv, STAGES=stages, L=tile_layout(K, warps),
        FLAT=gl.NVMMASharedLayout(layout.swizzle_byte_width, layout.element_bitwidth, 2),
        NBYTES=bv * K * pool.element_size(), num_warps=warps)
