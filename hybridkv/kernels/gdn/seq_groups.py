"""Run a chunked call over groups of sequences when one launch could not hold them all.

The chunk kernels put (sequence, value head) pairs on a grid axis that CUDA caps at 65,535 programs, so a prefill of
more than 65,535 / HV sequences in one call (1,025 of 64 value heads: many short prompts in one batch) would fail to
launch. `by_groups` cuts such a call into runs of whole sequences, each within the cap, and joins their outputs and
final states; sequences are independent, so the result is the unsplit call's. Any other call passes straight through.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

GRID_AXIS = 65_535  # programs on CUDA's second and third grid axes


def by_groups(fn: Callable, q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, *rest,
              limit: int = GRID_AXIS, **kw):
    """``fn`` (a chunk forward with `api.chunk_gated_delta_rule`'s positional arguments first) over groups of at most
    ``limit // HV`` sequences; (o, final state or None) as ``fn`` returns them for the whole call."""
    HV = v.shape[2]
    per = max(1, limit // HV)
    N = q.shape[0] if cu_seqlens is None else cu_seqlens.numel() - 1
    if N <= per:
        return fn(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, *rest, **kw)
    cu = None if cu_seqlens is None else cu_seqlens.tolist()  # a host read, on this rare path only
    outs, finals = [], []
    for s0 in range(0, N, per):
        s1 = min(N, s0 + per)
        if cu is None:  # B sequences of T tokens: a run of rows
            take, sub = (lambda x: x[s0:s1]), None
        else:  # one row of packed sequences: a run of tokens, its offsets rebased
            take, sub = (lambda x: x[:, cu[s0]:cu[s1]]), cu_seqlens[s0:s1 + 1] - cu[s0]
        h0 = None if initial_state is None else initial_state[s0:s1]
        o, f = fn(*map(take, (q, k, v, g, beta)), scale, h0, output_final_state, sub, *rest, **kw)
        outs.append(o)
        finals.append(f)
    o = torch.cat(outs, dim=0 if cu is None else 1)
    return o, (torch.cat(finals, dim=0) if output_final_state else None)
