"""The staging side of an import: whether to ask a producer to stage, the staged read's plan, our slot.

Heterogeneous TP in pull mode: a producer can pack the slices one consumer rank reads into a slot of its
own (:mod:`hybridkv.transport.staging`, the rules of a fenced resource). :class:`ImportStaging` is held
by :class:`~hybridkv.transport.fetch.Importer` and decides, before the Want, whether to ask each
producer to stage (under AUTO only where staging can win, which plans the slot's read from our blocks); once
the Export names a slot it plans the read (sliced, straight from the slot into our pages, or through a slot of
ours; the slot's read weighed before the Want is moved to the slot where the Export's blocks allow, and not
planned at all where a lower bound from our blocks shows the way is a slot of ours whatever its count, unless our
pool is full at post time), takes our slot at post time, unpacks it once every READ ended and gives it back when
nothing more can land there.
:class:`Work` (one producer's READ) is defined here, as its staged read and slot are this module's.
"""

from __future__ import annotations

import dataclasses
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from hybridkv import wire
from hybridkv.transport.copies import CopySteps
from hybridkv.transport.parts import Part
from hybridkv.transport.plan import PeerPlanner, TransferPlan
from hybridkv.transport.side import Peer, Side
from hybridkv.transport.staging import (Route, Slot, StagePool, Stager, StagingConfig, StagingMode, may_stage, route,
                                       slot_rows, staging_region)

@dataclass(frozen=True, eq=False, kw_only=True)
class Staged:
    """A staged part read through this side's own slot: the producer's slot, and how to unpack it."""

    stager: Stager
    src_blocks: dict[int, np.ndarray]
    dst_blocks: dict[int, np.ndarray]
    addr: int   # the producer's slot
    dev: int
    nbytes: int
    #: False: the direct read was not planned (our blocks alone showed it takes more than ``direct_rows``, so the
    #: way was SLOT whatever its count) and the Work's plan is the sliced one until ``slot_for``, which plans it
    #: only where no slot of ours is free and keeps the shorter of the two, as ``staged_work`` would have
    fallback_planned: bool = True


@dataclass(frozen=True, eq=False, kw_only=True)
class Work:
    """One producer's READ of an import: its part and the plan for it."""

    part: Part
    #: src: the producer's side, dst: ours; what is posted once ``ImportStaging.slot_for`` made it
    plan: TransferPlan
    #: staged, best read through a slot of ours (the plan is the direct read, used where none is free)
    staged: Staged | None = None
    slot: Slot | None = None  # ours, taken at post time: the READ lands there, then it is unpacked


@dataclass(frozen=True, eq=False, kw_only=True)
class _Held:
    """Under AUTO, the direct read of a part planned before its Want (``flags``), from our blocks alone, for the
    Export's to reuse (:meth:`ImportStaging._direct`): the read takes the producer's blocks only by their count."""

    stager: Stager
    mine: dict[int, np.ndarray]
    addr: int  # the slot address it was planned at (the staging region's base)
    dev: int
    plan: TransferPlan
    made: float  # time.monotonic()


#: rows of held direct reads kept at most (about 16 MB of plan; a held read whose Export never comes, or
#: comes unstaged, is dropped with the oldest or after the export timeout)
_HELD_ROWS = 1 << 18


