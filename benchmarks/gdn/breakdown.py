"""Where a call's GPU time goes: per-kernel device time (torch.profiler) next to the call's event time.

The gap between the two is time the GPU sat idle inside the call: host syncs, launch latency,
allocator work. `hybridkv bench gdn --breakdown` prints it for hybridkv and FLA on every prefill shape.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class Breakdown:
    name: str
    call_us: float  # CUDA-event time of one call (median)
    kernels: tuple[tuple[str, float], ...]  # (kernel name, device us per call), largest first

    @property
    def kernel_us(self) -> float:
        return sum(us for _, us in self.kernels)

    @property
    def idle_us(self) -> float:
        return max(self.call_us - self.kernel_us, 0.0)

    @property
    def overlap_us(self) -> float:
        """Kernel time beyond the call's: kernels ran side by side (a pipelined call's two streams)."""
        return max(self.kernel_us - self.call_us, 0.0)


def _short(name: str) -> str:
    # Triton names carry no templates; library kernels (FLA's, PyTorch's) can be long C++ signatures.
    return name.split("(")[0].split("<")[0][-48:]


def measure(name: str, fn, iters: int, median_ms) -> Breakdown:
    import torch
    from torch.profiler import ProfilerActivity, profile

    call_ms = median_ms(fn, iters)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    per_kernel: dict[str, float] = defaultdict(float)
    for evt in prof.events():
        if evt.device_type == torch.autograd.DeviceType.CUDA:
            per_kernel[_short(evt.name)] += evt.device_time / iters
    kernels = tuple(sorted(per_kernel.items(), key=lambda kv: -kv[1]))
    return Breakdown(name=name, call_us=call_ms * 1e3, kernels=kernels)


def render(shape: str, rows: list[Breakdown]) -> str:
    lines = [shape]
    for b in rows:
        if b.overlap_us > 0.05 * b.call_us:  # beyond the profiler's and the events' clock difference
            lines.append(f"  {b.name:10} call {b.call_us:8.1f} us < kernels {b.kernel_us:8.1f}: "
                         f"{b.overlap_us:.1f} us ran side by side")
        else:
            lines.append(f"  {b.name:10} call {b.call_us:8.1f} us = kernels {b.kernel_us:8.1f} + idle {b.idle_us:7.1f}")
        lines.extend(f"      {us:8.1f} us  {k}" for k, us in b.kernels)
    return "\n".join(lines)
