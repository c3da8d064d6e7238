"""The first calls of `hybridkv bench gdn`: which function each column calls, and its compiles timed apart.

`_impls` maps each column (`IMPLS`, titled `TITLES`) to the function it calls; `_first_calls` makes each one's first
call (Triton compiles and autotuning, TileLang's JIT, CuTe DSL) and turns a baseline's failure into a note. With
FlashQLA present, `_warm_parallel` makes the first calls of every shape in parallel processes (`python -m
hybridkv.benchmarks.gdn.warmup INDEX NAME...`, which runs `_warm_main`), filling the disk caches of the
`DISK_CACHED` implementations before the timing process times anything; `Warmed` is what they report.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from hybridkv.benchmarks.gdn import baselines
from hybridkv.benchmarks.gdn.cases import _inputs


IMPLS = ("hybridkv", "fla", "flash_qla", "flashinfer")
# Column name of each implementation in the table.
TITLES = {"hybridkv": "hybridkv", "fla": "FLA", "flash_qla": "FlashQLA", "flashinfer": "FlashInfer"}
# Compiles of these are cached on disk, so parallel warm-up processes take them out of the timing process.
DISK_CACHED = ("hybridkv", "fla", "flash_qla")


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
        proc = subprocess.Popen([sys.executable, "-m", "hybridkv.benchmarks.gdn.warmup", str(index), *names],
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


if __name__ == "__main__":  # a warm-up process of `_warm_parallel`
    sys.exit(_warm_main(sys.argv[1:]))
