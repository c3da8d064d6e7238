"""The reference engine on its own (no transport): async scheduling does not change tokens."""

from __future__ import annotations

import asyncio
import random

import pytest

from connectors.reference.engine import Engine, EngineConfig, Role
from connectors.reference.model import TinyHybridModel


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
