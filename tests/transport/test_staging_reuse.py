"""Under staging AUTO the direct read of a staged part is planned once, before the Want (transport/import_staging.py).

``flags`` plans the read of each producer's slot from our own blocks to weigh the part; once the Export names the
slot, ``staged_work`` reuses that plan moved to the slot's address (``StagePlan.rebase``) where the read's inputs
are the same: the same stager, our blocks unchanged and as many of the producer's blocks per group as ours (the
read takes theirs only by count). Else (a prefix hit here, our blocks changed, block sizes that differ, nothing
planned before) it plans anew. In one process, over random block lists on real layouts (hybridkv's, vLLM's
16-token kernel blocks, block sizes that differ): the reused read equals a fresh ``stager.read`` row for row, the
Work ``staged_work`` returns equals the one it returns planning anew, and the read is planned again exactly where
reuse must not apply.

Where we have a pool of our own and ``StagePlan.read_rows_least`` (a lower bound from the block lists alone) already
passes ``direct_rows``, the way is SLOT or SLICED whatever the direct read's count: neither ``flags`` nor
``staged_work`` plans it, and ``slot_for`` plans it only where our pool is full. The bound never exceeds the real
count; the decisions equal those made with the exact count; what is posted equals planning anew.
"""

from __future__ import annotations

import functools
import types

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from hybridkv import wire
from hybridkv.fencing.scheduler import TransferScheduler
from hybridkv.transport.config import TransportConfig
from hybridkv.transport.import_staging import ImportStaging
from hybridkv.transport.parts import Part
from hybridkv.transport.side import Peer
from hybridkv.transport.staging import StagePool, StagingConfig, StagingMode
from tests.transport.hetero_peers import _counts
from tests.transport.peers import build, build_vllm

#: staging wins at any size (dear descriptors, free copies): AUTO asks every producer that feeds a field
WINS = StagingConfig(mode=StagingMode.AUTO, descriptor_us=1e3, copy_gbps=1e6, capacity_bytes=8 << 20,
                     slot_bytes=1 << 12)
#: (producer TP, consumer TP, vLLM kernel block or None, producer block tokens; the consumer's are 48)
PAIRS = [(2, 1, None, 48), (1, 2, None, 48), (2, 1, 16, 48), (2, 1, None, 96)]


@functools.lru_cache(maxsize=None)
def _pair(p_tp: int, d_tp: int, kernel: int | None, p_block: int):
    """(consumer layout, its pools, planner for its producers, the producers as peers with a staging region)."""
    from hybridkv.descriptors.planning import DescriptorPlanner, source_ranks

    def side(seed, tp, rank, block):
        if kernel is None:
            return build(seed, tp=tp, rank=rank, block=block)
        return build_vllm(seed, tp=tp, rank=rank, block=block, kernel=kernel, pages=64)

    layout, memory, pools = side(50, d_tp, 0, 48)
    ranks, _ = source_ranks(d_tp, 0, p_tp)
    prods = [side(10 + r, p_tp, r, p_block) for r in ranks]
    planned = DescriptorPlanner().prepare(tuple(m for _, m, _ in prods), memory)
    peers = [Peer(agent=f"prefill-{r}", channel=None, memory=StagePool(m, WINS).memory, lease_s=30.0)
             for r, (_, m, _) in zip(ranks, prods)]
    return layout, memory, pools, planned, peers


