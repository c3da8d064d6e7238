"""Device probe for issue #8: every chunk schedule and state config on the bench's prefill shapes, and
the decode kernel with and without streaming cache hints, side by side with FLA in one run.

    python -m tools.gdn.schedules [--iters 10] [--json PATH]

Each variant's output is compared with the serial, autotuned call (relative RMS error) so a variant
that is fast because it is wrong shows. Run from the repository root on a CUDA machine.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from hybridkv.kernels.gdn import chunk_plan, gated_delta_rule_decode
from hybridkv.benchmarks.gdn import cases as bench_cases
from hybridkv.benchmarks.gdn import rows as bench_rows
from hybridkv.benchmarks.gdn import timing as bench_timing
from hybridkv.kernels.gdn import chunk as triton_chunk
from hybridkv.kernels.gdn import fused_recurrent as triton_recurrent
from hybridkv.kernels.gdn import decode
from hybridkv.kernels.gdn import decode_kernels


def rel(a, b) -> float:
    a, b = a.double(), b.double()
    return ((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt().clamp_min(1e-12)).item()


def probe_args(doc: str) -> argparse.Namespace:
    """The other probes' command line: --iters, --json, and --shapes (a prefill shape is kept if its
    label contains any of them)."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--json", default=None)
    p.add_argument("--shapes", nargs="*", default=[])
    return p.parse_args()


def reference_cases(shapes: list[str]):
    """The bench's prefill shapes whose label contains any of ``shapes`` (all without any), each with the
    pure-torch reference in fp32: (label, args, kwargs, o_ref, state_ref)."""
    from hybridkv.kernels.gdn import naive as reference

    for shape, _B, _T, _H, _HV, args, kw in bench_cases._prefill_cases():
        if shapes and not any(x in shape for x in shapes):
            continue
        q, k, v, g, beta = args
        o_ref, s_ref = reference.chunk_reference(q.float(), k.float(), v.float(), g, beta, 128**-0.5, None, True,
                                                 kw["cu_seqlens"], True)
        yield shape, args, kw, o_ref, s_ref


def prefill(iters: int, fla, shapes: list[str], quick: bool) -> list[dict]:
    rows = []
    for shape, B, T, H, HV, args, kw in bench_cases._prefill_cases():
        if shapes and not all(x in shape for x in shapes):
            continue
        q, k, v, g, beta = args
        cu = kw["cu_seqlens"]

        def call(schedule=None, config=None, segments=None):
            return triton_chunk.chunk_gated_delta_rule_fwd(q, k, v, g, beta, 128**-0.5, None, True, cu, True, False,
                                                           config=config, schedule=schedule, segments=segments)

        o_ref, s_ref = call(triton_chunk.Schedule.SERIAL)
        n_seq = B if cu is None else cu.numel() - 1
        sms = triton_chunk._sm_count(q.device.index)
        plan = triton_chunk._call_plan(q, k, v, n_seq, HV, 128, 128, triton_chunk._tables.get(cu, B, T, q.device)[3],
                                       None)
        auto = f"{plan.form.value} {plan.schedule.value} {plan.config} {plan.gluon_chain or ''}".rstrip()
        variants = [("serial autotuned", triton_chunk.Schedule.SERIAL, None, None), ("auto", None, None, None)]
        if quick:
            cfg = chunk_plan.PIPELINE_CONFIG
            variants += [(f"pipelined {cfg} x{n}", triton_chunk.Schedule.PIPELINED, cfg, n) for n in (2, 4)]
        for cfg in () if quick else triton_chunk.STATE_CONFIGS:
            variants.append((f"serial {cfg}", triton_chunk.Schedule.SERIAL, cfg, None))
        for sched in () if quick else (triton_chunk.Schedule.PIPELINED,):
            cfg = chunk_plan.PIPELINE_CONFIG
            if triton_chunk.triton.cdiv(128, cfg[0]) * n_seq * HV <= sms:
                for segments in (2, 3, 4):
                    variants.append((f"{sched.value} {cfg} x{segments}", sched, cfg, segments))
        fla_ms = None if fla is None else bench_timing._median_ms(lambda: fla[0](*args, **kw), iters)
        for name, sched, cfg, segments in variants:
            o, s = call(sched, cfg, segments)
            err = max(rel(o, o_ref), rel(s, s_ref))
            ms = bench_timing._median_ms(lambda: call(sched, cfg, segments), iters)
            row = dict(shape=shape, variant=name, ms=ms, fla_ms=fla_ms,
                       x_fla=None if fla_ms is None else fla_ms / ms, err_vs_serial=err, auto_plan=auto)
            rows.append(row)
            if name == variants[-1][0] and fla is not None:  # FLA again: how much its own time moves
                row["fla_ms_again"] = bench_timing._median_ms(lambda: fla[0](*args, **kw), iters)
                print(f"{shape:32} FLA again {row['fla_ms_again']:.3f} ms", flush=True)
            x = "-" if fla_ms is None else f"{fla_ms / ms:.2f}"
            print(f"{shape:32} {name:30} {ms:7.3f} ms  FLA {fla_ms if fla_ms is None else round(fla_ms, 3)}"
                  f"  x{x}  err {err:.1e}", flush=True)
        del args
    return rows


