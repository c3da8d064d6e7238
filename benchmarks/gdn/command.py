"""`hybridkv bench gdn`: hybridkv's GDN kernels side by side with FLA's Triton path, FlashQLA and FlashInfer, in one
run.

Prefill: every implementation that can run here (hybridkv; FLA's own Triton path from fla-core; FlashQLA through its
own API with `auto_cp=True`, when `flash_qla` imports; FlashInfer's GDN prefill through its own API, when
`flashinfer.gdn_prefill` imports and the GPU is one it has kernels for, its layouts mapped by `flashinfer_args.py`;
`baselines.py` says how FLA is kept off its FlashQLA dispatch) gets the same inputs, and their timed calls are
interleaved (one call of each per round, the order rotated between rounds), so drift in clocks or temperature hits
all alike. Each output and final state is checked against the fp32 chunked reference (`reference.chunk_reference`,
TF32 off) on the same inputs: the max absolute error per implementation per shape. The first call of each
implementation is timed apart (Triton compile and autotuning; TileLang's JIT compile for FlashQLA, 30-75 s per new
shape class; CuTe DSL compiles for FlashInfer): with FlashQLA present those first calls run in parallel warm-up
processes (`--warm-jobs`), which fill the TileLang and Triton disk caches before this process times anything.
FlashInfer's first call always runs in this process: its prefill kernels are cached in process memory only, so a
warm-up process could not spare this one the compile.

Times are CUDA-event medians of `--iters` calls after warm-up. Each timed call is queued behind a GPU spin longer
than twice its host-side queueing time, so the host-side launch cost of any implementation (Python checks,
autotuner dispatch) is hidden as it would be in a busy stream or a CUDA graph; host syncs still count. "b2b" is
the other measure: 20 calls queued back to back between two events, / 20, where host cost is hidden only as far as
the GPU work outlasts it. Prefill TFLOP/s use one count for all, 6 d^2 + 8 C d FLOP per token and value head (the
fused formulation, d = 128, C = 64), so their ratio is the time ratio. Prefill GB/s count the minimum traffic of a
fused kernel (q, k, v, g, beta read once, o written once). Decode GB/s count state bytes each implementation moves
(FLA reads the initial state and writes an fp32 final state); "% copy" divides by a device-to-device copy measured
in the same run.

Here: the command (its options and their checks, the `--breakdown` and `--host-profile` modes, the table and the
JSON). The shapes and their inputs are in :mod:`hybridkv.benchmarks.gdn.cases`; the timers in
:mod:`hybridkv.benchmarks.gdn.timing`; each column's function, its first call and the parallel warm-up processes
in :mod:`hybridkv.benchmarks.gdn.warmup`; the prefill rows, with their check against the fp32 reference, and the
decode rows in :mod:`hybridkv.benchmarks.gdn.rows`; the baselines' loaders in
:mod:`hybridkv.benchmarks.gdn.baselines`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict

from hybridkv.cli import CommandError, bounded, print_json

from hybridkv.benchmarks.gdn import baselines, cases
from hybridkv.benchmarks.gdn.cases import _prefill_cases, _select
from hybridkv.benchmarks.gdn.rows import Row, _decode_rows, _prefill_rows
from hybridkv.benchmarks.gdn.timing import _copy_gbps, _median_ms


def register(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print JSON rows instead of a table")
    parser.add_argument("--json-file", default=None, metavar="PATH",
                        help="also write the JSON there, rewritten after each prefill shape (a run cut short "
                             "keeps the shapes it finished), and print the table (default: none)")
    # Bounds keep a typo from running for hours (a shape's measurement is iters calls of each column).
    parser.add_argument("--iters", type=bounded(int, 10_000), default=20, help="timed calls per measurement (median)")
    parser.add_argument("--no-fla", action="store_true", help="skip the FLA baseline")
    parser.add_argument("--no-qla", action="store_true", help="skip FlashQLA even when flash_qla imports")
    parser.add_argument("--no-fi", action="store_true", help="skip FlashInfer even when flashinfer imports")
    parser.add_argument("--only", choices=("prefill", "decode"), default=None,
                        help="run only the prefill or only the decode rows (default: both)")
    parser.add_argument("--pool", action="append", default=None, choices=[p.value for p in cases.Pool],
                        help="decode: the slot pool each step runs in (repeatable; default: vllm and sglang). vllm: "
                             "int32 slots scattered over a pool 4x the batch, slot 0 never used, the step padded "
                             "with -1 (PAD_SLOT_ID) to the next CUDA-graph size; sglang: int64 slots, pads that "
                             "point at the reserved slot 0; dense: the former setting (random slots among 2N, no "
                             "pads)")
    parser.add_argument("--shape", action="append", default=None, metavar="TEXT",
                        help="prefill shapes whose label contains TEXT (repeatable; default: all)")
    parser.add_argument("--warm-jobs", type=bounded(int, 256), default=None, metavar="N",
                        help="with FlashQLA: first calls (compiles) of the prefill shapes in N parallel processes "
                             "before timing (default: one per shape, at most the CPU count; 0: in this process)")
    parser.add_argument("--warm-timeout", type=bounded(float, 3600.0), default=240.0, metavar="S",
                        help="with FlashQLA: seconds each warm-up process may take; a shape whose warm-up did not "
                             "finish is measured without FlashQLA")
    parser.add_argument("--breakdown", action="store_true",
                        help="prefill: per-kernel device time and idle time inside each call (torch.profiler), "
                             "for hybridkv and FLA")
    parser.add_argument("--host-profile", action="store_true",
                        help="prefill: where each call's host (CPU) time goes (cProfile, own time per function), for "
                             "hybridkv and FLA")
    parser.set_defaults(handler=run)


def _host_profiles(fla, iters: int, echo: bool) -> list[dict]:
    import torch

    from hybridkv.kernels.gdn import chunk_gated_delta_rule
    from hybridkv.benchmarks.gdn import host_profile

    out = []
    for shape, _, _, _, _, args, kw in _prefill_cases():
        calls = [("hybridkv", lambda: chunk_gated_delta_rule(*args, **kw))]
        if fla is not None:
            calls.append(("fla", lambda: fla[0](*args, **kw)))
        rows = []
        for name, fn in calls:
            for _ in range(3):  # compiles and autotuning happen here, not in the profile
                fn()
            rows.append(host_profile.measure(name, fn, iters, torch.cuda.synchronize))
        if echo:
            print(host_profile.render(shape, rows), flush=True)
        out.append({"shape": shape, "rows": [asdict(r) for r in rows]})
    return out


def _breakdowns(fla, iters: int, echo: bool) -> list[dict]:
    from hybridkv.kernels.gdn import chunk_gated_delta_rule
    from hybridkv.benchmarks.gdn import breakdown

    out = []
    for shape, _, _, _, _, args, kw in _prefill_cases():
        rows = [breakdown.measure("hybridkv", lambda: chunk_gated_delta_rule(*args, **kw), iters, _median_ms)]
        if fla is not None:
            rows.append(breakdown.measure("fla", lambda: fla[0](*args, **kw), iters, _median_ms))
        if echo:
            print(breakdown.render(shape, rows), flush=True)
        out.append({"shape": shape, "rows": [asdict(r) | {"idle_us": r.idle_us} for r in rows]})
    return out


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def _ratio(theirs: float | None, ours: float) -> float | None:
    return None if theirs is None else theirs / ours


def render(header: str, rows: list[Row], tuned: dict[str, dict[str, str]]) -> str:
    """The table: every row's times, then the prefill rows' accuracy, first calls and back-to-back times, and the
    decode rows' accuracy and bandwidth."""
    out = [header]
    out.append(f"{'kind':8} {'shape':38} {'ms':>8} {'FLA ms':>8} {'x FLA':>6} {'QLA ms':>8} {'x QLA':>6} "
               f"{'FI ms':>8} {'x FI':>6} {'Mtok/s':>8} {'TFLOP/s':>8} {'GB/s':>7} {'FLA GB/s':>8} {'%copy':>6} "
               f"{'FLA %copy':>9} {'host ms':>7} {'FLA host':>8} {'QLA host':>8} {'FI host':>8}")
    for r in rows:
        out.append(f"{r.kind:8} {r.shape:38} {r.ms:8.3f} {_fmt(r.fla_ms, '8.3f')} {_fmt(r.speedup, '6.2f')} "
                   f"{_fmt(r.qla_ms, '8.3f')} {_fmt(r.speedup_vs_qla, '6.2f')} "
                   f"{_fmt(r.fi_ms, '8.3f')} {_fmt(r.speedup_vs_fi, '6.2f')} "
                   f"{r.tokens_per_s / 1e6:8.3f} {_fmt(r.tflops, '8.1f')} {r.gbps:7.0f} {_fmt(r.fla_gbps, '8.0f')} "
                   f"{_fmt(r.copy_pct, '6.1f')} {_fmt(r.fla_copy_pct, '9.1f')} "
                   f"{_fmt(r.host_ms, '7.3f')} {_fmt(r.fla_host_ms, '8.3f')} {_fmt(r.qla_host_ms, '8.3f')} "
                   f"{_fmt(r.fi_host_ms, '8.3f')}")
    prefill = [r for r in rows if r.kind == "prefill"]
    if prefill:
        out.append("")
        out.append("prefill: max |error| vs the fp32 reference (output; final state), first call s (compiles "
                   "included), ms of 20 calls back to back / 20; hybridkv / FLA / FlashQLA / FlashInfer")
        out.append(f"{'shape':38} {'output error':>35} {'state error':>35} {'first call s':>27} "
                   f"{'b2b ms':>31} {'b2b x FLA':>9} {'b2b x QLA':>9} {'b2b x FI':>9}")
        for r in prefill:
            o = " ".join(_fmt(x, "8.1e") for x in (r.err, r.fla_err, r.qla_err, r.fi_err))
            s = " ".join(_fmt(x, "8.1e") for x in (r.state_err, r.fla_state_err, r.qla_state_err, r.fi_state_err))
            f = " ".join(_fmt(x, "6.1f") for x in (r.first_call_s, r.fla_first_call_s, r.qla_first_call_s,
                                                    r.fi_first_call_s))
            b = " ".join(_fmt(x, "7.3f") for x in (r.b2b_ms, r.fla_b2b_ms, r.qla_b2b_ms, r.fi_b2b_ms))
            x_fla, x_qla, x_fi = (_fmt(None if r.b2b_ms is None else _ratio(theirs, r.b2b_ms), "9.2f")
                                  for theirs in (r.fla_b2b_ms, r.qla_b2b_ms, r.fi_b2b_ms))
            out.append(f"{r.shape:38} {o:>35} {s:>35} {f:>27} {b:>31} {x_fla} {x_qla} {x_fi}")
        for r in prefill:
            out.extend(f"  {r.shape}: {note}" for note in r.notes)
    decode = [r for r in rows if r.kind == "decode"]
    if any(r.err is not None for r in decode):
        out.append("")
        out.append("decode: max |error| vs the fp32 reference (output; the pool's updated slots), % of copy bandwidth "
                   "(8 GB), % of a copy of the same bytes, and % of copy bandwidth timed as the decode tuner times "
                   "(one call from a clean L2, charged with the write-back it leaves); hybridkv / FlashInfer; "
                   "hybridkv's first call s (its compiles and tuning)")
        out.append(f"{'shape':38} {'output error':>17} {'state error':>17} {'%copy':>13} {'%same-size copy':>15} "
                   f"{'%copy charged':>13} {'first s':>7}")
        for r in decode:
            o = " ".join(_fmt(x, "8.1e") for x in (r.err, r.fi_err))
            s = " ".join(_fmt(x, "8.1e") for x in (r.state_err, r.fi_state_err))
            c = " ".join(_fmt(x, "6.1f") for x in (r.copy_pct, r.fi_copy_pct))
            c2 = " ".join(_fmt(x, "6.1f") for x in (r.copy_same_pct, r.fi_copy_same_pct))
            c3 = " ".join(_fmt(x, "6.1f") for x in (r.charged_pct, r.fi_charged_pct))
            out.append(f"{r.shape:38} {o:>17} {s:>17} {c:>13} {c2:>15} {c3:>13} {_fmt(r.first_call_s, '7.1f')}")
        for r in decode:
            out.extend(f"  {r.shape}: {note}" for note in r.notes)
    for name, picks in tuned.items():
        out.append(f"{name}: " + "; ".join(f"{key} -> {cfg}" for key, cfg in picks.items()))
    return "\n".join(out)


