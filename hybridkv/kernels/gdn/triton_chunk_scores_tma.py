"""The scores form's masked scores P (`triton_chunk.Form.SCORES`) with q and k moved by TMA, for Hopper and later.

`triton_chunk_inverse._chunk_scores_kernel` (one program per chunk row and key-head group) holds only the q and k
bytes in flight that its own loads ask for, and waits for them before its GEMM: on the H200 it moved its bytes at
about two thirds of copy speed (tools/gdn/README.md, "Scores kernel"), and a loop over several rows with pointer
loads was slower still. Here a fixed number of programs (PER_SM per SM) walk the (chunk row, group) tiles with a
stride, and Triton's pipeliner stages the next STAGES tiles' q and k in shared memory through tensor descriptors, as
the decode walk does (`triton_decode_tma`); P leaves through a descriptor too.

A chunk's 64-row boxes run past a sequence's end into the next sequence (or, at the tensor's end, into TMA's zero
fill). Those rows of q and k reach only the rows and columns of q k^T that the mask then zeroes, and they are
zeroed by a select, not a product, so an inf there stays out of P. The arithmetic after q k^T is the tile kernel's
(`_masked_scores`), so the two agree to the rounding of q k^T's sums. Its oracle is that kernel, and through
`triton_chunk`, `reference.chunk_reference`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from hybridkv.kernels.gdn import pdl as _pdl
from hybridkv.kernels.gdn.triton_chunk_inverse import _R_STRIDE, BT
from hybridkv.kernels.gdn.triton_chunk_rows import _masked_scores, _sequence, _table_row
from hybridkv.kernels.gdn.triton_decode_tma import _device

# (num_warps, programs per SM, pipeline stages). Offline sm_90 (`hybridkv kernels report --kernel chunk_scores_tma`):
# Triton 3.6's pipeliner double-buffers q and k (2 x 32 KB) whatever the stages, since their coordinates hang on two
# loads (the chunk table, then cu_seqlens); with P's staging and the row scales' copies a program takes 74-76 KB of
# shared memory, and 192-255 registers at four warps, 113-200 at eight, so two programs fit an SM.
CONFIG = (4, 2, 3)
# What tools/gdn/scores_probe.py times against the tile kernel (CONFIG among them).
CONFIGS = ((4, 2, 3), (8, 2, 3), (4, 1, 3), (8, 1, 3), (4, 4, 3))
_TMA_ALIGN = 16  # bytes: a tensor descriptor's base address and every stride but the last


@triton.jit
def _scores_tma_kernel(q_desc, k_desc, p_desc, R, cu_seqlens, chunk_table, row0, c_lo, c_hi, rows, progs, H, HV,
                       K: tl.constexpr, GROUP: tl.constexpr, SEGMENTED: tl.constexpr, STAGES: tl.constexpr,
                       PDL: tl.constexpr = False):
    """Grid (progs,): program p takes tiles p, p + progs, ... of the rows * HV / GROUP (chunk row, group of GROUP value
    heads of one key head) tiles, and writes P `[NC, HV, 64, 64]` of the group; rows not live (past the last chunk,
    or outside a segment) are read and dropped. PDL: a programmatic dependent launch (`pdl`)."""
    _pdl.wait(PDL)
    pid = tl.program_id(0)
    groups = HV // GROUP
    o_i = tl.arange(0, 64)
    for t in tl.range(pid, rows * groups, progs, num_stages=STAGES):
        i_g = t % groups
        i_c, i_n, i_t, live = _table_row(chunk_table, t // groups, row0, c_lo, c_hi, SEGMENTED)
        # A dead row reads sequence 0's first chunk (always there) so that the loads need no predicate.
        T, bos = _sequence(cu_seqlens, tl.maximum(i_n, 0))
        i_t = tl.where(live, i_t, 0)
        hv0 = i_g * GROUP
        i_h = hv0 // (HV // H)
        r0 = i_t * 64
        b_q = q_desc.load([(bos + r0).to(tl.int32), i_h * K])
        b_k = k_desc.load([(bos + r0).to(tl.int32), i_h * K])
        inside = r0 + o_i < T
        b_qk = tl.where(inside[:, None] & inside[None, :], tl.dot(b_q, tl.trans(b_k)), 0.0)
        for j in tl.static_range(GROUP):
            i_ch = i_c.to(tl.int64) * HV + hv0 + j
            p_r = R + i_ch * _R_STRIDE + o_i
            b_p = _masked_scores(b_qk, tl.load(p_r + 256), tl.load(p_r + 320), tl.load(p_r + 384),
                                 p_desc.dtype)
            if live:
                p_desc.store([(i_ch * 64).to(tl.int32), 0], b_p)


def eligible(q: torch.Tensor, k: torch.Tensor, P: torch.Tensor) -> bool:
    """Whether the TMA walk can make this call's P: a CUDA device with TMA (sm_90+), 16-bit q and k with a power-of-two
    head size from 16 to 256 (one box per chunk row), 16-byte aligned bases, and row counts a 32-bit coordinate
    holds. Anything else takes the tile kernel."""
    if q.device.type != "cuda" or not _device(q.device)[0]:
        return False
    K = q.shape[-1]
    if q.element_size() != 2 or k.dtype != q.dtype or K != triton.next_power_of_2(K) or not 16 <= K <= 256:
        return False
    if any(x.data_ptr() % _TMA_ALIGN for x in (q, k, P)):
        return False
    return q.shape[0] * q.shape[1] < 2**31 and P.shape[0] * P.shape[1] * BT < 2**31


def launch(q, k, R, P, cu_seqlens, chunk_table, rows: int, group: int, row0: int = 0, c_lo: int = 0, c_hi: int = 0,
           segmented: bool = False, *, sms: int, config: tuple[int, int, int] = CONFIG, pdl: bool = False) -> None:
    """`_scores_tma_kernel` over ``rows`` chunk rows (the arguments of `triton_chunk`'s scores launch) at ``config``
    (num_warps, programs per SM, stages) on ``sms`` SMs. q and k `[B, T, H, K]` and P `[NC, HV, 64, 64]` contiguous
    (the caller made them so)."""
    warps, per_sm, stages = config
    B, T, H, K = q.shape
    HV = P.shape[1]
    if (HV // H) % group or group < 1:
        raise ValueError(f"group must divide the value heads per key head ({HV // H}), got {group}")
    descs = [TensorDescriptor(x.view(B * T, H * K), [B * T, H * K], [H * K, 1], [BT, K]) for x in (q, k)]
    p_desc = TensorDescriptor(P.view(-1, BT), [P.numel() // BT, BT], [BT, 1], [BT, BT])
    progs = max(1, min(per_sm * sms, rows * (HV // group)))
    _scores_tma_kernel[(progs,)](*descs, p_desc, R, cu_seqlens, chunk_table, row0, c_lo, c_hi, rows, progs, H, HV,
                                 K=K, GROUP=group, SEGMENTED=segmented, STAGES=stages, num_warps=warps,
                                 **_pdl.launch_kwargs(pdl))
