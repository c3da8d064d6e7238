"""The reference engine on its own (no transport): async scheduling does not change tokens."""

from __future__ import annotations

import asyncio
import random

import pytest

from hybridkv.connectors.reference.engine import Engine, EngineConfig, Role
from hybridkv.connectors.reference.model import TinyHybridModel


@pytest.fixture(scope="module")
def model():
    import torch

    torch.set_num_threads(1)
    return TinyHybridModel()


def _run(model, cfg, reqs):
    done = {}
    e = Engine(model, cfg, on_finished=lambda r: done.__setitem__(r.rid, list(r.output)))
    for rid, p, n in reqs:
        e.submit(rid, p, n)
    asyncio.run(e.drain())
    assert e.leaked_blocks() == 0
    return done


def test_async_depth_and_batching_do_not_change_tokens(model):
    rng = random.Random(3)
    reqs = [(f"r{i}", [rng.randrange(1, 384) for _ in range(rng.randrange(3, 70))], rng.randrange(2, 7))
            for i in range(6)]
    serial = _run(model, EngineConfig(async_depth=0, max_running=1), reqs)
    ahead = _run(model, EngineConfig(async_depth=2, max_running=4, chunk_size=16), reqs)
    assert serial == ahead
    assert all(len(serial[rid]) == n for rid, _, n in reqs)


def test_bad_requests_are_refused(model):
    e = Engine(model, EngineConfig())
    with pytest.raises(ValueError, match="prompt must be non-empty"):
        e.submit("x", [], 3)
    e.submit("y", [1, 2], 1)
    with pytest.raises(ValueError, match="already submitted"):
        e.submit("y", [1, 2], 1)
    d = Engine(model, EngineConfig(role=Role.DECODE))
    with pytest.raises(ValueError, match="first token"):
        d.submit("z", [1, 2], 2)


def test_import_that_lands_while_the_engine_is_idle_is_still_scheduled(model):
    """Decode role: every request's import ends between steps (here: each comes back as
    RECOMPUTE after the engine went idle). The worker loop asks `busy` before stepping; it
    must stay true for a landed-but-not-joined request, or the engine idles forever (a demo
    run hung exactly so, with 4 landed requests and an idle engine)."""
    from hybridkv.fencing import NotYet
    from hybridkv.transport.endpoint import Outcome, Result

    async def fetcher(rid, comps):
        await asyncio.sleep(0.05)  # the engine has nothing else to do meanwhile
        sched = engine.sched
        while isinstance(tid := sched.post_import(rid, components=comps), NotYet):  # what Consumer._give_up records
            await asyncio.sleep(0.001)  # fenced until the step that zeroes the blocks completed
        sched.transfer_failed(tid)
        sched.recompute(rid)
        return Result(request_id=rid, outcome=Outcome.RECOMPUTE, error="no producer in this test")

    reqs = [(f"r{i}", [5 + i, 7, 11 + i], 3) for i in range(3)]
    expected = _run(model, EngineConfig(), reqs)
    done = {}
    engine = Engine(model, EngineConfig(role=Role.DECODE), fetcher=fetcher,
                    on_finished=lambda r: done.__setitem__(r.rid, list(r.output)))
    for rid, p, n in reqs:
        engine.submit(rid, p, n, first_token=expected[rid][0])

    async def worker_loop():  # serve.py's loop
        t_end = asyncio.get_running_loop().time() + 20
        while len(done) < len(reqs) and asyncio.get_running_loop().time() < t_end:
            if engine.busy:
                await engine.run_step()
            else:
                await asyncio.sleep(0.002)
        await engine.drain()

    asyncio.run(worker_loop())
    assert done == expected, engine.describe()
    assert engine.leaked_blocks() == 0


def test_checksums_see_one_changed_byte_and_moved_words(model):
    """The demo's byte check: per-page checksums of the attention pages and the state page, as a
    transfer moves them. One flipped byte, or two words swapped, changes its page's sum only."""
    e = Engine(model, EngineConfig())
    pages = e.cache.attn_pages
    torch = pytest.importorskip("torch")
    pages.copy_(torch.randint(0, 256, pages.shape, dtype=torch.uint8))
    e.cache.state_pages.copy_(torch.randint(0, 256, e.cache.state_pages.shape, dtype=torch.uint8))
    before = e.checksums([3, 5], 1).values()
    assert len(before) == 3 and e.checksums([3, 5], 1).values() == before
    pages[5, 17] ^= 1
    after = e.checksums([3, 5], 1).values()
    assert after[0] == before[0] and after[1] != before[1] and after[2] == before[2]
    words = e.cache.state_pages[1].view(torch.int32)
    a, b = int(words[0]), int(words[1])
    if a != b:
        words[0], words[1] = b, a
        assert e.checksums([3, 5], 1).values()[2] != before[2]


def test_qwen_presets_have_hybridkvs_cache_geometry():
    """The GPU demo's model moves exactly the caches hybridkv plans for the real model."""
    from hybridkv.connectors.reference.model import model_config
    from hybridkv.layout.presets import get_preset

    for name in ("qwen3.5-0.8b", "qwen3.5-2b"):
        assert model_config(name).geometry() == get_preset(name)
    with pytest.raises(ValueError, match="expected one of"):
        model_config("qwen3.5-7b")


def test_demo_options_refuse_bad_devices():
    from hybridkv.connectors.reference.demo import DemoOptions

    with pytest.raises(ValueError, match="--device 'tpu'"):
        DemoOptions(device="tpu")
    with pytest.raises(ValueError, match="--devices"):
        DemoOptions(device="cuda", devices=(0,))
    assert DemoOptions(device="cuda", devices=(0, 1)).device_of("decode") == "cuda:1"
    assert DemoOptions(device="cuda", devices=(0, 1)).device_of("aggregated") == "cuda:0"
