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
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import math
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field

from hybridkv.kernels.gdn import baselines


@dataclass(frozen=True, kw_only=True)
class PrefillShape:
    model: str
    H: int
    HV: int
    lens: tuple[int, ...]
    batched: bool = False  # [B, T] of equal sequences; else varlen (B = 1 with cu_seqlens) unless one sequence

    @property
    def label(self) -> str:
        n = len(self.lens)
        if self.batched:
            cut = f"{n}x{self.lens[0]}"
        elif n == 1:
            cut = f"1x{self.lens[0]}"
        elif len(set(self.lens)) == 1:
            cut = f"{n}x{self.lens[0]} varlen"
        else:
            cut = "varlen " + ",".join(map(str, self.lens))
        return f"{self.model} H={self.H} HV={self.HV} {cut}"


# Issue 23's table (FlashQLA's published H200 shapes and the batch/varlen regime of a prefill engine), and 397B
# 16x2048 varlen, which the README's table also has.
PREFILL_SHAPES = (
    PrefillShape(model="397B", H=16, HV=64, lens=(8192,)),
    PrefillShape(model="397B", H=16, HV=64, lens=(8192,) * 4, batched=True),
    PrefillShape(model="397B", H=16, HV=64, lens=(32768,)),
    PrefillShape(model="397B TP8", H=2, HV=8, lens=(8192,)),
    PrefillShape(model="397B", H=16, HV=64, lens=(2048,) * 16),
    PrefillShape(model="35B", H=16, HV=32, lens=(8192,)),
    PrefillShape(model="35B", H=16, HV=32, lens=(8192,) * 4, batched=True),
    PrefillShape(model="35B", H=16, HV=32, lens=(2048,) * 16),
    PrefillShape(model="35B", H=16, HV=32, lens=(5000, 1237, 1955, 3)),
)
DECODE_SHAPES = (("35B", 16, 32), ("397B", 16, 64))
D = 128
CHUNK = 64
DEVICE = "cuda"  # where the prefill inputs are made (tests run the bench's bookkeeping on the CPU)
B2B_CALLS = 20
B2B_ROUNDS = 3
IMPLS = ("hybridkv", "fla", "flash_qla", "flashinfer")
# Column name of each implementation in the table.
TITLES = {"hybridkv": "hybridkv", "fla": "FLA", "flash_qla": "FlashQLA", "flashinfer": "FlashInfer"}
# Compiles of these are cached on disk, so parallel warm-up processes take them out of the timing process.
DISK_CACHED = ("hybridkv", "fla", "flash_qla")


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
    host_ms: float | None = None  # host time to queue one call (hidden behind the spin in `ms`)
    fla_host_ms: float | None = None
    qla_ms: float | None = None  # FlashQLA (prefill only)
    qla_host_ms: float | None = None
    fi_ms: float | None = None  # FlashInfer (prefill only)
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


