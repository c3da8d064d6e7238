"""Device probe for issue #8: the scores form (`triton_chunk.Form.SCORES`) pipelined on one long 35B
sequence with register caps on the inverse kernel beside it, on the bench's prefill shapes, with per-kernel
device times (torch.profiler) and FLA in the same run. (Earlier variants - pipeline stages, segments,
BV=64 pipelines, batched scores, the split form - and their numbers are in triton_chunk's comments and in
git history.)

    python3 scripts/gdn_split_probe.py [--iters 10] [--json PATH] [--shapes 1x8192]

Each variant's output and final state are compared with the pure-torch reference in fp32 (relative RMS
error). Run from the repository root on a CUDA machine.
"""

from __future__ import annotations

import dataclasses
import json
import sys

import torch

from hybridkv.kernels.gdn import bench, breakdown, triton_chunk

from gdn_inverse_probe import kernel_us  # scripts/ is this script's own directory on sys.path
from gdn_schedules import probe_args, reference_cases, rel

FUSED, SCORES = triton_chunk.Form.FUSED, triton_chunk.Form.SCORES
SERIAL, PIPELINED = triton_chunk.Schedule.SERIAL, triton_chunk.Schedule.PIPELINED


def variants(shape: str):
    """(name, form, schedule, config, segments, inverse config): the plan (`triton_chunk._plan`) against
    the fused form autotuned, and for 35B's one sequence the pipelined scores form with register caps on
    the inverse kernel. Beside a chain program (188 registers x 128 threads) only two inverse programs
    (255 x 64) fit on an SM, and the inverse then runs about half as fast as alone, which is what keeps
    35B 1x8192 at 1.28-1.29x FLA; at 200 registers three fit, at 160 four (spills are the price)."""
    inv = triton_chunk.INVERSE_CONFIG
    yield "auto (plan)", None, None, None, None, inv
    yield "fused serial autotuned", FUSED, SERIAL, None, None, inv
    if "HV=32" not in shape or "1x" not in shape:
        return
    bv32 = (32, 4, 3)
    for n in (2, 4):
        for cap in (None, 200, 160, 128):
            yield (f"scores pipelined x{n} inverse maxnreg={cap}", SCORES, PIPELINED, bv32, n,
                   dataclasses.replace(inv, maxnreg=cap))
    yield "scores pipelined x2 inverse group=1", SCORES, PIPELINED, bv32, 2, dataclasses.replace(inv, group=1)
    yield "scores serial inverse maxnreg=160", SCORES, SERIAL, bv32, None, dataclasses.replace(inv, maxnreg=160)


def main() -> int:
    a = probe_args(__doc__)
    rows = []
    print(torch.cuda.get_device_name(), flush=True)
    fla = bench._load_fla(False)
    for shape, args, kw, o_ref, s_ref in reference_cases(a.shapes):
        q, k, v, g, beta = args
        cu = kw["cu_seqlens"]
        if fla is not None:
            b = breakdown.measure("FLA", lambda: fla[0](*args, **kw), a.iters, bench._median_ms)
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
            b = breakdown.measure("hybridkv", call, a.iters, bench._median_ms)
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
