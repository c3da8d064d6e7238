"""A page plan of few block pairs is made in Python ints (compiler._compile_few, a per-request speedup):
it must be the plan the numpy path makes, array for array, and refuse what it refuses with its words."""

from __future__ import annotations

import numpy as np
import pytest

import hybridkv.descriptors.compiler as compiler
from hybridkv.descriptors.compiler import TransferPlanner
from hybridkv.layout import plan_layout
from hybridkv.layout.alloc import NumpyAllocator
from hybridkv.layout.geometry import LayerKind, ModelGeometry
from hybridkv.layout.kinds.base import Paging
from hybridkv.layout.presets import get_preset
from hybridkv.transport.memory import from_layout

PAGES = 12


def _memory():
    geo = get_preset("qwen3.5-9b")
    geo = ModelGeometry(name="few", layers=geo.layers[:4])
    counts = {k: (2 if geo.spec_of(k).paging is Paging.STATE else PAGES) for k in geo.kinds()}
    return from_layout(plan_layout(geo, block_size=16, num_blocks=counts, allocator=NumpyAllocator()))


@pytest.fixture(scope="module")
def planner():
    src, dst = _memory(), _memory()
    return TransferPlanner.pages(src, dst), src


def _both(planner, sb, db, monkeypatch):
    out = []
    for few in (10**6, 0):  # every request through _compile_few, then none
        monkeypatch.setattr(compiler, "_FEW", few)
        try:
            out.append(planner.compile(sb, db))
        except ValueError as exc:
            out.append(str(exc))
    return out


def test_few_pairs_plan_as_the_numpy_path(planner, monkeypatch):
    p, mm = planner
    token = next(g.group_id for g in mm.layout.groups if g.kind is not LayerKind.GDN)
    state = next(g.group_id for g in mm.layout.groups if g.kind is LayerKind.GDN)
    rng = np.random.default_rng(7)
    for _ in range(300):
        k = int(rng.integers(0, PAGES + 1))
        sb = rng.permutation(PAGES + 1)[:k] - (rng.random() < 0.1)  # now and then a block past either end
        db = rng.permutation(PAGES)[:k]
        if rng.random() < 0.5:
            sb, db = np.sort(sb), np.sort(db)  # runs that merge
        if k and rng.random() < 0.3:
            db = db[: int(rng.integers(0, k))]  # a prefix hit: the dst list pairs with the src list's tail
        st = rng.permutation(2)[:1]
        src, dst = {token: sb, state: st}, {token: db, state: st[::-1].copy()}
        few, vec = _both(p, src, dst, monkeypatch)
        if isinstance(vec, str):
            assert few == vec
            continue
        for f in ("src", "dst", "src_region", "dst_region", "src_index", "dst_index"):
            a, b = getattr(few, f), getattr(vec, f)
            assert a.dtype == b.dtype and np.array_equal(a, b), f
        # posted as they are: the index arrays must need no conversion on the hot path
        assert few.src_index.flags.c_contiguous and few.dst_index.flags.c_contiguous and few.src.flags.c_contiguous