class ImportStaging:
    """The consumer's staged reads. Given the side (its config, scheduler and memory map), the staging
    config (None or OFF: never ask a producer to stage), this side's own slots (None: a staged part is
    read straight from the producer's slot) and ``prepared(agents)``, the planner for a set of producers."""

    def __init__(self, side: Side, *, staging: StagingConfig | None, pool: StagePool | None,
                 prepared: Callable[[Sequence[str]], PeerPlanner]) -> None:
        #: whether to ask producers to stage (None or OFF: never), and this side's own slots
        self._staging = staging if staging is not None and staging.mode is not StagingMode.OFF else None
        self._pool = pool
        self._prepared = prepared
        self._config = side.config
        self._scheduler = side.scheduler
        self._memory = side.memory
        #: (request, producer agent) -> its direct read planned before the Want (AUTO), oldest first
        self._held: dict[tuple[str, str], _Held] = {}
        self._held_rows = 0

    def flags(self, request_id: str, targets: Sequence[Peer]) -> list[bool]:
        """Per producer: whether to ask it to stage (pull mode, staging on here, a field-paired read, and under
        AUTO one that staging can win: else its pack and slot are spent for a read that goes sliced)."""
        if self._staging is None or self._config.mode is not wire.Mode.PULL:
            return [False] * len(targets)
        try:
            planned = self._prepared([p.agent for p in targets])
        except ValueError:
            return [False] * len(targets)  # refused again, with its reason, once the Exports are in
        stager_of = getattr(planned, "stager", None)
        stagers = [None if stager_of is None else stager_of(i) for i in range(len(targets))]
        if self._staging.mode is not StagingMode.AUTO:
            return [s is not None for s in stagers]
        try:
            mine = {g.group_id: np.asarray(self._scheduler.blocks(request_id, g.group_id), dtype=np.int64)
                    for g in self._memory.groups}
        except ValueError:
            return [s is not None for s in stagers]  # unknown here: the import refuses it with its reason
        self._drop_stale()
        out = []
        for i, (s, p) in enumerate(zip(stagers, targets)):
            ask, direct = (False, None) if s is None else self._weigh(
                self._staging, own_pool=self._pool is not None, planned=planned, source=i, stager=s, peer=p.memory,
                mine=mine)
            self._forget((request_id, p.agent))
            if ask and direct is not None:  # the Export's staged_work reuses it where its blocks allow
                self._hold((request_id, p.agent), direct)
            out.append(ask)
        return out

    def fields(self, targets: Sequence[Peer]) -> list[bytes]:
        """Per producer: the fields a Want asking it to stage names (``Stager.fields``): only those this rank
        reads from it (where GQA has it read a replicated head from another producer, not that head); b"" where
        that is every field it holds, or nothing is staged from it."""
        try:
            planned = self._prepared([p.agent for p in targets])
        except ValueError:
            return [b""] * len(targets)
        stager_of = getattr(planned, "stager", None)
        stagers = [None if stager_of is None else stager_of(i) for i in range(len(targets))]
        return [getattr(s, "fields", b"") if s is not None else b"" for s in stagers]

    @staticmethod
    def _weigh(config: StagingConfig, *, own_pool: bool, planned: PeerPlanner, source: int, stager: Stager,
               peer, mine: dict[int, np.ndarray]) -> tuple[bool, _Held | None]:
        """Whether ``route`` can stage producer ``source``'s part, weighed from our own blocks before its
        Export (``staging.may_stage``), and the direct read it planned for that (None where it planned none).
        Where blocks hold as many tokens on both sides the producer exports as many per group, or more at our
        prefix hit (more bytes, the same direct rows in each group, fewer joined across groups). The sliced plan
        is at most every block its own run: one block's rows times the blocks. Anything else (block sizes differ,
        no staging region): ask, as route decides after."""
        region = staging_region(peer)
        if region is None or not stager.same_blocks:
            return True, None
        try:
            most = sum(len(b) * _block_rows(planned, source, g) for g, b in mine.items() if len(b))
            nbytes = stager.nbytes(mine)
            if not may_stage(config, sliced_most=most, direct=0, direct_most=0, own_pool=own_pool, nbytes_least=nbytes,
                             mem=region.mem):
                return False, None  # loses even against a read of no rows: the direct read need not be planned
            least = _slot_for_sure(config, own_pool, stager, mine, mine)
            if least:  # the way is SLOT at any count from there (one row): decided without planning the read
                return may_stage(config, sliced_most=most, direct=least, direct_most=least, own_pool=own_pool,
                                 nbytes_least=nbytes, mem=region.mem), None
            plan = stager.read(region.base_addr, region.device_id, mine, mine)
        except ValueError:
            return True, None  # the Export's own plan refuses it, with its reason
        direct = plan.num_descriptors
        groups = sum(1 for b in mine.values() if len(b))  # at most one row joined across each boundary
        ask = may_stage(config, sliced_most=most, direct=direct, direct_most=direct + max(groups - 1, 0),
                        own_pool=own_pool, nbytes_least=nbytes, mem=region.mem)
        return ask, _Held(stager=stager, mine=mine, addr=region.base_addr, dev=region.device_id, plan=plan,
                          made=time.monotonic())

    def staged_work(self, part: Part, export: wire.Export, theirs: dict[int, np.ndarray],
                    mine: dict[int, np.ndarray], planned: PeerPlanner, source: int, sliced: TransferPlan) -> Work:
        """The producer packed our slices into its slot: read the slot (straight into our pages where
        that takes few descriptors, else through a slot of ours), unless the sliced plan is as short."""
        held = self._forget((part.rid, part.peer.agent))  # used here or never
        stager = _asked_stager(planned, source, part.fields)
        region = staging_region(part.peer.memory)
        if stager is None or region is None or len(export.stage) != 2:
            raise ValueError(f"export of {part.rid} names a staging slot {export.stage}; expected none from a "
                             "producer this side cannot read staged")
        offset, nbytes = export.stage
        want = stager.nbytes(theirs)
        if nbytes != want or offset + nbytes > region.stride * region.num_pages:
            raise ValueError(f"export of {part.rid}: staging slot ({offset}, {nbytes} bytes); expected {want} bytes "
                             f"inside the producer's staging region of {region.stride * region.num_pages}")
        addr = region.base_addr + offset
        own_pool = self._pool is not None
        least = 0 if held is not None or self._staging is None else _slot_for_sure(self._staging, own_pool, stager,
                                                                                   theirs, mine)
        if least:  # SLOT or SLICED whatever the direct read's count: it is planned only if our pool is full
            way = route(self._staging, sliced=sliced.num_descriptors, direct=least, own_pool=True, nbytes=nbytes,
                        mem=region.mem)
            if way is Route.SLICED:
                return Work(part=part, plan=sliced)
            return Work(part=part, plan=sliced, staged=Staged(stager=stager, src_blocks=theirs, dst_blocks=mine,
                                                              addr=addr, dev=region.device_id, nbytes=nbytes,
                                                              fallback_planned=False))
        direct = self._direct(held, stager, addr, region.device_id, theirs, mine)
        direct.check()
        way = route(self._staging, sliced=sliced.num_descriptors, direct=direct.num_descriptors,
                    own_pool=own_pool, nbytes=nbytes, mem=region.mem)
        if way is Route.SLICED:
            return Work(part=part, plan=sliced)  # the slot goes unread; the export's end frees it
        best = direct if direct.num_descriptors <= sliced.num_descriptors else sliced
        if way is Route.DIRECT:
            return Work(part=part, plan=best)
        # Through our slot; the direct read (or the sliced plan) stays the fallback where none is free.
        return Work(part=part, plan=best, staged=Staged(stager=stager, src_blocks=theirs, dst_blocks=mine,
                                                        addr=addr, dev=region.device_id, nbytes=nbytes))

    @staticmethod
    def _direct(held: _Held | None, stager: Stager, addr: int, dev: int, theirs: dict[int, np.ndarray],
                mine: dict[int, np.ndarray]) -> TransferPlan:
        """The direct read of the producer's slot at ``addr``: ``held``, the one planned before the Want, moved
        to ``addr`` where its inputs are this read's (the same stager and slot device, our blocks unchanged, as
        many of the producer's blocks per group as ours: ``Stager.read`` takes theirs only by count), else
        planned anew (a prefix hit here, blocks of other sizes, nothing held). Equal either way; reusing takes
        the planning off the Export -> post path."""
        rebase = getattr(stager, "rebase", None)
        if held is not None and rebase is not None and held.stager is stager and held.dev == dev \
                and _same_blocks(held.mine, theirs, mine):
            return rebase(held.plan, was=held.addr, slot_addr=addr, slot_dev=dev)
        return stager.read(addr, dev, theirs, mine)

    def done(self, request_id: str, agent: str) -> None:
        """The import of ``request_id`` from producer ``agent`` ended: a direct read still held for it (its
        Export never came, or came unstaged) is dropped now."""
        self._forget((request_id, agent))

    def _hold(self, key: tuple[str, str], held: _Held) -> None:
        """Keep a direct read for the Export, the oldest dropped past :data:`_HELD_ROWS` rows in all."""
        rows = held.plan.num_descriptors
        if rows > _HELD_ROWS:
            return
        while self._held and self._held_rows + rows > _HELD_ROWS:
            self._forget(next(iter(self._held)))
        self._held[key] = held
        self._held_rows += rows

    def _forget(self, key: tuple[str, str]) -> _Held | None:
        held = self._held.pop(key, None)
        if held is not None:
            self._held_rows -= held.plan.num_descriptors
        return held

    def _drop_stale(self) -> None:
        """Held reads older than the export timeout: their import got its Exports or gave up (fetch's wait)."""
        before = time.monotonic() - self._config.export_timeout_s
        while self._held:
            key, held = next(iter(self._held.items()))
            if held.made >= before:
                break
            self._forget(key)

    def slot_for(self, w: Work) -> Work:
        """At post time: a staged part reads into a slot of ours if one is free (else directly). The Work it
        returns holds the plan to post."""
        st, pool = w.staged, self._pool
        if st is None:
            return w
        if pool is None or (slot := pool.take(st.nbytes)) is None:
            # full: the direct read (back-pressure falls back, never waits)
            return w if st.fallback_planned else _fallback(w, st)
        plan = slot_rows(st.addr, st.dev, pool.base + slot.offset, pool.region.device_id, st.nbytes)
        return dataclasses.replace(w, plan=plan, slot=slot)

    def unpack(self, work: Sequence[Work]) -> str | None:
        """Every READ landed: staged parts go from our slots into our pages, every part's copies in one run (on
        a GPU one row table, one launch per row class and one wait for all producers, not one each; each step
        checked before any byte moves). An error, or None."""
        pool = self._pool
        if pool is None:
            return None
        try:
            parts = [w.staged.stager.unpack(w.staged.src_blocks, w.staged.dst_blocks, base=w.slot.offset)
                     for w in work if w.slot is not None and w.staged is not None]
            if parts:
                pool.copier.run(CopySteps.concat(parts))  # parts write disjoint fields of our pages from disjoint slots
        except Exception as exc:  # a bug, not the peer's: the import fails, the engine lives
            return f"unpacking the staged read failed: {type(exc).__name__}: {exc}"
        return None

    def free_slot(self, w: Work) -> None:
        """Its READ ended (landed, failed or aborted): nothing more lands in its slot."""
        if w.slot is not None and self._pool is not None:
            self._pool.give_back(w.slot)


