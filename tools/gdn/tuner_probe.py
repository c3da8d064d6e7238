"""Device probe: does the decode tuner (`triton_recurrent._tune_decode`) rank its candidates as serving would see them?

Twelfth session, H200: at 32 sequences of 35B bf16 the tuner kept the tile kernel (32, 2), which `decode_probe` timed at
69.7% of copy bandwidth, while the TMA walk with q, k, v by TMA reached 77.1%. Per candidate, here:
- "in tuning": what `_tuning_ms` measured (per launch; since the thirteenth session each launch from a clean L2 and
  charged with writing back what it leaves dirty, `triton_recurrent._charged_ms`), which the tuner's pick is the
  fastest of;
- "tie": since the fourteenth session, the near-ties of "in tuning" (`triton_recurrent.DECODE_TIE`) timed once more,
  each launch after one of its own (`DecodeTimings.steady`); the tuner keeps the fastest of these;
- "b2b": the tuner's former measurement, five launches back to back behind a spin on its dense scratch pool (slots
  0..N-1), best of three rounds: the pool stays in L2 when it is smaller (32 MB here against the H200's 50 MB);
- "cold": one launch on the bench's pool (random slots among 2N) with L2 flushed first by a read (`_cold_ms`; by a
  write until the thirteenth session), median of ``iters``;
- "warm": one launch behind a spin, median of ``iters`` (`bench_timing._median_ms`, what `bench gdn` reports);
- "host": the host time of one launch (median of 5, the GPU drained before each).

The first two runs (results/tuner_probe_h200.txt) had the tuner timing five launches back to back: during the tuning
the tile (32, 2) measured 17.5 us a launch, timed alone after it 19.9, while the walk measured 18.4 both times.

    python -m tools.gdn.tuner_probe [--batch 8 32 64] [--iters 20] [--models 35B] [--dtypes bfloat16] [--repeat 5]
"""

from __future__ import annotations

import argparse
import time

import torch

from hybridkv.kernels.gdn import bench_cases, bench_timing, triton_decode_prefetch, triton_decode_rows, triton_recurrent
from hybridkv.kernels.gdn.triton_recurrent import DecodeChoice, DecodeKernel, _launch_choice

from tools.gdn.schedules import decode_inputs


def _cold_ms(launch, spin: int, flush: torch.Tensor) -> float:
    """ms of one ``launch`` that finds L2 holding only clean lines of ``flush`` (read, not written), queued behind a GPU
    spin of ``spin`` cycles that outlasts its host time."""
    flush.max()
    return bench_timing._event_ms(launch, spin)


def _b2b5(choice: DecodeChoice, args, spin: int) -> float:
    best = float("inf")
    for _ in range(3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(spin)
        start.record()
        for _ in range(5):
            _launch_choice(choice, *args)
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 5)
    return best


def run(batches: list[int], iters: int, models=None, dtypes=("bfloat16", "float32"), repeat: int = 0) -> None:
    for N in batches:
        for model, H, HV in bench_cases.DECODE_SHAPES:
            if models and model not in models:
                continue
            for dtype in (getattr(torch, d) for d in dtypes):
                torch.manual_seed(0)
                q, k, v, a, b, A_log, dt_bias, pool, idx = decode_inputs(N, H, HV, dtype)
                o = torch.empty_like(v)
                scale = 128**-0.5
                bench_args = (q, k, v, a, b, A_log, dt_bias, o, pool, idx, scale, True, True, 1.0, 20.0)
                scratch = torch.zeros((N, *pool.shape[1:]), dtype=dtype, device="cuda")
                dense = torch.arange(N, device="cuda", dtype=idx.dtype)
                tuner_args = (q, k, v, a, b, A_log, dt_bias, torch.empty_like(v), scratch, dense, scale, True, True,
                              1.0, 20.0)
                cands = [DecodeChoice(kernel=DecodeKernel.TILE, cfg=c) for c in triton_recurrent.DECODE_CONFIGS]
                cands += [DecodeChoice(kernel=DecodeKernel.ROWS, cfg=c) for c in triton_decode_rows.ROWS_CONFIGS]
                cands += [DecodeChoice(kernel=DecodeKernel.PREFETCH, cfg=c)
                          for c in triton_decode_prefetch.PREFETCH_CONFIGS]
                cands += [DecodeChoice(kernel=DecodeKernel.TMA, cfg=c, qkv_tma=t)
                          for c in ((64, 4, 4, 3), (64, 4, 2, 3), (32, 4, 4, 3)) for t in (False, True)
                          if not t or c[0] == 64]
                for c in cands:
                    _launch_choice(c, *bench_args)
                    _launch_choice(c, *tuner_args)
                torch.cuda.synchronize()
                spin = 4_000_000
                if repeat:
                    # The tuner alone, `repeat` times afresh: does it keep the same candidate? (Its near-ties and
                    # their steady times each time.)
                    for r in range(repeat):
                        t = triton_recurrent._tuning_ms(tuner_args, N, True, True)
                        ties = ", ".join(f"{c} {t.charged[c] * 1e3:.2f}/{t.steady[c] * 1e3:.2f}"
                                         for c in sorted(t.steady, key=t.steady.__getitem__))
                        print(f"# {model} HV={HV} {str(dtype).removeprefix('torch.')} N={N} tuning {r + 1}: "
                              f"{t.pick()}; near-ties charged/steady us: {ties or '-'}", flush=True)
                    continue
                timings = triton_recurrent._tuning_ms(tuner_args, N, True, True)
                tuned, picked = timings.charged, timings.pick()
                flush = torch.empty(2 * triton_recurrent._l2_bytes(q.device), dtype=torch.int8, device="cuda")
                rows = []
                for c in cands:
                    host = []
                    for _ in range(5):
                        torch.cuda.synchronize()
                        t0 = time.perf_counter()
                        _launch_choice(c, *bench_args)
                        host.append((time.perf_counter() - t0) * 1e6)
                    torch.cuda.synchronize()
                    b2b = _b2b5(c, tuner_args, spin)
                    cold = sorted(_cold_ms(lambda c=c: _launch_choice(c, *bench_args), spin, flush)
                                  for _ in range(iters))[iters // 2]
                    warm = bench_timing._median_ms(lambda c=c: _launch_choice(c, *bench_args), iters)
                    steady = timings.steady.get(c)
                    rows.append((str(c), tuned[c] * 1e3, None if steady is None else steady * 1e3, b2b * 1e3,
                                 cold * 1e3, warm * 1e3, sorted(host)[2]))
                del flush
                print(f"# {model} HV={HV} {str(dtype).removeprefix('torch.')} N={N}: the tuner picks {picked}",
                      flush=True)
                for name, tt, st, bb, cold, warm, h in sorted(rows, key=lambda r: r[1]):
                    tie = "      -" if st is None else f"{st:7.2f}"
                    print(f"  {name:28} in tuning {tt:7.2f} us  tie {tie}  b2b {bb:7.2f}  cold {cold:7.2f}"
                          f"  warm {warm:7.2f}  host {h:6.1f}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, nargs="+", default=[8, 32, 64])
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--models", nargs="+", default=None, help="of bench_cases.DECODE_SHAPES (default: all)")
    p.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    p.add_argument("--repeat", type=int, default=0, help="only the tuner, this many times afresh, its pick each time")
    a = p.parse_args()
    run(a.batch, a.iters, a.models, a.dtypes, a.repeat)


if __name__ == "__main__":
    main()
