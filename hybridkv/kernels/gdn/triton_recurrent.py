"""Triton token-by-token gated delta rule: FLA-style fused recurrent and the in-place slot decode.

Fused recurrent: q, k `[B, T, H, K]`, v `[B, T, HV, V]`, g and beta `[B, T, HV]` (either may be absent),
states `[N, HV, K, V]` (`[N, HV, V, K]` V-first). Decode: one token per sequence, q, k `[N, H, K]`,
v `[N, HV, V]`, raw gate inputs a, b `[N, HV]`, and a slot pool `[slots, HV, V, K]` updated in place.

One kernel serves both; `reference.recurrent_reference` and `reference.decode_reference` are its
oracles. A program owns a [BV, K] tile of one (sequence, value head) state in fp32 registers and walks
that sequence's tokens. Decode reads the tile from its slot and writes it back to the same place, so
the state crosses HBM exactly once each way, in its own dtype. Decode is bound by those state bytes,
so its tile shape is tuned against copy bandwidth (`_tune_decode`).
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from hybridkv.kernels.gdn.bench_timing import _event_ms, _median


@triton.jit
def _l2norm(x):
    return x * tl.rsqrt(tl.sum(x * x, 0) + 1e-6)


@triton.jit
def _softplus(x, softplus_beta, softplus_threshold):
    bx = softplus_beta * x
    return tl.where(bx <= softplus_threshold, tl.log(1.0 + tl.exp(bx)) / softplus_beta, x)


@triton.jit
def _delta_rule_step(b_s, b_q, b_k, b_v, b_beta, scale):
    """One token on a decayed fp32 [BV, K] tile: (output row, updated tile). Shared with the TMA decode walk
    (`triton_decode_tma`), so the two kernels agree bit for bit."""
    # Both reductions read the decayed state, so they run side by side; S_new q = S q + delta (k.q).
    pred = tl.sum(b_s * b_k[None, :], 1)
    b_sq = tl.sum(b_s * b_q[None, :], 1)
    delta = b_beta * (b_v - pred)
    b_o = (b_sq + delta * tl.sum(b_k * b_q, 0)) * scale
    return b_o, b_s + delta[:, None] * b_k[None, :]


@triton.jit
def _head_loads(q, k, a, b, A_log, dt_bias, i_n, i_h, i_hv, i_nh, o_k, H: tl.constexpr, K: tl.constexpr):
    """The raw values `_head_math` turns into one (sequence i_n, value head i_hv) step's inputs: q and k of its key head
    i_h, a, dt_bias, A_log and b. Apart from the math so that a kernel can request them before it waits for anything."""
    r_q = tl.load(q + (i_n * H + i_h) * K + o_k)
    r_k = tl.load(k + (i_n * H + i_h) * K + o_k)
    return r_q, r_k, tl.load(a + i_nh), tl.load(dt_bias + i_hv), tl.load(A_log + i_hv), tl.load(b + i_nh)


@triton.jit
def _head_math(r_q, r_k, r_a, r_dt, r_A, r_b, softplus_beta, softplus_threshold, L2NORM: tl.constexpr):
    """fp32 q and k (l2-normed with L2NORM), the decay e^g with g = -exp(A_log) softplus(a + dt_bias), and
    beta = sigmoid(b), from `_head_loads`' values."""
    f_q = r_q.to(tl.float32)
    f_k = r_k.to(tl.float32)
    if L2NORM:
        f_q = _l2norm(f_q)
        f_k = _l2norm(f_k)
    x = r_a.to(tl.float32) + r_dt.to(tl.float32)
    decay = tl.exp(-tl.exp(r_A.to(tl.float32)) * _softplus(x, softplus_beta, softplus_threshold))
    beta = tl.sigmoid(r_b.to(tl.float32))
    return f_q, f_k, decay, beta


@triton.jit
def _head_inputs(q, k, a, b, A_log, dt_bias, i_n, i_h, i_hv, i_nh, o_k, softplus_beta, softplus_threshold,
                 H: tl.constexpr, K: tl.constexpr, L2NORM: tl.constexpr):
    """What one (sequence i_n, value head i_hv) step needs besides its state and v rows, as fp32 (`_head_math` of
    `_head_loads`). Shared by the row-looped kernels (`triton_decode_rows`, `triton_decode_prefetch`), so they agree bit
    for bit."""
    r_q, r_k, r_a, r_dt, r_A, r_b = _head_loads(q, k, a, b, A_log, dt_bias, i_n, i_h, i_hv, i_nh, o_k, H, K)
    return _head_math(r_q, r_k, r_a, r_dt, r_A, r_b, softplus_beta, softplus_threshold, L2NORM)