def register(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print JSON rows instead of a table")
    parser.add_argument("--json-file", default=None, metavar="PATH",
                        help="also write the JSON there, rewritten after each prefill shape (a run cut short "
                             "keeps the shapes it finished), and print the table")
    parser.add_argument("--iters", type=int, default=20, help="timed calls per measurement (median)")
    parser.add_argument("--no-fla", action="store_true", help="skip the FLA baseline")
    parser.add_argument("--no-qla", action="store_true", help="skip FlashQLA even when flash_qla imports")
    parser.add_argument("--no-fi", action="store_true", help="skip FlashInfer even when flashinfer imports")
    parser.add_argument("--only", choices=("prefill", "decode"), default=None)
    parser.add_argument("--shape", action="append", default=None, metavar="TEXT",
                        help="prefill shapes whose label contains TEXT (repeatable; default: all)")
    parser.add_argument("--warm-jobs", type=int, default=None, metavar="N",
                        help="with FlashQLA: first calls (compiles) of the prefill shapes in N parallel processes "
                             "before timing (default: one per shape, at most the CPU count; 0: in this process)")
    parser.add_argument("--warm-timeout", type=float, default=240.0, metavar="S",
                        help="with FlashQLA: seconds each warm-up process may take; a shape whose warm-up did not "
                             "finish is measured without FlashQLA")
    parser.add_argument("--breakdown", action="store_true",
                        help="prefill: per-kernel device time and idle time inside each call (torch.profiler), "
                             "for hybridkv and FLA")
    parser.set_defaults(handler=run)


@functools.cache
def _ms_per_mcycle() -> float:
    """GPU time of torch.cuda._sleep(1_000_000), to size the spin that hides host launch cost."""
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(1_000_000)
    start.record()
    torch.cuda._sleep(1_000_000)
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def _host_ms(fn) -> float:
    """Host time to queue one call (median of 5, the GPU drained before each)."""
    import torch

    times = []
    for _ in range(5):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    torch.cuda.synchronize()
    return sorted(times)[2]


def _spin_cycles(host_ms: float) -> int:
    # The spin outlasts twice the host's queueing time: a spin shorter than the host time (FLA's for one
    # 8192-token sequence is over 0.5 ms) would leave the event time measuring Python, not the GPU.
    return 1_000_000 * max(1, math.ceil((2 * host_ms + 0.2) / _ms_per_mcycle()))


def _event_ms(fn, spin: int) -> float:
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(spin)  # the host queues fn() while the GPU spins
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def _timed(fn, iters: int) -> tuple[float, float]:
    """(device ms, host ms) of one call: the median event time behind the spin, and `_host_ms`."""
    for _ in range(3):
        fn()
    host = _host_ms(fn)
    spin = _spin_cycles(host)
    times = sorted(_event_ms(fn, spin) for _ in range(iters))
    return times[len(times) // 2], host


def _median_ms(fn, iters: int) -> float:
    return _timed(fn, iters)[0]


def _b2b_ms(fn) -> float:
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(B2B_CALLS):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / B2B_CALLS


def _rotations(names: list[str], rounds: int) -> Iterator[list[str]]:
    """The call order of each round: every name once, the first place passed on, so none always goes first."""
    for i in range(rounds):
        j = i % len(names)
        yield names[j:] + names[:j]


@dataclass(frozen=True, kw_only=True)
class Timing:
    ms: float
    host_ms: float
    b2b_ms: float


def _interleaved(fns: dict[str, Callable[[], object]], iters: int) -> dict[str, Timing]:
    """`_timed` and `_b2b_ms` of each function, their calls interleaved round by round."""
    if not fns:
        return {}
    spins, hosts = {}, {}
    for name, fn in fns.items():
        for _ in range(3):
            fn()
        hosts[name] = _host_ms(fn)
        spins[name] = _spin_cycles(hosts[name])
    names = list(fns)
    times: dict[str, list[float]] = {name: [] for name in names}
    for order in _rotations(names, iters):
        for name in order:
            times[name].append(_event_ms(fns[name], spins[name]))
    b2b: dict[str, list[float]] = {name: [] for name in names}
    for order in _rotations(names, B2B_ROUNDS):
        for name in order:
            b2b[name].append(_b2b_ms(fns[name]))
    return {name: Timing(ms=_median(times[name]), host_ms=hosts[name], b2b_ms=_median(b2b[name])) for name in names}


def _median(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[len(xs) // 2]


def _copy_gbps(iters: int) -> float:
    import torch

    src = torch.empty(2**30, dtype=torch.float32, device="cuda")
    dst = torch.empty_like(src)
    ms = _median_ms(lambda: dst.copy_(src), iters)
    return 2 * src.numel() * 4 / ms / 1e6


def _load_fla(skip: bool):
    """(FLA's chunked prefill on its Triton path, its fused recurrent step), or None (the probes use this too)."""
    if skip:
        return None
    chunk = baselines.load_fla_chunk()
    recurrent = baselines.load_fla_recurrent()
    if chunk.fn is None or recurrent is None:
        return None
    return chunk.fn, recurrent


def _select(patterns: list[str] | None) -> tuple[tuple[int, PrefillShape], ...]:
    picked = tuple((i, s) for i, s in enumerate(PREFILL_SHAPES)
                   if patterns is None or any(p in s.label for p in patterns))
    if not picked:
        labels = "; ".join(s.label for s in PREFILL_SHAPES)
        raise ValueError(f"--shape {patterns} matches no prefill shape; the shapes are: {labels}")
    return picked


def _inputs(index: int):
    """The inputs of PREFILL_SHAPES[index], on the GPU, the same in every process: (B, T, args, kwargs)."""
    import torch
    import torch.nn.functional as F

    shape = PREFILL_SHAPES[index]
    gen = torch.Generator(device=DEVICE).manual_seed(1000 + index)
    lens = shape.lens
    B, T = (len(lens), lens[0]) if shape.batched else (1, sum(lens))

    def randn(*size, dtype=torch.bfloat16):
        return torch.randn(*size, device=DEVICE, generator=gen).to(dtype)

    q, k = randn(B, T, shape.H, D), randn(B, T, shape.H, D)
    v = randn(B, T, shape.HV, D)
    g = F.logsigmoid(randn(B, T, shape.HV, dtype=torch.float32) + 3.0)
    beta = torch.rand(B, T, shape.HV, device=DEVICE, generator=gen)
    cu = None
    if not shape.batched and len(lens) > 1:
        cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device=DEVICE)
    kw = dict(output_final_state=True, cu_seqlens=cu, use_qk_l2norm_in_kernel=True)
    return B, T, (q, k, v, g, beta), kw


def _prefill_cases(shapes: tuple[tuple[int, PrefillShape], ...] | None = None):
    """Each prefill shape's inputs, made on the GPU one shape at a time: (label, B, T, H, HV, args, kwargs)."""
    for index, shape in shapes or tuple(enumerate(PREFILL_SHAPES)):
        B, T, args, kw = _inputs(index)
        yield shape.label, B, T, shape.H, shape.HV, args, kw


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

    from hybridkv.kernels.gdn import reference

    q, k, v, g, beta = args
    with _fp32_matmuls(), torch.no_grad():
        # v in fp32 makes the reference return its fp32 output, not one rounded to bf16.
        return reference.chunk_reference(q, k, v.float(), g, beta, D**-0.5, None, True, kw["cu_seqlens"],
                                         kw["use_qk_l2norm_in_kernel"])


def _max_err(x, ref) -> float:
    return float((x.float() - ref).abs().max().item())


def _impls(*loaded_baselines: baselines.Loaded | None) -> dict[str, Callable]:
    from hybridkv.kernels.gdn import chunk_gated_delta_rule

    out: dict[str, Callable] = {"hybridkv": chunk_gated_delta_rule}
    for loaded in loaded_baselines:
        if loaded is not None and loaded.fn is not None:
            out[loaded.name] = loaded.fn
    return out


def _first_calls(impls: dict[str, Callable], args, kw) -> tuple[dict[str, float], dict[str, tuple], dict[str, str]]:
    """Each implementation's first call: (seconds, (o, final state), why it failed). hybridkv's failure raises
    (a bug here); a baseline's is a note and an empty column."""
    import torch

    seconds, outputs, failed = {}, {}, {}
    for name, fn in impls.items():
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        try:
            outputs[name] = fn(*args, **kw)
            torch.cuda.synchronize()
        except Exception as exc:  # noqa: BLE001 - a baseline that cannot run this shape leaves its column empty
            if name == "hybridkv":
                raise
            failed[name] = f"{TITLES[name]}: {type(exc).__name__}: {str(exc)[:300]}"
            continue
        seconds[name] = time.perf_counter() - t0
    return seconds, outputs, failed


def _warm_main(argv: list[str]) -> int:
    """A warm-up process: the first call of each named implementation on one prefill shape; prints one JSON line."""
    index, names = int(argv[0]), argv[1:]
    loaded = {"fla": baselines.load_fla_chunk() if "fla" in names else None,
              "flash_qla": baselines.load_flash_qla() if "flash_qla" in names else None,
              "flashinfer": baselines.load_flashinfer() if "flashinfer" in names else None}
    impls = {name: fn for name, fn in _impls(*loaded.values()).items() if name in names}
    _, _, args, kw = _inputs(index)
    seconds, _, failed = _first_calls(impls, args, kw)
    failed |= {name: f"{TITLES[name]}: {loaded[name].note}" for name in names
               if name not in impls and loaded.get(name) is not None}
    print(json.dumps({"index": index, "first_call_s": seconds, "failed": failed}), flush=True)
    return 0


@dataclass(frozen=True, kw_only=True)
class Warmed:
    first_call_s: dict[tuple[int, str], float] = field(default_factory=dict)
    failed: dict[tuple[int, str], str] = field(default_factory=dict)  # a warm-up that did not finish


def _warm_parallel(shapes, names: list[str], jobs: int, timeout: float) -> Warmed:
    """The first calls of every shape in `jobs` processes at once: TileLang's JIT compiles on the CPU, one shape
    class at a time in a process, and both its disk cache and Triton's take concurrent writers."""
    def one(index: int) -> tuple[int, dict | None, str]:
        # Same process group as this one: a `timeout` around the bench ends the warm-ups with it.
        proc = subprocess.Popen([sys.executable, "-m", "hybridkv.kernels.gdn.bench", str(index), *names],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            return index, None, f"warm-up did not finish in {timeout:.0f} s"
        found = [line for line in out.splitlines() if line.startswith('{"index"')]
        if proc.returncode != 0 or not found:
            tail = " | ".join(err.strip().splitlines()[-3:])
            return index, None, f"warm-up exited {proc.returncode}: {tail[:300]}"
        return index, json.loads(found[-1]), ""

    warmed = Warmed()
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        for index, found, why in pool.map(one, [i for i, _ in shapes]):
            if found is None:
                # The TileLang compile is what takes long; the Triton ones take seconds in the timing process.
                warmed.failed[(index, "flash_qla")] = f"{TITLES['flash_qla']}: {why}"
                continue
            warmed.first_call_s.update({(index, name): s for name, s in found["first_call_s"].items()})
            warmed.failed.update({(index, name): why for name, why in found["failed"].items()})
    return warmed


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


def _breakdowns(fla, iters: int, echo: bool) -> list[dict]:
    from hybridkv.kernels.gdn import breakdown, chunk_gated_delta_rule

    out = []
    for shape, _, _, _, _, args, kw in _prefill_cases():
        rows = [breakdown.measure("hybridkv", lambda: chunk_gated_delta_rule(*args, **kw), iters, _median_ms)]
        if fla is not None:
            rows.append(breakdown.measure("fla", lambda: fla[0](*args, **kw), iters, _median_ms))
        if echo:
            print(breakdown.render(shape, rows), flush=True)
        out.append({"shape": shape, "rows": [asdict(r) | {"idle_us": r.idle_us} for r in rows]})
    return out


def _decode_rows(fla, iters: int, copy_gbps: float) -> list[Row]:
    import torch

    from hybridkv.kernels.gdn import gated_delta_rule_decode

    N = 256
    rows = []
    for model, H, HV in DECODE_SHAPES:
        for dtype in (torch.float32, torch.bfloat16):
            q = torch.randn(N, H, D, device="cuda", dtype=torch.bfloat16)
            k = torch.randn(N, H, D, device="cuda", dtype=torch.bfloat16)
            v = torch.randn(N, HV, D, device="cuda", dtype=torch.bfloat16)
            a, b = torch.randn(N, HV, device="cuda"), torch.randn(N, HV, device="cuda")
            A_log, dt_bias = torch.randn(HV, device="cuda") * 0.5, torch.randn(HV, device="cuda") * 0.5
            pool = (torch.randn(2 * N, HV, D, D, device="cuda") * 0.1).to(dtype)
            idx = torch.randperm(2 * N, device="cuda")[:N]
            ours = _median_ms(lambda: gated_delta_rule_decode(q, k, v, a, b, A_log, dt_bias, pool, idx), iters)
            elt = pool.element_size()
            state_bytes = N * HV * D * D * 2 * elt
            theirs = fla_bytes = None
            if fla is not None:
                h0 = (torch.randn(N, HV, D, D, device="cuda") * 0.1).to(dtype)
                fkw = dict(initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True,
                           use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias,
                           use_beta_sigmoid_in_kernel=True)
                # FLA takes [B, T, ...]: one token for each of the N sequences.
                step = (q[:, None], k[:, None], v[:, None])
                theirs = _median_ms(lambda: fla[1](*step, g=a[:, None], beta=b[:, None], **fkw), iters)
                fla_bytes = N * HV * D * D * (elt + 4)
            gbps = state_bytes / ours / 1e6
            fla_gbps = None if theirs is None else fla_bytes / theirs / 1e6
            shape = f"{model} H={H} HV={HV} B={N} {str(dtype).removeprefix('torch.')} state"
            rows.append(Row(kind="decode", shape=shape, ms=ours, fla_ms=theirs, tokens_per_s=N / ours * 1e3,
                            tflops=None, gbps=gbps, fla_gbps=fla_gbps, copy_pct=100 * gbps / copy_gbps,
                            fla_copy_pct=None if fla_gbps is None else 100 * fla_gbps / copy_gbps))
            del pool
    return rows



def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def _ratio(theirs: float | None, ours: float) -> float | None:
    return None if theirs is None else theirs / ours


def render(header: str, rows: list[Row], tuned: dict[str, dict[str, str]]) -> str:
    """The table: every row's times, then the prefill rows' accuracy, first calls and back-to-back times."""
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
    for name, picks in tuned.items():
        out.append(f"{name}: " + "; ".join(f"{key} -> {cfg}" for key, cfg in picks.items()))
    return "\n".join(out)


def to_json(*, device: str, copy_gbps: float | None, fla: baselines.Loaded | None, qla: baselines.Loaded | None,
            fi: baselines.Loaded | None, rows: list[Row], tuned: dict[str, dict[str, str]], first_calls: str) -> dict:
    return {"device": device, "copy_gbps": copy_gbps,
            "fla": fla is not None and fla.fn is not None, "fla_note": None if fla is None else fla.note,
            "flash_qla": qla is not None and qla.fn is not None, "flash_qla_note": None if qla is None else qla.note,
            "flashinfer": fi is not None and fi.fn is not None, "flashinfer_note": None if fi is None else fi.note,
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
    shapes = _select(args.shape)
    import torch

    if not torch.cuda.is_available():
        raise ValueError("bench gdn needs a CUDA device")
    fla = None if args.no_fla else baselines.load_fla_chunk()
    recurrent = None if args.no_fla else baselines.load_fla_recurrent()
    fla_pair = None if fla is None or fla.fn is None or recurrent is None else (fla.fn, recurrent)
    if args.breakdown:
        found = _breakdowns(fla_pair, args.iters, echo=not args.json)
        if args.json:
            print(json.dumps({"device": torch.cuda.get_device_name(), "breakdown": found}, indent=1))
        return 0
    qla = None if args.no_qla or args.only == "decode" else baselines.load_flash_qla()
    fi = None if args.no_fi or args.only == "decode" else baselines.load_flashinfer()
    device = torch.cuda.get_device_name()
    copy_gbps = _copy_gbps(args.iters)
    header = (f"{device}; device copy {copy_gbps:.0f} GB/s; FLA: {_status(fla, 'skipped (--no-fla)')}; "
              f"FlashQLA: {_status(qla, 'skipped')}; FlashInfer: {_status(fi, 'skipped')}")
    rows: list[Row] = []
    first_calls = "in this process"

    def dump(done: list[Row]) -> None:
        if args.json_file:
            blob = to_json(device=device, copy_gbps=copy_gbps, fla=fla, qla=qla, fi=fi, rows=done,
                           tuned=_tuned_choices(), first_calls=first_calls)
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
        rows += _decode_rows(fla_pair, args.iters, copy_gbps)
    tuned = _tuned_choices()
    dump(rows)
    if args.json:
        print(json.dumps(to_json(device=device, copy_gbps=copy_gbps, fla=fla, qla=qla, fi=fi, rows=rows,
                                 tuned=tuned, first_calls=first_calls), indent=1))
        return 0
    print(render(header + f"; first calls {first_calls}", rows, tuned))
    return 0


def _tuned_choices() -> dict[str, dict[str, str]]:
    """What each self-tuning kernel settled on in this run, by its tuning key (the table's numbers
    are with these)."""
    import sys

    out = {}
    chunk = sys.modules.get("hybridkv.kernels.gdn.triton_chunk")
    if chunk is not None:
        out["chunk state (H, HV, log2 work, K, V; BV, warps, stages)"] = {
            str(key): f"BV={cfg.kwargs['BV']} warps={cfg.num_warps} stages={cfg.num_stages}"
            for key, cfg in chunk._chunk_state_tuned.cache.items()}
    recurrent = sys.modules.get("hybridkv.kernels.gdn.triton_recurrent")
    if recurrent is not None:
        out["decode (BV, warps)"] = {str(key): str(cfg) for key, cfg in recurrent.decode_choices().items()}
    return out


if __name__ == "__main__":  # a warm-up process of `_warm_parallel`
    sys.exit(_warm_main(sys.argv[1:]))
