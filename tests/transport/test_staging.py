"""Staging (transport/staging.py, descriptors/staging.py) in one process, without NIXL: the pool's
bounds and fence bookkeeping, the route rule, and pack -> slot -> unpack moving exactly the fields a
decode rank reads from each producer rank (the multi-process path is tests/transport/test_hetero_tp.py)."""

from __future__ import annotations

import functools

import numpy as np
import pytest

from hybridkv import wire
from hybridkv.transport.staging import Route, StagePool, StagingConfig, StagingMode, route
from tests.transport.hetero_peers import _counts, field_digests
from tests.transport.peers import build


@functools.lru_cache(maxsize=1)
def _memory():
    return build(1)[1]  # its layout's buffers live as long as the map (the layout holds them)


def _pool(units=4, slot=1024):
    return StagePool(_memory(), StagingConfig(capacity_bytes=units * slot, slot_bytes=slot))


def test_pool_is_bounded_and_falls_back_when_full():
    pool = _pool()
    a = pool.take(2048)
    b = pool.take(1500)  # rounds up to two units
    assert (a.first, a.units, b.first, b.units) == (0, 2, 2, 2)
    assert pool.take(1) is None and pool.full == 1  # full: the caller posts the sliced plan
    pool.give_back(a)
    assert pool.take(3000) is None  # no run of three free units
    c = pool.take(2048)
    assert c.first == 0
    with pytest.raises(RuntimeError, match="given back twice"):
        pool.give_back(a)  # a slot given back twice is a bug, not a free run
    assert pool.take(5 * 1024) is None  # larger than the pool


def test_a_held_slot_goes_back_only_at_its_deadline():
    pool = _pool()
    s = pool.take(4096)
    pool.hold(s, until=10.0)  # a reader may still be reading until its lease lapses
    pool.tick(9.9)
    assert pool.free_units() == 0 and pool.take(1) is None
    pool.tick(10.0)
    assert pool.free_units() == 4


def test_pool_region_is_registered_with_the_side():
    _, memory, _ = build(1)
    pool = StagePool(memory, StagingConfig(capacity_bytes=1 << 16, slot_bytes=1 << 12))
    assert pool.memory.regions[:-1] == memory.regions and pool.memory.groups == memory.groups
    r = pool.memory.regions[-1]
    assert (r.region_id, r.base_addr, r.num_pages * r.stride) == (len(memory.regions), pool.base, 1 << 16)


def test_a_pool_over_mixed_kinds_takes_its_kind_and_never_views_the_other_kind():
    """SGLang's side mixes kinds (KV on the GPU, metadata rows in host memory), in either order. The pool
    takes the named kind's device wherever that kind's first region is, and a copy that would view a region
    of the other kind through the slot's memory is refused before any byte moves (here: a host pool and a
    region marked VRAM, at an address that must never be touched)."""
    import dataclasses

    from hybridkv.transport.staging import CopyStep, Place

    memory = _memory()
    host = memory.regions[0]
    fake_gpu = dataclasses.replace(host, region_id=0, mem=wire.Mem.VRAM, device_id=3, base_addr=16)
    mixed = dataclasses.replace(memory, regions=(fake_gpu,) + tuple(
        dataclasses.replace(r, region_id=i + 1) for i, r in enumerate(memory.regions)), groups=())
    with pytest.raises(ValueError, match="memory kinds"):
        StagePool(mixed, StagingConfig(capacity_bytes=4096, slot_bytes=1024))
    pool = StagePool(mixed, StagingConfig(capacity_bytes=4096, slot_bytes=1024), mem=wire.Mem.DRAM)
    assert (pool.region.mem, pool.region.device_id) == (wire.Mem.DRAM, host.device_id)
    step = CopyStep(src=Place(region=0, offset=0, stride=64), dst=Place(region=None, offset=0, stride=64),
                    src_pages=np.array([0]), dst_pages=np.array([0]), length=64)
    with pytest.raises(ValueError, match="region 0 in VRAM, the staging slot is in host memory"):
        pool.copier.run([step])


def test_config_refuses_bad_values():
    with pytest.raises(ValueError, match="multiple of it"):
        StagingConfig(capacity_bytes=1000, slot_bytes=512)
    with pytest.raises(ValueError, match="direct_rows = 0"):
        StagingConfig(direct_rows=0)


