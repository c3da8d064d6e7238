"""The in-place slot-pool decode step (`api.gated_delta_rule_decode` on a GPU): pick the kernel for the call's key,
tuning it on the first eager call, and launch it.

The key holds what moves the best kernel: head counts and sizes, dtypes, the batch rounded up to a power of two (at
most DECODE_TUNE_ROWS), which kernels the pool can take, and the pool itself: its slot count and strides (an engine's
pool is one tensor for the life of the process, often a per-layer view of a block-major buffer) and the index dtype.
Where a step's slots and pads fall is not in the key (reading the indices would sync every step); the tuner times the
first eager call at its own indices, which an engine draws from the same pool the same way every step.
"""

from __future__ import annotations

import torch
import triton

from hybridkv.kernels.gdn import decode_kernels, decode_rows, decode_tma, decode_tune
from hybridkv.kernels.gdn.decode_kernels import DecodeChoice

DECODE_TUNE_ROWS = 256
_choices: dict[tuple, DecodeChoice] = {}


def decode_choices() -> dict[tuple, DecodeChoice]:
    """The kernel and config each decode key settled on (for the bench's report)."""
    return dict(_choices)


def decode_key(q, v, ssm_state, state_indices, state_v_first: bool, l2: bool) -> tuple:
    """The tuning key of a call (see the module docstring)."""
    N, H, K = q.shape
    HV, V = v.shape[1], v.shape[2]
    bucket = min(triton.next_power_of_2(max(N, 1)), DECODE_TUNE_ROWS)
    tma = decode_tma.eligible(q, v, ssm_state, state_v_first)
    by_rows = decode_rows.eligible(q, v, ssm_state, state_v_first)
    pool = (ssm_state.shape[0], ssm_state.stride(0), ssm_state.stride(1), state_indices.dtype)
    return (HV, K, V, ssm_state.dtype, q.dtype, state_v_first, l2, bucket, tma, by_rows, pool)


def decode_fwd(q, k, v, a, b, A_log, dt_bias, ssm_state, state_indices, scale, use_qk_l2norm_in_kernel,
               state_v_first, softplus_beta, softplus_threshold):
    """o `[N, HV, V]` of `api.gated_delta_rule_decode` (arguments validated there); ssm_state is updated in place."""
    q, k, v, a, b = (x.contiguous() for x in (q, k, v, a, b))
    o = torch.empty_like(v)
    args = (q, k, v, a, b, A_log, dt_bias, o, ssm_state, state_indices, scale, use_qk_l2norm_in_kernel,
            state_v_first, softplus_beta, softplus_threshold)
    key = decode_key(q, v, ssm_state, state_indices, state_v_first, use_qk_l2norm_in_kernel)
    choice = _choices.get(key)
    if choice is None:
        if torch.cuda.is_current_stream_capturing():  # nothing may sync: the default until an eager call has tuned
            choice = decode_kernels.DEFAULT
        else:
            rows = min(q.shape[0], DECODE_TUNE_ROWS)
            sub = tuple(x[:rows] for x in (q, k, v, a, b)) + (A_log, dt_bias, o[:rows], ssm_state,
                                                               state_indices[:rows], *args[10:])
            choice = _choices[key] = decode_tune.tune(sub, tma=key[8], by_rows=key[9])
    decode_kernels.launch(choice, *args)
    return o
