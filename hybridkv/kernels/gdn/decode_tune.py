"""The decode tuner: which candidate (`decode_kernels.candidates`) a decode key runs, timed once per key on the
caller's own pool, at the caller's own slots.

Triton's autotuner would clone the whole pool around every timed call (restore_value), which costs a pool-sized copy
and swamps the timings, so decode tunes itself instead: the slots the call touches are saved, every candidate is
timed on the caller's pool at the caller's state indices (scattered slots, pads and all: what the engine's step will
see), and the slots are put back before the call itself runs. Each timed launch finds L2 holding clean lines only,
as in serving after the layers between two decode calls of one layer have streamed their weights, and is charged
with writing back what it leaves dirty (`timing.charged_ms`); candidates within `DECODE_TIE` of the best are timed
once more, each launch after one of its own, and the fastest of those is kept.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from hybridkv.kernels.gdn import decode_kernels
from hybridkv.kernels.gdn.decode_kernels import DecodeChoice
from hybridkv.kernels.gdn.timing import charged_ms, event_ms, median

# The spin before each timed launch: cycles per second of a GPU clock at most this fast (Hopper boosts to under 2 GHz), so a
# spin of host time x this lasts at least that long; and a floor.
_SPIN_CYCLES_PER_S = 2.0e9
_SPIN_MIN_CYCLES = 200_000
# Candidates whose charged times lie within this fraction of the best are near-ties: the charged timing cannot order
# them from run to run, while a step after a step of its own (a decode loop) can.
DECODE_TIE = 0.04
_STEADY_CALLS = 4


@dataclass(frozen=True, kw_only=True)
class DecodeTimings:
    """What the tuner measured, ms a launch: every candidate from a clean L2, charged with its write-back
    (``charged``), and the near-ties of that (`DECODE_TIE`) after a launch of their own (``steady``)."""

    charged: dict[DecodeChoice, float]
    steady: dict[DecodeChoice, float]

    def pick(self) -> DecodeChoice:
        near = near_ties(self.charged)
        if len(near) == 1:
            return near[0]
        missing = [str(c) for c in near if c not in self.steady]
        if missing:
            raise ValueError(f"steady timings lack the near-ties {missing}; timed: {[str(c) for c in self.steady]}")
        return min(near, key=self.steady.__getitem__)


def near_ties(charged: dict[DecodeChoice, float]) -> list[DecodeChoice]:
    """The candidates within `DECODE_TIE` of the fastest charged time, fastest first. A charged time is a difference
    of two medians and can come out at or below zero on a step shorter than its noise: the band is then no wider than
    the best time's magnitude."""
    if not charged:
        raise ValueError("no decode candidates were timed")
    best = min(charged.values())
    bound = best + DECODE_TIE * abs(best)
    return sorted((c for c, ms in charged.items() if ms <= bound), key=charged.__getitem__)


def _l2_bytes(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).L2_cache_size


def tune(args: tuple, *, tma: bool, by_rows: bool) -> DecodeChoice:
    """The candidate `DecodeTimings.pick` keeps of `tuning_ms` on ``args`` (`decode.decode_fwd`'s launch arguments;
    the pool is left as it was)."""
    return tuning_ms(args, tma=tma, by_rows=by_rows).pick()


def tuning_ms(args: tuple, *, tma: bool, by_rows: bool) -> DecodeTimings:
    """Time every candidate on the caller's pool at the caller's state indices (at most `decode.DECODE_TUNE_ROWS`
    rows of them), then put the slots they touched back. ``tma``, ``by_rows``: which kernels the pool can take
    (`decode_kernels.candidates`)."""
    q, k, v, a, b, A_log, dt_bias, o, ssm_state, state_indices, *rest = args
    # Pads (-1) read and write nothing; SGLang-style pads write slot 0, which clamping saves as well.
    touched = state_indices.clamp(min=0).long()
    saved = ssm_state[touched]
    try:
        return _timings(args, decode_kernels.candidates(q, k, v, ssm_state, tma=tma, by_rows=by_rows))
    finally:
        ssm_state[touched] = saved  # duplicates (slot 0 of several pads) write the same saved value


def _timings(args: tuple, cands: list[DecodeChoice]) -> DecodeTimings:
    q = args[0]
    ssm_state, state_indices = args[8], args[9]
    step_bytes = state_indices.numel() * ssm_state[0].numel() * ssm_state.element_size()  # at most, pads included

    def run(choice):
        decode_kernels.launch(choice, *args)

    for choice in cands:  # compile and warm every candidate before any is timed
        run(choice)
    torch.cuda.synchronize()
    host_s = 0.0
    for choice in cands:  # the median of three, so that one stall (a GC pause) does not lengthen every spin
        launches = []
        for _ in range(3):
            t0 = time.perf_counter()
            run(choice)
            launches.append(time.perf_counter() - t0)
        host_s = max(host_s, sorted(launches)[1])
    torch.cuda.synchronize()
    # The timed launches are queued behind a GPU spin that outlasts the slowest candidate's host time, so the events
    # measure the GPU, as a CUDA graph's replay would, not whichever candidate launches fastest on the host.
    flush = torch.empty(2 * _l2_bytes(q.device), dtype=torch.int8, device=q.device)
    t0 = time.perf_counter()
    flush.max()
    host_s += time.perf_counter() - t0  # the read queued behind the spin too
    torch.cuda.synchronize()
    spin = int(max(_SPIN_MIN_CYCLES, 2 * host_s * _SPIN_CYCLES_PER_S))
    # Each sample carries the read of 2x L2, whose jitter is comparable to the gap between candidates when a step
    # takes a few us: small steps get more rounds.
    rounds = 5 if step_bytes >= _l2_bytes(q.device) // 2 else 15
    nothing = [charged_ms(lambda: None, spin, flush) for _ in range(5)]
    times: dict[DecodeChoice, list[float]] = {c: [] for c in cands}
    for _ in range(rounds):
        for choice in cands:
            times[choice].append(charged_ms(lambda c=choice: run(c), spin, flush))
        nothing.append(charged_ms(lambda: None, spin, flush))
    del flush
    read_ms = median(nothing)
    charged = {c: median([t - read_ms for t in ts]) for c, ts in times.items()}
    near = near_ties(charged)
    steady: dict[DecodeChoice, list[float]] = {c: [] for c in near}
    if len(near) > 1:
        # Interleaved, each sample after an untimed launch of the same candidate, so it finds L2 as its own previous
        # step left it; a sample is the mean of `_STEADY_CALLS` launches back to back.
        steady_spin = spin * _STEADY_CALLS

        def calls(c):
            for _ in range(_STEADY_CALLS):
                run(c)

        for _ in range(3 * rounds):
            for choice in near:
                run(choice)
                steady[choice].append(event_ms(lambda c=choice: calls(c), steady_spin) / _STEADY_CALLS)
    return DecodeTimings(charged=charged, steady={c: median(ts) for c, ts in steady.items() if ts})