DRAM, VRAM = wire.Mem.DRAM, wire.Mem.VRAM


@pytest.mark.parametrize("mode,sliced,direct,own,nbytes,mem,expected", [
    (StagingMode.OFF, 100, 1, True, 0, DRAM, Route.SLICED),
    (StagingMode.AUTO, 8, 1, True, 64 << 10, DRAM, Route.SLICED),   # 7 descriptors < 64 KB of copying
    (StagingMode.AUTO, 100, 3, True, 64 << 10, DRAM, Route.DIRECT),  # the slot lands in few pieces
    (StagingMode.AUTO, 100, 50, True, 64 << 10, DRAM, Route.SLOT),   # it would not: through a slot of ours
    (StagingMode.AUTO, 100, 50, False, 64 << 10, DRAM, Route.DIRECT),
    (StagingMode.AUTO, 100, 3, True, 1 << 20, DRAM, Route.SLICED),   # a CPU copies 1 MB slower than it posts 97
    (StagingMode.AUTO, 100, 3, True, 1 << 20, VRAM, Route.DIRECT),   # a GPU does not
    (StagingMode.ON, 2, 2, True, 1 << 30, DRAM, Route.DIRECT),       # ON: whatever it costs
    (StagingMode.ON, 2, 50, False, 0, DRAM, Route.SLICED),           # ...but never more descriptors
])
def test_route(mode, sliced, direct, own, nbytes, mem, expected):
    got = route(StagingConfig(mode=mode), sliced=sliced, direct=direct, own_pool=own, nbytes=nbytes, mem=mem)
    assert got is expected


@pytest.mark.parametrize("p_tp,d_tp,p_block,d_block", [(2, 1, 48, 48), (1, 2, 48, 48), (2, 1, 16, 32)])
def test_pack_read_unpack_moves_each_field_from_its_producer(p_tp, d_tp, p_block, d_block):
    """Producer pages -> its slot (pack) -> the decode rank's slot (one copy, the READ's job) -> its
    pages (unpack): every field equals the producer rank's it was assigned from, and the direct read
    of the slot covers the same bytes as the sliced plan in no more rows."""
    from hybridkv.descriptors.planning import DescriptorPlanner, source_ranks

    tokens = 200
    prods = [build(10 + r, tp=p_tp, rank=r, block=p_block) for r in range(p_tp)]
    for d in range(d_tp):
        layout, memory, _ = build(50 + d, tp=d_tp, rank=d, block=d_block)
        ranks, _ = source_ranks(d_tp, d, p_tp)
        planned = DescriptorPlanner().prepare(tuple(prods[r][1] for r in ranks), memory)
        mine = {g: np.arange(3, 3 + n) for g, n in _counts(layout, tokens).items()}
        cons_pool = StagePool(memory, StagingConfig(capacity_bytes=1 << 20, slot_bytes=1 << 10))
        for i, r in enumerate(ranks):
            src_layout, src_memory, _ = prods[r]
            theirs = {g: np.arange(1, 1 + n)[::-1].copy() for g, n in _counts(src_layout, tokens).items()}
            stager = planned.stager(i)
            ours = DescriptorPlanner().stager(src_memory, memory, stager.fields)  # what the producer packs by
            assert stager.keys == ours.keys and stager.nbytes(theirs) == ours.nbytes(theirs)
            prod_pool = StagePool(src_memory, StagingConfig(capacity_bytes=1 << 20, slot_bytes=1 << 10))
            prod_pool.take(1)  # the request's slot is not at offset 0
            slot = prod_pool.take(ours.nbytes(theirs))
            prod_pool.copier.run(ours.pack(theirs, base=slot.offset))
            sliced = planned.plan(i, theirs, mine)
            direct = stager.read(prod_pool.base + slot.offset, 0, theirs, mine)
            assert direct.num_descriptors <= sliced.num_descriptors and direct.nbytes == sliced.nbytes
            own = cons_pool.take(slot.nbytes)
            cons_pool.buffer[own.offset:own.offset + slot.nbytes] = \
                prod_pool.buffer[slot.offset:slot.offset + slot.nbytes]
            cons_pool.copier.run(stager.unpack(theirs, mine, base=own.offset))
            expected = field_digests(src_layout, theirs, tokens)
            got = field_digests(layout, mine, tokens)
            for key in planned.sources[src_layout.rank]:
                name = f"{key[0].value}/{key[1]}/{key[2]}"
                assert got[name] == expected[name], (r, d, name)


