"""Triton causal depthwise conv1d on DS conv-state slots `[slots, D, W - 1]`.

Oracles: `reference.conv1d_reference` and `reference.conv1d_update_reference`. Prefill runs as two
launches so that no program overwrites a slot another program still reads: outputs first (reading the
initial states), then the new states.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _conv_out_kernel(x, weight, bias, y, seq_of_token, cu_seqlens, conv_state, state_indices, has_init,
                     total, D, stride_slot, W: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr,
                     HAS_BIAS: tl.constexpr, HAS_STATE: tl.constexpr, HAS_INIT_FLAGS: tl.constexpr,
                     SILU: tl.constexpr):
    """y `[T, D]` for BT tokens x BD channels: grid (cdiv(T, BT), cdiv(D, BD)). A tap before a sequence's
    first token reads that sequence's conv state (when it has one and has_init says so), else zero."""
    i_t, i_d = tl.program_id(0), tl.program_id(1)
    o_t = i_t * BT + tl.arange(0, BT)
    o_d = i_d * BD + tl.arange(0, BD)
    m_t = o_t < total
    m_d = o_d < D
    seq = tl.load(seq_of_token + o_t, mask=m_t, other=0)
    bos = tl.load(cu_seqlens + seq, mask=m_t, other=0)
    from_state = m_t
    slot = tl.zeros([BT], dtype=tl.int64)
    if HAS_STATE:
        slot = tl.load(state_indices + seq, mask=m_t, other=-1).to(tl.int64)
        from_state = from_state & (slot >= 0)
        if HAS_INIT_FLAGS:
            from_state = from_state & (tl.load(has_init + seq, mask=m_t, other=0) != 0)
        else:
            from_state = from_state & False
    else:
        from_state = from_state & False
    acc = tl.zeros([BT, BD], dtype=tl.float32)
    for w in tl.static_range(W):
        src = o_t - (W - 1) + w
        in_seq = src >= bos
        m_x = (m_t & in_seq)[:, None] & m_d[None, :]
        xv = tl.load(x + src[:, None].to(tl.int64) * D + o_d[None, :], mask=m_x, other=0.0).to(tl.float32)
        if HAS_STATE:
            col = (W - 1) + src - bos
            m_s = (from_state & ~in_seq)[:, None] & m_d[None, :]
            p_s = conv_state + tl.maximum(slot, 0)[:, None] * stride_slot + o_d[None, :] * (W - 1) + col[:, None]
            xv += tl.load(p_s, mask=m_s, other=0.0).to(tl.float32)
        wv = tl.load(weight + o_d * W + w, mask=m_d, other=0.0).to(tl.float32)
        acc += xv * wv[None, :]
    if HAS_BIAS:
        acc += tl.load(bias + o_d, mask=m_d, other=0.0).to(tl.float32)[None, :]
    if SILU:
        acc = acc * tl.sigmoid(acc)
    tl.store(y + o_t[:, None].to(tl.int64) * D + o_d[None, :], acc.to(y.dtype.element_ty),
             mask=m_t[:, None] & m_d[None, :])


@triton.jit
def _conv_state_kernel(x, cu_seqlens, conv_state, state_indices, has_init, D, stride_slot, W: tl.constexpr,
                       BW: tl.constexpr, BD: tl.constexpr, HAS_INIT_FLAGS: tl.constexpr):
    """Sequence i_n's last W - 1 inputs into its slot `[D, W - 1]` (a sequence shorter than that keeps the
    newest entries of its initial state, or zeros): grid (N, cdiv(D, BD)). Launched after
    `_conv_out_kernel`, which reads the initial states this overwrites."""
    i_n, i_d = tl.program_id(0), tl.program_id(1)
    slot = tl.load(state_indices + i_n).to(tl.int64)
    live = slot >= 0
    bos = tl.load(cu_seqlens + i_n)
    eos = tl.load(cu_seqlens + i_n + 1)
    init = live
    if HAS_INIT_FLAGS:
        init = init & (tl.load(has_init + i_n) != 0)
    else:
        init = init & False
    o_d = i_d * BD + tl.arange(0, BD)
    o_w = tl.arange(0, BW)
    m = (o_d[:, None] < D) & (o_w[None, :] < W - 1) & live
    src = eos - (W - 1) + o_w
    in_seq = src >= bos
    p_base = conv_state + tl.maximum(slot, 0) * stride_slot + o_d[:, None] * (W - 1)
    xv = tl.load(x + src[None, :].to(tl.int64) * D + o_d[:, None], mask=m & in_seq[None, :], other=0.0)
    old = tl.load(p_base + ((W - 1) + src - bos)[None, :], mask=m & ~in_seq[None, :] & init, other=0.0)
    val = tl.where(in_seq[None, :], xv.to(tl.float32), old.to(tl.float32))
    tl.store(p_base + o_w[None, :], val.to(conv_state.dtype.element_ty), mask=m)


