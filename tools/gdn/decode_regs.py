"""A probe for issue #23's missed decode goal (35B, bf16 state, 64 sequences): the row-looped decode with its state and
v rows prefetched into registers, DEPTH blocks ahead, the first ones before q and k are even loaded.

Why (tools/gdn/pattern_probe.py --sweep, results/pattern_sweep_h200.txt): the row-looped kernel's grid and loop
with nothing computed moves 35B bf16 at 64 sequences at 95.6% of copy bandwidth (8, 64, 4 warps, 3 stages); the kernel
itself, at the same config, 70.8%. So decode's own work costs 25 points there, not its memory pattern. Two latencies
in `triton_decode_rows` sit on every program's critical path:
- The v rows of a block are a 2-byte load a thread, too narrow for cp.async, so Triton's pipeliner leaves them in the
  loop: every block waits one global-memory latency for them before its delta.
- q, k and the gates are loaded and l2-normed before the loop, and the pipeliner issues the first state loads just
  before the loop, after that code: a program's first state bytes are requested one global latency late.
Here the state block and its v rows are plain loads into registers, issued DEPTH blocks ahead of their use (loop-carried
values; a load's latency is waited for only where its value is first used), the first DEPTH of them before q and k.
No shared memory, no cp.async group waits, no barrier in the loop.

``ABLATE`` (diagnostics, not candidates): ``qk`` takes q, k and the gates as constants (no loads, no norms) to show what
the prologue costs; ``touch`` stores each block back unchanged (the pattern alone, as pattern_probe's touch).

    python -m tools.gdn.decode_regs [--iters 20] [--batch 64 256] [--json PATH] [--steady]
        [--models 35B] [--dtypes bfloat16] [--regs 4,128,1,2,2 4,64,1,2,2@64]  (--steady's configs; @: a register cap)
        [--regs3 4,128,1,32]  (--steady's configs of launch3: BV, ROWS, warps, KC)

Each candidate's output and updated pool are compared with `triton_decode_rows`' (same arithmetic, same row sums:
equal up to the sums' order). Run from the repository root on a CUDA machine.
"""

from __future__ import annotations

import argparse
import json

import torch
import triton
import triton.language as tl

from hybridkv.kernels.gdn import bench_cases, bench_timing, gated_delta_rule_decode, triton_decode_rows
# The shipped loop's block loads; STREAM=True everywhere here (evict-first at fp32 too, as this probe measured).
from hybridkv.kernels.gdn.triton_decode_prefetch import _block, _l2_prefetch
from hybridkv.kernels.gdn.triton_recurrent import _delta_rule_step, _head_inputs, _head_loads, _head_math, _softplus

from tools.gdn.schedules import decode_inputs

D = 128


@triton.jit
def _sblock(base, v, i_nh, j, shift, row0, o_r, o_k, live, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr,
            NB: tl.constexpr, STREAM: tl.constexpr, STAGGER: tl.constexpr):
    """`_block` j of a walk that starts at block ``shift`` and wraps around (STAGGER), or `_block` j itself."""
    if STAGGER:
        rows = row0 + ((j + shift) % NB) * BV + o_r
        inside = j < NB
        raw = tl.load(base + rows[:, None] * K + o_k[None, :], mask=live & inside, other=0.0,
                      eviction_policy="evict_first" if STREAM else "")
        b_v = tl.load(v + i_nh.to(tl.int64) * V + rows, mask=inside, other=0.0)
    else:
        raw, b_v = _block(base, v, i_nh, j, row0, o_r, o_k, live, K, V, BV, NB, STREAM)
    return raw, b_v


