"""Device probe for issue #8: the scores kernel alone (`triton_chunk_inverse._chunk_scores_kernel`, the
parallel half of `triton_chunk.Form.SCORES`) at several value heads per program and warp counts, against
a device copy of the same bytes in the same run.

    python3 scripts/gdn_scores_probe.py [--iters 20] [--json PATH] [--shapes 1x8192]

Why: on one 35B sequence its first segment sits on the pipelined call's critical path, and it moved ~100 MB
in 47-53 us (~2 TB/s of the H200's 4.3). Beside the library kernel, a looped candidate (`_scores_looped`,
probe-only until measured) whose programs walk several chunk rows so that loads overlap the stores; each of
its outputs is compared with the library kernel's bit for bit. The row scales read are made up (finite,
decaying): the time does not depend on their values. Run from the repository root on a CUDA machine.
"""

from __future__ import annotations

import json
import sys

import torch
import triton
import triton.language as tl

from hybridkv.kernels.gdn import bench, triton_chunk
from hybridkv.kernels.gdn.triton_chunk_inverse import _NROW, _R_STRIDE, BT, _chunk_scores_kernel
from hybridkv.kernels.gdn.triton_chunk_rows import _masked_scores, _sequence

from gdn_schedules import probe_args  # scripts/ is this script's own directory on sys.path


@triton.jit
def _scores_looped(q, k, R, P, cu_seqlens, chunk_table, NC, STEP, H, HV, K: tl.constexpr, BK: tl.constexpr,
                   GROUP: tl.constexpr):
    """A candidate for the library kernel (not in it yet): each program walks the chunk rows pid, pid +
    STEP, ... so that Triton's pipeliner (num_stages >= 2) can load the next row's q and k while this
    row's scores are made and stored; rows past the last chunk are masked, not branched around (a branch
    in the loop body keeps the pipeliner out)."""
    pid, i_g = tl.program_id(0), tl.program_id(1)
    hv0 = i_g * GROUP
    i_h = hv0 // (HV // H)
    o_i = tl.arange(0, 64)
    for i_c in range(pid, NC, STEP):
        i_n = tl.load(chunk_table + 2 * i_c)
        i_t = tl.load(chunk_table + 2 * i_c + 1)
        live = i_n >= 0
        T, bos = _sequence(cu_seqlens, tl.maximum(i_n, 0))
        T = tl.where(live, T, 0)  # a dead row loads nothing (all out of bounds) and stores nothing
        p_q = tl.make_block_ptr(q + (bos * H + i_h) * K, (T, K), (H * K, 1), (i_t * 64, 0), (64, BK), (1, 0))
        p_k = tl.make_block_ptr(k + (bos * H + i_h) * K, (T, K), (H * K, 1), (i_t * 64, 0), (64, BK), (1, 0))
        b_q = tl.load(p_q, boundary_check=(0, 1), padding_option="zero")
        b_k = tl.load(p_k, boundary_check=(0, 1), padding_option="zero")
        b_qk = tl.dot(b_q, tl.trans(b_k))
        row = tl.cast(i_c, tl.int64)  # tl.cast, not .to: the interpreter's loop variable is a Python int
        for j in tl.static_range(GROUP):  # unrolled: Triton pipelines innermost loops only
            i_ch = row * HV + hv0 + j
            p_r = R + i_ch * _R_STRIDE + o_i
            b_p = _masked_scores(b_qk, tl.load(p_r + 256), tl.load(p_r + 320), tl.load(p_r + 384),
                                 P.dtype.element_ty)
            tl.store(P + i_ch * 4096 + o_i[:, None] * 64 + o_i[None, :], b_p, mask=live)


def row_scales(NC: int, HV: int) -> torch.Tensor:
    """R as the inverse kernel lays it out: cumulative log decays in row 4, scale rq and rk in rows 5-6."""
    R = torch.rand(NC, HV, _NROW, BT, device="cuda")
    R[:, :, 4] = -torch.cumsum(0.05 * torch.rand(NC, HV, BT, device="cuda"), -1)
    R[:, :, 5:7] = 0.09
    return R


def timed(shape, name, launch, moved, copy_ms, iters) -> dict:
    launch()
    ms = bench._median_ms(launch, iters)
    row = dict(shape=shape, variant=name, us=ms * 1e3, copy_us=copy_ms * 1e3, gbps=moved / ms / 1e6,
               x_copy=copy_ms / ms)
    print(f"{shape:30} {name:44} {row['us']:6.1f} us  {row['gbps']:6.0f} GB/s  {row['x_copy']:.2f}x copy speed",
          flush=True)
    return row


def main() -> int:
    a = probe_args(__doc__)
    rows = []
    print(torch.cuda.get_device_name(), flush=True)
    for shape, B, T, H, HV, args, kw in bench._prefill_cases():
        if a.shapes and not any(x in shape for x in a.shapes):
            continue
        q, k = args[0], args[1]
        cu, table, _, NC = triton_chunk._tables.get(kw["cu_seqlens"], B, T, q.device)
        R = row_scales(NC, HV)
        P = q.new_empty((NC, HV, BT, BT), dtype=k.dtype)
        moved = q.numel() * 2 * 2 + P.numel() * 2 + NC * HV * 3 * BT * 4  # q, k once per key head; P; 3 R rows
        src = torch.empty(moved // 2, dtype=torch.uint8, device="cuda")
        dst = torch.empty_like(src)
        copy_ms = bench._median_ms(lambda: dst.copy_(src), a.iters)  # reads and writes `moved` bytes
        print(f"{shape:30} copy of {moved / 1e6:.0f} MB: {copy_ms * 1e3:6.1f} us", flush=True)
        per = HV // H
        sms = triton_chunk._sm_count(q.device.index)
        want = None
        for group in [g for g in (1, 2, 4) if per % g == 0]:
            for warps in (4, 8):
                def launch(group=group, warps=warps):
                    _chunk_scores_kernel[(NC, HV // group)](q, k, R, P, cu, table, 0, 0, 0, H, HV, K=128, BK=128,
                                                            GROUP=group, SEGMENTED=False, num_warps=warps,
                                                            num_stages=1)
                rows.append(timed(shape, f"library group {group} warps {warps}", launch, moved, copy_ms, a.iters))
                want = P.clone() if want is None else want
        group = max(g for g in (1, 2, 4) if per % g == 0)
        for waves in (1, 2, 4):
            for stages in (2, 3):
                step = max(1, min(NC, waves * sms * group // HV))  # about `waves` programs per SM

                def looped(step=step, stages=stages):
                    _scores_looped[(step, HV // group)](q, k, R, P, cu, table, NC, step, H, HV, K=128, BK=128,
                                                        GROUP=group, num_warps=4, num_stages=stages)
                P.fill_(float("nan"))
                looped()
                live = table[:, 0] >= 0  # rows past the last chunk are left unwritten by both
                same = bool(torch.equal(P[live], want[live]))
                rows.append(timed(shape, f"looped group {group} step {step} stages {stages} same={same}", looped,
                                  moved, copy_ms, a.iters))
        del args, q, k, P, R, src, dst
    if a.json:
        json.dump(rows, open(a.json, "w"), indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
