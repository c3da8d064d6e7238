"""Device probe: does the decode tuner (`triton_recurrent._tune_decode`) rank its candidates as the bench times them?

Twelfth session, H200: at 32 sequences of 35B bf16 the tuner kept the tile kernel (32, 2), which `decode_probe` timed at
69.7% of copy bandwidth, while the TMA walk with q, k, v by TMA reached 77.1%. The tuner differs from the bench in
three ways, each timed here per candidate so that the one that reorders them shows:
- "tuner": its own measurement, five launches back to back behind a spin on a dense scratch pool of zeros (slots
  0..N-1), best of three rounds;
- "b2b": the same five launches behind a spin on the bench's pool (random slots among 2N, random values);
- "single": one launch behind a spin, median of ``iters`` (`bench_timing._median_ms`, what the bench reports);
and "host", the host time of one launch (median of 5, the GPU drained before each).

The first run (results/tuner_probe_h200.txt) showed the tuner's own measurement ranking the walk first where
`_tune_decode` kept the tile: its spin was sized by the candidates' mean host time, short of the walk's launches.

    python -m benchmarks.gdn.tuner_probe [--batch 8 32 64] [--iters 20]
"""

from __future__ import annotations

import argparse
import time

import torch

from hybridkv.kernels.gdn import bench_cases, bench_timing, triton_recurrent
from hybridkv.kernels.gdn.triton_recurrent import DecodeChoice, DecodeKernel, _launch_choice

from benchmarks.gdn.schedules import decode_inputs


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


def run(batches: list[int], iters: int) -> None:
    for N in batches:
        for model, H, HV in bench_cases.DECODE_SHAPES:
            for dtype in (torch.bfloat16, torch.float32):
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
                cands += [DecodeChoice(kernel=DecodeKernel.TMA, cfg=c, qkv_tma=t)
                          for c in ((64, 4, 4, 3), (64, 4, 2, 3), (32, 4, 4, 3)) for t in (False, True)
                          if not t or c[0] == 64]
                for c in cands:
                    _launch_choice(c, *bench_args)
                    _launch_choice(c, *tuner_args)
                torch.cuda.synchronize()
                spin = 4_000_000
                picked = triton_recurrent._tune_decode(tuner_args, N, True)
                rows = []
                for c in cands:
                    host = []
                    for _ in range(5):
                        torch.cuda.synchronize()
                        t0 = time.perf_counter()
                        _launch_choice(c, *tuner_args)
                        host.append((time.perf_counter() - t0) * 1e6)
                    torch.cuda.synchronize()
                    tuner = _b2b5(c, tuner_args, spin)
                    b2b = _b2b5(c, bench_args, spin)
                    single = bench_timing._median_ms(lambda: _launch_choice(c, *bench_args), iters)
                    rows.append((str(c), tuner * 1e3, b2b * 1e3, single * 1e3, sorted(host)[2]))
                print(f"# {model} HV={HV} {str(dtype).removeprefix('torch.')} N={N}: the tuner picks {picked}",
                      flush=True)
                for name, t, bb, s, h in sorted(rows, key=lambda r: r[3]):
                    print(f"  {name:28} tuner {t:7.2f} us  b2b {bb:7.2f} us  single {s:7.2f} us  host {h:6.1f} us",
                          flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, nargs="+", default=[8, 32, 64])
    p.add_argument("--iters", type=int, default=20)
    a = p.parse_args()
    run(a.batch, a.iters)


if __name__ == "__main__":
    main()
