"""The decode candidates: which kernels and configs the tuner times for an in-place slot-pool decode step, and one
launch of a choice.

Decode is bound by the state bytes (each slot read once and written back once), so what matters is how many bytes a
kernel keeps in flight; that depends on the state dtype, the head count and the batch, so the tuner (`decode_tune`)
times these per key:

- TILE: `fused_recurrent._recurrent_kernel` with slots, one [BV, K] tile per program; runs anywhere.
- TMA: `decode_tma`, persistent programs with the state staged by TMA (sm_90+).
- ROWS: `decode_rows`, a program loops over its head's rows, few a thread, loads pipelined by Triton.
- PREFETCH: `decode_prefetch`, the same loop with blocks prefetched into registers by hand (and optionally into L2).

All four run the same arithmetic (`fused_recurrent._delta_rule_step`), so they agree bit for bit on a given layout.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import triton

from hybridkv.kernels.gdn import decode_prefetch, decode_rows, decode_tma
from hybridkv.kernels.gdn.fused_recurrent import _recurrent_kernel

TILE_CONFIGS = ((16, 2), (32, 2), (32, 4), (64, 4), (64, 8), (128, 8))  # (BV, num_warps)


class DecodeKernel(enum.Enum):
    TILE = "tile"
    TMA = "tma"
    ROWS = "rows"
    PREFETCH = "prefetch"


@dataclass(frozen=True, kw_only=True)
class DecodeChoice:
    kernel: DecodeKernel
    # TILE: (BV, num_warps); TMA: (BV, num_warps, programs per SM, stages); ROWS: (BV, ROWS, num_warps, stages);
    # PREFETCH: (BV, ROWS, num_warps[, blocks asked into L2 ahead]).
    cfg: tuple[int, ...]
    # TMA only: q, k and v through tensor descriptors (`decode_tma.QKV.TMA`) where a call's tensors allow it
    # (`decode_tma.qkv_describable`), else by loads: the same arithmetic, so the same bits, either way.
    qkv_tma: bool = False

    def __str__(self) -> str:
        return f"{self.kernel.value} {self.cfg}{' qkv-tma' if self.qkv_tma else ''}"


# What a step runs under CUDA-graph capture before an eager call has tuned its key (nothing may sync there).
DEFAULT = DecodeChoice(kernel=DecodeKernel.TILE, cfg=(32, 4))


def candidates(q, k, v, ssm_state, *, tma: bool, by_rows: bool) -> list[DecodeChoice]:
    """Every choice the tuner times for this call: the tile configs always; the TMA walk's where ``tma``
    (`decode_tma.eligible`), with q, k and v by TMA too where they are describable; the row loop's and the
    prefetching loop's where ``by_rows`` (`decode_rows.eligible`), the L2-prefetching configs only where the pool can
    also take the TMA walk (which asks as much alignment)."""
    cands = [DecodeChoice(kernel=DecodeKernel.TILE, cfg=c) for c in TILE_CONFIGS]
    if tma:
        cands += [DecodeChoice(kernel=DecodeKernel.TMA, cfg=c) for c in decode_tma.TMA_CONFIGS]
        cands += [DecodeChoice(kernel=DecodeKernel.TMA, cfg=c, qkv_tma=True) for c in decode_tma.TMA_CONFIGS
                  if decode_tma.qkv_describable(c, q, k, v)]
    if by_rows:
        cands += [DecodeChoice(kernel=DecodeKernel.ROWS, cfg=c) for c in decode_rows.ROWS_CONFIGS]
        cands += [DecodeChoice(kernel=DecodeKernel.PREFETCH, cfg=c) for c in decode_prefetch.PREFETCH_CONFIGS
                  if not decode_prefetch.l2_ahead(c) or tma]
    return cands


def _launch_tile(cfg, q, k, v, a, b, A_log, dt_bias, o, ssm_state, state_indices, scale, l2, v_first,
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


def launch(choice: DecodeChoice, q, k, v, a, b, A_log, dt_bias, o, ssm_state, state_indices, scale, l2, v_first,
           softplus_beta, softplus_threshold) -> None:
    """One decode step at ``choice`` (arguments as `decode.decode_fwd`'s, o the output to fill)."""
    if choice.kernel is DecodeKernel.TMA:
        by_tma = choice.qkv_tma and decode_tma.qkv_describable(choice.cfg, q, k, v)
        decode_tma.launch(choice.cfg, q, k, v, a, b, A_log, dt_bias, o, ssm_state, state_indices, scale, l2,
                          softplus_beta, softplus_threshold, qkv=decode_tma.QKV.TMA if by_tma else decode_tma.QKV.LOADS)
    elif choice.kernel is DecodeKernel.ROWS:
        decode_rows.launch(choice.cfg, q, k, v, a, b, A_log, dt_bias, o, ssm_state, state_indices, scale, l2,
                           softplus_beta, softplus_threshold)
    elif choice.kernel is DecodeKernel.PREFETCH:
        decode_prefetch.launch(choice.cfg, q, k, v, a, b, A_log, dt_bias, o, ssm_state, state_indices, scale, l2,
                               softplus_beta, softplus_threshold)
    else:
        _launch_tile(choice.cfg, q, k, v, a, b, A_log, dt_bias, o, ssm_state, state_indices, scale, l2, v_first,
                     softplus_beta, softplus_threshold)
