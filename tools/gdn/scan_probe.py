"""Device probe for issue #23: a call's plan against what it replaced and its variants (`variants`): the scan schedule
(`triton_chunk_scan`) for few value heads (TP-sharded), the serial scores form on the Gluon chain for 397B-shaped
heads, and for batches the scores form on the batch plan's Gluon chain against the fused form; every variant's error
against the fp32 reference, and where the plan's and the fastest variant's time goes (per-kernel device time,
torch.profiler). The variants measured before: tools/gdn/README.md.

    python -m tools.gdn.scan_probe [--iters 10] [--json PATH] [--shapes "397B TP8 1x8192" "397B 1x8192"]

Run from the repository root on a CUDA machine. Times are `bench gdn`'s: the median CUDA-event time of
one call queued behind a spin, so the host's launch cost is hidden (and printed beside it).
"""

from __future__ import annotations

import json
import sys
import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton

from tools.gdn.schedules import probe_args, rel
from hybridkv.kernels.gdn import (
    bench_rows,
    bench_timing,
    breakdown,
    chunk_plan,
    pdl,
    reference,
    triton_chunk,
    triton_chunk_scan,
)
from hybridkv.kernels.gdn.triton_chunk_inverse import GLUON_INVERSE_CONFIG, InverseConfig

# (label, H, HV, N, T): N sequences of T tokens (packed, varlen) of Qwen3.5-397B (H=16, HV=64) and 35B (16, 32) heads,
# sharded by TP, dk = dv = 128.
SHAPES = (
    ("397B TP8 1x8192", 2, 8, 1, 8192),
    ("397B 1x8192", 16, 64, 1, 8192),
    ("397B 1x32768", 16, 64, 1, 32768),
    ("397B TP8 1x32768", 2, 8, 1, 32768),
    ("397B TP4 1x8192", 4, 16, 1, 8192),
    ("35B TP8 1x8192", 2, 4, 1, 8192),
    ("35B TP2 1x8192", 8, 16, 1, 8192),
    ("35B 1x8192", 16, 32, 1, 8192),
    ("397B 4x8192", 16, 64, 4, 8192),
    ("35B 4x8192", 16, 32, 4, 8192),
    ("397B 16x2048", 16, 64, 16, 2048),
    ("35B 16x2048", 16, 32, 16, 2048),
)

SCAN = triton_chunk.Schedule.SCAN


