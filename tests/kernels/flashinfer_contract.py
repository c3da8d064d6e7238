"""CPU stand-ins for FlashInfer 0.7.2's `flashinfer.gdn_prefill.chunk_gated_delta_rule` (and, at the end, its pool
decode), written from its documented contract (its docstring; its tests compare the final state transposed against a
K-by-V reference and pass `torch.rand` as the gate): flat `[T_total, heads, 128]` q/k/v with required cu_seqlens; g
is the decay factor itself (linear, not log); fp32 g and beta `[T_total, HV]`; states `[N, HV, V, K]`; value head h
reads key head h // (HV // H); output in q's dtype. One token at a time in fp32, so that a wrong mapping of any of
these shows.

It refuses what FlashInfer refuses on the way (non-contiguous or wrongly typed inputs, no cu_seqlens), so a mapping
that only works here cannot pass.
"""

from __future__ import annotations

import torch


def chunk_gated_delta_rule(q, k, v, g=None, beta=None, scale=None, initial_state=None, output_final_state=False,
                           cu_seqlens=None, use_qk_l2norm_in_kernel=False, max_seqlen=None):
    assert cu_seqlens is not None and cu_seqlens.dtype in (torch.int32, torch.int64)
    assert q.dtype in (torch.bfloat16, torch.float16) and k.dtype == v.dtype == q.dtype
    assert g.dtype == beta.dtype == torch.float32
    assert all(x.is_contiguous() for x in (q, k, v, g, beta))
    T, H, K = q.shape
    HV, V = v.shape[1:]
    assert k.shape == (T, H, K) and g.shape == beta.shape == (T, HV)
    offsets = cu_seqlens.tolist()
    assert offsets[0] == 0 and offsets[-1] == T
    if max_seqlen is not None:
        assert max(b - a for a, b in zip(offsets, offsets[1:])) <= max_seqlen <= T
    qf, kf = q.float(), k.float()
    if use_qk_l2norm_in_kernel:
        qf = qf * torch.rsqrt((qf * qf).sum(-1, keepdim=True) + 1e-6)
        kf = kf * torch.rsqrt((kf * kf).sum(-1, keepdim=True) + 1e-6)
    qf, kf = qf.repeat_interleave(HV // H, dim=1), kf.repeat_interleave(HV // H, dim=1)
    scale = K**-0.5 if not scale else scale
    N = len(offsets) - 1
    states = torch.zeros(N, HV, V, K) if initial_state is None else initial_state.float().clone()
    assert states.shape == (N, HV, V, K)
    o = torch.zeros(T, HV, V)
    for n in range(N):
        S = states[n]  # [HV, V, K]
        for t in range(offsets[n], offsets[n + 1]):
            S = g[t, :, None, None] * S
            v_old = torch.einsum("hvk,hk->hv", S, kf[t])
            S = S + beta[t, :, None, None] * torch.einsum("hv,hk->hvk", v[t].float() - v_old, kf[t])
            o[t] = scale * torch.einsum("hvk,hk->hv", S, qf[t])
        states[n] = S
    out = o.to(q.dtype)
    return (out, states) if output_final_state else out


def gated_delta_rule_decode_pretranspose(q, k, v, state=None, A_log=None, a=None, dt_bias=None, b=None, scale=None,
                                         output=None, use_qk_l2norm=True, initial_state=None,
                                         initial_state_indices=None, output_state_indices=None,
                                         intermediate_states_buffer=None, disable_state_update=False, backend="auto"):
    """FlashInfer 0.7.2's `flashinfer.gdn_decode.gated_delta_rule_decode_pretranspose` in pool mode, from its
    docstring: q, k `[B, 1, H, K]`, v `[B, 1, HV, V]` in bf16/fp16; a, b `[B, 1, HV]` in bf16/fp16 (g = -exp(A_log)
    softplus(a + dt_bias), beta = sigmoid(b)); A_log fp32 `[HV]`; the pool `[pool, HV, V, K]` K-contiguous, gathered
    and written in place at `initial_state_indices` `[B]`: int32 here, although the docstring allows int64, because the
    bf16-state kernel does not compile with int64 ones (CuTe DSL TYPE_UNSTABLE_JOIN, H200 2026-12-02). Returns
    (o `[B, 1, HV, V]`, the pool)."""
    assert state is None and initial_state is not None and initial_state_indices is not None
    B, T, H, K = q.shape
    HV, V = v.shape[2:]
    assert T == 1 and k.shape == q.shape and v.shape == (B, 1, HV, V)
    assert q.dtype in (torch.bfloat16, torch.float16) and k.dtype == v.dtype == q.dtype
    assert a.dtype in (torch.bfloat16, torch.float16) and b.dtype == a.dtype and a.shape == b.shape == (B, 1, HV)
    assert A_log.dtype == torch.float32 and A_log.shape == dt_bias.shape == (HV,)
    assert dt_bias.dtype in (torch.bfloat16, torch.float32)
    assert initial_state.shape[1:] == (HV, V, K) and initial_state.stride(-1) == 1
    assert initial_state_indices.shape == (B,) and initial_state_indices.dtype == torch.int32
    assert output_state_indices is None and not disable_state_update
    qf, kf = q[:, 0].float(), k[:, 0].float()
    if use_qk_l2norm:
        qf = qf * torch.rsqrt((qf * qf).sum(-1, keepdim=True) + 1e-6)
        kf = kf * torch.rsqrt((kf * kf).sum(-1, keepdim=True) + 1e-6)
    qf, kf = qf.repeat_interleave(HV // H, dim=1), kf.repeat_interleave(HV // H, dim=1)
    decay = torch.exp(-torch.exp(A_log) * torch.nn.functional.softplus(a[:, 0].float() + dt_bias.float()))
    beta = torch.sigmoid(b[:, 0].float())
    scale = K**-0.5 if scale is None else scale
    o = torch.zeros(B, 1, HV, V)
    for i, slot in enumerate(initial_state_indices.tolist()):
        S = decay[i, :, None, None] * initial_state[slot].float()  # [HV, V, K]
        v_old = torch.einsum("hvk,hk->hv", S, kf[i])
        S = S + beta[i, :, None, None] * torch.einsum("hv,hk->hvk", v[i, 0].float() - v_old, kf[i])
        o[i, 0] = scale * torch.einsum("hvk,hk->hv", S, qf[i])
        initial_state[slot] = S.to(initial_state.dtype)
    return o.to(q.dtype), initial_state