def _pool_ops():
    from hypothesis import strategies as st

    op = st.one_of(st.tuples(st.just("take"), st.integers(1, 5000)),
                   st.tuples(st.just("end"), st.integers(0, 7), st.booleans()),  # a live slot's export ends
                   st.tuples(st.just("tick"), st.floats(0.0, 3.0)))
    return st.lists(op, max_size=40)


def _check_pool(ops, pool) -> None:
    """Replays ``ops``; a unit is never handed out while a slot holding it may still be read."""
    now = 0.0
    live: list = []                       # taken, export not ended: a reader may read it
    held: list[tuple[float, object]] = []  # ended with a reader that may still read it, until the deadline
    for op in ops:
        if op[0] == "take":
            slot = pool.take(op[1])
            if slot is None:
                continue
            busy = {u for s in live for u in range(s.first, s.first + s.units)}
            busy |= {u for t, s in held if now < t for u in range(s.first, s.first + s.units)}
            mine = set(range(slot.first, slot.first + slot.units))
            assert not mine & busy, (slot.first, slot.units, sorted(busy))
            live.append(slot)
        elif op[0] == "end" and live:
            slot = live.pop(op[1] % len(live))
            if op[2]:
                pool.give_back(slot)  # every reader done
            else:
                held.append((now + 1.0, slot))  # a reader lost: until its lease lapses
                pool.hold(slot, now + 1.0)
        elif op[0] == "tick":
            now += op[1]
            pool.tick(now)


def test_pool_never_hands_out_a_unit_that_may_be_read():
    """Property: under any order of takes, ends (all readers done, or held to the lease) and clock
    ticks, no unit of a slot that may still be read is handed out again."""
    from hypothesis import given, settings

    @settings(max_examples=150, deadline=None)
    @given(_pool_ops())
    def check(ops):
        _check_pool(ops, _pool(units=8))

    check()


def test_the_pool_property_catches_a_hold_that_frees_at_once():
    """The property above fails for a pool whose hold gives the slot back at once (the fence off)."""
    pool = _pool(units=2)
    pool.hold = lambda slot, until: pool.give_back(slot)  # mutant: no wait for the lease
    with pytest.raises(AssertionError):
        _check_pool([("take", 2048), ("end", 0, False), ("take", 1024)], pool)


@pytest.mark.parametrize("kind", ["numpy", "torch"])
@pytest.mark.parametrize("word", [1, 2, 4, 8])
def test_rows_view_in_words_moves_the_same_bytes(kind, word):
    """The copier gathers in the widest element that tiles a step (a byte per index ran at 1-4% of a plain
    copy on an H100): rows gathered and scattered as words land byte for byte where byte rows would, and
    nothing between the rows changes. torch on the CPU runs the same view and index code as on a GPU."""
    from hybridkv.transport.staging import rows_view

    rng = np.random.default_rng(word)
    src = rng.integers(0, 256, 4096, dtype=np.uint8)
    pages_src = np.array([5, 1, 7, 3])
    pages_dst = np.array([0, 2, 1, 3])
    expected = np.zeros(2048, dtype=np.uint8)
    for s, d in zip(pages_src, pages_dst):
        expected[64 + d * 256: 64 + d * 256 + 40] = src[8 + s * 400: 8 + s * 400 + 40]
    dst = np.zeros(2048, dtype=np.uint8)
    if kind == "torch":
        torch = pytest.importorskip("torch")
        tsrc, tdst = torch.from_numpy(src), torch.from_numpy(dst)
        a = rows_view(tsrc, 8, 400, 8, 40, word)
        b = rows_view(tdst, 64, 256, 4, 40, word)
        b[torch.as_tensor(pages_dst)] = a[torch.as_tensor(pages_src)]
    else:
        a = rows_view(src, 8, 400, 8, 40, word)
        b = rows_view(dst, 64, 256, 4, 40, word)
        b[pages_dst] = a[pages_src]
    assert np.array_equal(dst, expected)