def _fallback(w: Work, st: Staged) -> Work:
    """``w`` (its plan the sliced one) with the fallback ``staged_work`` leaves unplanned where the way is SLOT for
    sure: the direct read where it is no longer than the sliced plan. Planned here, on the post path, only where
    our pool is full. A read that does not plan (a bug: the Export was checked, and the bound paired the block
    lists) posts the sliced plan, a read of the same bytes, rather than raising while other parts hold slots."""
    try:
        direct = st.stager.read(st.addr, st.dev, st.src_blocks, st.dst_blocks)
        direct.check()
    except ValueError:
        direct = w.plan
    plan = direct if direct.num_descriptors <= w.plan.num_descriptors else w.plan
    return dataclasses.replace(w, plan=plan, staged=dataclasses.replace(st, fallback_planned=True))


def _slot_for_sure(config: StagingConfig, own_pool: bool, stager: Stager, theirs: dict[int, np.ndarray],
                   mine: dict[int, np.ndarray]) -> int:
    """A lower bound on the rows of the direct read of ``theirs`` into ``mine`` where it passes
    ``config.direct_rows`` and we have a pool of our own: ``route``'s way is then SLOT (one row) or SLICED
    whatever the exact count, so the read need not be planned to decide. 0 otherwise (plan it), or where the
    stager has no bound."""
    least_of = getattr(stager, "read_rows_least", None)
    if not own_pool or least_of is None:
        return 0
    least = least_of(theirs, mine, cap=config.direct_rows + 1)
    return least if least > config.direct_rows else 0


