"""What decode's memory pattern alone reaches: the ceiling under issue #23's one missed decode goal.

Every decode kernel tried at 35B with a bf16 state and 64 sequences lands at 71-76% of copy bandwidth, FlashInfer
0.7.2's included, while the goal is 80% and a copy of the same bytes reaches ~91% there. The copy reads one buffer and
writes another, in one contiguous stream. Decode reads each sequence's slot (scattered over the pool) and writes it back in
place. This probe times that pattern with no arithmetic: the row-looped decode kernel's grid and pipeline
(`triton_decode_rows`), each [BV, K] block loaded and stored straight back (``touch``), beside the same-size copy and
the shipped decode step, all in one run:

- ``touch in place``: random slots, written back where they were read (decode's pattern);
- ``touch in place, slots 0..N-1``: the same over contiguous slots;
- ``touch to a buffer``: random slots read, written to a separate contiguous buffer (a gather);
- ``touch in place, fp32 math``: in place, each element converted to fp32, scaled by a runtime 1.0 and converted back.

If the pattern by itself stays under 80%, the goal is bounded by the pattern, not by decode's arithmetic.

    python -m tools.gdn.pattern_probe [--iters 20] [--batch 64 256] [--json PATH] [--sweep]

``--sweep``: 35B bf16 only, the pattern alone beside the row-looped decode kernel config by config (`SWEEP`).

Run from the repository root on a CUDA machine.
"""

from __future__ import annotations

import argparse
import json

import torch
import triton
import triton.language as tl

from hybridkv.kernels.gdn import bench_cases, bench_timing, gated_delta_rule_decode

from tools.gdn.schedules import decode_inputs

D = 128
TOUCH = (16, 128, 4, 3)  # (BV, ROWS, num_warps, stages): the row-looped kernel's bf16 probe config


