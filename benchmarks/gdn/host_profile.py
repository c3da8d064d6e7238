"""Where a call's host time goes: the Python functions (and the C calls they make, kernel launches included) that
take the CPU time of one call, from cProfile.

In an engine step that runs the GDN layers eagerly (vLLM keeps attention-like custom ops out of its piecewise CUDA
graphs) a call whose host time exceeds its device time leaves the GPU waiting, which short TP-sharded prompts do.
`hybridkv bench gdn --host-profile` prints this table for hybridkv and FLA on every prefill shape.
"""

from __future__ import annotations

import cProfile
import pstats
import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class HostProfile:
    name: str
    call_us: float  # wall time of one call on the host, profiler off (median of the timed calls)
    functions: tuple[tuple[str, float], ...]  # (function, own host us per call, profiler on), largest first


def _label(func: tuple[str, int, str]) -> str:
    path, line, name = func
    if path == "~":  # a builtin or C call, e.g. a kernel launcher's
        return name[-60:]
    return f"{'/'.join(path.split('/')[-2:])}:{line} {name}"[-60:]


def measure(name: str, fn: Callable[[], object], calls: int, sync: Callable[[], None] = lambda: None,
            top: int = 12) -> HostProfile:
    """``fn`` already warmed up (compiled, autotuned): ``calls`` timed host calls, then ``calls`` under cProfile;
    ``sync`` (torch.cuda.synchronize on a GPU) runs between the phases, so that neither waits on the other's work."""
    if calls < 1:
        raise ValueError(f"calls must be >= 1, got {calls}")
    sync()
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    sync()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    sync()
    stats = pstats.Stats(prof).stats  # {func: (primitive calls, calls, own time, cumulative time, callers)}
    own = sorted(((_label(f), v[2] / calls * 1e6) for f, v in stats.items()), key=lambda kv: -kv[1])
    return HostProfile(name=name, call_us=sorted(times)[len(times) // 2] * 1e6, functions=tuple(own[:top]))


def render(shape: str, rows: list[HostProfile]) -> str:
    lines = [shape]
    for p in rows:
        lines.append(f"  {p.name:10} host {p.call_us:8.1f} us per call; own time per call under cProfile:")
        lines.extend(f"      {us:8.1f} us  {f}" for f, us in p.functions)
    return "\n".join(lines)
