"""Device probe for issues #8 and #23: the scores kernel alone (the parallel half of `triton_chunk.Form.SCORES`), the
tile kernel (`triton_chunk_inverse._chunk_scores_kernel`) at four and eight warps and the TMA walk
(`triton_chunk_scores_tma`) at each of its CONFIGS, at the inverse's group, against a device copy of the same bytes
in the same run; the walk's P against the tile kernel's.

    python -m tools.gdn.scores_probe [--iters 20] [--json PATH] [--shapes 1x8192]

Why: on one 35B sequence its first segment sits on the pipelined call's critical path, and it moved ~100 MB
in 47-53 us (~2 TB/s of the H200's 4.3) at four warps; eight are faster (`SCORES_WARPS`). A looped candidate
whose programs walked several chunk rows so that Triton pipelined their q and k loads was slower (64.8-113.7
us at 35B, 99.8-178.9 at 397B; in git history). The row scales read are made up (finite, decaying): the time
does not depend on their values. Run from the repository root on a CUDA machine.
"""

from __future__ import annotations

import json
import sys

import torch

from hybridkv.kernels.gdn import bench_cases, bench_timing, triton_chunk, triton_chunk_scores_tma
from hybridkv.kernels.gdn.triton_chunk_inverse import _NROW, BT, _chunk_scores_kernel

from tools.gdn.schedules import probe_args


def row_scales(NC: int, HV: int) -> torch.Tensor:
    """R as the inverse kernel lays it out: cumulative log decays in row 4, scale rq and rk in rows 5-6."""
    R = torch.rand(NC, HV, _NROW, BT, device="cuda")
    R[:, :, 4] = -torch.cumsum(0.05 * torch.rand(NC, HV, BT, device="cuda"), -1)
    R[:, :, 5:7] = 0.09
    return R


def timed(shape, name, launch, moved, copy_ms, iters) -> dict:
    launch()
    ms = bench_timing._median_ms(launch, iters)
    row = dict(shape=shape, variant=name, us=ms * 1e3, copy_us=copy_ms * 1e3, gbps=moved / ms / 1e6,
               x_copy=copy_ms / ms)
    print(f"{shape:30} {name:44} {row['us']:6.1f} us  {row['gbps']:6.0f} GB/s  {row['x_copy']:.2f}x copy speed",
          flush=True)
    return row


def main() -> int:
    a = probe_args(__doc__)
    rows = []
    print(torch.cuda.get_device_name(), flush=True)
    for shape, B, T, H, HV, args, kw in bench_cases._prefill_cases():
        if a.shapes and not any(x in shape for x in a.shapes):
            continue
        q, k = args[0], args[1]
        cu, table, _, NC = triton_chunk._tables.get(kw["cu_seqlens"], B, T, q.device)
        R = row_scales(NC, HV)
        P = q.new_empty((NC, HV, BT, BT), dtype=k.dtype)
        moved = q.numel() * 2 * 2 + P.numel() * 2 + NC * HV * 3 * BT * 4  # q, k once per key head; P; 3 R rows
        src = torch.empty(moved // 2, dtype=torch.uint8, device="cuda")
        dst = torch.empty_like(src)
        copy_ms = bench_timing._median_ms(lambda: dst.copy_(src), a.iters)  # reads and writes `moved` bytes
        print(f"{shape:30} copy of {moved / 1e6:.0f} MB: {copy_ms * 1e3:6.1f} us", flush=True)
        per = HV // H
        group = max(g for g in (1, 2, 4) if per % g == 0)  # the inverse's group, which the call launches with
        for warps in (4, 8):
            def launch(warps=warps):
                _chunk_scores_kernel[(NC, HV // group)](q, k, R, P, cu, table, 0, 0, 0, H, HV, K=128, BK=128,
                                                        GROUP=group, SEGMENTED=False, num_warps=warps, num_stages=1)
            rows.append(timed(shape, f"tile group {group} warps {warps}", launch, moved, copy_ms, a.iters))
        want = P.clone()  # the shipped tile kernel's (8 warps, the last launch)
        sms = torch.cuda.get_device_properties(q.device).multi_processor_count
        for config in triton_chunk_scores_tma.CONFIGS:
            def launch(config=config):
                triton_chunk_scores_tma.launch(q, k, R, P, cu, table, NC, group, sms=sms, config=config)
            P.fill_(float("nan"))
            row = timed(shape, f"tma group {group} (warps, per SM, stages) {config}", launch, moved, copy_ms, a.iters)
            live = table[:, 0] >= 0
            row["max_diff_vs_tile"] = (P[live].float() - want[live].float()).abs().max().item()
            print(f"{'':30} max |P - tile P| {row['max_diff_vs_tile']:.2e}", flush=True)
            rows.append(row)
        del args, q, k, P, R, src, dst
    if a.json:
        json.dump(rows, open(a.json, "w"), indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