def _draw(rng, layout, tokens: int, *, shared: bool, extra: int = 0) -> dict[int, np.ndarray]:
    """Per group: a request's blocks, distinct (across groups too where they share one pool), scattered, in runs
    or sorted; ``extra`` more in token groups (a producer's list where the consumer hit its prefix cache)."""
    counts = {g.group_id: _counts(layout, tokens)[g.group_id] + (extra if g.block_tokens else 0)
              for g in layout.groups}
    out, taken = {}, set()
    for g in layout.groups:
        pages = layout.regions[g.placements[0].region_id].num_pages
        free = np.array([p for p in range(pages) if p not in taken], dtype=np.int64)
        n, how = counts[g.group_id], rng.integers(3)
        if how == 0:  # a run of neighbours from a random start (rows merge)
            start = int(rng.integers(len(free) - n + 1))
            b = free[start:start + n]
        elif how == 1:  # sorted, gaps at random
            b = np.sort(rng.choice(free, n, replace=False))
        else:
            b = rng.choice(free, n, replace=False)
        out[g.group_id] = np.asarray(b, dtype=np.int64)
        if shared:
            taken.update(int(x) for x in b)
    return out


def _same(x, y) -> bool:
    return (x is None and y is None) or (x is not None and y is not None and np.array_equal(x, y))


class _NoBound:
    """The stager without ``read_rows_least`` while in a ``with``: the exact count decides (the reference)."""

    def __init__(self, *stagers) -> None:
        self.stagers = [s for s in stagers if s is not None]

    def __enter__(self):
        for s in self.stagers:
            s.read_rows_least = None  # shadows the method: import_staging takes it as absent
        return self

    def __exit__(self, *exc) -> None:
        for s in self.stagers:
            del s.read_rows_least


def _full(pool: StagePool):
    """Every slot of ``pool`` taken (give them back with ``pool.give_back``)."""
    taken = []
    while (slot := pool.take(pool.config.slot_bytes)) is not None:
        taken.append(slot)
    return taken


def _equal(a, b) -> bool:
    """Two plans alike row for row (both forms)."""
    return all(_same(getattr(a, f), getattr(b, f))
               for f in ("src", "dst", "src_region", "dst_region", "src_index", "dst_index"))


class _Counted:
    """``stager.read`` counted while in a ``with`` (instrumentation: the real read runs)."""

    def __init__(self, stager) -> None:
        self.stager, self.calls = stager, 0

    def __enter__(self):
        real = type(self.stager).read

        def read(*args, **kw):
            self.calls += 1
            return real(self.stager, *args, **kw)

        self.stager.read = read
        return self

    def __exit__(self, *exc) -> None:
        del self.stager.read


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pair=st.sampled_from(PAIRS), seed=st.integers(0, 2**32 - 1), tokens=st.integers(1, 700),
       case=st.sampled_from(["same", "same", "same", "prefix", "ours-moved", "on"]), own=st.booleans(),
       rows=st.sampled_from([1, 3, 8]))