def to_json(*, device: str, copy_gbps: float | None, fla: baselines.Loaded | None, qla: baselines.Loaded | None,
            fi: baselines.Loaded | None, rows: list[Row], tuned: dict[str, dict[str, str]], first_calls: str,
            fi_decode: baselines.Loaded | None = None) -> dict:
    return {"device": device, "copy_gbps": copy_gbps,
            "fla": fla is not None and fla.fn is not None, "fla_note": None if fla is None else fla.note,
            "flash_qla": qla is not None and qla.fn is not None, "flash_qla_note": None if qla is None else qla.note,
            "flashinfer": fi is not None and fi.fn is not None, "flashinfer_note": None if fi is None else fi.note,
            "flashinfer_decode": fi_decode is not None and fi_decode.fn is not None,
            "flashinfer_decode_note": None if fi_decode is None else fi_decode.note,
            "first_calls": first_calls,
            "rows": [asdict(r) | {"speedup_vs_fla": r.speedup, "speedup_vs_qla": r.speedup_vs_qla,
                                  "speedup_vs_fi": r.speedup_vs_fi} for r in rows],
            "tuned": tuned}


def _status(loaded: baselines.Loaded | None, skipped: str) -> str:
    if loaded is None:
        return skipped
    return loaded.note if loaded.fn is not None else f"none ({loaded.note})"


