"""`hybridkv bench gdn`: hybridkv's GDN kernels side by side with FLA (fla-core) in one run.

Times are CUDA-event medians of `--iters` calls after warm-up. Each timed call is queued behind a GPU
spin longer than twice its host-side queueing time, so the host-side launch cost of either
implementation (Python checks, autotuner dispatch) is hidden as it would be in a busy stream or a CUDA
graph; host syncs still count. Prefill TFLOP/s use one count for both implementations, 6 d^2 + 8 C d
FLOP per token and value head (the fused formulation, d = 128, C = 64), so their ratio is the time
ratio. Prefill GB/s count the minimum traffic of a fused kernel (q, k, v, g, beta read once, o written
once). Decode GB/s count state bytes each implementation moves (FLA reads the initial state and writes
an fp32 final state); "% copy" divides by a device-to-device copy measured in the same run.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import time
from dataclasses import asdict, dataclass

PREFILL_SHAPES = (  # (model, H, HV, sequence lengths, batched)
    ("35B", 16, 32, (8192,), False),
    ("35B", 16, 32, (8192,) * 4, True),
    ("35B", 16, 32, (2048,) * 16, False),
    ("397B", 16, 64, (8192,), False),
    ("397B", 16, 64, (8192,) * 4, True),
    ("397B", 16, 64, (2048,) * 16, False),
)
DECODE_SHAPES = (("35B", 16, 32), ("397B", 16, 64))
D = 128
CHUNK = 64


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

    @property
    def speedup(self) -> float | None:
        return None if self.fla_ms is None else self.fla_ms / self.ms


def register(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print JSON rows instead of a table")
    parser.add_argument("--iters", type=int, default=20, help="timed calls per measurement (median)")
    parser.add_argument("--no-fla", action="store_true", help="skip the FLA baseline")
    parser.add_argument("--only", choices=("prefill", "decode"), default=None)
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


def _timed(fn, iters: int) -> tuple[float, float]:
    """(device ms, host ms) of one call: the median event time behind the spin, and `_host_ms`."""
    import torch

    for _ in range(3):
        fn()
    # The spin outlasts twice the host's queueing time: a spin shorter than the host time (FLA's for one
    # 8192-token sequence is over 0.5 ms) would leave the event time measuring Python, not the GPU.
    host = _host_ms(fn)
    spin = 1_000_000 * max(1, math.ceil((2 * host + 0.2) / _ms_per_mcycle()))
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(spin)  # the host queues fn() while the GPU spins
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    return times[len(times) // 2], host


def _median_ms(fn, iters: int) -> float:
    return _timed(fn, iters)[0]


def _copy_gbps(iters: int) -> float:
    import torch

    src = torch.empty(2**30, dtype=torch.float32, device="cuda")
    dst = torch.empty_like(src)
    ms = _median_ms(lambda: dst.copy_(src), iters)
    return 2 * src.numel() * 4 / ms / 1e6


def _load_fla(skip: bool):
    if skip:
        return None
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
    except ImportError:
        return None
    return chunk_gated_delta_rule, fused_recurrent_gated_delta_rule


def _prefill_cases():
    """Each prefill shape's inputs, made on the GPU one shape at a time: (label, B, T, H, HV, args, kwargs)."""
    import torch
    import torch.nn.functional as F

    for model, H, HV, lens, batched in PREFILL_SHAPES:
        B, T = (len(lens), lens[0]) if batched else (1, sum(lens))
        q = torch.randn(B, T, H, D, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(B, T, H, D, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(B, T, HV, D, device="cuda", dtype=torch.bfloat16)
        g = F.logsigmoid(torch.randn(B, T, HV, device="cuda") + 3.0)
        beta = torch.rand(B, T, HV, device="cuda")
        cu = None if batched else torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device="cuda")
        kw = dict(output_final_state=True, cu_seqlens=cu, use_qk_l2norm_in_kernel=True)
        label = f"{model} H={H} HV={HV} " + (f"{B}x{T}" if batched else f"{len(lens)}x{lens[0]} varlen"
                                              if len(lens) > 1 else f"1x{T}")
        yield label, B, T, H, HV, (q, k, v, g, beta), kw


def _prefill_rows(fla, iters: int) -> list[Row]:
    from hybridkv.kernels.gdn import chunk_gated_delta_rule

    rows = []
    for shape, B, T, H, HV, args, kw in _prefill_cases():
        ms, host = _timed(lambda: chunk_gated_delta_rule(*args, **kw), iters)
        theirs, fla_host = (None, None) if fla is None else _timed(lambda: fla[0](*args, **kw), iters)
        tokens = B * T
        flop = tokens * HV * (6 * D * D + 8 * CHUNK * D)
        nbytes = tokens * (2 * 2 * H * D + 2 * 2 * HV * D + 8 * HV)
        rows.append(Row(kind="prefill", shape=shape, ms=ms, fla_ms=theirs, tokens_per_s=tokens / ms * 1e3,
                        tflops=flop / ms / 1e9, gbps=nbytes / ms / 1e6,
                        fla_gbps=None if theirs is None else nbytes / theirs / 1e6, copy_pct=None,
                        fla_copy_pct=None, host_ms=host, fla_host_ms=fla_host))
    return rows


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


def run(args: argparse.Namespace) -> int:
    if args.iters < 1:
        raise ValueError(f"--iters must be >= 1, got {args.iters}")
    import torch

    if not torch.cuda.is_available():
        raise ValueError("bench gdn needs a CUDA device")
    fla = _load_fla(args.no_fla)
    if args.breakdown:
        found = _breakdowns(fla, args.iters, echo=not args.json)
        if args.json:
            print(json.dumps({"device": torch.cuda.get_device_name(), "breakdown": found}, indent=1))
        return 0
    copy_gbps = _copy_gbps(args.iters)
    rows = []
    if args.only in (None, "prefill"):
        rows += _prefill_rows(fla, args.iters)
    if args.only in (None, "decode"):
        rows += _decode_rows(fla, args.iters, copy_gbps)
    tuned = _tuned_choices()
    if args.json:
        out = {"device": torch.cuda.get_device_name(), "copy_gbps": copy_gbps, "fla": fla is not None,
               "rows": [asdict(r) | {"speedup_vs_fla": r.speedup} for r in rows], "tuned": tuned}
        print(json.dumps(out, indent=1))
        return 0
    print(f"{torch.cuda.get_device_name()}; device copy {copy_gbps:.0f} GB/s; FLA baseline: "
          f"{'fla-core' if fla else 'not installed'}")
    head = f"{'kind':13} {'shape':38} {'ms':>8} {'FLA ms':>8} {'x FLA':>6} {'Mtok/s':>8} {'TFLOP/s':>8} " \
           f"{'GB/s':>7} {'FLA GB/s':>8} {'%copy':>6} {'FLA %copy':>9} {'host ms':>7} {'FLA host':>8}"
    print(head)
    for r in rows:
        print(f"{r.kind:13} {r.shape:38} {r.ms:8.3f} {_fmt(r.fla_ms, '8.3f')} {_fmt(r.speedup, '6.2f')} "
              f"{r.tokens_per_s / 1e6:8.3f} {_fmt(r.tflops, '8.1f')} {r.gbps:7.0f} {_fmt(r.fla_gbps, '8.0f')} "
              f"{_fmt(r.copy_pct, '6.1f')} {_fmt(r.fla_copy_pct, '9.1f')} "
              f"{_fmt(r.host_ms, '7.3f')} {_fmt(r.fla_host_ms, '8.3f')}")
    for name, picks in tuned.items():
        print(f"{name}: " + "; ".join(f"{key} -> {cfg}" for key, cfg in picks.items()))
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