@triton.jit
def _conv_update_kernel(x, conv_state, weight, bias, y, state_indices, D, stride_slot, W: tl.constexpr,
                        BW: tl.constexpr, BD: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr):
    """One decode token per sequence: y `[N, D]` from the slot's W - 1 inputs and x, then the slot shifted
    by one in place: grid (N, cdiv(D, BD)). Slot -1: pool untouched, output zero."""
    i_n, i_d = tl.program_id(0), tl.program_id(1)
    slot = tl.load(state_indices + i_n).to(tl.int64)
    live = slot >= 0
    o_d = i_d * BD + tl.arange(0, BD)
    o_w = tl.arange(0, BW)
    m_d = o_d < D
    m_w = o_w < W - 1
    m = m_d[:, None] & m_w[None, :] & live
    p_base = conv_state + tl.maximum(slot, 0) * stride_slot + o_d[:, None] * (W - 1)
    st = tl.load(p_base + o_w[None, :], mask=m, other=0.0).to(tl.float32)
    nxt = tl.load(p_base + o_w[None, :] + 1, mask=m & (o_w[None, :] + 1 < W - 1), other=0.0).to(tl.float32)
    xv = tl.load(x + i_n.to(tl.int64) * D + o_d, mask=m_d, other=0.0).to(tl.float32)
    wv = tl.load(weight + o_d[:, None] * W + o_w[None, :], mask=m_d[:, None] & m_w[None, :], other=0.0)
    w_last = tl.load(weight + o_d * W + (W - 1), mask=m_d, other=0.0).to(tl.float32)
    acc = tl.sum(st * wv.to(tl.float32), 1) + xv * w_last
    if HAS_BIAS:
        acc += tl.load(bias + o_d, mask=m_d, other=0.0).to(tl.float32)
    if SILU:
        acc = acc * tl.sigmoid(acc)
    acc = tl.where(live, acc, 0.0)
    tl.store(y + i_n.to(tl.int64) * D + o_d, acc.to(y.dtype.element_ty), mask=m_d)
    shifted = tl.where(o_w[None, :] == W - 2, xv[:, None], nxt)
    tl.store(p_base + o_w[None, :], shifted.to(conv_state.dtype.element_ty), mask=m)


def _check_state_layout(conv_state: torch.Tensor) -> None:
    if conv_state.stride(2) != 1 or conv_state.stride(1) != conv_state.shape[2]:
        raise ValueError(f"conv_state's (D, W - 1) dims must be contiguous, got strides {conv_state.stride()}")


def conv1d_fwd(x, weight, bias, cu_seqlens, conv_state, state_indices, has_initial_state, silu):
    total, D = x.shape
    W = weight.shape[1]
    x, weight = x.contiguous(), weight.contiguous()
    if cu_seqlens is None:
        # Made on the device: a host list copied over would sync the stream on every call.
        cu = torch.arange(2, dtype=torch.int32, device=x.device) * total
    else:
        cu = cu_seqlens.to(device=x.device, dtype=torch.int32)
    N = cu.numel() - 1
    lens = cu[1:] - cu[:-1]
    seq_of_token = torch.repeat_interleave(torch.arange(N, device=x.device, dtype=torch.int32), lens,
                                           output_size=total)
    flags = has_initial_state.to(torch.int8) if has_initial_state is not None else None
    if conv_state is not None:
        _check_state_layout(conv_state)
    stride_slot = conv_state.stride(0) if conv_state is not None else 0
    y = torch.empty_like(x)
    if total:
        BT, BD = 32, 128
        _conv_out_kernel[(triton.cdiv(total, BT), triton.cdiv(D, BD))](
            x, weight, bias, y, seq_of_token, cu, conv_state, state_indices, flags, total, D, stride_slot,
            W=W, BT=BT, BD=BD, HAS_BIAS=bias is not None, HAS_STATE=conv_state is not None,
            HAS_INIT_FLAGS=flags is not None, SILU=silu, num_warps=4)
    if conv_state is not None and N:
        BD = 256
        _conv_state_kernel[(N, triton.cdiv(D, BD))](
            x, cu, conv_state, state_indices, flags, D, stride_slot, W=W,
            BW=triton.next_power_of_2(max(W - 1, 1)), BD=BD, HAS_INIT_FLAGS=flags is not None, num_warps=4)
    return y


def conv1d_update_fwd(x, conv_state, weight, bias, state_indices, silu):
    N, D = x.shape
    W = weight.shape[1]
    _check_state_layout(conv_state)
    x, weight = x.contiguous(), weight.contiguous()
    y = torch.empty_like(x)
    BD = 256
    _conv_update_kernel[(N, triton.cdiv(D, BD))](
        x, conv_state, weight, bias, y, state_indices, D, conv_state.stride(0), W=W,
        BW=triton.next_power_of_2(max(W - 1, 1)), BD=BD, HAS_BIAS=bias is not None, SILU=silu, num_warps=4)
    return y
