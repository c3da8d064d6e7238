"""How `hybridkv bench gdn` times a call: CUDA events behind a GPU spin, calls back to back, interleaved rounds.

`_timed` (and `_median_ms`, its device time) hides the host's queueing time, measured by `_host_ms`, behind a
`torch.cuda._sleep` spin; `_b2b_ms` queues `B2B_CALLS` calls back to back; `_interleaved` times several
implementations with their calls rotated round by round (`_rotations`); `_copy_gbps` is the device-to-device copy
that decode's "% copy" divides by; `_charged_ms` times a decode step as the decode tuner does. The probes in
tools/gdn time with these too.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from hybridkv.kernels.gdn.timing import charged_ms, event_ms, median


B2B_CALLS = 20
B2B_ROUNDS = 3


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


_event_ms = event_ms  # the tuner's, so that the bench and the tuner time alike


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


_median = median


def _flush_bytes() -> int:
    """Twice the current device's L2: what a read must cover to leave L2 holding its lines only."""
    import torch

    return 2 * torch.cuda.get_device_properties(torch.cuda.current_device()).L2_cache_size


def _charged_ms(fn, iters: int, flush) -> float:
    """ms of one call as the decode tuner times it (`hybridkv.kernels.gdn.timing.charged_ms`): from a clean L2, charged with
    writing back what it leaves dirty, median of ``iters``, the charging read's own time subtracted. ``_median_ms``
    times a call back to back with its predecessor on the same pool, which no serving step sees; this is the other
    view, for the decode rows."""
    spin = _spin_cycles(_host_ms(fn) + _host_ms(flush.max))
    nothing = sorted(charged_ms(lambda: None, spin, flush) for _ in range(iters))
    times = sorted(charged_ms(fn, spin, flush) for _ in range(iters))
    return times[iters // 2] - nothing[iters // 2]


def _copy_gbps(iters: int, src=None) -> float:
    """GB/s (bytes read and written) of a device-to-device copy of ``src``, timed as a call is; None: 4 GiB of fp32,
    large enough that no launch or ramp shows."""
    import torch

    if src is None:
        src = torch.empty(2**30, dtype=torch.float32, device="cuda")
    dst = torch.empty_like(src)
    ms = _median_ms(lambda: dst.copy_(src), iters)
    return 2 * src.numel() * src.element_size() / ms / 1e6