@triton.jit
def _decode_regs_kernel(q, k, v, a, b, A_log, dt_bias, o, state, state_indices, scale, stride_slot, stride_head,
                        softplus_beta, softplus_threshold, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr,
                        V: tl.constexpr, BV: tl.constexpr, ROWS: tl.constexpr, DEPTH: tl.constexpr,
                        L2NORM: tl.constexpr, STREAM: tl.constexpr, CONST_QK: tl.constexpr, TOUCH: tl.constexpr,
                        UNROLL: tl.constexpr = 1, QK_FIRST: tl.constexpr = False, STAGGER: tl.constexpr = 0,
                        L2AHEAD: tl.constexpr = 0, L2ALL: tl.constexpr = False):
    """`triton_decode_rows._decode_rows_kernel`'s grid and arithmetic; blocks prefetched into registers DEPTH (1-4)
    ahead. L2AHEAD (> DEPTH, or 0 for off): each block is also asked into L2 (`_l2_prefetch`) L2AHEAD blocks before its
    use, those up to L2AHEAD before the loop; L2ALL: the program's whole row range is asked into L2 at once, first. STAGGER (odd, or 0 for off): a program walks its blocks starting at block (pid * STAGGER) % NB and wraps
    around, so that the programs in flight at one time do not all ask for the same offset of their 32 KB heads."""
    NR: tl.constexpr = V // ROWS
    NB: tl.constexpr = ROWS // BV
    pid = tl.program_id(0)
    i_r, i_nh = pid % NR, pid // NR
    i_n, i_hv = i_nh // HV, i_nh % HV
    i_h = i_hv // (HV // H)
    o_k = tl.arange(0, K)
    o_r = tl.arange(0, BV)
    row0 = i_r * ROWS
    if QK_FIRST:
        # q, k and the gate inputs requested before the slot index: the state loads wait for the index, and these
        # loads would otherwise queue behind that wait.
        r_q, r_k, r_a, r_dt, r_A, r_b = _head_loads(q, k, a, b, A_log, dt_bias, i_n, i_h, i_hv, i_nh, o_k, H, K)
    slot = tl.load(state_indices + i_n).to(tl.int64)
    live = slot >= 0
    base = state + tl.maximum(slot, 0) * stride_slot + i_hv * stride_head
    shift = (pid * STAGGER) % NB
    BLOCK_BYTES: tl.constexpr = BV * K * state.dtype.element_ty.primitive_bitwidth // 8
    if L2ALL:
        _l2_prefetch(base + row0 * K, NB * BLOCK_BYTES)
    # The first DEPTH blocks go out before anything else is waited for.
    s0, v0 = _sblock(base, v, i_nh, 0, shift, row0, o_r, o_k, live, K, V, BV, NB, STREAM, STAGGER)
    if DEPTH >= 2:
        s1, v1 = _sblock(base, v, i_nh, 1, shift, row0, o_r, o_k, live, K, V, BV, NB, STREAM, STAGGER)
    if DEPTH >= 3:
        s2, v2 = _sblock(base, v, i_nh, 2, shift, row0, o_r, o_k, live, K, V, BV, NB, STREAM, STAGGER)
    if DEPTH >= 4:
        s3, v3 = _sblock(base, v, i_nh, 3, shift, row0, o_r, o_k, live, K, V, BV, NB, STREAM, STAGGER)
    if QK_FIRST:
        f_q, f_k, decay, beta = _head_math(r_q, r_k, r_a, r_dt, r_A, r_b, softplus_beta, softplus_threshold, L2NORM)
    elif CONST_QK:
        f_q = tl.full([K], 0.088388, tl.float32)
        f_k = tl.full([K], 0.088388, tl.float32)
        decay = 0.9
        beta = 0.5
    else:
        f_q, f_k, decay, beta = _head_inputs(q, k, a, b, A_log, dt_bias, i_n, i_h, i_hv, i_nh, o_k, softplus_beta,
                                             softplus_threshold, H, K, L2NORM)
    if L2AHEAD:
        for i in tl.static_range(DEPTH, L2AHEAD):
            if i < NB:
                _l2_prefetch(base + (row0 + i * BV) * K, BLOCK_BYTES)
    # UNROLL = DEPTH lets ptxas rename the rotated registers instead of moving them.
    for j in tl.range(0, NB, loop_unroll_factor=UNROLL):
        if L2AHEAD:
            if j + L2AHEAD < NB:
                _l2_prefetch(base + (row0 + (j + L2AHEAD) * BV) * K, BLOCK_BYTES)
        raw, b_v = s0, v0
        if DEPTH == 1:
            s0, v0 = _sblock(base, v, i_nh, j + 1, shift, row0, o_r, o_k, live, K, V, BV, NB, STREAM, STAGGER)
        elif DEPTH == 2:
            s0, v0 = s1, v1
            s1, v1 = _sblock(base, v, i_nh, j + 2, shift, row0, o_r, o_k, live, K, V, BV, NB, STREAM, STAGGER)
        elif DEPTH == 3:
            s0, v0 = s1, v1
            s1, v1 = s2, v2
            s2, v2 = _sblock(base, v, i_nh, j + 3, shift, row0, o_r, o_k, live, K, V, BV, NB, STREAM, STAGGER)
        else:
            s0, v0 = s1, v1
            s1, v1 = s2, v2
            s2, v2 = s3, v3
            s3, v3 = _sblock(base, v, i_nh, j + 4, shift, row0, o_r, o_k, live, K, V, BV, NB, STREAM, STAGGER)
        if STAGGER:
            jj = (j + shift) % NB
        else:
            jj = j
        rows = row0 + jj * BV + o_r
        p = base + rows[:, None] * K + o_k[None, :]
        if TOUCH:
            tl.store(p, raw, mask=live, cache_modifier=".cs" if STREAM else "")
        else:
            b_o, b_s = _delta_rule_step(raw.to(tl.float32) * decay, f_q, f_k, b_v.to(tl.float32), beta, scale)
            tl.store(o + i_nh.to(tl.int64) * V + rows, tl.where(live, b_o, 0.0).to(o.dtype.element_ty))
            tl.store(p, b_s.to(state.dtype.element_ty), mask=live, cache_modifier=".cs" if STREAM else "")


