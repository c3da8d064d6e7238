"""A probe candidate for issue #23's decode goal (35B bf16 state at 64 sequences): a Gluon TMA walk with no global
load on its per-tile critical path.

Why (offline sm_90 SASS of the shipped Triton walk, `triton_decode_tma`, bf16, BV 64): of its ~990 instructions a tile,
the first ~200 are the tile's prologue. q and k arrive by plain 2-byte loads (too narrow for cp.async, so Triton's
pipeliner leaves them in the loop) and are used at once, so every tile waits a global load's latency (Nsight Compute:
the top stall site, 13% of all samples, is the first use of q); their l2 norms are reduced across the four warps
(shared memory and ~10 CTA barriers a tile); q and k then move to the tile's layout through shared memory. The earlier
Gluon walks (46c6401, `gluon_decode_direct`) fixed the layout but still loaded q, k, v and the gates with plain loads
at the top of each tile.

Here:
- q, k and v ride the state's TMA ring: each ring stage holds the state tile and its q, k, v rows, all behind one
  mbarrier, so they are in flight as far ahead as the state.
- The tile's gates (a, b, A_log, dt_bias) are loaded one tile ahead into registers; every sequence's slot is read
  once into shared memory (v4; v3 loaded them from global memory two refills ahead, and ptxas made each refill wait
  for that load anyway: the slot has to be in a uniform register, and it is moved there right after the load).
- The layout puts 8 lanes along K and no warp across K, so every reduction (both l2 norms, k.q, S k, S q) stays in a
  warp: in-thread FMAs then three shuffles. The l2 norms scale the row sums, not q and k.
- A stage is refilled as soon as every warp holds it in registers; the updated tile goes through its own store buffer
  and a TMA store, which the next stored tile waits for (`store_wait(0)`, a whole tile later). That is v3: v1 and v2
  (a04ca84) stored each tile in place from its stage and refilled the stage after that store had read it; their
  fixed cost was half the Triton walk's but their us/MB 9-11% worse (results/decode_probe_ring*_h200.txt).

Arithmetic: `triton_recurrent._delta_rule_step`'s, summed in another order, so equal to the shipped walk to rounding.
A pad (slot < 0) asks TMA for a box out of bounds (zeros, nothing read) and is not stored. Gluon has no CPU
interpreter: the probe checks it against the shipped kernel on the GPU (its err column). v1-v3 and the q/k/v control
were measured (tools/gdn/README.md, "Decode"); v4, the slot table in shared memory, was written after the day's
device time ran out and has not run on a GPU.
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma

from tools.gdn.gluon_decode_direct import tile_layout  # 8 lanes along K: a thread holds K / 8 elements of a row

@gluon.jit
def _issue(desc, qd, kd, vd, bars, bufs, qbufs, kbufs, vbufs, stage, t, slot, H: gl.constexpr, HV: gl.constexpr,
           NV: gl.constexpr, BV: gl.constexpr, NBYTES: gl.constexpr, QKV_TMA: gl.constexpr):
    """TMA-load tile t's state (slot ``slot``; a pad's -1 is out of bounds: zeros, nothing read), q, k and v rows
    into ring ``stage``, all on that stage's barrier."""
    i_v = t % NV
    i_hv = (t // NV) % HV
    i_n = t // (NV * HV)
    i_h = i_hv // (HV // H)
    bar = bars.index(stage)
    mbarrier.expect(bar, NBYTES)
    tma.async_copy_global_to_shared(desc, [slot, i_hv, i_v * BV, 0], bar, bufs.index(stage))
    if QKV_TMA:
        tma.async_copy_global_to_shared(qd, [i_n, i_h, 0], bar, qbufs.index(stage))
        tma.async_copy_global_to_shared(kd, [i_n, i_h, 0], bar, kbufs.index(stage))
        tma.async_copy_global_to_shared(vd, [i_n, i_hv, i_v * BV], bar, vbufs.index(stage))


@gluon.jit
def _ring_kernel(qd, kd, vd, q, k, v, stride_qn, stride_qh, stride_vn, stride_vh, a, b, A_log, dt_bias, o, desc,
                 state_indices, N, progs, scale, softplus_beta, softplus_threshold, H: gl.constexpr,
                 HV: gl.constexpr, K: gl.constexpr, V: gl.constexpr, BV: gl.constexpr, STAGES: gl.constexpr,
                 L: gl.constexpr, FLAT: gl.constexpr, VEC: gl.constexpr, NBYTES: gl.constexpr, SLOTS: gl.constexpr,
                 W: gl.constexpr, QKV_TMA: gl.constexpr):
    """Grid (progs,): program p takes tiles p, p + progs, ... of the N * HV * (V / BV) [BV, K] tiles, each one
    (sequence, value head, V block), as `triton_decode_tma._decode_tma_kernel` (l2norm on). ``a``, ``b``: [N, HV]
    contiguous; ``o``: [N, HV, V] contiguous."""
    pid = gl.program_id(0)
    NV: gl.constexpr = V // BV
    n_tiles = N * HV * NV
    n_mine = gl.cdiv(n_tiles - pid, progs)
    row: gl.constexpr = gl.SliceLayout(1, L)
    col: gl.constexpr = gl.SliceLayout(0, L)
    o_bv = gl.arange(0, BV, layout=row)

    bufs = gl.allocate_shared_memory(desc.dtype, [STAGES, 1, 1, BV, K], desc.layout)
    qbufs = gl.allocate_shared_memory(qd.dtype, [STAGES, 1, 1, K], qd.layout)
    kbufs = gl.allocate_shared_memory(kd.dtype, [STAGES, 1, 1, K], kd.layout)
    vbufs = gl.allocate_shared_memory(vd.dtype, [STAGES, 1, 1, BV], vd.layout)
    obuf = gl.allocate_shared_memory(desc.dtype, [1, 1, BV, K], desc.layout)
    out = obuf._reinterpret(desc.dtype, [BV, K], FLAT)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(bars.index(s), count=1)
    # Every sequence's slot, once, into shared memory: a TMA coordinate lives in a uniform register, and ptxas moves a
    # loaded slot there right after its load, so a slot prefetched from global memory made each refill wait a load's
    # round trip anyway (v3 under Nsight Compute: the top stall site, 12-34% of samples). From shared memory it is a
    # shared load's latency.
    slot_tab = gl.allocate_shared_memory(gl.int32, [SLOTS, 1], VEC)  # [SLOTS, 1] so that .index(n) is one slot
    P1: gl.constexpr = gl.BlockedLayout([1], [32], [W], [0])
    o_all = gl.arange(0, SLOTS, layout=P1)
    all_slots = gl.load(state_indices + o_all, mask=o_all < N, other=-1).to(gl.int32)
    slot_tab._reinterpret(gl.int32, [SLOTS], VEC).store(all_slots)
    gl.thread_barrier()
    for s in gl.static_range(STAGES):
        if s < n_mine:
            t = pid + s * progs
            _issue(desc, qd, kd, vd, bars, bufs, qbufs, kbufs, vbufs, s, t,
                   gl.sum(slot_tab.index(t // (NV * HV)).load(P1), 0), H, HV, NV, BV, NBYTES, QKV_TMA)
    t_issue = pid + STAGES * progs  # the next tile to issue (tile j + STAGES at iteration j, into tile j's stage)
    # Tile 0's scalars; each iteration loads the next tile's.
    i_n = pid // (NV * HV)
    i_hv = (pid // NV) % HV
    slot = gl.sum(slot_tab.index(i_n).load(P1), 0)
    x = gl.load(a + i_n.to(gl.int64) * HV + i_hv).to(gl.float32) + gl.load(dt_bias + i_hv).to(gl.float32)
    bb = gl.load(b + i_n.to(gl.int64) * HV + i_hv).to(gl.float32)
    alog = gl.load(A_log + i_hv).to(gl.float32)
    o_k = gl.arange(0, K, layout=col)
    if not QKV_TMA:  # q, k, v by plain loads, a tile ahead into registers (the probe's control for their TMA copies)
        i_h = i_hv // (HV // H)
        r_q = gl.load(q + i_n.to(gl.int64) * stride_qn + i_h * stride_qh + o_k)
        r_k = gl.load(k + i_n.to(gl.int64) * stride_qn + i_h * stride_qh + o_k)
        r_v = gl.load(v + i_n.to(gl.int64) * stride_vn + i_hv * stride_vh + (pid % NV) * BV + o_bv)
    for j in range(n_mine):
        t = pid + j * progs
        stage = j % STAGES
        # The next tile's scalars, in flight while this one computes.
        t_n = gl.minimum(t + progs, n_tiles - 1)
        n_n = t_n // (NV * HV)
        hv_n = (t_n // NV) % HV
        slot_n = gl.sum(slot_tab.index(n_n).load(P1), 0)
        a_n = gl.load(a + n_n.to(gl.int64) * HV + hv_n)
        dtb_n = gl.load(dt_bias + hv_n)
        bb_n = gl.load(b + n_n.to(gl.int64) * HV + hv_n)
        alog_n = gl.load(A_log + hv_n)
        if not QKV_TMA:
            h_n = hv_n // (HV // H)
            q_n = gl.load(q + n_n.to(gl.int64) * stride_qn + h_n * stride_qh + o_k)
            k_n = gl.load(k + n_n.to(gl.int64) * stride_qn + h_n * stride_qh + o_k)
            v_n = gl.load(v + n_n.to(gl.int64) * stride_vn + hv_n * stride_vh + (t_n % NV) * BV + o_bv)

        i_v = t % NV
        i_hv = (t // NV) % HV
        i_n = t // (NV * HV)
        beta = 1.0 / (1.0 + gl.exp(-bb))
        bx = softplus_beta * x
        sp = gl.where(bx <= softplus_threshold, gl.log(1.0 + gl.exp(bx)) / softplus_beta, x)
        gate = gl.exp(-gl.exp(alog) * sp)

        mbarrier.wait(bars.index(stage), (j // STAGES) & 1)
        if QKV_TMA:
            f_q = qbufs.index(stage)._reinterpret(qd.dtype, [K], VEC).load(col).to(gl.float32)
            f_k = kbufs.index(stage)._reinterpret(kd.dtype, [K], VEC).load(col).to(gl.float32)
            f_v = vbufs.index(stage)._reinterpret(vd.dtype, [BV], VEC).load(row).to(gl.float32)
        else:
            f_q = r_q.to(gl.float32)
            f_k = r_k.to(gl.float32)
            f_v = r_v.to(gl.float32)
        s_t = bufs.index(stage)._reinterpret(desc.dtype, [BV, K], FLAT).load(L).to(gl.float32) * gate
        # Every warp has this stage in registers: refill it at once, as Triton's pipeliner does, so the refill never
        # waits on a store (v1 and v2 stored in place and refilled after the store had read the stage).
        gl.thread_barrier()
        if j + STAGES < n_mine:
            _issue(desc, qd, kd, vd, bars, bufs, qbufs, kbufs, vbufs, stage, t_issue,
                   gl.sum(slot_tab.index(t_issue // (NV * HV)).load(P1), 0), H, HV, NV, BV, NBYTES, QKV_TMA)
            t_issue += progs
        # The l2 norms scale the row sums (and delta), not the K / 8 elements of q and k each thread holds.
        rq = gl.rsqrt(gl.sum(f_q * f_q, 0) + 1e-6)
        rk = gl.rsqrt(gl.sum(f_k * f_k, 0) + 1e-6)
        pred = rk * gl.sum(s_t * f_k[None, :], 1)
        s_q = rq * gl.sum(s_t * f_q[None, :], 1)
        delta = beta * (f_v - pred)
        b_o = (s_q + delta * (rk * rq * gl.sum(f_k * f_q, 0))) * scale
        delta = delta * rk
        if slot >= 0:
            # The store buffer is free once the previous tile's store has read it (a whole tile ago).
            tma.store_wait(0)
            gl.thread_barrier()
            out.store((s_t + delta[:, None] * f_k[None, :]).to(desc.dtype))
            fence_async_shared()
            gl.thread_barrier()
            tma.async_copy_shared_to_global(desc, [slot, i_hv, i_v * BV, 0], obuf)
        # After the shared-memory fence, not before it: the fence waited on these stores' round trip (Nsight Compute).
        gl.store(o + (i_n.to(gl.int64) * HV + i_hv) * V + i_v * BV + o_bv,
                 gl.where(slot >= 0, b_o, 0.0).to(o.dtype.element_ty))
        slot = slot_n
        x = a_n.to(gl.float32) + dtb_n.to(gl.float32)
        bb = bb_n.to(gl.float32)
        alog = alog_n.to(gl.float32)
        if not QKV_TMA:
            r_q = q_n
            r_k = k_n
            r_v = v_n
    tma.store_wait(0)
    for s in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(s))


# ((BV, num_warps, programs per SM, ring stages), q/k/v by TMA): what `decode_probe --ring` times (those whose programs
# all fit an SM by shared memory: the ring plus one store buffer; bf16 BV 64 at 2 stages is 48 KB a program). BV is at
# least 64: a stage's v row is then 128 bytes, the alignment a TMA destination needs (BV 32 faulted, misaligned, on
# the H200). Without TMA for q/k/v they are plain loads a tile ahead into registers (offline sm_90, bf16 BV 64: 168
# registers at 4 warps, so three programs per SM; 128 at 8 warps): the control for the TMA copies' cost.
CONFIGS = (((64, 4, 3, 3), True), ((64, 4, 3, 3), False), ((64, 8, 2, 3), True), ((64, 8, 2, 3), False),
           ((64, 4, 2, 2), True), ((64, 4, 2, 2), False))


def _gl_dtype(t: torch.dtype):
    return {torch.float32: gl.float32, torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}[t]


def launch(cfg, q, k, v, a, b, A_log, dt_bias, o, pool, idx, scale=None, softplus_beta=1.0,
           softplus_threshold=20.0, qkv_tma: bool = True) -> None:
    """One launch at ``cfg`` on a V-first pool (`triton_decode_tma.eligible`), on Hopper. q, k: [N, H, K], v and o:
    [N, HV, V] (q, k, v strided as a tensor descriptor allows; o, a and b contiguous)."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    bv, warps, per_sm, stages = cfg
    N, H, K = q.shape
    HV, V = v.shape[1], v.shape[2]
    if stages < 2:
        raise ValueError(f"the ring keeps at least 2 tiles, got {stages}")
    if bv * v.element_size() % 128:
        raise ValueError(f"a ring stage's v row must be a multiple of 128 bytes (TMA's alignment), got BV={bv}")
    if not (o.is_contiguous() and a.is_contiguous() and b.is_contiguous()):
        raise ValueError("o, a and b must be contiguous")
    box = [1, 1, bv, K]
    layout = gl.NVMMASharedLayout.get_default_for(box, _gl_dtype(pool.dtype))
    desc = TensorDescriptor(pool, list(pool.shape), list(pool.stride()), box, layout)
    flat = gl.NVMMASharedLayout(0, 8 * q.element_size(), 3)  # rows of q, k, v: no swizzle, linear in shared memory
    qd = TensorDescriptor(q, list(q.shape), list(q.stride()), [1, 1, K], flat)
    kd = TensorDescriptor(k, list(k.shape), list(k.stride()), [1, 1, K], flat)
    vd = TensorDescriptor(v, list(v.shape), list(v.stride()), [1, 1, bv], flat)
    sms = torch.cuda.get_device_properties(q.device).multi_processor_count
    programs = max(1, min(per_sm * sms, N * HV * (V // bv)))
    nbytes = bv * K * pool.element_size() + ((2 * K + bv) * q.element_size() if qkv_tma else 0)
    if q.stride(-1) != 1 or v.stride(-1) != 1 or q.stride() != k.stride():
        raise ValueError(f"q, k, v need contiguous rows and q, k the same strides, got {q.stride()}, {k.stride()}, "
                         f"{v.stride()}")
    _ring_kernel[(programs,)](
        qd, kd, vd, q, k, v, q.stride(0), q.stride(1), v.stride(0), v.stride(1), a, b, A_log, dt_bias, o, desc, idx, N,
        programs, K**-0.5 if scale is None else scale, float(softplus_beta), float(softplus_threshold), H=H, HV=HV,
        K=K, V=V, BV=bv, STAGES=stages,
        L=tile_layout(K, warps), FLAT=gl.NVMMASharedLayout(layout.swizzle_byte_width, layout.element_bitwidth, 2),
        VEC=gl.SwizzledSharedLayout(1, 1, 1, [0]), NBYTES=nbytes, SLOTS=triton.next_power_of_2(N),
        W=warps, QKV_TMA=qkv_tma, num_warps=warps)