def test_reused_direct_read_equals_a_fresh_one(pair, seed, tokens, case, own, rows):
    p_tp, d_tp, kernel, p_block = pair
    layout, memory, pools, planned, peers = _pair(*pair)
    rng = np.random.default_rng(seed)
    shared = kernel is not None  # vLLM's groups share one pool
    mine = _draw(rng, layout, tokens, shared=shared)
    sched = TransferScheduler(pools, managed_pool=False)
    rid = f"r{seed}"
    sched.add_request(rid)
    for g, b in mine.items():
        sched.assign(rid, g, [int(x) for x in b])
    # direct_rows of 1 and 3 too: more parts past it (SLOT for sure) at the few blocks these layouts hold
    cfg = StagingConfig(**{**WINS.__dict__, "direct_rows": rows,
                           "mode": StagingMode.ON if case == "on" else StagingMode.AUTO})
    side = types.SimpleNamespace(config=TransportConfig(), scheduler=sched, memory=memory)
    pool = StagePool(memory, cfg) if own else None
    staging = ImportStaging(side, staging=cfg, pool=pool, prepared=lambda agents: planned)

    asked = staging.flags(rid, peers)
    with _NoBound(*(planned.stager(i) for i in range(len(peers)))):  # the decision the exact count makes
        exact = ImportStaging(side, staging=cfg, pool=pool, prepared=lambda agents: planned)
        assert exact.flags(rid, peers) == asked
    for i, peer in enumerate(peers):
        stager = planned.stager(i)
        if stager is None:  # feeds none of our fields (a GQA duplicate): never asked
            assert not asked[i]
            continue
        held = staging._held.get((rid, peer.agent))
        # planned before the Want only under AUTO, where the slot holds as many tokens a block as ours, and kept
        # only for a producer asked to stage (a rank that feeds one GDN state row is not: no staged read is shorter),
        # and not where our blocks alone show it takes more than direct_rows and we have a pool (SLOT for sure)
        sure = own and stager.same_blocks and stager.read_rows_least(mine, mine) > cfg.direct_rows
        assert (held is not None) == (asked[i] and case != "on" and stager.same_blocks and not sure)
        prod = planned._layouts[i]
        extra = int(rng.integers(1, 4)) if case == "prefix" and p_block == 48 else 0  # a prefix hit here
        theirs = _draw(rng, prod, tokens, shared=shared, extra=extra)
        now = {g: b.copy() for g, b in mine.items()}
        if case == "ours-moved":  # our blocks changed between the Want and the Export: one block elsewhere
            g = max(now, key=lambda g: len(now[g]))
            pages = layout.regions[layout.group(g).placements[0].region_id].num_pages
            used = set(now[g].tolist())
            now[g][int(rng.integers(len(now[g])))] = next(p for p in range(pages) if p not in used)
        reuse = held is not None and case in ("same", "on")
        skip = held is None and own and stager.read_rows_least(theirs, now) > cfg.direct_rows
        event(f"{case}: {'reused' if reuse else 'held, planned anew' if held is not None else 'nothing held'}"
              f"{', not planned (SLOT for sure)' if skip else ''}")
        region = peer.memory.regions[-1]
        nbytes = stager.nbytes(theirs)
        offset = int(rng.integers(region.stride * region.num_pages - nbytes + 1)) // region.stride * region.stride
        addr = region.base_addr + offset

        if held is not None:  # the unit: reused (or planned anew) read == a fresh read, row for row
            with _Counted(stager) as counted:
                got = ImportStaging._direct(held, stager, addr, region.device_id, theirs, now)
            assert counted.calls == (0 if reuse else 1)
            assert _equal(got, stager.read(addr, region.device_id, theirs, now)), (case, i)

        # staged_work as an import calls it: equal to planning anew, which it does exactly where reuse cannot apply
        export = wire.Export(request_id=rid, blocks=tuple(wire.GroupBlocks(group_id=g, ids=tuple(int(x) for x in b))
                                                           for g, b in theirs.items()),
                             lease_s=30.0, stage=(offset, nbytes))
        part = Part(rid=rid, peer=peer, export=None, token=b"t", fields=stager.fields)
        sliced = planned.plan(i, theirs, now)
        if held is not None:
            staging._hold((rid, peer.agent), held)  # as flags left it
        with _Counted(stager) as counted:
            w = staging.staged_work(part, export, theirs, now, planned, i, sliced)
        assert counted.calls == (0 if reuse or skip else 1), (case, i)
        assert (rid, peer.agent) not in staging._held  # used once, or dropped
        with _NoBound(stager):  # nothing held, no bound: planned anew, the exact count deciding
            again = staging.staged_work(part, export, theirs, now, planned, i, sliced)
        assert again.staged is None or again.staged.fallback_planned
        assert (w.staged is None) == (again.staged is None)
        if w.staged is None:
            assert _equal(w.plan, again.plan)
            continue
        assert (w.staged.addr, w.staged.dev, w.staged.nbytes) == (again.staged.addr, again.staged.dev,
                                                                  again.staged.nbytes)
        assert w.staged.fallback_planned == (not skip) and (skip or _equal(w.plan, again.plan))
        # what is posted: through a free slot of ours, and where our pool is full the fallback (planned now
        # where staged_work left it unplanned), equal either way
        for full in (False, True):
            taken = _full(pool) if full else []
            with _Counted(stager) as counted:
                got = staging.slot_for(w)
            assert counted.calls == (1 if full and skip else 0)
            staging.free_slot(got)  # the same slot for the reference
            want = staging.slot_for(again)
            staging.free_slot(want)
            assert (got.slot is None) == (want.slot is None) == full
            assert _equal(got.plan, want.plan), (case, i, full)
            assert got.staged.fallback_planned or got.slot is not None  # posted: the slot read, or planned
            for x in taken:
                pool.give_back(x)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pair=st.sampled_from(PAIRS), seed=st.integers(0, 2**32 - 1), tokens=st.integers(1, 700),
       extra=st.sampled_from([0, 0, 1, 3]), cap=st.integers(1, 40))
