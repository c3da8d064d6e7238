"""Where a reference-engine step spends its time on a GPU (issue #24): the aggregated engine with the
qwen3.5-0.8b model under cProfile, then one decode forward timed with and without a sync, and its kernel count.
Run on the device: python3 -m tools.device.profile_demo_engine"""
import asyncio
import cProfile
import io
import os
import pstats
import random
import time

import torch

os.environ.setdefault("TRITON_CACHE_AUTOTUNING", "1")
from hybridkv.connectors.reference.cache import CacheConfig  # noqa: E402
from hybridkv.connectors.reference.engine import Engine, EngineConfig  # noqa: E402
from hybridkv.connectors.reference.model import TinyHybridModel, model_config  # noqa: E402

dev = "cuda:0"
torch.cuda.set_device(dev)
model = TinyHybridModel(model_config("qwen3.5-0.8b"), device=dev)
rng = random.Random(0)


def run(n: int, depth: int) -> float:
    e = Engine(model, EngineConfig(device=dev, async_depth=depth, chunk_size=256,
                                   cache=CacheConfig(attention_blocks=600, state_slots=10)))
    for i in range(n):
        e.submit(f"r{i}", [rng.randrange(1, 384) for _ in range(rng.randint(16, 512))], 8)
    t = time.perf_counter()
    asyncio.run(e.drain())
    dt = time.perf_counter() - t
    print(f"{n} requests depth {depth}: {dt:.2f} s, {e.steps_launched} steps, overlapped {e.steps_overlapped}, "
          f"step ms median {sorted(e.step_seconds)[len(e.step_seconds) // 2] * 1e3:.1f}")
    return dt


run(8, 1)  # compile and tune
prof = cProfile.Profile()
prof.enable()
run(8, 1)
prof.disable()
s = io.StringIO()
pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(25)
print(s.getvalue()[:6000])
s = io.StringIO()
pstats.Stats(prof, stream=s).sort_stats("cumulative").print_stats(30)
print(s.getvalue()[:6000])
