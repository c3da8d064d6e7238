"""Device probe for issue #8: can a persistent decode kernel keep more state bytes in flight than one
tile per program?

The shipped decode (`triton_recurrent._recurrent_kernel`, USE_SLOTS) gives each program one [BV, K]
tile: load the slot index, then the state, then q/k/v, reduce, store. A bf16 tile is half an fp32
tile's bytes behind the same chain of dependent latencies, and bf16 at HV=32 sits at 79-81% of copy
bandwidth where fp32 reaches 88%. The candidate here runs a fixed number of programs, each walking
tiles with a stride, and issues tile t+1's loads (slot, state, q, k, v, gates) before it computes
tile t, so one tile's loads are in flight while the previous one computes and stores.

A second candidate moves the state by TMA (`_decode_tma`): the pipeliner stages the next tiles' state
in shared memory, so the bytes in flight are no longer bounded by the registers that receive them.
Why that should matter, from offline sm_90 compiles (Triton 3.6, HV=32, bf16 state): the shipped
kernel at (BV=32, 4 warps) takes 121 registers, so 4 programs (16 warps) fit an SM and 32 KB of state
is in flight per SM, about 4.2 MB over the GPU; (128, 8) takes 186 registers, one program per SM, the
same 32 KB. At ~4.3 TB/s and ~1.5 us of latency, Little's law wants over 6 MB. The register-prefetch
walk compiles to 255 registers (spilling at BV >= 64): no better. The TMA walk at (32, 4) takes 80
registers and 25 KB of shared memory at 3 stages: 5 programs per SM, up to 15 tiles (120 KB) in flight.

Run on an H200 2026-12-02 (tools/device/results/decode_probe_h200.txt): the TMA walk won (bf16 up to 84.8%
of copy bandwidth against 78%) and ships as `hybridkv.kernels.gdn.triton_decode_tma`, which this probe now
times; the register-prefetch walk gained at most 2 points and stays here. A TMA walk that also loads the next
tile's q, k and v ahead (they are plain loads in its loop: 2 bytes a thread, too narrow for cp.async) was measured
at a17e0c7 and reverted: +-2 points either way (tools/device/results/decode_probe_prefetch_h200.txt). So
was a Gluon walk with its layout and pipeline written out (no cross-warp reduction, an mbarrier ring with slot
indices loaded a tile ahead, two store buffers; its ``--gluon`` here), at 46c6401: correct, and 6-20 points of copy
bandwidth behind this walk at 64 sequences (tools/device/results/decode_probe_gluon_h200.txt).

``--store`` (ninth session) times only the walk's shipped configs beside three changes to it: updated tiles stored
from registers instead of through a shared buffer and a TMA store (`triton_decode_tma.Store.DIRECT`); for bf16 states,
both row reductions as one tensor-core product (`_decode_tma_mma`); and the walk in Gluon with its layout written out
and the direct store (`gluon_decode_direct`).

``--ring`` (eleventh session) times the shipped configs beside the same walk with q, k and v through tensor descriptors
(`triton_decode_tma.QKV.TMA`) and beside `gluon_decode_ring`: the Gluon walk with q, k and v in the state's TMA ring
and the gates loaded a tile ahead.

``--rows`` (twelfth session) times `triton_decode_rows`, FlashInfer's decode shape in Triton (few rows a thread, a
program looping over its head's rows; written here, shipped after results/decode_probe_rows_h200.txt), beside the
walk's and the tile kernel's best configs.

    python -m tools.gdn.decode_probe [--iters 20] [--json PATH] [--batch 256] [--store | --ring | --rows]
    DECODEFIRST=1 TESTS=0 ONLY=decode bash tools/device/gdn.sh   # on the device, then the decode bench

Each candidate's output and updated pool are compared with the shipped kernel's on the same inputs.
Run from the repository root on a CUDA machine.
"""

from __future__ import annotations

import argparse
import json

import torch
import triton
import triton.language as tl

from hybridkv.kernels.gdn import (bench_cases, bench_timing, gated_delta_rule_decode, triton_decode_rows,
                                  triton_decode_tma, triton_recurrent)
from hybridkv.kernels.gdn.triton_decode_tma import _delta_step
from hybridkv.kernels.gdn.triton_recurrent import _l2norm, _softplus

from tools.gdn import gluon_decode_direct, gluon_decode_ring
from tools.gdn.schedules import decode_inputs


