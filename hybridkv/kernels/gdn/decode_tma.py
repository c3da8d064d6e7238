"""The in-place slot decode with the state moved by TMA, for Hopper and later.

The tile decode (`fused_recurrent._recurrent_kernel`) keeps only the state bytes in flight that its registers can
receive. Here a fixed number of programs (PER_SM per SM) each walk tiles with a stride, and Triton's pipeliner stages
the next STAGES tiles' state in shared memory through a tensor descriptor, so the bytes in flight are bounded by
shared memory, not registers. q, k and v can come by TMA too (`QKV.TMA`), which shortens a small batch's fixed cost.
Results are bitwise equal to the tile kernel's (same arithmetic, `_delta_step`). A decode tuner candidate
(`decode_kernels`) where it can run (`eligible`): a V-first pool whose strides a tensor descriptor accepts, on a
device with TMA. `naive.decode_reference` is the oracle.
"""

from __future__ import annotations

import enum

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from hybridkv.kernels.gdn.fused_recurrent import _delta_rule_step, _l2norm, _softplus

# (BV, num_warps, programs per SM, pipeline stages): the probe's best per state dtype and head count
# (64, 4, 4, 3 led bf16 at both head counts; 64, 4, 2, 3 and 32, 4, 4, 3 fp32) and a deeper walk.
TMA_CONFIGS = ((64, 4, 4, 3), (64, 4, 2, 3), (32, 4, 4, 3), (64, 4, 8, 3))


class QKV(enum.Enum):
    """How a tile's q, k and v rows reach the walk. LOADS: plain loads in the tile (2 bytes a thread: too narrow for
    cp.async, so Triton's pipeliner leaves them in the loop and each tile waits one global-load latency before its l2
    norms; Nsight Compute: the walk's top stall site, 13-23% of samples at 35B bf16). TMA: through tensor
    descriptors, which the pipeliner stages ahead with the state: a smaller fixed cost a call, which pays on small
    batches; the tuner takes both forms."""

    LOADS = "loads"
    TMA = "tma"


_TMA_ALIGN = 16  # bytes: a tensor descriptor's base address and every stride but the last
_TMA_ROW = 128  # bytes: a v row (BV elements) staged by TMA, so that every stage of its buffer stays aligned
_BOX_MAX = 256  # elements per box dimension


@triton.jit
def _delta_step(raw, b_q, b_k, b_v, x, bb, neg_a, scale, softplus_beta, softplus_threshold, L2NORM: tl.constexpr):
    """One token on one [BV, K] tile, gating fused: returns (output row, updated tile), both fp32, from the
    tile kernel's own helpers in its order (`_recurrent_kernel`'s decode step), so the two agree bit for bit."""
    f_q = b_q.to(tl.float32)
    f_k = b_k.to(tl.float32)
    if L2NORM:
        f_q = _l2norm(f_q)
        f_k = _l2norm(f_k)
    b_s = raw.to(tl.float32) * tl.exp(neg_a * _softplus(x, softplus_beta, softplus_threshold))
    return _delta_rule_step(b_s, f_q, f_k, b_v.to(tl.float32), tl.sigmoid(bb), scale)


