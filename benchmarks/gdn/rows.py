"""The rows of `hybridkv bench gdn`: each prefill shape timed and checked against the fp32 reference, and decode.

`_prefill_rows` starts the warm-up processes (with FlashQLA), then `_prefill_row` for each shape: the first calls, each
output and final state against `_reference` (`reference.chunk_reference` under `_fp32_matmuls`, TF32 off), the
interleaved timings, and the FLOP and byte counts, as one `Row`. `_decode_rows` times hybridkv's decode step, FLA's
fused recurrent step and FlashInfer's pool decode on a slot pool of each state dtype, checking hybridkv's and
FlashInfer's against the reference. `_load_fla` is how the probes in benchmarks/gdn get the (chunked prefill, recurrent
step) FLA pair that `_decode_rows` and the `--breakdown` mode take.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from hybridkv.benchmarks.gdn import baselines
from hybridkv.benchmarks.gdn import cases as bench_cases
from hybridkv.benchmarks.gdn.cases import CHUNK, D, PrefillShape, _inputs
from hybridkv.benchmarks.gdn.timing import (Timing, _charged_ms, _copy_gbps, _flush_bytes, _interleaved,
                                               _median_ms)
from hybridkv.benchmarks.gdn.warmup import DISK_CACHED, IMPLS, TITLES, Warmed, _first_calls, _impls, _warm_parallel


@dataclass(frozen=True, kw_only=True)
class Row:
    kind: str
    shape: str
    ms: float
    fla_ms: float | None
    tokens_per_s: float
    tflops: float | None
    gbps: float
    fla_gbps: float | None
    copy_pct: float | None
    fla_copy_pct: float | None
    fi_gbps: float | None = None  # decode: FlashInfer's state traffic
    fi_copy_pct: float | None = None
    # decode: % of a copy of the same bytes (the call's slots into a buffer of their size), timed as a call is; the
    # 8 GB copy of `copy_pct` has no launch and no ramp for a small pool to pay
    copy_same_pct: float | None = None
    fi_copy_same_pct: float | None = None
    # decode: % of copy bandwidth timed as the decode tuner times (`timing._charged_ms`: from a clean L2, charged
    # with the write-back it leaves), not back to back on one pool
    charged_pct: float | None = None
    fi_charged_pct: float | None = None
    host_ms: float | None = None  # host time to queue one call (hidden behind the spin in `ms`)
    fla_host_ms: float | None = None
    qla_ms: float | None = None  # FlashQLA (prefill only)
    qla_host_ms: float | None = None
    fi_ms: float | None = None  # FlashInfer (its decode for decode rows)
    fi_host_ms: float | None = None
    b2b_ms: float | None = None  # B2B_CALLS calls back to back / B2B_CALLS
    fla_b2b_ms: float | None = None
    qla_b2b_ms: float | None = None
    fi_b2b_ms: float | None = None
    err: float | None = None  # max |o - fp32 reference|
    fla_err: float | None = None
    qla_err: float | None = None
    fi_err: float | None = None
    state_err: float | None = None  # max |final state - fp32 reference|
    fla_state_err: float | None = None
    qla_state_err: float | None = None
    fi_state_err: float | None = None
    first_call_s: float | None = None  # the first call, compiles included
    fla_first_call_s: float | None = None
    qla_first_call_s: float | None = None
    fi_first_call_s: float | None = None
    notes: tuple[str, ...] = ()  # why a column of this row is empty

    @property
    def speedup(self) -> float | None:
        return None if self.fla_ms is None else self.fla_ms / self.ms

    @property
    def speedup_vs_qla(self) -> float | None:
        return None if self.qla_ms is None else self.qla_ms / self.ms

    @property
    def speedup_vs_fi(self) -> float | None:
        return None if self.fi_ms is None else self.fi_ms / self.ms


def _load_fla(skip: bool):
    """(FLA's chunked prefill on its Triton path, its fused recurrent step), or None (the probes use this too)."""
    if skip:
        return None
    chunk = baselines.load_fla_chunk()
    recurrent = baselines.load_fla_recurrent()
    if chunk.fn is None or recurrent is None:
        return None
    return chunk.fn, recurrent


@contextlib.contextmanager
def _fp32_matmuls() -> Iterator[None]:
    """TF32 off (the reference must be fp32 whatever a loaded package set)."""
    import torch

    old = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(old)


def _reference(args, kw):
    import torch

    from hybridkv.kernels.gdn import naive as reference

    q, k, v, g, beta = args
    with _fp32_matmuls(), torch.no_grad():
        # v in fp32 makes the reference return its fp32 output, not one rounded to bf16.
        return reference.chunk_reference(q, k, v.float(), g, beta, D**-0.5, None, True, kw["cu_seqlens"],
                                         kw["use_qk_l2norm_in_kernel"])


def _max_err(x, ref) -> float:
    return float((x.float() - ref).abs().max().item())


def _prefill_row(shape: PrefillShape, index: int, impls: dict[str, Callable], warmed: Warmed, iters: int) -> Row:
    import torch

    B, T, args, kw = _inputs(index)
    notes = [why for (i, name), why in warmed.failed.items() if i == index and name != "hybridkv"]
    # A baseline whose warm-up did not finish would compile here, past the run's time budget.
    impls = {name: fn for name, fn in impls.items() if name == "hybridkv" or (index, name) not in warmed.failed}
    seconds, outputs, failed = _first_calls(impls, args, kw)
    notes += failed.values()
    ref_o, ref_state = _reference(args, kw)
    errs = {name: (_max_err(o, ref_o), _max_err(state, ref_state)) for name, (o, state) in outputs.items()}
    del outputs, ref_o, ref_state
    torch.cuda.empty_cache()

    def call(fn):
        return lambda: fn(*args, **kw)

    timed = _interleaved({name: call(impls[name]) for name in impls if name not in failed}, iters)
    first = {name: warmed.first_call_s.get((index, name), s) for name, s in seconds.items()}
    tokens = B * T
    flop = tokens * shape.HV * (6 * D * D + 8 * CHUNK * D)
    nbytes = tokens * (2 * 2 * shape.H * D + 2 * 2 * shape.HV * D + 8 * shape.HV)
    ours, fla, qla, fi = (timed.get(name) for name in IMPLS)

    def err(name: str, which: int) -> float | None:
        return errs[name][which] if name in errs else None

    return Row(kind="prefill", shape=shape.label, ms=ours.ms, fla_ms=_pick(fla, "ms"),
               tokens_per_s=tokens / ours.ms * 1e3, tflops=flop / ours.ms / 1e9, gbps=nbytes / ours.ms / 1e6,
               fla_gbps=None if fla is None else nbytes / fla.ms / 1e6, copy_pct=None, fla_copy_pct=None,
               host_ms=ours.host_ms, fla_host_ms=_pick(fla, "host_ms"), qla_ms=_pick(qla, "ms"),
               qla_host_ms=_pick(qla, "host_ms"), fi_ms=_pick(fi, "ms"), fi_host_ms=_pick(fi, "host_ms"),
               b2b_ms=ours.b2b_ms, fla_b2b_ms=_pick(fla, "b2b_ms"), qla_b2b_ms=_pick(qla, "b2b_ms"),
               fi_b2b_ms=_pick(fi, "b2b_ms"), err=err("hybridkv", 0), fla_err=err("fla", 0),
               qla_err=err("flash_qla", 0), fi_err=err("flashinfer", 0), state_err=err("hybridkv", 1),
               fla_state_err=err("fla", 1), qla_state_err=err("flash_qla", 1), fi_state_err=err("flashinfer", 1),
               first_call_s=first.get("hybridkv"), fla_first_call_s=first.get("fla"),
               qla_first_call_s=first.get("flash_qla"), fi_first_call_s=first.get("flashinfer"),
               notes=tuple(notes))


def _pick(timing: Timing | None, what: str) -> float | None:
    return None if timing is None else getattr(timing, what)


def _prefill_rows(shapes, loaded: tuple[baselines.Loaded | None, ...], iters: int, warm_jobs: int,
                  warm_timeout: float, on_row: Callable[[Row], None]) -> tuple[list[Row], str]:
    """The rows, and where their first calls ran."""
    impls = _impls(*loaded)
    warmed, where = Warmed(), "in this process"
    if "flash_qla" in impls and warm_jobs > 0:
        t0 = time.perf_counter()
        warmed = _warm_parallel(shapes, [name for name in impls if name in DISK_CACHED], warm_jobs, warm_timeout)
        where = (f"in {min(warm_jobs, len(shapes))} parallel warm-up processes, "
                 f"{time.perf_counter() - t0:.0f} s for all")
        if "flashinfer" in impls:
            where += f" ({TITLES['flashinfer']}'s in this process)"
        print(f"warm-up: {where}", file=sys.stderr, flush=True)
    rows = []
    for index, shape in shapes:
        rows.append(_prefill_row(shape, index, impls, warmed, iters))
        on_row(rows[-1])
    return rows, where


def _pct_of_copy(nbytes: int, ms: float, copy_gbps: float) -> float | None:
    """% of copy bandwidth of ``nbytes`` moved in ``ms``; None where ``ms`` is no time (a charged time is a difference
    of two medians: on a step shorter than that difference's noise it can come out at or below zero)."""
    return 100 * nbytes / ms / 1e6 / copy_gbps if ms > 0 else None


def _decode_rows(fla, iters: int, copy_gbps: float, fi=None, pools=None) -> list[Row]:
    """Each decode shape in each pool (`cases.Pool`; default the engines'): hybridkv's step, FLA's fused recurrent
    step (fla: the pair of `_load_fla`; it takes no pool, so it runs on the live rows) and FlashInfer's pool decode (fi:
    `baselines.load_flashinfer_decode()`'s callable) on the same step. hybridkv's and FlashInfer's first calls are
    checked against `naive.decode_reference` on the live rows (output, and their slots) on a copy of the pool.
    Bandwidth counts the live rows' state bytes."""
    import torch

    from hybridkv.kernels.gdn import gated_delta_rule_decode
    from hybridkv.kernels.gdn import naive as reference

    rows = []
    device = bench_cases.DEVICE  # the CPU in the tests of this bookkeeping
    pools = tuple(bench_cases.Pool(p) for p in bench_cases.ENGINE_POOLS) if pools is None else pools
    for pool_kind, (model, H, HV) in ((p, s) for p in pools for s in bench_cases.DECODE_SHAPES):
        for N, dtype in ((n, dt) for n in bench_cases.DECODE_BATCHES for dt in (torch.float32, torch.bfloat16)):
            step = bench_cases.decode_step(pool_kind, N, device)
            idx, live = step.indices, step.live
            R = idx.numel()
            q = torch.randn(R, H, D, device=device, dtype=torch.bfloat16)
            k = torch.randn(R, H, D, device=device, dtype=torch.bfloat16)
            v = torch.randn(R, HV, D, device=device, dtype=torch.bfloat16)
            # Gate inputs come out of the engine's projection in bf16, and FlashInfer takes them only so; every
            # implementation sees the same values (hybridkv's and FLA's as fp32).
            a16, b16 = torch.randn(R, HV, device=device).bfloat16(), torch.randn(R, HV, device=device).bfloat16()
            a, b = a16.float(), b16.float()
            A_log, dt_bias = torch.randn(HV, device=device) * 0.5, torch.randn(HV, device=device) * 0.5
            pool = (torch.randn(step.slots, HV, D, D, device=device) * 0.1).to(dtype)
            # FlashInfer gets the live rows' slots as int32, as vLLM's state indices are (its bf16-state kernel does
            # not compile with int64 ones); pads are hybridkv's contract, not its.
            idx32 = idx[live].to(torch.int32)
            q_l, k_l, v_l, a16_l, b16_l = (x[live] for x in (q, k, v, a16, b16))
            args = (q, k, v, a, b, A_log, dt_bias)
            live_args = tuple(x[live] for x in args[:5]) + (A_log, dt_bias)
            want_pool = pool.to(torch.float32, copy=True)  # .float() of an fp32 pool is the pool itself
            want = reference.decode_reference(*live_args, want_pool, idx[live].long(), D**-0.5, True, True).float()
            live_slots = idx[live].long()
            want_slots = want_pool[live_slots]

            def check(step_fn, gates, slots=idx, rows=live):
                trial = pool.clone()
                qkv = (q, k, v) if rows is live else (q_l, k_l, v_l)
                o = step_fn(*qkv, *gates, A_log, dt_bias, trial, slots).float()[rows]
                return ((o - want).abs().max().item(), (trial[live_slots].float() - want_slots).abs().max().item())

            # Every check before any timed call: the timed calls update the pool in place.
            # Its first call compiles and tunes (every candidate timed in this pool, once per key).
            t0 = time.perf_counter()
            err, state_err = check(gated_delta_rule_decode, (a, b))
            first_s = time.perf_counter() - t0
            fi_ms = fi_err = fi_state_err = None
            notes: tuple[str, ...] = ()
            if fi is not None:
                try:
                    fi_err, fi_state_err = check(fi, (a16_l, b16_l), idx32, slice(None))
                except Exception as exc:  # noqa: BLE001 - a baseline that cannot take a shape leaves its column empty
                    notes = (f"FlashInfer: {type(exc).__name__}: {str(exc)[:200]}",)
            ours = _median_ms(lambda: gated_delta_rule_decode(*args, pool, idx), iters)
            elt = pool.element_size()
            state_bytes = N * HV * D * D * 2 * elt
            theirs = fla_bytes = None
            if fla is not None:
                h0 = (torch.randn(N, HV, D, D, device=device) * 0.1).to(dtype)
                fkw = dict(initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True,
                           use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias,
                           use_beta_sigmoid_in_kernel=True)
                # FLA takes [B, T, ...]: one token for each of the N live sequences.
                lq, lk, lv, la, lb = live_args[:5]
                theirs = _median_ms(lambda: fla[1](lq[:, None], lk[:, None], lv[:, None], g=la[:, None],
                                                   beta=lb[:, None], **fkw), iters)
                fla_bytes = N * HV * D * D * (elt + 4)
            if fi_err is not None:
                fi_ms = _median_ms(lambda: fi(q_l, k_l, v_l, a16_l, b16_l, A_log, dt_bias, pool, idx32), iters)
            same_gbps = _copy_gbps(iters, pool[:N])  # as many bytes as the step moves
            flush = torch.empty(_flush_bytes(), dtype=torch.int8, device=device)
            charged = _charged_ms(lambda: gated_delta_rule_decode(*args, pool, idx), iters, flush)
            fi_charged = None if fi_ms is None else _charged_ms(
                lambda: fi(q_l, k_l, v_l, a16_l, b16_l, A_log, dt_bias, pool, idx32), iters, flush)
            del flush
            gbps = state_bytes / ours / 1e6
            fla_gbps = None if theirs is None else fla_bytes / theirs / 1e6
            fi_gbps = None if fi_ms is None else state_bytes / fi_ms / 1e6
            shape = f"{model} HV={HV} B={N} {str(dtype).removeprefix('torch.')} {pool_kind.value}"
            rows.append(Row(kind="decode", shape=shape, ms=ours, fla_ms=theirs, tokens_per_s=N / ours * 1e3,
                            tflops=None, gbps=gbps, fla_gbps=fla_gbps, copy_pct=100 * gbps / copy_gbps,
                            fla_copy_pct=None if fla_gbps is None else 100 * fla_gbps / copy_gbps,
                            fi_ms=fi_ms, fi_gbps=fi_gbps,
                            fi_copy_pct=None if fi_gbps is None else 100 * fi_gbps / copy_gbps,
                            copy_same_pct=100 * gbps / same_gbps,
                            charged_pct=_pct_of_copy(state_bytes, charged, copy_gbps),
                            fi_charged_pct=None if fi_charged is None else _pct_of_copy(state_bytes, fi_charged,
                                                                                        copy_gbps),
                            fi_copy_same_pct=None if fi_gbps is None else 100 * fi_gbps / same_gbps,
                            err=err, state_err=state_err, fi_err=fi_err, fi_state_err=fi_state_err, notes=notes,
                            first_call_s=first_s))
            del pool, want_pool
    return rows