@triton.jit
def _tile_loads(t, n_tiles, q, k, v, a, b, A_log, dt_bias, state, state_indices, stride_slot, stride_head,
                o_k, o_bv, o_s, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                BV: tl.constexpr, STREAM: tl.constexpr):
    NV: tl.constexpr = V // BV
    valid = t < n_tiles
    i_v = t % NV
    i_hv = (t // NV) % HV
    i_n = t // (NV * HV)
    i_h = i_hv // (HV // H)
    slot = tl.load(state_indices + i_n, mask=valid, other=-1).to(tl.int64)
    live = valid & (slot >= 0)
    base = tl.maximum(slot, 0) * stride_slot + i_hv * stride_head + i_v * (BV * K)
    raw = tl.load(state + base + o_s, mask=live, other=0.0, eviction_policy="evict_first" if STREAM else "")
    row_h = i_n.to(tl.int64) * H + i_h
    row_hv = i_n.to(tl.int64) * HV + i_hv
    b_q = tl.load(q + row_h * K + o_k, mask=valid, other=0.0)
    b_k = tl.load(k + row_h * K + o_k, mask=valid, other=0.0)
    b_v = tl.load(v + row_hv * V + i_v * BV + o_bv, mask=valid, other=0.0)
    x = tl.load(a + row_hv, mask=valid, other=0.0).to(tl.float32) + tl.load(dt_bias + i_hv).to(tl.float32)
    bb = tl.load(b + row_hv, mask=valid, other=0.0).to(tl.float32)
    neg_a = -tl.exp(tl.load(A_log + i_hv).to(tl.float32))
    return raw, b_q, b_k, b_v, x, bb, neg_a, valid, live, base, row_hv * V + i_v * BV


@triton.jit
def _decode_persistent(q, k, v, a, b, A_log, dt_bias, o, state, state_indices, N, progs, scale, stride_slot,
                       stride_head, softplus_beta, softplus_threshold, H: tl.constexpr, HV: tl.constexpr,
                       K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr, L2NORM: tl.constexpr,
                       STREAM: tl.constexpr):
    """V-first pools ([slots, HV, V, K], hybridkv's default), as the bench and the TMA walk."""
    pid = tl.program_id(0)
    n_tiles = N * HV * (V // BV)
    o_k = tl.arange(0, K)
    o_bv = tl.arange(0, BV)
    o_s = o_bv[:, None] * K + o_k[None, :]
    raw, b_q, b_k, b_v, x, bb, neg_a, valid, live, base, o_row = _tile_loads(
        pid, n_tiles, q, k, v, a, b, A_log, dt_bias, state, state_indices, stride_slot, stride_head, o_k, o_bv,
        o_s, H, HV, K, V, BV, STREAM)
    for t in range(pid, n_tiles, progs):
        # The next tile's loads go out before this tile's arithmetic and stores.
        n_raw, n_q, n_k, n_v, n_x, n_bb, n_neg_a, n_valid, n_live, n_base, n_o_row = _tile_loads(
            t + progs, n_tiles, q, k, v, a, b, A_log, dt_bias, state, state_indices, stride_slot, stride_head,
            o_k, o_bv, o_s, H, HV, K, V, BV, STREAM)
        b_o, b_s = _delta_step(raw, b_q, b_k, b_v, x, bb, neg_a, scale, softplus_beta, softplus_threshold, L2NORM)
        tl.store(o + o_row + o_bv, tl.where(live, b_o, 0.0).to(o.dtype.element_ty), mask=valid)
        tl.store(state + base + o_s, b_s.to(state.dtype.element_ty), mask=live,
                 cache_modifier=".cs" if STREAM else "")
        raw, b_q, b_k, b_v, x, bb, neg_a, valid, live, base, o_row = (
            n_raw, n_q, n_k, n_v, n_x, n_bb, n_neg_a, n_valid, n_live, n_base, n_o_row)


@triton.jit
def _bf16_split(x):
    """x (fp32) as three bf16 terms whose sum is x to about 2^-24 relative: 8 mantissa bits each."""
    x1 = x.to(tl.bfloat16)
    r1 = x - x1.to(tl.float32)
    x2 = r1.to(tl.bfloat16)
    x3 = (r1 - x2.to(tl.float32)).to(tl.bfloat16)
    return x1, x2, x3


@triton.jit
def _decode_tma_mma(q, k, v, a, b, A_log, dt_bias, o, desc, state_indices, N, progs, scale, softplus_beta,
                    softplus_threshold, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                    BV: tl.constexpr, STAGES: tl.constexpr):
    """The TMA walk (`triton_decode_tma._decode_tma_kernel`, l2norm on) with both of a tile's row reductions, S k and
    S q, done as one bf16 mma instead of shuffle trees: S [BV, K] (a bf16 state, straight from the TMA buffer) times
    the [K, 16] matrix whose columns are k and q, each split into three bf16 terms. bf16 products are exact in the
    fp32 accumulator and the split keeps 24 bits, so this is the fp32 FMAs' arithmetic in another order: for bf16
    states only, not bit for bit the tile kernel's.
    Why: offline sm_90 the shipped walk's loop is ~1,000 instructions a thread per tile, 85 of them SHFL, and at 64
    sequences a third of the call is fixed cost; an mma takes the 64 shuffles and two FMAs an element out."""
    pid = tl.program_id(0)
    NV: tl.constexpr = V // BV
    n_tiles = N * HV * NV
    o_k = tl.arange(0, K)
    o_bv = tl.arange(0, BV)
    col = tl.arange(0, 16)[None, :]
    for t in tl.range(pid, n_tiles, progs, num_stages=STAGES):
        i_v = t % NV
        i_hv = (t // NV) % HV
        i_n = t // (NV * HV)
        i_h = i_hv // (HV // H)
        slot = tl.load(state_indices + i_n).to(tl.int32)
        live = slot >= 0
        raw = desc.load([slot, i_hv, i_v * BV, 0]).reshape(BV, K)
        row_h = i_n.to(tl.int64) * H + i_h
        row_hv = i_n.to(tl.int64) * HV + i_hv
        f_q = _l2norm(tl.load(q + row_h * K + o_k).to(tl.float32))
        f_k = _l2norm(tl.load(k + row_h * K + o_k).to(tl.float32))
        b_v = tl.load(v + row_hv * V + i_v * BV + o_bv).to(tl.float32)
        x = tl.load(a + row_hv).to(tl.float32) + tl.load(dt_bias + i_hv).to(tl.float32)
        bb = tl.load(b + row_hv).to(tl.float32)
        neg_a = -tl.exp(tl.load(A_log + i_hv).to(tl.float32))
        gate = tl.exp(neg_a * _softplus(x, softplus_beta, softplus_threshold))
        k1, k2, k3 = _bf16_split(f_k)
        q1, q2, q3 = _bf16_split(f_q)
        zero = tl.zeros_like(k1)
        kq = tl.where(col == 0, k1[:, None], tl.where(col == 1, k2[:, None], tl.where(col == 2, k3[:, None], tl.where(
            col == 3, q1[:, None], tl.where(col == 4, q2[:, None], tl.where(col == 5, q3[:, None], zero[:, None]))))))
        c = tl.dot(raw, kq)
        # The decay is a scalar per tile, so it multiplies the products instead of the state: S_decayed k = g (S k).
        pred = gate * tl.sum(tl.where(col < 3, c, 0.0), 1)
        b_sq = gate * tl.sum(tl.where((col >= 3) & (col < 6), c, 0.0), 1)
        delta = tl.sigmoid(bb) * (b_v - pred)
        b_o = (b_sq + delta * tl.sum(f_k * f_q, 0)) * scale
        b_s = raw.to(tl.float32) * gate + delta[:, None] * f_k[None, :]
        tl.store(o + row_hv * V + i_v * BV + o_bv, tl.where(live, b_o, 0.0).to(o.dtype.element_ty))
        if live:
            desc.store([slot, i_hv, i_v * BV, 0], b_s.to(desc.dtype).reshape(1, 1, BV, K))


def launch_tma_mma(cfg, q, k, v, a, b, A_log, dt_bias, o, pool, idx, sms=None, maxnreg=None):
    """`_decode_tma_mma` at cfg = (BV, num_warps, programs per SM, stages), as `triton_decode_tma.launch` does."""
    _, warps, _, stages = cfg
    N, H, K = q.shape
    HV, V = v.shape[1], v.shape[2]
    bv, programs, desc = triton_decode_tma.walk(cfg, q, v, pool, sms)
    _decode_tma_mma[(programs,)](q, k, v, a, b, A_log, dt_bias, o, desc, idx, N, programs, K**-0.5, 1.0, 20.0, H=H,
                                 HV=HV, K=K, V=V, BV=bv, STAGES=stages, num_warps=warps,
                                 **({} if maxnreg is None else {"maxnreg": maxnreg}))


def launch_tma(cfg, q, k, v, a, b, A_log, dt_bias, o, pool, idx, store=triton_decode_tma.Store.TMA, maxnreg=None,
               qkv=triton_decode_tma.QKV.LOADS):
    triton_decode_tma.launch(cfg, q, k, v, a, b, A_log, dt_bias, o, pool, idx, q.shape[-1]**-0.5, True, 1.0, 20.0,
                             store=store, maxnreg=maxnreg, qkv=qkv)


# --rows: configs beyond the shipped ones (wider steps for 16-bit states, deeper pipelines).
ROWS_MORE = ((32, 64, 4, 3), (32, 128, 4, 3), (32, 128, 8, 3), (16, 128, 4, 3), (16, 64, 4, 4), (16, 32, 4, 3),
             (8, 32, 4, 3), (8, 64, 4, 4))


def launch_persistent(cfg, q, k, v, a, b, A_log, dt_bias, o, pool, idx, stream):
    bv, warps, per_sm = cfg
    N, H, K = q.shape
    HV, V = v.shape[1], v.shape[2]
    programs = per_sm * torch.cuda.get_device_properties(q.device).multi_processor_count
    _decode_persistent[(programs,)](
        q, k, v, a, b, A_log, dt_bias, o, pool, idx, N, programs, K**-0.5, pool.stride(0), pool.stride(1), 1.0, 20.0,
        H=H, HV=HV, K=K, V=V, BV=bv, L2NORM=True, STREAM=stream, num_warps=warps)


PERSISTENT = tuple((bv, w, s) for bv, w in ((32, 4), (64, 8)) for s in (4, 8))
TMA = tuple((bv, w, s, st) for bv, w in ((32, 4), (64, 4), (64, 8), (128, 8)) for s in (2, 4, 8) for st in (2, 3, 4))
# `--store`: the TMA walk as shipped (its configs) beside the same walk storing from registers (`Store.DIRECT`: no
# shared store buffer, no wait on the last tile's store). Offline sm_90, the direct store at BV 64 takes 168
# registers (3 programs of 4 warps per SM), so it is also timed at a 128 cap (8 bytes of stack).
STORE = tuple((cfg, triton_decode_tma.Store.DIRECT, cap) for cfg in (
    (64, 4, 4, 3), (64, 4, 4, 4), (64, 4, 3, 4), (32, 4, 4, 3), (32, 4, 6, 3), (32, 4, 8, 3), (32, 4, 6, 4),
    (64, 4, 2, 3)) for cap in ((None, 128) if cfg[0] == 64 and cfg[2] > 3 else (None,)))
# And, for bf16 states, the walk with its row reductions on the tensor cores (`_decode_tma_mma`; offline sm_90: BV 64
# at 4 warps 162 registers, 8 B of stack at a 128 cap; at 8 warps 116).
MMA = ((64, 4, 4, 3, 128), (64, 4, 3, 3, None), (64, 4, 4, 4, 128), (64, 8, 2, 3, None), (32, 4, 4, 3, None))


def run(iters: int, copy_gbps: float, N: int = 256, store_only: bool = False, ring: bool = False,
        rows_only: bool = False) -> list[dict]:
    rows = []
    for model, H, HV in bench_cases.DECODE_SHAPES:
        # --ring: bf16 first, the goal's case (a fault in a new kernel ends the process).
        for dtype in (torch.bfloat16, torch.float32) if ring or rows_only else (torch.float32, torch.bfloat16):
            torch.manual_seed(0)
            q, k, v, a, b, A_log, dt_bias, pool0, idx = decode_inputs(N, H, HV, dtype)
            idx[::17] = -1  # pads: the pool must stay untouched there
            nbytes = int((idx >= 0).sum()) * HV * 128 * 128 * 2 * pool0.element_size()
            stream = dtype == torch.bfloat16
            label = f"{model} HV={HV} {str(dtype).removeprefix('torch.')}"

            ref_pool = pool0.clone()
            ref_o = gated_delta_rule_decode(q, k, v, a, b, A_log, dt_bias, ref_pool, idx)  # also tunes
            pool = pool0.clone()
            ms = bench_timing._median_ms(lambda: gated_delta_rule_decode(q, k, v, a, b, A_log, dt_bias, pool, idx),
                                         iters)
            shipped_pct = 100 * nbytes / ms / 1e6 / copy_gbps
            # A copy of as many bytes, timed as a call is: the launch and ramp a pool this size pays anyway.
            moved = 2 * pool0[:N].numel() * pool0.element_size()
            same_gbps = bench_timing._copy_gbps(iters, pool0[:N])
            same_pct = 100 * same_gbps / copy_gbps
            rows.append(dict(shape=label, kernel="same-size copy", cfg=None, ms=moved / same_gbps / 1e6,
                             pct_copy=same_pct, err=0.0, mb=moved / 1e6))
            print(f"{label:22} a copy of {moved / 1e6:.0f} MB moved  {moved / same_gbps / 1e6:.4f} ms "
                  f"{same_pct:5.1f}% copy", flush=True)
            rows.append(dict(shape=label, kernel="shipped", cfg=None, ms=ms, pct_copy=shipped_pct, err=0.0,
                             mb=nbytes / 1e6))
            print(f"{label:22} shipped {triton_recurrent.decode_choices()}  {ms:.4f} ms {shipped_pct:5.1f}% copy",
                  flush=True)
            if rows_only:
                cands = [("tma", c, lambda c, o, pool: launch_tma(c, q, k, v, a, b, A_log, dt_bias, o, pool, idx))
                         for c in ((64, 4, 4, 3), (64, 4, 2, 3), (32, 4, 4, 3))]
                cands += [("tile", c, lambda c, o, pool: triton_recurrent._launch_decode(
                    c, q, k, v, a, b, A_log, dt_bias, o, pool, idx, q.shape[-1]**-0.5, True, True, 1.0, 20.0))
                    for c in ((16, 2), (32, 2))]
                cands += [("rows", c, lambda c, o, pool: triton_decode_rows.launch(
                    c, q, k, v, a, b, A_log, dt_bias, o, pool, idx, q.shape[-1]**-0.5, True, 1.0, 20.0))
                    for c in triton_decode_rows.ROWS_CONFIGS + ROWS_MORE]
            elif ring:
                cands = [("tma", c, lambda c, o, pool: launch_tma(c, q, k, v, a, b, A_log, dt_bias, o, pool, idx))
                         for c in triton_decode_tma.TMA_CONFIGS]
                # The shipped walk with q, k, v through tensor descriptors (`QKV.TMA`): its top stall site gone.
                cands += [("tma qkv-tma", c, lambda c, o, pool: launch_tma(c, q, k, v, a, b, A_log, dt_bias, o, pool,
                                                                         idx, qkv=triton_decode_tma.QKV.TMA))
                          for c in triton_decode_tma.TMA_CONFIGS if c[0] >= 64]
                cands += [(f"gluon ring{'' if tma else ' qkv loads'}", c,
                           lambda c, o, pool, tma=tma: gluon_decode_ring.launch(c, q, k, v, a, b, A_log, dt_bias, o,
                                                                                pool, idx, qkv_tma=tma))
                          for c, tma in gluon_decode_ring.CONFIGS
                          if c[0] * 128 * pool0.element_size() * (c[3] + 1) * c[2] <= 220_000]
            elif store_only:
                cands = [("tma", c, lambda c, o, pool: launch_tma(c, q, k, v, a, b, A_log, dt_bias, o, pool, idx))
                         for c in triton_decode_tma.TMA_CONFIGS]
                cands += [(f"tma {st.value} store{'' if cap is None else f' maxnreg {cap}'}", c,
                           lambda c, o, pool, st=st, cap=cap: launch_tma(c, q, k, v, a, b, A_log, dt_bias, o, pool,
                                                                         idx, st, cap))
                          for c, st, cap in STORE]
                cands += [("gluon direct", c, lambda c, o, pool: gluon_decode_direct.launch(c, q, k, v, a, b, A_log,
                                                                                         dt_bias, o, pool, idx))
                          for c in gluon_decode_direct.CONFIGS]
                if dtype == torch.bfloat16:
                    cands += [(f"tma mma{'' if c[4] is None else f' maxnreg {c[4]}'}", c[:4],
                               lambda c, o, pool, cap=c[4]: launch_tma_mma(c, q, k, v, a, b, A_log, dt_bias, o, pool,
                                                                           idx, maxnreg=cap))
                              for c in MMA]
            else:
                cands = [("persistent", c, lambda c, o, pool: launch_persistent(c, q, k, v, a, b, A_log, dt_bias, o,
                                                                               pool, idx, stream)) for c in PERSISTENT]
                cands += [("tma", c, lambda c, o, pool: launch_tma(c, q, k, v, a, b, A_log, dt_bias, o, pool, idx))
                          for c in TMA]
            for name, cfg, fn in cands:
                if name.startswith("tma") and dtype == torch.float32 and cfg[0] * 128 * 4 * cfg[3] > 200_000:
                    continue  # more shared memory than an SM has
                pool = pool0.clone()
                o = torch.full_like(v, float("nan"))
                try:
                    fn(cfg, o, pool)
                except Exception as exc:  # a config that does not compile or launch is a result, not a stop
                    print(f"{label:22} {name} {cfg}  failed: {str(exc)[:120]}", flush=True)
                    continue
                err = max((o.float() - ref_o.float()).abs().max().item(),
                          (pool.float() - ref_pool.float()).abs().max().item())
                ms = bench_timing._median_ms(lambda: fn(cfg, o, pool), iters)
                pct = 100 * nbytes / ms / 1e6 / copy_gbps
                rows.append(dict(shape=label, kernel=name, cfg=cfg, ms=ms, pct_copy=pct, err=err, mb=nbytes / 1e6))
                print(f"{label:22} {name} {cfg}  {ms:.4f} ms {pct:5.1f}% copy  x{pct / shipped_pct:.3f}"
                      f"  err {err:.1e}", flush=True)
            del pool, pool0, ref_pool
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--json", default=None)
    p.add_argument("--batch", type=int, nargs="+", default=[256], help="sequences per decode step (default 256)")
    p.add_argument("--store", action="store_true",
                   help="only the TMA walk's configs: TMA and direct stores, and (bf16) reductions on the tensor cores")
    p.add_argument("--ring", action="store_true",
                   help="only the TMA walk's configs beside the Gluon ring walk (gluon_decode_ring)")
    p.add_argument("--rows", action="store_true",
                   help="the TMA walk's and tile kernel's best configs beside the row-looped kernel (decode_rows)")
    a = p.parse_args()
    copy = bench_timing._copy_gbps(a.iters)
    print(torch.cuda.get_device_name(), f"copy {copy:.0f} GB/s", flush=True)
    rows = []
    for batch in a.batch:
        print(f"# {batch} sequences", flush=True)
        rows += [dict(r, batch=batch) for r in run(a.iters, copy, batch, a.store, a.ring, a.rows)]
    fits = _fits(rows, copy)  # none with one batch size
    for f in fits:
        print(f"fit {f['shape']:22} {f['kernel']} {f['cfg'] or ''}: {f['fixed_us']:.1f} us + "
              f"{f['us_per_mb']:.3f} us/MB; 80% of copy bandwidth at the smallest batch needs the fixed part under "
              f"{f['fixed_for_80_us']:.1f} us", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"copy_gbps": copy, "rows": rows, "fits": fits}, f, indent=1)


def _fits(rows: list[dict], copy_gbps: float) -> list[dict]:
    """Each candidate's time as a line through its smallest and largest batch: a fixed part (launch, ramp, tail) and a
    streaming rate, and the fixed part at which that rate would reach 80% of copy bandwidth at the smallest batch."""
    by: dict[tuple, list[dict]] = {}
    for r in rows:
        by.setdefault((r["shape"], r["kernel"], str(r["cfg"])), []).append(r)
    out = []
    for (shape, kernel, _), rs in by.items():
        lo, hi = min(rs, key=lambda r: r["mb"]), max(rs, key=lambda r: r["mb"])
        if hi["mb"] <= lo["mb"]:
            continue
        per_mb = (hi["ms"] - lo["ms"]) * 1e3 / (hi["mb"] - lo["mb"])
        fixed = lo["ms"] * 1e3 - per_mb * lo["mb"]
        target = lo["mb"] * 1e6 / (0.8 * copy_gbps * 1e9) * 1e6  # us at 80% of copy bandwidth
        out.append(dict(shape=shape, kernel=kernel, cfg=lo["cfg"], fixed_us=fixed, us_per_mb=per_mb,
                        fixed_for_80_us=target - per_mb * lo["mb"]))
    return out


if __name__ == "__main__":
    main()