@triton.jit
def _recurrent_kernel(q, k, v, g, beta, a, b, A_log, dt_bias, o, state, state_out, state_indices, cu_seqlens,
                      scale, T, stride_slot, stride_head, softplus_beta, softplus_threshold, H, HV,
                      K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr,
                      BV: tl.constexpr, HAS_G: tl.constexpr, HAS_BETA: tl.constexpr, GATE_IN_KERNEL: tl.constexpr,
                      L2NORM: tl.constexpr, IS_VARLEN: tl.constexpr, HAS_STATE: tl.constexpr,
                      STORE_STATE: tl.constexpr, USE_SLOTS: tl.constexpr, V_FIRST: tl.constexpr,
                      EVEN: tl.constexpr, STREAM: tl.constexpr = False):
    """The gated delta rule over one sequence's tokens for one [BV, K] state tile: grid
    (cdiv(V, BV) * N * HV,). Per token, with S `[K, V]`: S = e^g S, S = S + k (beta (v - S^T k))^T,
    o = scale S^T q (q and k l2-normed first with L2NORM).

    USE_SLOTS (decode): the state is read from and written back to slot state_indices[n] of the pool
    (-1: pool untouched, output zero); otherwise it comes from ``state`` (if HAS_STATE) and goes to
    ``state_out``. GATE_IN_KERNEL: g = -exp(A_log) softplus(a + dt_bias), beta = sigmoid(b)."""
    # One grid axis, V blocks fastest (the order a 2-D grid would run them in): a second axis stops at 65535, which
    # N * HV passes at 1,025 sequences of 64 value heads.
    NV: tl.constexpr = (V + BV - 1) // BV
    pid = tl.program_id(0)
    i_v, i_nh = pid % NV, pid // NV
    i_n, i_hv = i_nh // HV, i_nh % HV
    i_h = i_hv // (HV // H)
    if IS_VARLEN:
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    else:
        bos = i_n.to(tl.int64) * T
        eos = bos + T

    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k = o_k < K
    m_v = o_v < V
    m_s = m_v[:, None] & m_k[None, :]
    # Tile [BV, BK] holds S[k, v] transposed; only the addressing depends on the memory layout.
    if V_FIRST:
        o_s = o_v[:, None] * K + o_k[None, :]
    else:
        o_s = o_k[None, :] * V + o_v[:, None]

    live = True
    if USE_SLOTS:
        slot = tl.load(state_indices + i_n).to(tl.int64)
        live = slot >= 0
        p_s = state + tl.maximum(slot, 0) * stride_slot + i_hv * stride_head + o_s
        p_s_out = p_s
    else:
        # Without an initial state (or a final one) that pointer is None: address only what the call passes.
        if HAS_STATE:
            p_s = state + i_nh.to(tl.int64) * K * V + o_s
        if STORE_STATE:
            p_s_out = state_out + i_nh.to(tl.int64) * K * V + o_s
    b_s = tl.zeros([BV, BK], dtype=tl.float32)
    if HAS_STATE:
        # EVEN: the tile covers K and V exactly; unmasked, the state moves in full-width vectors.
        if EVEN and USE_SLOTS:
            # STREAM: each slot is read once and written once; keep it out of the way of q, k, v in L2.
            b_s = tl.load(p_s, mask=live, other=0.0, eviction_policy="evict_first" if STREAM else "").to(tl.float32)
        elif EVEN:
            b_s = tl.load(p_s).to(tl.float32)
        else:
            b_s = tl.load(p_s, mask=m_s & live, other=0.0).to(tl.float32)

    if GATE_IN_KERNEL:
        neg_a = -tl.exp(tl.load(A_log + i_hv).to(tl.float32))
        bias = tl.load(dt_bias + i_hv).to(tl.float32)
    for t in range(bos, eos):
        b_q = tl.load(q + (t * H + i_h) * K + o_k, mask=m_k, other=0.0).to(tl.float32)
        b_k = tl.load(k + (t * H + i_h) * K + o_k, mask=m_k, other=0.0).to(tl.float32)
        b_v = tl.load(v + (t * HV + i_hv) * V + o_v, mask=m_v, other=0.0).to(tl.float32)
        if L2NORM:
            b_q = _l2norm(b_q)
            b_k = _l2norm(b_k)
        if GATE_IN_KERNEL:
            x = tl.load(a + t * HV + i_hv).to(tl.float32) + bias
            b_s = b_s * tl.exp(neg_a * _softplus(x, softplus_beta, softplus_threshold))
            b_beta = tl.sigmoid(tl.load(b + t * HV + i_hv).to(tl.float32))
        else:
            if HAS_G:
                b_s = b_s * tl.exp(tl.load(g + t * HV + i_hv).to(tl.float32))
            if HAS_BETA:
                b_beta = tl.load(beta + t * HV + i_hv).to(tl.float32)
            else:
                b_beta = 1.0
        b_o, b_s = _delta_rule_step(b_s, b_q, b_k, b_v, b_beta, scale)
        b_o = tl.where(live, b_o, 0.0)
        tl.store(o + (t * HV + i_hv) * V + o_v, b_o.to(o.dtype.element_ty), mask=m_v)
    if STORE_STATE:
        if EVEN and USE_SLOTS:
            tl.store(p_s_out, b_s.to(p_s_out.dtype.element_ty), mask=live, cache_modifier=".cs" if STREAM else "")
        elif EVEN:
            tl.store(p_s_out, b_s.to(p_s_out.dtype.element_ty))
        else:
            tl.store(p_s_out, b_s.to(p_s_out.dtype.element_ty), mask=m_s & live)


