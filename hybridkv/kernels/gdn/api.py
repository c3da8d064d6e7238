"""Public GDN entries: validate, then run the torch reference (`naive`, CPU tensors) or the kernels (CUDA)."""

from __future__ import annotations

import enum

import torch

from hybridkv.kernels.gdn import naive


class ConvActivation(enum.Enum):
    IDENTITY = "identity"
    SILU = "silu"


def _shape(name: str, x: torch.Tensor, expected: tuple[int | None, ...]) -> None:
    ok = x.dim() == len(expected) and all(e is None or e == s for e, s in zip(expected, x.shape))
    if not ok:
        want = "[" + ", ".join("*" if e is None else str(e) for e in expected) + "]"
        raise ValueError(f"{name} has shape {list(x.shape)}, expected {want}")


def _on_cuda(*tensors: torch.Tensor | None) -> bool:
    present = [t for t in tensors if t is not None]
    kinds = {t.device.type for t in present}
    devices = {t.device for t in present}
    if kinds == {"cpu"}:
        return False
    if kinds == {"cuda"} and len(devices) == 1:
        return True
    raise ValueError(f"tensors must all be on the CPU or all on one CUDA device, got {sorted(map(str, devices))}")


def _check_cu_seqlens(cu_seqlens: torch.Tensor | None, batch: int, length: int) -> int:
    """Number of sequences."""
    if cu_seqlens is None:
        return batch
    if batch != 1:
        raise ValueError(f"varlen (cu_seqlens given) needs batch size 1, got {batch}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2 or cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"cu_seqlens must be a 1-D int32/int64 tensor of N + 1 offsets, got shape "
            f"{list(cu_seqlens.shape)} dtype {cu_seqlens.dtype}"
        )
    if cu_seqlens.device.type == "cpu":
        offs = cu_seqlens.tolist()
        if offs[0] != 0 or offs[-1] != length or any(b < a for a, b in zip(offs, offs[1:])):
            raise ValueError(f"cu_seqlens must rise from 0 to T={length}, got {offs}")
    return cu_seqlens.numel() - 1


def _check_rule(q, k, v, g, beta, initial_state, cu_seqlens, state_v_first, need_gates: bool):
    if q.dim() != 4:
        raise ValueError(f"q has shape {list(q.shape)}, expected [B, T, H, K]")
    B, T, H, K = q.shape
    _shape("k", k, (B, T, H, K))
    if v.dim() != 4 or v.shape[:2] != (B, T):
        raise ValueError(f"v has shape {list(v.shape)}, expected [{B}, {T}, HV, V]")
    HV, V = v.shape[2], v.shape[3]
    if HV % H:
        raise ValueError(f"value heads HV={HV} must be a multiple of key heads H={H}")
    for name, x in (("g", g), ("beta", beta)):
        if x is None:
            if need_gates:
                raise ValueError(f"{name} is required")
            continue
        _shape(name, x, (B, T, HV))
    N = _check_cu_seqlens(cu_seqlens, B, T)
    if initial_state is not None:
        _shape("initial_state", initial_state, (N, HV, V, K) if state_v_first else (N, HV, K, V))
    return N