def test_read_rows_least_is_a_lower_bound(pair, seed, tokens, extra, cap):
    """``StagePlan.read_rows_least`` never exceeds the direct read's real count, over block lists scattered, sorted
    with gaps and in runs (where rows merge most), a prefix hit here (theirs longer), and counted up to ``cap``
    it is the bound capped."""
    layout, memory, pools, planned, peers = _pair(*pair)
    rng = np.random.default_rng(seed)
    shared = pair[2] is not None
    mine = _draw(rng, layout, tokens, shared=shared)
    for i in range(len(peers)):
        stager = planned.stager(i)
        if stager is None:
            continue
        theirs = _draw(rng, planned._layouts[i], tokens, shared=shared, extra=extra if pair[3] == 48 else 0)
        real = stager.read(0, 0, theirs, mine).num_descriptors
        least = stager.read_rows_least(theirs, mine)
        event(f"{'tight' if least == real else 'loose'}; past 8: {least > 8}/{real > 8}")
        assert 0 <= least <= real, (least, real)
        assert stager.read_rows_least(theirs, mine, cap=cap) == min(least, cap)


def test_held_reads_are_bounded_and_dropped(monkeypatch):
    """A held read whose Export never comes (or comes unstaged) is not kept for good: past the row bound the
    oldest goes, and a flags call drops those older than the export timeout."""
    from hybridkv.transport import import_staging

    layout, memory, pools, planned, peers = _pair(2, 1, None, 48)
    sched = TransferScheduler(pools, managed_pool=False)
    clock = [1000.0]
    monkeypatch.setattr(import_staging, "time", types.SimpleNamespace(monotonic=lambda: clock[0]))
    side = types.SimpleNamespace(config=TransportConfig(export_timeout_s=5.0), scheduler=sched, memory=memory)
    staging = ImportStaging(side, staging=WINS, pool=None, prepared=lambda agents: planned)
    mine = _draw(np.random.default_rng(1), layout, 480, shared=False)
    for n in range(3):
        sched.add_request(f"q{n}")
        for g, b in mine.items():
            sched.assign(f"q{n}", g, [int(x) for x in b])
    assert staging.flags("q0", peers) == [True, False]  # rank 1 feeds one GDN row: no staged read is shorter
    rows = staging._held_rows
    assert len(staging._held) == 1 and rows == next(iter(staging._held.values())).plan.num_descriptors > 0
    monkeypatch.setattr(import_staging, "_HELD_ROWS", rows + 1)  # room for one request's reads, not two
    staging.flags("q1", peers)
    assert {k[0] for k in staging._held} == {"q1"} and staging._held_rows == rows
    clock[0] += 6.0  # past the export timeout: q1's Exports came or its import gave up
    monkeypatch.setattr(import_staging, "_HELD_ROWS", 1 << 18)
    staging.flags("q2", peers)
    assert {k[0] for k in staging._held} == {"q2"} and staging._held_rows == rows
    staging.done("q2", peers[0].agent)  # its import ended (fetch's finally): dropped at once
    assert not staging._held and staging._held_rows == 0