# Decode streams each state once; which kernel and tile keep enough bytes in flight depends on the state
# dtype, head count and batch. Triton's autotuner would clone the whole pool around every timed call
# (restore_value), which both costs a pool-sized copy and swamps the timings, so decode tunes itself
# once per key on a scratch pool instead. The key carries the batch size rounded up to a power of two
# (at most DECODE_TUNE_ROWS) because the best tile moves with it: a tile tuned on a small batch can be
# several points of copy bandwidth short on a large one. The candidates are the tile kernel's
# (BV, num_warps) configs and, where they can run, the TMA walk's (`triton_decode_tma.TMA_CONFIGS`, those with a
# 128-byte v row also with q, k and v read by TMA), the row-looped kernel's (`triton_decode_rows.ROWS_CONFIGS`) and its
# register-prefetching form's (`triton_decode_prefetch.PREFETCH_CONFIGS`).
DECODE_TUNE_ROWS = 256
# The spin before each timed tuning launch (`_tuning_ms`): cycles per second of a GPU clock that is at
# most this fast (H200: 1.98 GHz boost), so a spin of host time x this lasts at least that long; and a floor.
_SPIN_CYCLES_PER_S = 2.0e9
_SPIN_MIN_CYCLES = 200_000
DECODE_CONFIGS = ((16, 2), (32, 2), (32, 4), (64, 4), (64, 8), (128, 8))  # (BV, num_warps)


class DecodeKernel(enum.Enum):
    TILE = "tile"  # `_recurrent_kernel`, one [BV, K] tile per program
    TMA = "tma"  # `triton_decode_tma`, persistent programs with the state staged by TMA
    ROWS = "rows"  # `triton_decode_rows`, a program loops over its head's rows, few a thread
    PREFETCH = "prefetch"  # `triton_decode_prefetch`, the same loop with blocks prefetched into registers


@dataclass(frozen=True, kw_only=True)
class DecodeChoice:
    kernel: DecodeKernel
    # TILE: (BV, num_warps); TMA: (BV, num_warps, programs per SM, stages); ROWS: (BV, ROWS, num_warps, stages);
    # PREFETCH: (BV, ROWS, num_warps[, blocks asked into L2 ahead]).
    cfg: tuple[int, ...]
    # TMA only: q, k and v through tensor descriptors (`triton_decode_tma.QKV.TMA`) where a call's tensors allow it
    # (`triton_decode_tma.qkv_describable`), else by loads: the same arithmetic, so the same bits, either way.
    qkv_tma: bool = False

    def __str__(self) -> str:
        return f"{self.kernel.value} {self.cfg}{' qkv-tma' if self.qkv_tma else ''}"


_DEFAULT_DECODE = DecodeChoice(kernel=DecodeKernel.TILE, cfg=(32, 4))
_decode_choice: dict[tuple, DecodeChoice] = {}