@triton.jit
def _block3(base, v, i_nh, j, shift, row0, o_c, o_r, o_e, live, K: tl.constexpr, V: tl.constexpr,
            BV: tl.constexpr, KC: tl.constexpr, NB: tl.constexpr, STAGGER: tl.constexpr):
    """`_sblock` with the state block as [BV, K / KC, KC]: K cut into chunks of KC."""
    if STAGGER:
        rows = row0 + ((j + shift) % NB) * BV + o_r
    else:
        rows = row0 + j * BV + o_r
    inside = j < NB
    p = base + rows[:, None, None] * K + o_c[None, :, None] * KC + o_e[None, None, :]
    raw = tl.load(p, mask=live & inside, other=0.0, eviction_policy="evict_first")
    b_v = tl.load(v + i_nh.to(tl.int64) * V + rows, mask=(rows < V) & inside, other=0.0)
    return raw, b_v


@triton.jit
def _decode_regs3_kernel(q, k, v, a, b, A_log, dt_bias, o, state, state_indices, scale, stride_slot, stride_head,
                         softplus_beta, softplus_threshold, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr,
                         V: tl.constexpr, BV: tl.constexpr, ROWS: tl.constexpr, KC: tl.constexpr,
                         L2NORM: tl.constexpr, STREAM: tl.constexpr, STAGGER: tl.constexpr = 0):
    """`_decode_regs_kernel` at DEPTH 2, UNROLL 2, with each block held as [BV, K / KC, KC]. A thread's 16-byte
    vector is along KC and Triton's coalescing puts the next lanes along the rows (the chunk and row axes tie on
    contiguity; the lower axis goes first, offline sm_90 TTGIR), so the K / KC chunks of a row sit in one thread and a
    row's sums take log2(KC / vector) shuffles, not log2(K / vector) (16 lanes for a bf16 row of 128 as [BV, K]).
    q, k and the gate inputs are requested before the slot index, as the shipped kernel does; STAGGER as in
    `_decode_regs_kernel`."""
    NR: tl.constexpr = V // ROWS
    NB: tl.constexpr = ROWS // BV
    C: tl.constexpr = K // KC
    pid = tl.program_id(0)
    i_r, i_nh = pid % NR, pid // NR
    i_n, i_hv = i_nh // HV, i_nh % HV
    i_h = i_hv // (HV // H)
    o_c = tl.arange(0, C)
    o_e = tl.arange(0, KC)
    o_r = tl.arange(0, BV)
    row0 = i_r * ROWS
    o_qk = (i_n * H + i_h) * K + o_c[None, :, None] * KC + o_e[None, None, :]
    r_q = tl.load(q + o_qk)
    r_k = tl.load(k + o_qk)
    r_a, r_dt, r_A, r_b = tl.load(a + i_nh), tl.load(dt_bias + i_hv), tl.load(A_log + i_hv), tl.load(b + i_nh)
    slot = tl.load(state_indices + i_n).to(tl.int64)
    live = slot >= 0
    base = state + tl.maximum(slot, 0) * stride_slot + i_hv * stride_head
    shift = (pid * STAGGER) % NB
    s0, v0 = _block3(base, v, i_nh, 0, shift, row0, o_c, o_r, o_e, live, K, V, BV, KC, NB, STAGGER)
    s1, v1 = _block3(base, v, i_nh, 1, shift, row0, o_c, o_r, o_e, live, K, V, BV, KC, NB, STAGGER)
    f_q = r_q.to(tl.float32)
    f_k = r_k.to(tl.float32)
    if L2NORM:
        f_q = f_q * tl.rsqrt(tl.sum(tl.sum(f_q * f_q, 2), 1)[:, None, None] + 1e-6)
        f_k = f_k * tl.rsqrt(tl.sum(tl.sum(f_k * f_k, 2), 1)[:, None, None] + 1e-6)
    kq = tl.sum(tl.sum(f_k * f_q, 2), 1)  # [1]
    x = r_a.to(tl.float32) + r_dt.to(tl.float32)
    decay = tl.exp(-tl.exp(r_A.to(tl.float32)) * _softplus(x, softplus_beta, softplus_threshold))
    beta = tl.sigmoid(r_b.to(tl.float32))
    for j in tl.range(0, NB, loop_unroll_factor=2):
        raw, b_v = s0, v0
        s0, v0 = s1, v1
        s1, v1 = _block3(base, v, i_nh, j + 2, shift, row0, o_c, o_r, o_e, live, K, V, BV, KC, NB, STAGGER)
        if STAGGER:
            rows = row0 + ((j + shift) % NB) * BV + o_r
        else:
            rows = row0 + j * BV + o_r
        b_s = raw.to(tl.float32) * decay
        pred = tl.sum(tl.sum(b_s * f_k, 2), 1)
        b_sq = tl.sum(tl.sum(b_s * f_q, 2), 1)
        delta = beta * (b_v.to(tl.float32) - pred)
        b_o = (b_sq + delta * kq) * scale
        b_s = b_s + delta[:, None, None] * f_k
        tl.store(o + i_nh.to(tl.int64) * V + rows, tl.where(live, b_o, 0.0).to(o.dtype.element_ty))
        p = base + rows[:, None, None] * K + o_c[None, :, None] * KC + o_e[None, None, :]
        tl.store(p, b_s.to(state.dtype.element_ty), mask=live, cache_modifier=".cs" if STREAM else "")