def _default_scale(scale: float | None, k_dim: int) -> float:
    return k_dim**-0.5 if scale is None else float(scale)


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    use_qk_l2norm_in_kernel: bool = False,
    state_v_first: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Chunked gated delta rule, FLA's signature.

    q, k `[B, T, H, K]`; v `[B, T, HV, V]`; g (log decay) and beta `[B, T, HV]`; states `[N, HV, K, V]`
    (`[N, HV, V, K]` with `state_v_first`), N = B, or len(cu_seqlens) - 1 for varlen (B = 1).
    Returns o `[B, T, HV, V]` in v's dtype and the fp32 final state (None unless asked).
    """
    _check_rule(q, k, v, g, beta, initial_state, cu_seqlens, state_v_first, need_gates=True)
    scale = _default_scale(scale, q.shape[-1])
    args = (q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens,
            use_qk_l2norm_in_kernel, state_v_first)
    if _on_cuda(q, k, v, g, beta, initial_state, cu_seqlens):
        from hybridkv.kernels.gdn import chunk, seq_groups

        return seq_groups.by_groups(chunk.chunk_gated_delta_rule_fwd, *args)
    return naive.chunk_reference(*args)


def fused_recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor | None = None,
    beta: torch.Tensor | None = None,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    use_qk_l2norm_in_kernel: bool = False,
    state_v_first: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Token-by-token gated delta rule (decode, short chunks), FLA's keyword names.

    g None means no decay and beta None means beta = 1, as in FLA. Pass beta by name: FLA puts
    `gk`/`gv` between g and beta.
    """
    _check_rule(q, k, v, g, beta, initial_state, cu_seqlens, state_v_first, need_gates=False)
    scale = _default_scale(scale, q.shape[-1])
    args = (q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens,
            use_qk_l2norm_in_kernel, state_v_first)
    if _on_cuda(q, k, v, g, beta, initial_state, cu_seqlens):
        from hybridkv.kernels.gdn import fused_recurrent

        return fused_recurrent.fused_recurrent_fwd(*args)
    return naive.recurrent_reference(*args)


def _check_slots(name: str, state_indices: torch.Tensor, rows: int, num_slots: int) -> None:
    _shape(name, state_indices, (rows,))
    if state_indices.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name} must be int32 or int64, got {state_indices.dtype}")
    # Content checks need the values on the host; on CUDA that would sync every decode step.
    if state_indices.device.type != "cpu":
        return
    live = state_indices[state_indices >= 0]
    if (state_indices < -1).any() or (live >= num_slots).any():
        raise ValueError(f"{name} must lie in [-1, {num_slots}), got {state_indices.tolist()}")
    if live.unique().numel() != live.numel():
        raise ValueError(f"{name} repeats a slot (two rows would write one state): {state_indices.tolist()}")


def gated_delta_rule_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    ssm_state: torch.Tensor,
    state_indices: torch.Tensor,
    *,
    scale: float | None = None,
    use_qk_l2norm_in_kernel: bool = True,
    state_v_first: bool = True,
    softplus_beta: float = 1.0,
    softplus_threshold: float = 20.0,
) -> torch.Tensor:
    """One decode step for N sequences with gating fused, state read and written in place by slot.

    q, k `[N, H, K]`; v `[N, HV, V]`; a, b `[N, HV]` raw gate inputs (g = -exp(A_log) *
    softplus(a + dt_bias), beta = sigmoid(b)); A_log, dt_bias `[HV]`. ssm_state is a slot pool
    `[slots, HV, V, K]` (hybridkv's (HV, dv, dk) layout; `[slots, HV, K, V]` with state_v_first=False),
    fp32 or bf16, and may be a strided view (one layer of a block-major pool); its last two dims must
    be contiguous. Row i uses slot state_indices[i]; -1 = pad: pool untouched, output row zero.
    """
    if q.dim() != 3:
        raise ValueError(f"q has shape {list(q.shape)}, expected [N, H, K]")
    N, H, K = q.shape
    _shape("k", k, (N, H, K))
    if v.dim() != 3 or v.shape[0] != N:
        raise ValueError(f"v has shape {list(v.shape)}, expected [{N}, HV, V]")
    HV, V = v.shape[1], v.shape[2]
    if HV % H:
        raise ValueError(f"value heads HV={HV} must be a multiple of key heads H={H}")
    _shape("a", a, (N, HV))
    _shape("b", b, (N, HV))
    _shape("A_log", A_log, (HV,))
    _shape("dt_bias", dt_bias, (HV,))
    _shape("ssm_state", ssm_state, (None, HV, V, K) if state_v_first else (None, HV, K, V))
    if ssm_state.stride(-1) != 1 or ssm_state.stride(-2) != ssm_state.shape[-1]:
        raise ValueError(f"ssm_state's last two dims must be contiguous, got strides {ssm_state.stride()}")
    if ssm_state.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"ssm_state must be fp32, bf16 or fp16, got {ssm_state.dtype}")
    _check_slots("state_indices", state_indices, N, ssm_state.shape[0])
    scale = _default_scale(scale, K)
    args = (q, k, v, a, b, A_log, dt_bias, ssm_state, state_indices, scale, use_qk_l2norm_in_kernel,
            state_v_first, softplus_beta, softplus_threshold)
    if _on_cuda(q, k, v, a, b, A_log, dt_bias, ssm_state, state_indices):
        from hybridkv.kernels.gdn import decode

        return decode.decode_fwd(*args)
    return naive.decode_reference(*args)