def decode_choices() -> dict[tuple, DecodeChoice]:
    """The kernel and config each decode key settled on (for the bench's report)."""
    return dict(_decode_choice)


def _block_v(V: int) -> int:
    return min(32, triton.next_power_of_2(V))


def fused_recurrent_fwd(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens,
                        use_qk_l2norm_in_kernel, state_v_first):
    """o `[B, T, HV, V]` and the fp32 final state (None unless asked) of
    `api.fused_recurrent_gated_delta_rule`, whose arguments these are (validated there)."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    q, k, v = (x.contiguous() for x in (q, k, v))
    g = g.contiguous() if g is not None else None
    beta = beta.contiguous() if beta is not None else None
    N = B if cu_seqlens is None else cu_seqlens.numel() - 1
    o = torch.empty_like(v)
    h0 = initial_state.contiguous() if initial_state is not None else None
    final = None
    if output_final_state:
        final = q.new_empty((N, HV, V, K) if state_v_first else (N, HV, K, V), dtype=torch.float32)
    BV = _block_v(V)
    grid = (triton.cdiv(V, BV) * N * HV,)
    _recurrent_kernel[grid](
        q, k, v, g, beta, None, None, None, None, o, h0, final, None, cu_seqlens, scale, T, 0, 0, 1.0, 20.0, H, HV,
        K=K, V=V, BK=triton.next_power_of_2(K), BV=BV, HAS_G=g is not None,
        HAS_BETA=beta is not None, GATE_IN_KERNEL=False, L2NORM=use_qk_l2norm_in_kernel,
        IS_VARLEN=cu_seqlens is not None, HAS_STATE=h0 is not None, STORE_STATE=final is not None,
        USE_SLOTS=False, V_FIRST=state_v_first, EVEN=False, num_warps=4,
    )
    return o, final


def _launch_decode(cfg, q, k, v, a, b, A_log, dt_bias, o, ssm_state, state_indices, scale, l2, v_first,
                   softplus_beta, softplus_threshold, stream: bool | None = None):
    """One decode launch at ``cfg`` = (BV, num_warps). ``stream``: streaming cache hints on the state
    (evict-first loads, .cs stores); None: for 16-bit states, where they were faster (fp32: no gain).
    Each slot is read once and written once, so keeping it out of L2 leaves room for q, k and v."""
    if stream is None:
        stream = ssm_state.element_size() == 2
    N, H, K = q.shape
    HV, V = v.shape[1], v.shape[2]
    bv, warps = cfg
    BK = triton.next_power_of_2(K)
    bv = min(bv, triton.next_power_of_2(V))
    _recurrent_kernel[(triton.cdiv(V, bv) * N * HV,)](
        q, k, v, None, None, a, b, A_log, dt_bias, o, ssm_state, None, state_indices, None, scale, 1,
        ssm_state.stride(0), ssm_state.stride(1), float(softplus_beta), float(softplus_threshold), H, HV,
        K=K, V=V, BK=BK, BV=bv, HAS_G=False, HAS_BETA=False,
        GATE_IN_KERNEL=True, L2NORM=l2, IS_VARLEN=False, HAS_STATE=True,
        STORE_STATE=True, USE_SLOTS=True, V_FIRST=v_first, EVEN=(BK == K and V % bv == 0), STREAM=stream,
        num_warps=warps,
    )


def _launch_choice(choice: DecodeChoice, q, k, v, a, b, A_log, dt_bias, o, ssm_state, state_indices, scale, l2,
                   v_first, softplus_beta, softplus_threshold) -> None:
    if choice.kernel is DecodeKernel.TMA:
        by_tma = choice.qkv_tma and triton_decode_tma.qkv_describable(choice.cfg, q, k, v)
        triton_decode_tma.launch(choice.cfg, q, k, v, a, b, A_log, dt_bias, o, ssm_state, state_indices, scale, l2,
                                 softplus_beta, softplus_threshold,
                                 qkv=triton_decode_tma.QKV.TMA if by_tma else triton_decode_tma.QKV.LOADS)
    elif choice.kernel is DecodeKernel.ROWS:
        triton_decode_rows.launch(choice.cfg, q, k, v, a, b, A_log, dt_bias, o, ssm_state, state_indices, scale, l2,
                                  softplus_beta, softplus_threshold)
    elif choice.kernel is DecodeKernel.PREFETCH:
        triton_decode_prefetch.launch(choice.cfg, q, k, v, a, b, A_log, dt_bias, o, ssm_state, state_indices, scale,
                                      l2, softplus_beta, softplus_threshold)
    else:
        _launch_decode(choice.cfg, q, k, v, a, b, A_log, dt_bias, o, ssm_state, state_indices, scale, l2, v_first,
                       softplus_beta, softplus_threshold)


def _l2_bytes(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).L2_cache_size


def _charged_ms(launch, spin: int, flush: torch.Tensor) -> float:
    """ms of one ``launch`` that finds L2 holding clean lines only, plus the read of ``flush`` (2x L2) after it, which
    writes back whatever the launch left dirty; `_tuning_ms` subtracts that read's own time (`_charged_ms` of a no-op).
    Queued behind a GPU spin of ``spin`` cycles that outlasts the host time."""
    flush.max()
    return _event_ms(lambda: (launch(), flush.max()), spin)


def _tune_decode(args, rows: int, tma: bool, by_rows: bool) -> DecodeChoice:
    """The candidate `DecodeTimings.pick` keeps of `_tuning_ms`."""
    return _tuning_ms(args, rows, tma, by_rows).pick()


# Candidates whose charged times (`_charged_ms`) lie within this fraction of the best are near-ties: the charged
# timing cannot order them from run to run. At 35B bf16 with 64 sequences on an H200 the prefetching row loop's charged
# time against the TMA walk's (q, k, v by TMA) came out -0.15%, -2.5% and more than +1.5% in three runs
# (results/tuner_probe_charged_h200.txt, tuner_probe_tie_h200.txt, bench_gdn_fi_decode_fourteenth_h200.txt: the walk
# kept), while a step after a step of its own (`bench gdn`, a decode loop) put the loop 6-8% ahead every time (39.6
# against 42.6 us), and one from a clean L2 2-3% ahead (decode_regs_depth4_h200.txt). So near-ties are timed once more
# so, each launch after one of its own on the same pool, and the fastest of that is kept.
DECODE_TIE = 0.04
_STEADY_CALLS = 4


@dataclass(frozen=True, kw_only=True)
class DecodeTimings:
    """What the decode tuner measured, ms a launch: every candidate from a clean L2, charged with its write-back
    (``charged``), and the near-ties of that (`DECODE_TIE`) after a launch of their own (``steady``)."""

    charged: dict[DecodeChoice, float]
    steady: dict[DecodeChoice, float]

    def pick(self) -> DecodeChoice:
        near = near_ties(self.charged)
        if len(near) == 1:
            return near[0]
        missing = [str(c) for c in near if c not in self.steady]
        if missing:
            raise ValueError(f"steady timings lack the near-ties {missing}; timed: {[str(c) for c in self.steady]}")
        return min(near, key=self.steady.__getitem__)


def near_ties(charged: dict[DecodeChoice, float]) -> list[DecodeChoice]:
    """The candidates within `DECODE_TIE` of the fastest charged time, fastest first. A charged time is a difference
    of two medians and can come out at or below zero on a step shorter than its noise: the band is then no wider than
    the best time's magnitude."""
    if not charged:
        raise ValueError("no decode candidates were timed")
    best = min(charged.values())
    bound = best + DECODE_TIE * abs(best)
    return sorted((c for c, ms in charged.items() if ms <= bound), key=charged.__getitem__)


