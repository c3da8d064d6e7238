"""Device probe for issue #8: the plan (`chunk_plan.plan`) on the bench's prefill shapes against the fused
form, and on one long sequence against the previous inverse and other segment counts, with per-kernel
device times (torch.profiler) and FLA in the same run. (Earlier variants - pipeline stages, segments,
BV=64 pipelines, batched scores, the split form - have their numbers in tools/gdn/README.md and
their code in git history.)

    python -m tools.gdn.split_probe [--iters 10] [--json PATH] [--shapes 1x8192]

Each variant's output and final state are compared with the pure-torch reference in fp32 (relative RMS
error). Run from the repository root on a CUDA machine.
"""

from __future__ import annotations

import dataclasses
import json
import sys

import torch

from hybridkv.kernels.gdn import bench_rows, bench_timing, breakdown, chunk_plan, triton_chunk

from tools.gdn.inverse_probe import kernel_us
from tools.gdn.schedules import probe_args, reference_cases, rel

FUSED, SCORES = triton_chunk.Form.FUSED, triton_chunk.Form.SCORES
SERIAL, PIPELINED = triton_chunk.Schedule.SERIAL, triton_chunk.Schedule.PIPELINED


def variants(shape: str):
    """(name, form, schedule, config, segments, inverse config): the plan (`chunk_plan.plan`) against the fused form
    autotuned, and on one sequence the plan's inverse against one taking 32 columns of k per gram step (the
    default before the transposed substitution). Register caps on the inverse beside the pipelined chain (so
    that three or four inverse programs fit on an SM beside a chain program, not two) were all slower, H200, 35B
    1x8192, call us: no cap 417.4 / 421.3 (2 / 4 segments), maxnreg 200 430.8 / 443.2, 160 450.9 / 430.1, 128
    432.8 / 461.5."""
    inv = triton_chunk.INVERSE_CONFIG
    yield "auto (plan)", None, None, None, None, inv
    yield "fused serial autotuned", FUSED, SERIAL, None, None, inv
    if "1x" not in shape:
        return
    old = dataclasses.replace(inv, bkc=32)
    hv = int(shape.split("HV=")[1].split()[0])
    plan = chunk_plan.plan(1, hv, 128, 128, torch.cuda.get_device_properties(0).multi_processor_count, 128)
    yield "plan, inverse at 32 k columns", plan.form, plan.schedule, plan.config, None, old
    if plan.schedule is PIPELINED:
        yield "plan in 4 segments", plan.form, plan.schedule, plan.config, 4, inv
        yield "scores serial", SCORES, SERIAL, plan.config, None, inv


def main() -> int:
    a = probe_args(__doc__)
    rows = []
    print(torch.cuda.get_device_name(), flush=True)
    fla = bench_rows._load_fla(False)
    for shape, args, kw, o_ref, s_ref in reference_cases(a.shapes):
        q, k, v, g, beta = args
        cu = kw["cu_seqlens"]
        if fla is not None:
            b = breakdown.measure("FLA", lambda: fla[0](*args, **kw), a.iters, bench_timing._median_ms)
            print(f"{shape:30} FLA: call {b.call_us:7.1f} us  kernels {b.kernel_us:7.1f}", flush=True)
            rows.append(dict(shape=shape, variant="FLA", call_us=b.call_us, kernels=b.kernels))

        for name, form, sched, cfg, n, inv in variants(shape):
            def call(form=form, sched=sched, cfg=cfg, n=n, inv=inv):
                return triton_chunk.chunk_gated_delta_rule_fwd(q, k, v, g, beta, 128**-0.5, None, True, cu, True,
                                                               False, config=cfg, schedule=sched, segments=n,
                                                               form=form, inverse=inv)
            try:
                o, s = call()
            except Exception as exc:  # noqa: BLE001 - a variant that does not compile is a result too
                print(f"{shape:30} {name}: FAILED {type(exc).__name__}: {str(exc)[:300]}", flush=True)
                continue
            err = (rel(o, o_ref), rel(s, s_ref))
            b = breakdown.measure("hybridkv", call, a.iters, bench_timing._median_ms)
            row = dict(shape=shape, variant=name, call_us=b.call_us, inverse_us=kernel_us(b, "inverse"),
                       parallel_us=kernel_us(b, "wu") + kernel_us(b, "scores"),
                       chain_us=kernel_us(b, "chain") + kernel_us(b, "state"), o_err=err[0], s_err=err[1])
            rows.append(row)
            print(f"{shape:30} {name:34} call {b.call_us:7.1f} us  inverse {row['inverse_us']:6.1f}  wu/P "
                  f"{row['parallel_us']:6.1f}  chain {row['chain_us']:6.1f}  err o {err[0]:.2e} s {err[1]:.2e}",
                  flush=True)
    if a.json:
        json.dump(rows, open(a.json, "w"), indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