def run(args: argparse.Namespace) -> int:
    if args.iters < 1:
        raise ValueError(f"--iters must be >= 1, got {args.iters}")
    if args.warm_jobs is not None and args.warm_jobs < 0:
        raise ValueError(f"--warm-jobs must be >= 0, got {args.warm_jobs}")
    if args.warm_timeout <= 0:
        raise ValueError(f"--warm-timeout must be > 0 seconds, got {args.warm_timeout}")
    if args.breakdown and args.host_profile:
        raise ValueError("--breakdown and --host-profile are two separate runs (one profiles the GPU, the other the "
                         "host); pass one")
    shapes = _select(args.shape)
    import torch

    if not torch.cuda.is_available():
        # The machine, not the input: exit 1 like `hybridkv demo --device cuda`.
        raise CommandError("bench gdn: torch sees no CUDA device")
    fla = None if args.no_fla else baselines.load_fla_chunk()
    recurrent = None if args.no_fla else baselines.load_fla_recurrent()
    fla_pair = None if fla is None or fla.fn is None or recurrent is None else (fla.fn, recurrent)
    if args.breakdown:
        found = _breakdowns(fla_pair, args.iters, echo=not args.json)
        if args.json:
            print_json({"device": torch.cuda.get_device_name(), "breakdown": found}, indent=1)
        return 0
    if args.host_profile:
        found = _host_profiles(fla_pair, args.iters, echo=not args.json)
        if args.json:
            print_json({"device": torch.cuda.get_device_name(), "host_profile": found}, indent=1)
        return 0
    qla = None if args.no_qla or args.only == "decode" else baselines.load_flash_qla()
    fi = None if args.no_fi or args.only == "decode" else baselines.load_flashinfer()
    fi_decode = None if args.no_fi or args.only == "prefill" else baselines.load_flashinfer_decode()
    device = torch.cuda.get_device_name()
    copy_gbps = _copy_gbps(args.iters)
    header = (f"{device}; device copy {copy_gbps:.0f} GB/s; FLA: {_status(fla, 'skipped (--no-fla)')}; "
              f"FlashQLA: {_status(qla, 'skipped')}; FlashInfer: {_status(fi, 'skipped')}"
              + ("" if fi_decode is None else f"; FlashInfer decode: {_status(fi_decode, 'skipped')}"))
    rows: list[Row] = []
    first_calls = "in this process"

    def dump(done: list[Row]) -> None:
        if args.json_file:
            blob = to_json(device=device, copy_gbps=copy_gbps, fla=fla, qla=qla, fi=fi, rows=done,
                           tuned=_tuned_choices(), first_calls=first_calls, fi_decode=fi_decode)
            with open(args.json_file, "w") as f:
                json.dump(blob, f, indent=1)

    def on_row(row: Row) -> None:
        print(f"{row.shape}: hybridkv {row.ms:.3f} ms, FLA {_fmt(row.fla_ms, '.3f')}, "
              f"FlashQLA {_fmt(row.qla_ms, '.3f')}, FlashInfer {_fmt(row.fi_ms, '.3f')}", file=sys.stderr, flush=True)
        dump(rows + [row])

    if args.only in (None, "prefill"):
        jobs = min(len(shapes), os.cpu_count() or 1) if args.warm_jobs is None else args.warm_jobs
        found, first_calls = _prefill_rows(shapes, (fla, qla, fi), args.iters, jobs, args.warm_timeout, on_row)
        rows += found
    if args.only in (None, "decode"):
        rows += _decode_rows(fla_pair, args.iters, copy_gbps, None if fi_decode is None else fi_decode.fn,
                             pools=tuple(cases.Pool(p) for p in (args.pool or cases.ENGINE_POOLS)))
    tuned = _tuned_choices()
    dump(rows)
    if args.json:
        print_json(to_json(device=device, copy_gbps=copy_gbps, fla=fla, qla=qla, fi=fi, rows=rows,
                           tuned=tuned, first_calls=first_calls, fi_decode=fi_decode), indent=1)
        return 0
    print(render(header + f"; first calls {first_calls}", rows, tuned))
    return 0


def _tuned_choices() -> dict[str, dict[str, str]]:
    """What each self-tuning kernel settled on in this run, by its tuning key (the table's numbers
    are with these)."""
    import sys

    out = {}
    chunk = sys.modules.get("hybridkv.kernels.gdn.chunk")
    if chunk is not None:
        out["chunk state (H, HV, log2 work, K, V; BV, warps, stages)"] = {
            str(key): f"BV={cfg.kwargs['BV']} warps={cfg.num_warps} stages={cfg.num_stages}"
            for key, cfg in chunk._chunk_state_tuned.cache.items()}
    recurrent = sys.modules.get("hybridkv.kernels.gdn.decode")
    if recurrent is not None:
        out["decode (kernel, config)"] = {str(key): str(cfg) for key, cfg in recurrent.decode_choices().items()}
    return out
