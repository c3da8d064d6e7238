"""Device probe: one decode step timed as `bench gdn` times it (the host's queueing hidden behind a GPU spin, as a
CUDA graph or a busy stream hides it) and back to back in eager mode (each call's host time exposed), in vLLM's
slot pool. Where the step's GPU time is shorter than its host time, eager back-to-back calls are host-bound.

    python -m tools.gdn.host_bound_probe [--calls 200]
"""

from __future__ import annotations

import argparse
import time

import torch

from hybridkv.benchmarks.gdn import cases
from hybridkv.benchmarks.gdn.timing import _copy_gbps, _median_ms
from hybridkv.kernels.gdn import gated_delta_rule_decode

D = cases.D


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=200, help="calls back to back (default 200)")
    a = p.parse_args()
    copy = _copy_gbps(20)
    print(f"{torch.cuda.get_device_name()}; device copy {copy:.0f} GB/s", flush=True)
    for model, H, HV in cases.DECODE_SHAPES:
        for N in cases.DECODE_BATCHES:
            for dtype in (torch.float32, torch.bfloat16):
                step = cases.decode_step(cases.Pool.VLLM, N, "cuda")
                R = step.indices.numel()
                q, k, v, ga, gb, A_log, dt_bias = cases.decode_inputs(R, H, HV, "cuda")
                pool = cases.decode_pool(step.slots, HV, dtype, "cuda")

                def call():
                    return gated_delta_rule_decode(q, k, v, ga, gb, A_log, dt_bias, pool, step.indices)

                hidden = _median_ms(call, 20)
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                for _ in range(a.calls):
                    call()
                host_only = (time.perf_counter() - t0) * 1e3 / a.calls  # queueing, before the GPU catches up
                torch.cuda.synchronize()
                eager = (time.perf_counter() - t0) * 1e3 / a.calls
                state = N * HV * D * D * 2 * pool.element_size()
                pct = lambda ms: 100 * state / ms / 1e6 / copy  # noqa: E731
                print(f"{model:4} B={N:3} {str(dtype).removeprefix('torch.'):8} GPU {hidden * 1e3:6.1f} us "
                      f"({pct(hidden):5.1f}% copy) | eager back to back {eager * 1e3:6.1f} us ({pct(eager):5.1f}%), "
                      f"host {host_only * 1e3:6.1f} us a call", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
