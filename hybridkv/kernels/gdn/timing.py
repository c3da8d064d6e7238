"""GPU timing the decode tuner needs (and `hybridkv bench gdn` shares): CUDA events behind a GPU spin, and a launch
charged with the write-back it leaves in L2.

Here rather than in the bench because the tuner ships: the kernels package never imports the benchmarks.
"""

from __future__ import annotations

from collections.abc import Callable


def median(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[len(xs) // 2]


def event_ms(fn: Callable[[], object], spin: int) -> float:
    """ms between CUDA events around ``fn()``, queued behind a GPU spin of ``spin`` cycles so that the events measure
    the GPU, not the host's launch of ``fn``."""
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(spin)  # the host queues fn() while the GPU spins
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def charged_ms(launch: Callable[[], object], spin: int, flush) -> float:
    """ms of one ``launch`` that finds L2 holding clean lines only, plus the read of ``flush`` (2x L2) after it,
    which writes back whatever the launch left dirty; a caller subtracts that read's own time (`charged_ms` of a
    no-op). Queued behind a GPU spin of ``spin`` cycles that outlasts the host time."""
    flush.max()
    return event_ms(lambda: (launch(), flush.max()), spin)