def _tuning_ms(args, rows: int, tma: bool, by_rows: bool) -> DecodeTimings:
    """Time each candidate on a scratch pool of `rows` slots (the caller's pool is never touched): ms of one launch
    that finds L2 clean, charged with writing back what it leaves dirty (`_charged_ms`), median of five rounds
    (fifteen on a scratch pool under half of L2); then the near-ties of that (`near_ties`) once more, each launch
    after one of its own, as many rounds. ``tma``: the caller's pool can take the TMA walk
    (`triton_decode_tma.eligible`), so its configs are candidates too; ``by_rows``: so can the row-looped kernel and
    its register-prefetching form (`triton_decode_rows.eligible`)."""
    q, k, v, a, b, A_log, dt_bias, o, ssm_state, state_indices, scale, l2, v_first, *rest = args
    scratch = torch.zeros((rows, *ssm_state.shape[1:]), dtype=ssm_state.dtype, device=ssm_state.device)
    idx = torch.arange(rows, device=q.device, dtype=state_indices.dtype)
    sub = (q[:rows], k[:rows], v[:rows], a[:rows], b[:rows], A_log, dt_bias, torch.empty_like(v[:rows]),
           scratch, idx, scale, l2, v_first, *rest)
    cands = [DecodeChoice(kernel=DecodeKernel.TILE, cfg=c) for c in DECODE_CONFIGS]
    # The walk is timed on the dense scratch pool, which it must be able to describe as well.
    if tma and triton_decode_tma.eligible(q, v, scratch, v_first):
        cands += [DecodeChoice(kernel=DecodeKernel.TMA, cfg=c) for c in triton_decode_tma.TMA_CONFIGS]
        # With q, k and v staged by TMA beside the state, a tile no longer waits a load latency for q before its
        # norms: on an H200 the fixed part of a call fell from 7.6 to 2.9 us (35B bf16, fits through 64 and 256
        # sequences) and the per-MB rate rose 10%, so it wins on small batches and loses on large ones.
        cands += [DecodeChoice(kernel=DecodeKernel.TMA, cfg=c, qkv_tma=True) for c in triton_decode_tma.TMA_CONFIGS
                  if triton_decode_tma.qkv_describable(c, *sub[:3])]
    if by_rows and triton_decode_rows.eligible(q, v, scratch, v_first):
        cands += [DecodeChoice(kernel=DecodeKernel.ROWS, cfg=c) for c in triton_decode_rows.ROWS_CONFIGS]
        # Configs that ask L2 ahead (`triton_decode_prefetch.l2_prefetchable`) only where the caller's pool can take the
        # TMA walk, which asks as much of it (sm_90+, 16-byte aligned base and strides) and is part of the key.
        cands += [DecodeChoice(kernel=DecodeKernel.PREFETCH, cfg=c) for c in triton_decode_prefetch.PREFETCH_CONFIGS
                  if not triton_decode_prefetch.l2_ahead(c) or tma]
    for choice in cands:  # compile and warm every candidate before any is timed
        _launch_choice(choice, *sub)
    torch.cuda.synchronize()
    host_s = 0.0
    for choice in cands:  # the median of three, so that one stall (a GC pause) does not lengthen every spin
        launches = []
        for _ in range(3):
            t0 = time.perf_counter()
            _launch_choice(choice, *sub)
            launches.append(time.perf_counter() - t0)
        host_s = max(host_s, sorted(launches)[1])
    torch.cuda.synchronize()
    # The timed launches are queued behind a GPU spin that outlasts their host time, so the events measure the GPU:
    # a small batch's step (a few us) takes less device time than one launch's Python, and timed back to back it
    # would pick whichever candidate launches fastest on the host, not what a CUDA graph then replays. The spin
    # covers the slowest candidate's launch: the TMA walk's, a tensor descriptor per operand, takes up to twice a tile
    # launch's host time (35-150 us a launch on the H200's host).
    flush = torch.empty(2 * _l2_bytes(q.device), dtype=torch.int8, device=q.device)
    t0 = time.perf_counter()
    flush.max()
    host_s += time.perf_counter() - t0  # the read queued behind the spin too
    torch.cuda.synchronize()
    spin = int(max(_SPIN_MIN_CYCLES, 2 * host_s * _SPIN_CYCLES_PER_S))
    # Each timed launch finds L2 holding clean lines only, as in serving after the layers between two decode calls of
    # one layer have streamed their weights, and is charged with writing back what it leaves dirty, which a step pays
    # in steady state (the writes compete with the next layers' reads). Timed on one pool back to back, a pool under
    # L2's size (32 sequences of 35B bf16 state: 32 MB) stayed resident across launches and the order of the
    # candidates moved their times by up to 14% (H200, tools/gdn/tuner_probe.py), enough to keep a tile config
    # over the walk. Timed as one launch after a flush and no more, a launch paid for none of the writes it left in L2
    # (up to L2's size): at 35B bf16 with 64 sequences the walk (q, k, v by TMA) and the prefetching row loop (4, 128,
    # 1) came within 2% of each other, either one kept from run to run, while back to back, as `bench gdn` and a
    # decode loop run them, the prefetching loop is 5% faster (results/tuner_probe_prefetch_h200.txt). The read after
    # the launch writes its dirty lines back; its own time, the same read after a clean L2, is subtracted. Median of
    # five rounds over all candidates (fifteen for pools under half of L2). The flush buffer (twice L2, ~100 MB on an
    # H200) and the scratch pool go back to torch's caching allocator after the tuning, which an engine's first eager
    # calls (its memory profiling) include.
    # Each sample carries the read of 2x L2 (~25 us on an H200), whose jitter is comparable to the gap between
    # candidates when a step takes a few us: small pools get more rounds (a review's concern, not measured).
    rounds = 5 if scratch.numel() * scratch.element_size() >= _l2_bytes(q.device) // 2 else 15
    nothing = [_charged_ms(lambda: None, spin, flush) for _ in range(5)]
    times: dict[DecodeChoice, list[float]] = {c: [] for c in cands}
    for _ in range(rounds):
        for choice in cands:
            times[choice].append(_charged_ms(lambda c=choice: _launch_choice(c, *sub), spin, flush))
        nothing.append(_charged_ms(lambda: None, spin, flush))
    del flush
    read_ms = sorted(nothing)[len(nothing) // 2]
    charged = {c: _median([t - read_ms for t in ts]) for c, ts in times.items()}
    near = near_ties(charged)
    steady: dict[DecodeChoice, list[float]] = {c: [] for c in near}
    if len(near) > 1:
        # Interleaved, each sample after an untimed launch of the same candidate: it finds L2 as its own previous step
        # left it (dirty lines of the pool to write back while it reads), not as another candidate's. A sample is the
        # mean of `_STEADY_CALLS` launches back to back behind a spin that outlasts their host time, over three times
        # the charged rounds. With one launch a sample, median of five, the tuner kept prefetch (16, 128, 4) at 35B bf16
        # with 64 sequences in a run where a longer steady timing had it 1-2 points behind (4, 128, 1) and (8, 128, 4)
        # (results/decode_regs_charged_h200.txt).
        steady_spin = spin * _STEADY_CALLS

        def calls(c):
            for _ in range(_STEADY_CALLS):
                _launch_choice(c, *sub)

        for _ in range(3 * rounds):
            for choice in near:
                _launch_choice(choice, *sub)
                steady[choice].append(_event_ms(lambda c=choice: calls(c), steady_spin) / _STEADY_CALLS)
    return DecodeTimings(charged=charged, steady={c: _median(ts) for c, ts in steady.items() if ts})


def decode_fwd(q, k, v, a, b, A_log, dt_bias, ssm_state, state_indices, scale, use_qk_l2norm_in_kernel,
               state_v_first, softplus_beta, softplus_threshold):
    """o `[N, HV, V]` of `api.gated_delta_rule_decode` (arguments validated there); ssm_state is updated in
    place. The kernel and tile are tuned on the first eager call per key (`_tune_decode`)."""
    N, H, K = q.shape
    HV, V = v.shape[1], v.shape[2]
    q, k, v, a, b = (x.contiguous() for x in (q, k, v, a, b))
    o = torch.empty_like(v)
    args = (q, k, v, a, b, A_log, dt_bias, o, ssm_state, state_indices, scale, use_qk_l2norm_in_kernel,
            state_v_first, softplus_beta, softplus_threshold)
    bucket = min(triton.next_power_of_2(max(N, 1)), DECODE_TUNE_ROWS)
    tma = triton_decode_tma.eligible(q, v, ssm_state, state_v_first)
    by_rows = triton_decode_rows.eligible(q, v, ssm_state, state_v_first)
    # Whether this pool can take the TMA walk or the row-looped kernel is part of the key: the same shapes over a pool
    # one cannot read (a misaligned view, K-first) must not reuse its choice.
    key = (HV, K, V, ssm_state.dtype, q.dtype, state_v_first, use_qk_l2norm_in_kernel, bucket, tma, by_rows)
    choice = _decode_choice.get(key)
    if choice is None:
        # Under CUDA-graph capture nothing may sync: use the default until an eager call has tuned.
        if torch.cuda.is_current_stream_capturing():
            choice = _DEFAULT_DECODE
        else:
            choice = _decode_choice[key] = _tune_decode(args, max(1, min(N, bucket)), tma, by_rows)
    _launch_choice(choice, *args)
    return o


# At the end: the TMA walk and the row-looped kernel take their arithmetic from the helpers above, so this module must
# be whole before they load, whichever is imported first.
from hybridkv.kernels.gdn import triton_decode_prefetch, triton_decode_rows, triton_decode_tma  # noqa: E402
