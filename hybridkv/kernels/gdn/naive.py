"""Pure-torch references for every GDN kernel (the CPU implementation and the GPU tests' oracle).

All arithmetic is fp32. Shapes follow FLA: q, k `[B, T, H, K]`, v `[B, T, HV, V]`, g (log decay) and
beta `[B, T, HV]`, states `[N, HV, K, V]` (or `[N, HV, V, K]` with `state_v_first`). Value head `hv`
reads key head `hv // (HV // H)` (GVA). Varlen inputs have B = 1 and `cu_seqlens` of N + 1 offsets.
Inputs are assumed validated by `api.py`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNK = 64
L2NORM_EPS = 1e-6


def l2norm(x: torch.Tensor, eps: float = L2NORM_EPS) -> torch.Tensor:
    x = x.float()
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def gdn_gating(
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    softplus_beta: float = 1.0,
    softplus_threshold: float = 20.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3.5 gates: g = -exp(A_log) * softplus(a + dt_bias) (log decay), beta = sigmoid(b)."""
    x = a.float() + dt_bias.float()
    sp = F.softplus(x, beta=softplus_beta, threshold=softplus_threshold)
    g = -torch.exp(A_log.float()) * sp
    return g, torch.sigmoid(b.float())


def _spans(cu_seqlens: torch.Tensor | None, batch: int, length: int) -> list[tuple[int, int, int]]:
    """(batch row, start, end) of each sequence."""
    if cu_seqlens is None:
        return [(i, 0, length) for i in range(batch)]
    offs = cu_seqlens.tolist()
    return [(0, offs[i], offs[i + 1]) for i in range(len(offs) - 1)]


def _expand_heads(x: torch.Tensor, hv: int) -> torch.Tensor:
    """[..., H, D] -> [..., HV, D] with value head hv reading key head hv // (HV // H)."""
    return x.repeat_interleave(hv // x.shape[-2], dim=-2)


def _load_state(state: torch.Tensor | None, n: int, hv: int, dk: int, dv: int, v_first: bool,
                device: torch.device) -> torch.Tensor:
    if state is None:
        return torch.zeros(n, hv, dk, dv, dtype=torch.float32, device=device)
    s = state.float()
    return s.transpose(-1, -2).contiguous() if v_first else s.clone()


def _store_state(s: torch.Tensor, v_first: bool) -> torch.Tensor:
    return s.transpose(-1, -2).contiguous() if v_first else s


def recurrent_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor | None,
    beta: torch.Tensor | None,
    scale: float,
    initial_state: torch.Tensor | None,
    output_final_state: bool,
    cu_seqlens: torch.Tensor | None,
    use_qk_l2norm_in_kernel: bool,
    state_v_first: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Token-by-token gated delta rule; g None = no decay, beta None = 1."""
    B, T, H, K = q.shape
    HV, V = v.shape[-2], v.shape[-1]
    spans = _spans(cu_seqlens, B, T)
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    qf = _expand_heads(q.float(), HV) * scale
    kf = _expand_heads(k.float(), HV)
    vf = v.float()
    gf = torch.zeros(B, T, HV, device=q.device) if g is None else g.float()
    bf = torch.ones(B, T, HV, device=q.device) if beta is None else beta.float()
    states = _load_state(initial_state, len(spans), HV, K, V, state_v_first, q.device)
    o = torch.zeros(B, T, HV, V, dtype=torch.float32, device=q.device)
    for n, (row, start, end) in enumerate(spans):
        s = states[n]
        for t in range(start, end):
            s = s * torch.exp(gf[row, t])[:, None, None]
            pred = torch.einsum("hk,hkv->hv", kf[row, t], s)
            delta = bf[row, t][:, None] * (vf[row, t] - pred)
            s = s + kf[row, t][:, :, None] * delta[:, None, :]
            o[row, t] = torch.einsum("hk,hkv->hv", qf[row, t], s)
        states[n] = s
    final = _store_state(states, state_v_first) if output_final_state else None
    return o.to(v.dtype), final


def _chunk_one(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
               s: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence in WY form. q, k [T, HV, K]; v [T, HV, V]; g, beta [T, HV]; s [HV, K, V] fp32."""
    T, HV, K = q.shape
    V = v.shape[-1]
    pad = (-T) % CHUNK
    # Padding tokens have k = 0, beta = 0 and g = 0: they neither decay nor write the state.
    if pad:
        q, k, v = (F.pad(x, (0, 0, 0, 0, 0, pad)) for x in (q, k, v))
        g, beta = (F.pad(x, (0, 0, 0, pad)) for x in (g, beta))
    nt = (T + pad) // CHUNK
    # -> [HV, NT, C, D]
    q, k, v = (x.reshape(nt, CHUNK, HV, -1).permute(2, 0, 1, 3) for x in (q, k, v))
    g, beta = (x.reshape(nt, CHUNK, HV).permute(2, 0, 1) for x in (g, beta))
    gamma = g.cumsum(-1)
    diff = gamma[..., :, None] - gamma[..., None, :]
    causal = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=q.device).tril()
    strict = causal.tril(-1)
    # exp only where the mask keeps the entry: above the diagonal diff > 0 can overflow.
    decay = torch.exp(torch.where(causal, diff, torch.full_like(diff, float("-inf"))))
    lower = torch.where(strict, beta[..., :, None] * decay * (k @ k.transpose(-1, -2)), 0.0)
    eye = torch.eye(CHUNK, device=q.device).expand_as(lower)
    tinv = torch.linalg.solve_triangular(eye + lower, eye, upper=False, unitriangular=True)
    w = tinv @ ((beta * torch.exp(gamma))[..., None] * k)
    u = tinv @ (beta[..., None] * v)
    qs = q * scale
    attn = (qs @ k.transpose(-1, -2)) * decay
    o = torch.empty(HV, nt, CHUNK, V, dtype=torch.float32, device=q.device)
    for c in range(nt):
        v_new = u[:, c] - w[:, c] @ s
        o[:, c] = torch.exp(gamma[:, c])[..., None] * (qs[:, c] @ s) + attn[:, c] @ v_new
        g_last = gamma[:, c, -1]
        k_decayed = torch.exp(g_last[:, None] - gamma[:, c])[..., None] * k[:, c]
        s = torch.exp(g_last)[:, None, None] * s + k_decayed.transpose(-1, -2) @ v_new
    o = o.permute(1, 2, 0, 3).reshape(nt * CHUNK, HV, V)[:T]
    return o, s


