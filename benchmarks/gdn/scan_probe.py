"""Device probe for issue #23: the scan schedule (`triton_chunk_scan`) against the pipelined one on
one long sequence with few value heads (TP-sharded), every variant's error against the fp32 reference,
and where a call's time goes (per-kernel device time, torch.profiler).

    python -m benchmarks.gdn.scan_probe [--iters 10] [--json PATH] [--shapes TP8]

Run from the repository root on a CUDA machine. Times are `bench gdn`'s: the median CUDA-event time of
one call queued behind a spin, so the host's launch cost is hidden (and printed beside it).
"""

from __future__ import annotations

import json
import sys

import torch
import torch.nn.functional as F

from benchmarks.gdn.schedules import probe_args, rel
from hybridkv.kernels.gdn import bench, breakdown, reference, triton_chunk, triton_chunk_scan

# (label, H, HV, T): Qwen3.5-397B (H=16, HV=64) and 35B (16, 32) sharded by TP, dk = dv = 128.
SHAPES = (
    ("397B TP8 1x8192", 2, 8, 8192),
    ("397B TP8 1x32768", 2, 8, 32768),
    ("397B TP4 1x8192", 4, 16, 8192),
    ("35B TP8 1x8192", 2, 4, 8192),
    ("35B TP2 1x8192", 8, 16, 8192),
    ("35B 1x8192", 16, 32, 8192),
)

SCAN, PIPELINED = triton_chunk.Schedule.SCAN, triton_chunk.Schedule.PIPELINED
SCORES, FUSED = triton_chunk.Form.SCORES, triton_chunk.Form.FUSED


def inputs(H: int, HV: int, T: int, seed: int = 0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q, k = (torch.randn(1, T, H, 128, device="cuda", generator=gen).bfloat16() for _ in range(2))
    v = torch.randn(1, T, HV, 128, device="cuda", generator=gen).bfloat16()
    g = F.logsigmoid(torch.randn(1, T, HV, device="cuda", generator=gen) + 3.0)
    beta = torch.rand(1, T, HV, device="cuda", generator=gen)
    cu = torch.tensor([0, T], device="cuda")
    return q, k, v, g, beta, cu


def variants(HV: int, T: int):
    """(name, schedule, form, config, segments, summary config) to time; None: the plan's."""
    out = [("auto", None, None, None, None, None),
           ("pipelined scores (32,4,3) x2", PIPELINED, SCORES, (32, 4, 3), 2, None)]
    for seg in (2, 4, 8, 16):
        out.append((f"scan scores (32,4,3) x{seg}", SCAN, SCORES, (32, 4, 3), seg, None))
    out += [("scan fused (32,4,3) x4", SCAN, FUSED, (32, 4, 3), 4, None),
            ("scan scores (64,4,3) x4", SCAN, SCORES, (64, 4, 3), 4, None),
            ("scan scores (64,4,3) x8", SCAN, SCORES, (64, 4, 3), 8, None),
            ("scan scores (32,4,2) x4", SCAN, SCORES, (32, 4, 2), 4, None),
            ("scan scores (32,4,3) x4, summary (32,4,3)", SCAN, SCORES, (32, 4, 3), 4, (32, 4, 3)),
            ("scan scores (32,4,3) x4, summary (64,4,2)", SCAN, SCORES, (32, 4, 3), 4, (64, 4, 2))]
    return out


def main() -> int:
    a = probe_args(__doc__)
    rows = []
    shipped_summary = triton_chunk_scan.SUMMARY_CONFIG
    for label, H, HV, T in SHAPES:
        if a.shapes and not any(x in label for x in a.shapes):
            continue
        q, k, v, g, beta, cu = inputs(H, HV, T)
        with bench._fp32_matmuls():
            o_ref, s_ref = reference.chunk_reference(q, k, v.float(), g, beta, 128**-0.5, None, True, cu, True)
        sms = triton_chunk._sm_count(q.device.index)
        plan = triton_chunk._plan(1, HV, 128, 128, sms, T // 64)
        print(f"{label}: plan {plan.form.value} {plan.schedule.value} {plan.config}", flush=True)
        best = None
        for name, sched, form, cfg, seg, summary in variants(HV, T):
            triton_chunk_scan.SUMMARY_CONFIG = summary or shipped_summary

            def call():
                return triton_chunk.chunk_gated_delta_rule_fwd(q, k, v, g, beta, 128**-0.5, None, True, cu, True,
                                                               False, config=cfg, schedule=sched, segments=seg,
                                                               form=form)
            try:
                o, s = call()
                ms, host = bench._timed(call, a.iters)
            except Exception as exc:  # a variant that does not compile or launch is a finding, not an abort
                print(f"{label:22} {name:44} failed: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
                continue
            err = (rel(o, o_ref), rel(s, s_ref))
            row = dict(shape=label, variant=name, ms=ms, host_ms=host, o_err=err[0], s_err=err[1])
            rows.append(row)
            print(f"{label:22} {name:44} {ms:7.3f} ms  host {host:.3f}  err o {err[0]:.1e} s {err[1]:.1e}",
                  flush=True)
            if sched is SCAN and (best is None or ms < best[0]):
                best = (ms, name, call, summary)
        for name, fn, summary in (("auto", lambda: triton_chunk.chunk_gated_delta_rule_fwd(
                q, k, v, g, beta, 128**-0.5, None, True, cu, True, False), None),
                                  *(((f"best scan: {best[1]}", best[2], best[3]),) if best else ())):
            triton_chunk_scan.SUMMARY_CONFIG = summary or shipped_summary
            b = breakdown.measure(name, fn, a.iters, bench._median_ms)
            print(breakdown.render(label, [b]), flush=True)
            rows.append(dict(shape=label, breakdown=name, call_us=b.call_us, kernels=list(b.kernels)))
        triton_chunk_scan.SUMMARY_CONFIG = shipped_summary
        del q, k, v, g, beta, o_ref, s_ref
        torch.cuda.empty_cache()
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