def _check_conv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                conv_state: torch.Tensor | None) -> tuple[int, int]:
    if x.dim() != 2:
        raise ValueError(f"x has shape {list(x.shape)}, expected [T, D]")
    D = x.shape[1]
    if weight.dim() != 2 or weight.shape[0] != D or weight.shape[1] < 2:
        raise ValueError(f"weight has shape {list(weight.shape)}, expected [{D}, W] with W >= 2")
    W = weight.shape[1]
    if bias is not None:
        _shape("bias", bias, (D,))
    if conv_state is not None:
        _shape("conv_state", conv_state, (None, D, W - 1))
    return D, W


def causal_conv1d_fn(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    cu_seqlens: torch.Tensor | None = None,
    conv_state: torch.Tensor | None = None,
    state_indices: torch.Tensor | None = None,
    has_initial_state: torch.Tensor | None = None,
    activation: ConvActivation = ConvActivation.SILU,
) -> torch.Tensor:
    """Causal depthwise conv1d over packed sequences (prefill).

    x `[T, D]` token-major, sequences packed by cu_seqlens (one sequence without it); weight `[D, W]`.
    conv_state is a slot pool `[slots, D, W - 1]` (DS layout). Sequence i starts from its slot when
    has_initial_state[i], else from zeros, and leaves its last W - 1 inputs there (slot -1: neither).
    Returns y `[T, D]` in x's dtype.
    """
    _check_conv(x, weight, bias, conv_state)
    N = _check_cu_seqlens(cu_seqlens, 1, x.shape[0])
    if (state_indices is None) != (conv_state is None):
        raise ValueError("conv_state and state_indices go together: pass both or neither")
    if state_indices is not None:
        _check_slots("state_indices", state_indices, N, conv_state.shape[0])
    if has_initial_state is not None:
        _shape("has_initial_state", has_initial_state, (N,))
    if not isinstance(activation, ConvActivation):
        raise ValueError(f"activation must be a ConvActivation, got {activation!r}")
    silu = activation is ConvActivation.SILU
    args = (x, weight, bias, cu_seqlens, conv_state, state_indices, has_initial_state, silu)
    if _on_cuda(x, weight, bias, cu_seqlens, conv_state, state_indices, has_initial_state):
        from hybridkv.kernels.gdn import conv

        return conv.conv1d_fwd(*args)
    return naive.conv1d_reference(*args)


def causal_conv1d_update(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    state_indices: torch.Tensor,
    activation: ConvActivation = ConvActivation.SILU,
) -> torch.Tensor:
    """One decode token per sequence: x `[N, D]`; conv_state slot pool `[slots, D, W - 1]` shifted in
    place; row i uses slot state_indices[i]; -1 = pad (pool untouched, output row zero)."""
    _check_conv(x, weight, bias, conv_state)
    _check_slots("state_indices", state_indices, x.shape[0], conv_state.shape[0])
    if not isinstance(activation, ConvActivation):
        raise ValueError(f"activation must be a ConvActivation, got {activation!r}")
    silu = activation is ConvActivation.SILU
    args = (x, conv_state, weight, bias, state_indices, silu)
    if _on_cuda(x, conv_state, weight, bias, state_indices):
        from hybridkv.kernels.gdn import conv

        return conv.conv1d_update_fwd(*args)
    return naive.conv1d_update_reference(*args)
