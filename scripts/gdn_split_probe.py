"""Device probe for issue #8: pipeline stages and segments of the fused state kernel, and the scores form
(`triton_chunk.Form.SCORES`), serial and pipelined, on the bench's prefill shapes, with per-kernel device
times (torch.profiler) and FLA in the same run. (The split form's numbers are in `triton_chunk_wu`'s
docstring; git history has the variants that measured it.)

    python3 scripts/gdn_split_probe.py [--iters 10] [--json PATH] [--shapes 1x8192]

Each variant's output and final state are compared with the pure-torch reference in fp32 (relative RMS
error). Run from the repository root on a CUDA machine.
"""

from __future__ import annotations

import json
import sys

import torch

from hybridkv.kernels.gdn import bench, breakdown, triton_chunk

from gdn_inverse_probe import kernel_us  # scripts/ is this script's own directory on sys.path
from gdn_schedules import probe_args, reference_cases, rel

FUSED, SCORES = triton_chunk.Form.FUSED, triton_chunk.Form.SCORES
SERIAL, PIPELINED = triton_chunk.Schedule.SERIAL, triton_chunk.Schedule.PIPELINED


def variants(shape: str):
    """The plan (`triton_chunk._plan`) against the fused form autotuned, the scores form's pipeline at
    BV=32 and BV=64 (at 35B, BV=64 leaves half the SMs wholly to the inverse of the next segment), and
    the scores form on batched shapes (no spills at BV=64, offline sm_90)."""
    yield "auto (plan)", None, None, None, None
    yield "fused serial autotuned", FUSED, SERIAL, None, None
    yield "scores serial autotuned", SCORES, SERIAL, None, None
    if "1x" not in shape:
        for cfg in ((64, 4, 2), (64, 8, 2), (32, 4, 2), (64, 4, 3)):
            yield f"scores serial {cfg}", SCORES, SERIAL, cfg, None
        return
    if "HV=32" in shape:
        yield "fused pipelined (32, 4, 3) x2", FUSED, PIPELINED, (32, 4, 3), 2
        for cfg, segs in (((32, 4, 3), (2, 4)), ((64, 4, 3), (2, 3, 4)), ((64, 8, 3), (2, 4))):
            for n in segs:
                yield f"scores pipelined {cfg} x{n}", SCORES, PIPELINED, cfg, n
        yield "scores serial (64, 4, 3)", SCORES, SERIAL, (64, 4, 3), None
    else:
        yield "scores serial (64, 4, 3)", SCORES, SERIAL, (64, 4, 3), None
        for n in (2, 3):
            yield f"scores pipelined (64, 4, 3) x{n}", SCORES, PIPELINED, (64, 4, 3), n


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

        for name, form, sched, cfg, n in variants(shape):
            def call(form=form, sched=sched, cfg=cfg, n=n):
                return triton_chunk.chunk_gated_delta_rule_fwd(q, k, v, g, beta, 128**-0.5, None, True, cu, True,
                                                               False, config=cfg, schedule=sched, segments=n,
                                                               form=form)
            try:
                o, s = call()
            except Exception as exc:  # noqa: BLE001 - a variant that does not compile is a result too
                print(f"{shape:30} {name}: FAILED {type(exc).__name__}: {str(exc)[:300]}", flush=True)
                continue
            err = (rel(o, o_ref), rel(s, s_ref))
            b = breakdown.measure("hybridkv", call, a.iters, bench._median_ms)
            row = dict(shape=shape, variant=name, call_us=b.call_us, inverse_us=kernel_us(b, "inverse"),
                       wu_us=kernel_us(b, "wu") + kernel_us(b, "scores"), chain_us=kernel_us(b, "chain") + kernel_us(b, "state"),
                       o_err=err[0], s_err=err[1])
            rows.append(row)
            print(f"{shape:30} {name:34} call {b.call_us:7.1f} us  inverse {row['inverse_us']:6.1f}  wu/P "
                  f"{row['wu_us']:6.1f}  chain {row['chain_us']:6.1f}  err o {err[0]:.2e} s {err[1]:.2e}",
                  flush=True)
    if a.json:
        json.dump(rows, open(a.json, "w"), indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