@triton.jit
def _decode_tma_kernel(q, k, v, a, b, A_log, dt_bias, o, desc, state, stride_slot, stride_head, stride_row,
                       state_indices, N, progs, scale, softplus_beta, softplus_threshold, H: tl.constexpr,
                       HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr, L2NORM: tl.constexpr,
                       STAGES: tl.constexpr, QKV_TMA: tl.constexpr):
    """Grid (progs,): program p takes tiles p, p + progs, ... of the N * HV * (V / BV) [BV, K] tiles, each
    one (sequence, value head, V block). A pad (slot < 0) writes a zero output row and leaves the pool alone.
    ``state`` (the pool's base, strides in elements) is used by the direct store only (`Store.DIRECT`). QKV_TMA: q, k
    and v are tensor descriptors ([N, H, K] boxes [1, 1, K]; v [N, HV, V] box [1, 1, BV]), else contiguous tensors."""
    pid = tl.program_id(0)
    NV: tl.constexpr = V // BV
    n_tiles = N * HV * NV
    o_k = tl.arange(0, K)
    o_bv = tl.arange(0, BV)
    for t in tl.range(pid, n_tiles, progs, num_stages=STAGES):
        i_v = t % NV
        i_hv = (t // NV) % HV
        i_n = t // (NV * HV)
        i_h = i_hv // (HV // H)
        slot = tl.load(state_indices + i_n).to(tl.int32)
        live = slot >= 0
        # A pad (slot -1, vLLM's PAD_SLOT_ID for CUDA-graph padding) asks for a box wholly out of bounds: TMA fills it
        # with zeros and reads nothing, as the tile kernel's masked load does, so pads cost no state traffic.
        raw = desc.load([slot, i_hv, i_v * BV, 0]).reshape(BV, K)
        row_h = i_n.to(tl.int64) * H + i_h
        row_hv = i_n.to(tl.int64) * HV + i_hv
        if QKV_TMA:
            b_q = q.load([i_n, i_h, 0]).reshape(K)
            b_k = k.load([i_n, i_h, 0]).reshape(K)
            b_v = v.load([i_n, i_hv, i_v * BV]).reshape(BV)
        else:
            b_q = tl.load(q + row_h * K + o_k)
            b_k = tl.load(k + row_h * K + o_k)
            b_v = tl.load(v + row_hv * V + i_v * BV + o_bv)
        x = tl.load(a + row_hv).to(tl.float32) + tl.load(dt_bias + i_hv).to(tl.float32)
        bb = tl.load(b + row_hv).to(tl.float32)
        neg_a = -tl.exp(tl.load(A_log + i_hv).to(tl.float32))
        b_o, b_s = _delta_step(raw, b_q, b_k, b_v, x, bb, neg_a, scale, softplus_beta, softplus_threshold, L2NORM)
        tl.store(o + row_hv * V + i_v * BV + o_bv, tl.where(live, b_o, 0.0).to(o.dtype.element_ty))
        if live:
            desc.store([slot, i_hv, i_v * BV, 0], b_s.to(desc.dtype).reshape(1, 1, BV, K))


_devices: dict[int, tuple[bool, int]] = {}


def _device(device: torch.device) -> tuple[bool, int]:
    """(has TMA, SM count) of a CUDA device, looked up once."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _devices:
        props = torch.cuda.get_device_properties(index)
        _devices[index] = (props.major >= 9, props.multi_processor_count)
    return _devices[index]


def eligible(q: torch.Tensor, v: torch.Tensor, ssm_state: torch.Tensor, v_first: bool) -> bool:
    """Whether the TMA walk can serve this decode call: a CUDA device with TMA (sm_90+), a V-first
    `[slots, HV, V, K]` pool whose base and leading strides are 16-byte aligned and whose rows are
    contiguous, and power-of-two K and V within a descriptor box. Anything else takes the tile kernel."""
    if ssm_state.device.type != "cuda" or not v_first or ssm_state.dim() != 4:
        return False
    K, V = q.shape[-1], v.shape[-1]
    if K != triton.next_power_of_2(K) or V != triton.next_power_of_2(V) or K > _BOX_MAX or V < 16:
        return False
    return _describable(ssm_state) and _device(ssm_state.device)[0]


def _describable(t: torch.Tensor) -> bool:
    """Whether a tensor descriptor can take ``t``: contiguous rows, a 16-byte aligned base and leading strides."""
    elt = t.element_size()
    aligned = not t.data_ptr() % _TMA_ALIGN and not any(x * elt % _TMA_ALIGN for x in t.stride()[:-1])
    return t.stride(-1) == 1 and aligned


def walk(cfg, q, v, ssm_state, sms: int | None = None) -> tuple[int, int, TensorDescriptor]:
    """(BV capped at V, programs, the pool's descriptor with a [1, 1, BV, K] box) of a walk at ``cfg`` = (BV,
    num_warps, programs per SM, stages): programs per SM times ``sms`` (default: the device's), at most one a tile."""
    bv, _, per_sm, _ = cfg
    N, _, K = q.shape
    HV, V = v.shape[1], v.shape[2]
    bv = min(bv, V)
    sms = sms if sms is not None else _device(q.device)[1]
    programs = max(1, min(per_sm * sms, N * HV * (V // bv)))
    return bv, programs, TensorDescriptor(ssm_state, list(ssm_state.shape), list(ssm_state.stride()), [1, 1, bv, K])


def _staged_rows_misfit(bv: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> str | None:
    """Why `QKV.TMA` cannot stage these rows, or None: every row it stages (q and k rows of K, a v row of BV) must be a
    multiple of 128 bytes, so that every stage of their buffers stays aligned (K = 32 of bf16 faulted on an H200:
    misaligned address)."""
    if bv * v.element_size() % _TMA_ROW:
        return f"qkv=QKV.TMA needs BV * {v.element_size()} bytes to be a multiple of {_TMA_ROW}, got BV={bv}"
    for t in (q, k):
        if t.shape[-1] * t.element_size() % _TMA_ROW:
            return (f"qkv=QKV.TMA needs K * {t.element_size()} bytes to be a multiple of {_TMA_ROW}, "
                    f"got K={t.shape[-1]}")
    return None


def qkv_describable(cfg, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether `QKV.TMA` can read these q, k and v at ``cfg`` (BV capped at V): [N, heads, D] tensors a descriptor
    takes, with rows it can stage (`_staged_rows_misfit`)."""
    return (all(t.dim() == 3 and _describable(t) for t in (q, k, v))
            and _staged_rows_misfit(min(cfg[0], v.shape[-1]), q, k, v) is None)


def _row_descriptor(t: torch.Tensor, name: str, row: int) -> TensorDescriptor:
    """A [N, heads, D] tensor's descriptor with a [1, 1, row] box, or a ValueError naming what TMA cannot take."""
    if t.dim() != 3 or not _describable(t):
        raise ValueError(f"qkv=QKV.TMA needs {name} as [N, heads, D] with rows of contiguous elements, a 16-byte "
                         f"aligned base and 16-byte aligned strides; got shape {tuple(t.shape)}, strides {t.stride()}")
    return TensorDescriptor(t, list(t.shape), list(t.stride()), [1, 1, row])


def launch(cfg, q, k, v, a, b, A_log, dt_bias, o, ssm_state, state_indices, scale, l2, softplus_beta,
           softplus_threshold, sms: int | None = None, qkv: QKV = QKV.LOADS) -> None:
    """One TMA decode launch at ``cfg`` = (BV, num_warps, programs per SM, stages); the caller has checked
    `eligible`. BV is capped at V. ``sms``: the SM count (default: the device's; CI's interpreter passes one).
    ``qkv``: how q, k and v are read (`QKV`; TMA needs every row it stages to be a multiple of 128 bytes)."""
    if not isinstance(qkv, QKV):
        raise ValueError(f"qkv must be a decode_tma.QKV, got {qkv!r}")
    bv, warps, _, stages = cfg
    N, H, K = q.shape
    HV, V = v.shape[1], v.shape[2]
    bv, programs, desc = walk(cfg, q, v, ssm_state, sms)
    if qkv is QKV.TMA:
        misfit = _staged_rows_misfit(bv, q, k, v)
        if misfit is not None:
            raise ValueError(misfit)
        q, k, v = _row_descriptor(q, "q", K), _row_descriptor(k, "k", K), _row_descriptor(v, "v", bv)
    _decode_tma_kernel[(programs,)](
        q, k, v, a, b, A_log, dt_bias, o, desc, ssm_state, *ssm_state.stride()[:3], state_indices, N, programs, scale,
        float(softplus_beta), float(softplus_threshold), H=H, HV=HV, K=K, V=V, BV=bv, L2NORM=l2, STAGES=stages,
        QKV_TMA=qkv is QKV.TMA, num_warps=warps)