def chunk_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float,
    initial_state: torch.Tensor | None,
    output_final_state: bool,
    cu_seqlens: torch.Tensor | None,
    use_qk_l2norm_in_kernel: bool,
    state_v_first: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Chunked (C = 64) WY-form gated delta rule; only the state is carried between chunks."""
    B, T, H, K = q.shape
    HV, V = v.shape[-2], v.shape[-1]
    spans = _spans(cu_seqlens, B, T)
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    qf, kf = _expand_heads(q.float(), HV), _expand_heads(k.float(), HV)
    states = _load_state(initial_state, len(spans), HV, K, V, state_v_first, q.device)
    o = torch.zeros(B, T, HV, V, dtype=torch.float32, device=q.device)
    for n, (row, start, end) in enumerate(spans):
        if end == start:
            continue
        sl = slice(start, end)
        o[row, sl], states[n] = _chunk_one(qf[row, sl], kf[row, sl], v[row, sl].float(),
                                           g[row, sl].float(), beta[row, sl].float(), states[n], scale)
    final = _store_state(states, state_v_first) if output_final_state else None
    return o.to(v.dtype), final


def decode_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    ssm_state: torch.Tensor,
    state_indices: torch.Tensor,
    scale: float,
    use_qk_l2norm_in_kernel: bool,
    state_v_first: bool,
    softplus_beta: float = 1.0,
    softplus_threshold: float = 20.0,
) -> torch.Tensor:
    """One token per sequence; q, k [N, H, K], v [N, HV, V], a, b [N, HV]; state pool updated in place.

    Rows whose slot is -1 (pad) leave the pool alone and get a zero output.
    """
    N, HV, V = v.shape
    g, beta = gdn_gating(a, b, A_log, dt_bias, softplus_beta, softplus_threshold)
    o = torch.zeros(N, HV, V, dtype=v.dtype, device=v.device)
    live = (state_indices >= 0).nonzero().flatten()
    if live.numel() == 0:
        return o
    slots = state_indices[live].long()
    init = ssm_state[slots]
    out, final = recurrent_reference(
        q[live][None], k[live][None], v[live][None], g[live][None], beta[live][None], scale,
        init, True, _unit_cu_seqlens(live.numel(), q.device), use_qk_l2norm_in_kernel, state_v_first,
    )
    o[live] = out[0]
    ssm_state[slots] = final.to(ssm_state.dtype)
    return o


def _unit_cu_seqlens(n: int, device: torch.device) -> torch.Tensor:
    return torch.arange(n + 1, dtype=torch.int64, device=device)


def conv1d_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    cu_seqlens: torch.Tensor | None,
    conv_state: torch.Tensor | None,
    state_indices: torch.Tensor | None,
    has_initial_state: torch.Tensor | None,
    silu: bool,
) -> torch.Tensor:
    """Causal depthwise conv over x [T, D] with weight [D, W]; conv states [slots, D, W - 1] (DS).

    Sequence i starts from conv_state[state_indices[i]] when has_initial_state[i] (else zeros) and,
    unless its slot is -1, leaves its last W - 1 inputs there.
    """
    T, D = x.shape
    W = weight.shape[1]
    offs = [0, T] if cu_seqlens is None else cu_seqlens.tolist()
    y = torch.empty(T, D, dtype=x.dtype, device=x.device)
    wf = weight.float()
    for i in range(len(offs) - 1):
        start, end = offs[i], offs[i + 1]
        slot = -1 if state_indices is None else int(state_indices[i])
        if slot >= 0 and has_initial_state is not None and bool(has_initial_state[i]):
            init = conv_state[slot].float().t()
        else:
            init = torch.zeros(W - 1, D, device=x.device)
        full = torch.cat([init, x[start:end].float()])
        # out[t] = sum_w weight[:, w] * full[t + w]
        windows = full.unfold(0, W, 1)[: end - start]
        out = (windows * wf).sum(-1)
        if bias is not None:
            out = out + bias.float()
        y[start:end] = (F.silu(out) if silu else out).to(x.dtype)
        if slot >= 0 and conv_state is not None:
            conv_state[slot] = full[full.shape[0] - (W - 1):].t().to(conv_state.dtype)
    return y


def conv1d_update_reference(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    state_indices: torch.Tensor,
    silu: bool,
) -> torch.Tensor:
    """One token per sequence: x [N, D]; conv_state [slots, D, W - 1] shifted in place; pad rows -> 0."""
    N, D = x.shape
    y = torch.zeros(N, D, dtype=x.dtype, device=x.device)
    live = (state_indices >= 0).nonzero().flatten()
    if live.numel() == 0:
        return y
    slots = state_indices[live].long()
    window = torch.cat([conv_state[slots].float(), x[live].float()[:, :, None]], dim=-1)
    out = (window * weight.float()).sum(-1)
    if bias is not None:
        out = out + bias.float()
    y[live] = (F.silu(out) if silu else out).to(x.dtype)
    conv_state[slots] = window[:, :, 1:].to(conv_state.dtype)
    return y