@triton.jit
def _touch_kernel(src, dst, state_indices, scale, stride_slot, stride_head, dst_slot, HV: tl.constexpr,
                  K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr, ROWS: tl.constexpr, STAGES: tl.constexpr,
                  MATH: tl.constexpr, GATHER: tl.constexpr):
    """`triton_decode_rows._decode_rows_kernel`'s grid and loop with nothing computed: each [BV, K] block of slot
    state_indices[n], head hv, goes back in place (or, GATHER, to row n of a contiguous [N, HV, V, K] ``dst``)."""
    NR: tl.constexpr = V // ROWS
    pid = tl.program_id(0)
    i_r, i_nh = pid % NR, pid // NR
    i_n, i_hv = i_nh // HV, i_nh % HV
    slot = tl.load(state_indices + i_n).to(tl.int64)
    o_k = tl.arange(0, K)
    base = src + slot * stride_slot + i_hv * stride_head
    out = dst + i_n.to(tl.int64) * dst_slot + i_hv * (V * K) if GATHER else base
    for j in tl.range(0, ROWS // BV, num_stages=STAGES):
        rows = i_r * ROWS + j * BV + tl.arange(0, BV)
        raw = tl.load(base + rows[:, None] * K + o_k[None, :], eviction_policy="evict_first")
        if MATH:
            raw = (raw.to(tl.float32) * scale).to(raw.dtype)
        tl.store(out + rows[:, None] * K + o_k[None, :], raw, cache_modifier=".cs")


def touch(pool, idx, dst=None, math=False, cfg=TOUCH):
    bv, rows, warps, stages = cfg
    N, HV, V, K = idx.numel(), pool.shape[1], pool.shape[2], pool.shape[3]
    gather = dst is not None
    _touch_kernel[(V // rows * N * HV,)](
        pool, dst if gather else pool, idx, 1.0, pool.stride(0), pool.stride(1), HV * V * K, HV=HV, K=K, V=V,
        BV=bv, ROWS=rows, STAGES=stages, MATH=math, GATHER=gather, num_warps=warps)


def run(iters: int, batches: list[int]) -> list[dict]:
    copy_gbps = bench_timing._copy_gbps(iters)
    print(f"{torch.cuda.get_device_name()} copy {copy_gbps:.0f} GB/s")
    rows = []
    for model, H, HV in bench_cases.DECODE_SHAPES:
        for N in batches:
            for dtype in (torch.bfloat16, torch.float32):
                q, k, v, a, b, A_log, dt_bias, pool, idx = decode_inputs(N, H, HV, dtype)
                idx = idx.to(torch.int32)
                contig = torch.arange(N, device="cuda", dtype=torch.int32)
                dst = torch.empty(N, HV, D, D, device="cuda", dtype=dtype)
                same_src = pool[:N]
                before = pool.clone()
                touch(pool, idx)
                touch(pool, idx, math=True)
                touch(pool, idx, dst=dst)
                ok = torch.equal(pool, before) and torch.equal(dst, before[idx.long()])
                fns = {
                    "copy, same size": lambda: dst.copy_(same_src),
                    "touch in place": lambda: touch(pool, idx),
                    "touch in place, slots 0..N-1": lambda: touch(pool, contig),
                    "touch to a buffer": lambda: touch(pool, idx, dst=dst),
                    "touch in place, fp32 math": lambda: touch(pool, idx, math=True),
                    "decode (shipped)": lambda: gated_delta_rule_decode(q, k, v, a, b, A_log, dt_bias, pool, idx),
                }
                gated_delta_rule_decode(q, k, v, a, b, A_log, dt_bias, pool, idx)  # tune before timing
                times = bench_timing._interleaved(fns, iters)
                nbytes = 2 * N * HV * D * D * pool.element_size()
                shape = f"{model} B={N} {str(dtype).removeprefix('torch.')}"
                for name, t in times.items():
                    pct = 100 * nbytes / t.ms / 1e6 / copy_gbps
                    same = 100 * times["copy, same size"].ms / t.ms
                    rows.append({"shape": shape, "what": name, "ms": t.ms, "pct_copy": pct, "pct_same_size": same,
                                 "touch_exact": ok})
                    print(f"{shape:24} {name:30} {t.ms * 1e3:8.1f} us {pct:6.1f}% copy {same:6.1f}% same-size"
                          f"{'' if ok else '  TOUCH NOT EXACT'}", flush=True)
                del pool, dst, before
    return rows


SWEEP = ((8, 64, 4, 3), (8, 128, 4, 3), (16, 128, 4, 3), (16, 128, 4, 4), (32, 128, 4, 3), (32, 128, 8, 3),
         (16, 128, 2, 3), (16, 64, 4, 3), (16, 128, 8, 4), (32, 128, 8, 2))


def sweep(iters: int, batches: list[int]) -> list[dict]:
    """35B bf16: per (BV, ROWS, num_warps, stages), the pattern alone (touch in place) beside the row-looped decode
    kernel at the same config, so that the gap between them is what decode's arithmetic costs at that config."""
    from hybridkv.kernels.gdn import triton_decode_rows, triton_recurrent

    copy_gbps = bench_timing._copy_gbps(iters)
    model, H, HV = bench_cases.DECODE_SHAPES[0]
    rows = []
    for N in batches:
        q, k, v, a, b, A_log, dt_bias, pool, idx = decode_inputs(N, H, HV, torch.bfloat16)
        idx = idx.to(torch.int32)
        o = torch.empty_like(v)
        gated_delta_rule_decode(q, k, v, a, b, A_log, dt_bias, pool, idx)
        picks = {key[-3:]: c for key, c in triton_recurrent._decode_choice.items()
                 if key[3] == torch.bfloat16 and key[0] == HV}
        print(f"{model} B={N} bf16: the tuner's choice", picks)
        fns = {"decode (shipped)": lambda: gated_delta_rule_decode(q, k, v, a, b, A_log, dt_bias, pool, idx)}
        for cfg in SWEEP:
            fns[f"touch {cfg}"] = lambda cfg=cfg: touch(pool, idx, cfg=cfg)
            fns[f"rows  {cfg}"] = lambda cfg=cfg: triton_decode_rows.launch(
                cfg, q, k, v, a, b, A_log, dt_bias, o, pool, idx, D**-0.5, True, 1.0, 20.0)
        times = bench_timing._interleaved(fns, iters)
        nbytes = 2 * N * HV * D * D * 2
        for name, t in times.items():
            pct = 100 * nbytes / t.ms / 1e6 / copy_gbps
            rows.append({"shape": f"{model} B={N} bfloat16", "what": name, "ms": t.ms, "pct_copy": pct})
            print(f"{model} B={N} bf16 {name:32} {t.ms * 1e3:8.1f} us {pct:6.1f}% copy", flush=True)
        del pool
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--batch", type=int, nargs="+", default=[64, 256])
    p.add_argument("--json", default=None)
    p.add_argument("--sweep", action="store_true", help="35B bf16 only: touch and row-looped decode per config")
    args = p.parse_args()
    rows = (sweep if args.sweep else run)(args.iters, args.batch)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