def _asked_stager(planned: PeerPlanner, source: int, fields: bytes | None) -> Stager | None:
    """The stager of what producer ``source`` packed: the planner's own (only the fields this rank reads from it),
    or where its Want named other fields (``Consumer.want`` called with none: every field), the planner's for
    that mask."""
    stager_of = getattr(planned, "stager", None)
    if stager_of is None:
        return None
    stager = stager_of(source)
    if stager is None or fields is None or fields == getattr(stager, "fields", b""):
        return stager
    return stager_of(source, fields)


def _same_blocks(planned: dict[int, np.ndarray], theirs: dict[int, np.ndarray], mine: dict[int, np.ndarray]) -> bool:
    """Whether a read planned from ``planned`` (our blocks then, as both sides' lists) is the read of ``theirs``
    into ``mine``: ours unchanged, and theirs as many per group."""
    if planned.keys() != mine.keys():
        return False
    return all(len(theirs.get(g, ())) == len(planned.get(g, ())) for g in planned.keys() | theirs.keys()) \
        and all(np.array_equal(b, mine[g]) for g, b in planned.items())


#: per planner (dropped with it): rows of a producer's sliced plan for one block of a group
_ROWS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _block_rows(planned: PeerPlanner, source: int, group: int) -> int:
    """Rows of producer ``source``'s sliced plan for one block of ``group`` (the same for any block: rows join
    within a page alike everywhere), kept as long as the planner is."""
    try:
        rows = _ROWS.setdefault(planned, {})
    except TypeError:  # a planner that takes no weak reference (slots): not kept
        rows = {}
    key = (source, group)
    if key not in rows:
        one = np.zeros(1, dtype=np.int64)
        rows[key] = planned.plan(source, {group: one}, {group: one}).num_descriptors
    return rows[key]


__all__ = ["ImportStaging", "Staged", "Work"]