def decode_inputs(N: int, H: int, HV: int, dtype: torch.dtype) -> tuple:
    """The bench's dense decode step: (q, k, v, a, b, A_log, dt_bias, pool, idx), N rows on N of 2N slots."""
    step = bench_cases.decode_step(bench_cases.Pool.DENSE, N, "cuda")
    q, k, v, a, b, A_log, dt_bias = bench_cases.decode_inputs(N, H, HV, "cuda")
    pool, idx = bench_cases.decode_pool(step.slots, HV, dtype, "cuda"), step.indices
    return q, k, v, a, b, A_log, dt_bias, pool, idx


def decode(iters: int, copy_gbps: float) -> list[dict]:
    rows = []
    N = 256
    for model, H, HV in bench_cases.DECODE_SHAPES:
        for dtype in (torch.float32, torch.bfloat16):
            q, k, v, a, b, A_log, dt_bias, pool, idx = decode_inputs(N, H, HV, dtype)
            o = torch.empty_like(v)
            nbytes = N * HV * 128 * 128 * 2 * pool.element_size()
            gated_delta_rule_decode(q, k, v, a, b, A_log, dt_bias, pool, idx)  # tunes
            for cfg in decode_kernels.TILE_CONFIGS:
                for stream in ((False, True) if dtype == torch.bfloat16 else (False,)):
                    fn = lambda: decode_kernels._launch_tile(cfg, q, k, v, a, b, A_log, dt_bias, o, pool, idx,
                                                                 128**-0.5, True, True, 1.0, 20.0, stream=stream)
                    ms = bench_timing._median_ms(fn, iters)
                    gbps = nbytes / ms / 1e6
                    rows.append(dict(shape=f"{model} HV={HV} {dtype}", cfg=cfg, stream=stream, ms=ms,
                                     pct_copy=100 * gbps / copy_gbps))
                    print(f"decode {model} HV={HV} {str(dtype):15} {cfg} stream={stream!s:5} {ms:.4f} ms "
                          f"{gbps:6.0f} GB/s {100 * gbps / copy_gbps:5.1f}% copy", flush=True)
            print("tuned:", decode.decode_choices(), flush=True)
            del pool
    return rows


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--json", default=None)
    p.add_argument("--only", choices=("prefill", "decode"), default=None)
    p.add_argument("--quick", action="store_true", help="prefill: serial, auto and the widest pipeline config only")
    p.add_argument("--shapes", nargs="*", default=[], help="only prefill shapes whose label contains all of these")
    a = p.parse_args()
    fla = bench_rows._load_fla(False)
    copy = bench_timing._copy_gbps(a.iters)
    print(torch.cuda.get_device_name(), "copy", round(copy), "GB/s; FLA", fla is not None, flush=True)
    out = {"copy_gbps": copy}
    if a.only in (None, "decode"):
        out["decode"] = decode(a.iters, copy)
    if a.only in (None, "prefill"):
        out["prefill"] = prefill(a.iters, fla, a.shapes, a.quick)
    if a.json:
        json.dump(out, open(a.json, "w"), indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