def launch3(cfg, q, k, v, a, b, A_log, dt_bias, o, ssm_state, state_indices, scale, l2=True, softplus_beta=1.0,
            softplus_threshold=20.0) -> None:
    """cfg = (BV, ROWS, num_warps, KC[, STAGGER])."""
    bv, rows, warps, kc = cfg[:4]
    stagger = cfg[4] if len(cfg) > 4 else 0
    N, H, K = q.shape
    HV, V = v.shape[1], v.shape[2]
    rows = min(rows, V)
    bv = min(bv, rows)
    _decode_regs3_kernel[(V // rows * N * HV,)](
        q, k, v, a, b, A_log, dt_bias, o, ssm_state, state_indices, scale, ssm_state.stride(0), ssm_state.stride(1),
        float(softplus_beta), float(softplus_threshold), H=H, HV=HV, K=K, V=V, BV=bv, ROWS=rows, KC=min(kc, K),
        L2NORM=l2, STREAM=ssm_state.element_size() == 2, STAGGER=stagger, num_warps=warps, num_stages=1)


def launch(cfg, q, k, v, a, b, A_log, dt_bias, o, ssm_state, state_indices, scale, l2=True, softplus_beta=1.0,
           softplus_threshold=20.0, const_qk=False, touch=False, unroll=1, maxnreg=None, qk_first=False,
           stream=True, stagger=0, l2ahead=0, l2all=False) -> None:
    """cfg = (BV, ROWS, num_warps, DEPTH[, UNROLL]), ROWS capped at V and BV at ROWS (`triton_decode_rows.eligible`
    pools)."""
    bv, rows, warps, depth = cfg[:4]
    unroll = cfg[4] if len(cfg) > 4 else unroll
    if depth not in (1, 2, 3, 4):
        raise ValueError(f"DEPTH must be 1, 2, 3 or 4, got {depth}")
    N, H, K = q.shape
    HV, V = v.shape[1], v.shape[2]
    rows = min(rows, V)
    bv = min(bv, rows)
    _decode_regs_kernel[(V // rows * N * HV,)](
        q, k, v, a, b, A_log, dt_bias, o, ssm_state, state_indices, scale, ssm_state.stride(0), ssm_state.stride(1),
        float(softplus_beta), float(softplus_threshold), H=H, HV=HV, K=K, V=V, BV=bv, ROWS=rows, DEPTH=depth,
        L2NORM=l2, STREAM=stream, CONST_QK=const_qk, TOUCH=touch, UNROLL=unroll, QK_FIRST=qk_first,
        STAGGER=stagger, L2AHEAD=l2ahead, L2ALL=l2all, num_warps=warps, num_stages=1, **({} if maxnreg is None else {"maxnreg": maxnreg}))


# (BV, ROWS, num_warps, DEPTH, UNROLL)
REGS = ((8, 64, 4, 2, 2), (8, 128, 4, 3, 3), (8, 128, 4, 2, 2), (8, 64, 4, 3, 1), (8, 128, 4, 3, 1),
        (16, 128, 4, 2, 2), (16, 64, 4, 2, 2), (4, 32, 4, 3, 3), (4, 64, 4, 3, 3), (16, 128, 8, 2, 2),
        (32, 128, 8, 2, 2))
ROWS = ((8, 64, 4, 3), (8, 128, 4, 3), (16, 128, 4, 3))


def run(iters: int, batches: list[int]) -> list[dict]:
    copy_gbps = bench_timing._copy_gbps(iters)
    print(f"{torch.cuda.get_device_name()} copy {copy_gbps:.0f} GB/s")
    out = []
    for model, H, HV in bench_cases.DECODE_SHAPES:
        for N in batches:
            for dtype in (torch.bfloat16, torch.float32):
                q, k, v, a, b, A_log, dt_bias, pool, idx = decode_inputs(N, H, HV, dtype)
                idx = idx.to(torch.int32)
                idx[5] = -1  # a pad, as vLLM's CUDA-graph batches have
                args = (q, k, v, a, b, A_log, dt_bias)
                o_want = torch.empty_like(v)
                want = pool.clone()
                triton_decode_rows.launch(ROWS[0], *args, o_want, want, idx, D**-0.5, True, 1.0, 20.0)
                errs = {}
                for cfg in REGS:
                    trial, o_got = pool.clone(), torch.empty_like(v)
                    launch(cfg, *args, o_got, trial, idx, D**-0.5)
                    errs[cfg] = max((o_got.float() - o_want.float()).abs().max().item(),
                                    (trial.float() - want.float()).abs().max().item())
                del want, trial
                o = torch.empty_like(v)
                fns = {"decode (shipped)": lambda: gated_delta_rule_decode(*args, pool, idx)}
                gated_delta_rule_decode(*args, pool, idx)  # tunes
                for cfg in ROWS:
                    fns[f"rows {cfg}"] = lambda cfg=cfg: triton_decode_rows.launch(cfg, *args, o, pool, idx, D**-0.5,
                                                                                   True, 1.0, 20.0)
                for cfg in REGS:
                    fns[f"regs {cfg}"] = lambda cfg=cfg: launch(cfg, *args, o, pool, idx, D**-0.5)
                for cfg in REGS[:4]:
                    fns[f"regs {cfg} const qk"] = lambda cfg=cfg: launch(cfg, *args, o, pool, idx, D**-0.5,
                                                                         const_qk=True)
                    fns[f"regs {cfg} touch"] = lambda cfg=cfg: launch(cfg, *args, o, pool, idx, D**-0.5,
                                                                      touch=True)
                same_src, dst = pool[:N], torch.empty_like(pool[:N])
                fns["copy, same size"] = lambda: dst.copy_(same_src)
                times = bench_timing._interleaved(fns, iters)
                nbytes = 2 * N * HV * D * D * pool.element_size()
                shape = f"{model} B={N} {str(dtype).removeprefix('torch.')}"
                for name, t in times.items():
                    pct = 100 * nbytes / t.ms / 1e6 / copy_gbps
                    cfg = next((c for c in REGS if name == f"regs {c}"), None)
                    err = errs.get(cfg)
                    out.append({"shape": shape, "what": name, "ms": t.ms, "pct_copy": pct, "max_diff_vs_rows": err})
                    print(f"{shape:22} {name:34} {t.ms * 1e3:8.1f} us {pct:6.1f}% copy"
                          f"{'' if err is None else f'  max diff vs rows {err:.1e}'}", flush=True)
                del pool, dst
    return out


# One warp a program first led at 35B bf16 64 sequences ((4, 128, 1, 2, 2): 80.1-80.6% of copy bandwidth, no CTA
# barrier in the loop; results/decode_regs_steady3_h200.txt). A register cap of 48 spilled and lost 8 points (same
# file).
# Other one-warp configs (two rows, three blocks ahead, one ahead, unrolled by four) lost to (4, 128, 1, 2, 2) at every
# bf16 shape (results/decode_regs_steady4_h200.txt).
STEADY_REGS = ((8, 128, 4, 2, 2), (16, 128, 4, 2, 2), (4, 128, 1, 2, 2), (8, 64, 4, 2, 2))
STEADY_MAXNREG = ()
STEADY_ROWS = ((8, 64, 4, 3), (8, 128, 4, 3), (16, 128, 4, 3))
# (BV, ROWS, num_warps, KC) of `launch3`: none beat `launch` at its best configs (results/decode_regs_steady2_h200.txt:
# 35B bf16 64 sequences 69-77% against 78.0-78.4; fewer shuffles, but 104-174 registers), so none is timed now.
STEADY_REGS3 = ()
# --variants: launch's keyword arguments beside each --regs config. "touch" (the pattern alone, each block stored back
# unchanged) with and without "stagger" says whether the order in which the programs in flight walk their heads is what
# the memory system minds.
VARIANTS = {"qk-first": {"qk_first": True}, "no-stream": {"stream": False}, "stagger": {"stagger": 1},
            "stagger7": {"stagger": 7}, "touch": {"touch": True}, "stagger-touch": {"stagger": 1, "touch": True},
            "l2ahead3": {"l2ahead": 3}, "l2ahead4": {"l2ahead": 4}, "l2ahead6": {"l2ahead": 6}, "l2ahead8": {"l2ahead": 8}, "l2ahead16": {"l2ahead": 16}, "l2all": {"l2all": True},
            "l2ahead8-touch": {"l2ahead": 8, "touch": True}, "l2all-touch": {"l2all": True, "touch": True}}


def _dirty_ms(launch, spin: int, flush: torch.Tensor) -> float:
    """ms of one ``launch`` after ``flush`` (2x L2) was written: L2 holds ~its size of another's dirty lines, which the
    launch writes back (how the decode tuner flushed until the thirteenth session)."""
    flush.zero_()
    return bench_timing._event_ms(launch, spin)


def _after_ms(launch, before, spin: int) -> float:
    """ms of one ``launch`` right after ``before`` (untimed)."""
    before()
    return bench_timing._event_ms(launch, spin)


def _clean_ms(launch, spin: int, flush: torch.Tensor) -> float:
    """ms of one ``launch`` that finds L2 holding clean lines only: ``flush`` (2x L2) is read, not written, first, so
    the launch pays no write-back of anyone else's dirty lines (`_dirty_ms` leaves ~L2's size of them)."""
    flush.sum()
    return bench_timing._event_ms(launch, spin)


def steady(iters: int, batches: list[int], rounds: int = 3, dtypes=("bfloat16", "float32"), models=None,
           regs=None, maxnreg=None, variants=None, regs3=None) -> list[dict]:
    """Interleaved timing (`run`) moved one config by 12 points between two runs (rows (8, 64, 4, 3)
    at 35B, 64 sequences: 70.8 then 83.2): each call finds the L2 its predecessor left, and a 64 MB pool's write-backs
    land in whichever call comes next. Here each candidate is timed as `bench gdn` times decode (its own calls back to
    back, median of ``iters``), in ``rounds`` rounds of rotated order; as the tuner timed it until this session (one
    launch after L2 is flushed by a write, median of 5: "cold", `_dirty_ms`); and after a flush by a read ("clean",
    `_clean_ms`).
    Steady state reads the slots the previous call wrote: a serving engine runs every other layer between two calls of
    one layer's decode, so what is left in L2 then is other layers' data, as in "cold" or "clean"."""
    from hybridkv.kernels.gdn import triton_recurrent as tr

    copy_gbps = bench_timing._copy_gbps(iters)
    print(f"{torch.cuda.get_device_name()} copy {copy_gbps:.0f} GB/s")
    flush = torch.empty(2 * tr._l2_bytes(torch.device("cuda")) // 4, dtype=torch.float32, device="cuda")
    byte_flush = flush.view(torch.int8)  # the tuner's flush reads int8 (`.max()`)
    out = []
    regs = STEADY_REGS if regs is None else regs
    variants = variants or {}
    maxnreg = STEADY_MAXNREG if maxnreg is None else maxnreg
    for model, H, HV in bench_cases.DECODE_SHAPES:
        if models and model not in models:
            continue
        for N, dtype in ((n, getattr(torch, dt)) for n in batches for dt in dtypes):
            q, k, v, a, b, A_log, dt_bias, pool, idx = decode_inputs(N, H, HV, dtype)
            idx = idx.to(torch.int32)
            args = (q, k, v, a, b, A_log, dt_bias)
            o = torch.empty_like(v)
            gated_delta_rule_decode(*args, pool, idx)  # tunes
            key = next(key for key in tr._decode_choice if key[0] == HV and key[3] == dtype
                       and key[7] == min(triton.next_power_of_2(N), tr.DECODE_TUNE_ROWS))
            fns = {f"decode (shipped: {tr._decode_choice[key]})": lambda: gated_delta_rule_decode(*args, pool, idx)}
            for qkv in (False, True):
                ch = tr.DecodeChoice(kernel=tr.DecodeKernel.TMA, cfg=(64, 4, 4, 3), qkv_tma=qkv)
                fns[f"walk {ch}"] = lambda ch=ch: tr._launch_choice(ch, *args, o, pool, idx, D**-0.5, True, True,
                                                                    1.0, 20.0)
            for cfg in STEADY_ROWS:
                fns[f"rows {cfg}"] = lambda cfg=cfg: triton_decode_rows.launch(cfg, *args, o, pool, idx, D**-0.5,
                                                                               True, 1.0, 20.0)
            for cfg in regs:
                fns[f"regs {cfg}"] = lambda cfg=cfg: launch(cfg, *args, o, pool, idx, D**-0.5)
                for name, kw in variants.items():
                    fns[f"regs {cfg} {name}"] = lambda cfg=cfg, kw=kw: launch(cfg, *args, o, pool, idx, D**-0.5, **kw)
            for cfg, cap in maxnreg:
                fns[f"regs {cfg} maxnreg {cap}"] = lambda cfg=cfg, cap=cap: launch(cfg, *args, o, pool, idx, D**-0.5,
                                                                                   maxnreg=cap)
            o_want, want = torch.empty_like(v), pool.clone()
            launch(STEADY_REGS[0], *args, o_want, want, idx, D**-0.5)
            for cfg, (name, kw) in ((c, v) for c in regs for v in (("", {}), *variants.items())):
                # every candidate against the first shipped-shape config: same arithmetic, same sums
                trial, o_got = pool.clone(), torch.empty_like(v)
                launch(cfg, *args, o_got, trial, idx, D**-0.5, **kw)
                diff = max((o_got.float() - o_want.float()).abs().max().item(),
                           (trial.float() - want.float()).abs().max().item())
                print(f"regs {cfg} {name}: max diff {diff:.1e}", flush=True)
            for cfg in (STEADY_REGS3 if regs3 is None else regs3):
                trial, o_got = pool.clone(), torch.empty_like(v)
                launch3(cfg, *args, o_got, trial, idx, D**-0.5)
                diff = max((o_got.float() - o_want.float()).abs().max().item(),
                           (trial.float() - want.float()).abs().max().item())
                fns[f"regs3 {cfg} (diff {diff:.0e})"] = lambda cfg=cfg: launch3(cfg, *args, o, pool, idx, D**-0.5)
            del want
            same_src, dst = pool[:N], torch.empty_like(pool[:N])
            fns["copy, same size"] = lambda: dst.copy_(same_src)
            names = list(fns)
            steady_ms = {n: [] for n in names}
            for order in bench_timing._rotations(names, rounds):
                for n in order:
                    steady_ms[n].append(bench_timing._median_ms(fns[n], iters))
            spin = bench_timing._spin_cycles(max(bench_timing._host_ms(f) for f in fns.values()))
            # After another layer's decode step (the shipped kernel on a second pool of the same size): L2 holds that
            # layer's dirty lines, none of this pool's, as in a stack of GDN layers with little between them.
            pool2 = pool.clone()
            other_layer = lambda: gated_delta_rule_decode(*args, pool2, idx)  # noqa: E731
            other = {n: sorted(_after_ms(fns[n], other_layer, spin) for _ in range(9))[4] for n in names}
            del pool2
            cold = {n: sorted(_dirty_ms(fns[n], spin, flush) for _ in range(5))[2] for n in names}
            clean = {n: sorted(_clean_ms(fns[n], spin, flush) for _ in range(5))[2] for n in names}
            # As the decode tuner times a candidate (`triton_recurrent._charged_ms`): from a clean L2, charged with the
            # write-back it leaves, the charging read's own time subtracted; median of 9.
            read = sorted(tr._charged_ms(lambda: None, spin, byte_flush) for _ in range(9))[4]
            charged = {n: sorted(tr._charged_ms(fns[n], spin, byte_flush) for _ in range(9))[4] - read for n in names}
            nbytes = 2 * N * HV * D * D * pool.element_size()
            shape = f"{model} B={N} {str(dtype).removeprefix('torch.')}"
            for n in names:
                pcts = [100 * nbytes / ms / 1e6 / copy_gbps for ms in steady_ms[n]]
                cold_pct = 100 * nbytes / cold[n] / 1e6 / copy_gbps
                clean_pct = 100 * nbytes / clean[n] / 1e6 / copy_gbps
                other_pct = 100 * nbytes / other[n] / 1e6 / copy_gbps
                charged_pct = 100 * nbytes / charged[n] / 1e6 / copy_gbps if charged[n] > 0 else float("nan")
                out.append({"shape": shape, "what": n, "steady_ms": steady_ms[n], "pct_copy": pcts,
                            "cold_ms": cold[n], "cold_pct_copy": cold_pct, "clean_ms": clean[n],
                            "clean_pct_copy": clean_pct, "other_ms": other[n], "other_pct_copy": other_pct,
                            "charged_ms": charged[n], "charged_pct_copy": charged_pct})
                print(f"{shape:20} {n:58} steady {' '.join(f'{x:5.1f}' for x in pcts)} % copy; cold {cold_pct:5.1f}"
                      f"; clean {clean_pct:5.1f}; charged {charged_pct:5.1f}; other {other_pct:5.1f}", flush=True)
            del pool, dst
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--batch", type=int, nargs="+", default=[64, 256])
    p.add_argument("--json", default=None)
    p.add_argument("--steady", action="store_true", help="each candidate timed as bench gdn and the tuner do")
    p.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"], help="--steady's state dtypes")
    p.add_argument("--models", nargs="+", default=None, help="--steady's models of bench_cases.DECODE_SHAPES")
    p.add_argument("--regs", nargs="+", default=None, help="--steady's configs BV,ROWS,warps,DEPTH,UNROLL[@maxnreg]")
    p.add_argument("--regs3", nargs="+", default=None,
                   help="--steady's configs of launch3 (K held as [K / KC, KC]): BV,ROWS,warps,KC")
    p.add_argument("--variants", nargs="+", default=[], choices=list(VARIANTS),
                   help="--steady: each --regs config also as each named variant (VARIANTS)")
    args = p.parse_args()
    variants = {v: VARIANTS[v] for v in args.variants}
    regs = maxnreg = None
    if args.regs:
        parsed = [(tuple(int(x) for x in r.split("@")[0].split(",")), int(r.split("@")[1]) if "@" in r else None)
                  for r in args.regs]
        regs = tuple(c for c, cap in parsed if cap is None)
        maxnreg = tuple((c, cap) for c, cap in parsed if cap is not None)
    regs3 = None if args.regs3 is None else tuple(tuple(int(x) for x in r.split(",")) for r in args.regs3)
    rows = (steady(args.iters, args.batch, dtypes=args.dtypes, models=args.models, regs=regs, maxnreg=maxnreg,
                   variants=variants, regs3=regs3)
            if args.steady else run(args.iters, args.batch))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