def inputs(H: int, HV: int, N: int, T: int, seed: int = 0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q, k = (torch.randn(1, N * T, H, 128, device="cuda", generator=gen).bfloat16() for _ in range(2))
    v = torch.randn(1, N * T, HV, 128, device="cuda", generator=gen).bfloat16()
    g = F.logsigmoid(torch.randn(1, N * T, HV, device="cuda", generator=gen) + 3.0)
    beta = torch.rand(1, N * T, HV, device="cuda", generator=gen)
    cu = torch.arange(N + 1, device="cuda") * T
    return q, k, v, g, beta, cu


@dataclass(frozen=True, kw_only=True)
class Variant:
    """One way to run a shape; None: the plan's (or the shipped module setting)."""

    name: str
    schedule: triton_chunk.Schedule | None = None
    form: triton_chunk.Form | None = None
    config: tuple[int, int, int] | None = None
    segments: int | None = None
    summary: tuple[int, int, int] | None = None  # triton_chunk_scan.SUMMARY_CONFIG
    by_segment: bool = False  # triton_chunk_scan.BY_SEGMENT
    whole_m: bool = False  # triton_chunk_scan.SCAN_WHOLE_M
    scan_prec: str = triton_chunk_scan.SCAN_PRECISION
    scan_bv: int = triton_chunk_scan.SCAN_BV
    inverse: InverseConfig | None = None  # None: the call's default (the Gluon inverse on Hopper)
    gluon_chain: chunk_plan.GluonChain | None = None
    pdl: bool = True  # pdl.ENABLED
    scores_tma: bool = triton_chunk.SCORES_TMA


def variants(plan: chunk_plan.Plan, segments: int, N: int = 1) -> list[Variant]:
    """The plan, and the plan with the Gluon inverse on four warps (`InverseConfig.warps` 4, eighth session; offline
    sm_90 with the scores: one value head per program 107 registers, four programs per SM; the shipped group capped at
    168, three per SM, or at 128, four, spilling 120 B; two warps today: 254, four programs, eight warps an SM).
    Earlier variants (P by the scores kernel, the fused form on the batch Gluon chain, the inverse's wide stores
    65906a5, its scores by 16-row slabs or after every inversion, the scan's configs, PDL, TMA scores, the Triton chain
    before the Gluon one, by segment, stacked inverse, whole M, pipelined and scanned 397B prompts): git history and
    tools/gdn/README.md."""
    four = dataclasses.replace(GLUON_INVERSE_CONFIG, warps=4)
    like_plan = dict(schedule=plan.schedule, form=plan.form, config=plan.config,
                     segments=segments if plan.schedule is SCAN else None, gluon_chain=plan.gluon_chain)
    return [Variant(name="plan"),
            Variant(name="plan, inverse 4 warps, 1 head", inverse=dataclasses.replace(four, group=1), **like_plan),
            Variant(name="plan, inverse 4 warps, maxnreg 168", inverse=dataclasses.replace(four, maxnreg=168),
                    **like_plan),
            Variant(name="plan, inverse 4 warps, maxnreg 128", inverse=dataclasses.replace(four, maxnreg=128),
                    **like_plan)]


def main() -> int:
    a = probe_args(__doc__)
    rows = []
    for label, H, HV, N, T in SHAPES:
        if a.shapes and not any(x in label for x in a.shapes):
            continue
        q, k, v, g, beta, cu = inputs(H, HV, N, T)
        with bench_rows._fp32_matmuls():
            o_ref, s_ref = reference.chunk_reference(q, k, v.float(), g, beta, 128**-0.5, None, True, cu, True)
        sms = triton_chunk._sm_count(q.device.index)
        plan = triton_chunk._call_plan(q, k, v, N, HV, 128, 128, N * T // 64, None)  # the Gluon chain where it can
        print(f"{label}: plan {plan.form.value} {plan.schedule.value} {plan.config} {plan.gluon_chain or ''}",
              flush=True)
        segments = chunk_plan.scan_segments(triton.cdiv(128, (plan.config or (32,))[0]) * HV, sms, T // 64)
        calls = {}
        for var in variants(plan, segments, N):
            def call(var=var):
                triton_chunk_scan.SUMMARY_CONFIG = var.summary
                triton_chunk_scan.BY_SEGMENT = var.by_segment
                triton_chunk_scan.SCAN_WHOLE_M = var.whole_m
                triton_chunk_scan.SCAN_PRECISION, triton_chunk_scan.SCAN_BV = var.scan_prec, var.scan_bv
                pdl.ENABLED = var.pdl
                triton_chunk.SCORES_TMA = var.scores_tma
                return triton_chunk.chunk_gated_delta_rule_fwd(q, k, v, g, beta, 128**-0.5, None, True, cu, True,
                                                               False, config=var.config, schedule=var.schedule,
                                                               segments=var.segments, form=var.form,
                                                               inverse=var.inverse, gluon_chain=var.gluon_chain)
            try:
                o, s = call()
                ms, host = bench_timing._timed(call, a.iters)
            except Exception as exc:  # a variant that does not compile or launch is a finding, not an abort
                print(f"{label:22} {var.name:44} failed: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
                continue
            err = (rel(o, o_ref), rel(s, s_ref))
            rows.append(dict(shape=label, variant=var.name, ms=ms, host_ms=host, o_err=err[0], s_err=err[1]))
            print(f"{label:22} {var.name:44} {ms:7.3f} ms  host {host:.3f}  err o {err[0]:.1e} s {err[1]:.1e}",
                  flush=True)
            calls[var.name] = call
        for name, call in calls.items():  # where each variant's time goes
            b = breakdown.measure(name, call, a.iters, bench_timing._median_ms)
            print(breakdown.render(label, [b]), flush=True)
            rows.append(dict(shape=label, breakdown=name, call_us=b.call_us, kernels=list(b.kernels)))
        triton_chunk_scan.SUMMARY_CONFIG, triton_chunk_scan.BY_SEGMENT = None, False
        triton_chunk_scan.SCAN_WHOLE_M = False
        triton_chunk_scan.SCAN_PRECISION, triton_chunk_scan.SCAN_BV = Variant.scan_prec, Variant.scan_bv
        pdl.ENABLED, triton_chunk.SCORES_TMA = True, Variant.scores_tma
        del q, k, v, g, beta, o_ref, s_ref
        torch.cuda.empty_cache()
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
