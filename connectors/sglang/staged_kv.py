"""KV at different attention TP through staging slots (``HYBRIDKV_SGLANG_STAGING``).

Sliced, a prefill rank writes one descriptor per head slice of every token of every KV layer buffer
(sliced_lists.py). Staged, it packs the decode rank's head slices of a chunk's pages into a slot of its own
pool (descriptors/staging.py's StagePlan makes the copies, the core's Copier runs them) and WRITEs the slot:

* DIRECT (P < D: the decode rank's slice of a prefill page is its whole page): into the decode's pages, one
  row per run of consecutive decode pages;
* SLOT (P > D: a decode page interleaves several prefill ranks' heads token by token, so a direct write
  would not merge): into a slot the decode took for this prefill rank when it sent the room's METADATA, one
  row per chunk; the decode unpacks it into its pages once every writer of the room landed, before it
  reports the room ready to SGLang.

The compact page (what one slot holds per page) is the decode's own page cut down to the fields this prefill
rank writes, in the decode's order, so the decode builds its unpack from its own layout alone
(:func:`writer_keys`); the prefill checks at REGISTER that its plan packs exactly that page, else it writes
that decode sliced. A room's LANDED names the pages a writer put in its decode slot (a chunk may fall back
to the sliced lists): the decode unpacks only those.

Slots are fenced resources. The prefill's goes back once its WRITE ended (landed, failed or aborted; one
NIXL would not abort keeps it until it ends: prefill_side.py). The decode's goes back only when the room's
import is over (every writer drained, or the drain deadline: decode_side.py, the ImportLedger's rule),
never while a write may land; ``HYBRIDKV_STAGING_RULE_OFF=1`` (tests only) gives it back as soon as the
room fails, to show why. A full pool on either side falls back to the sliced lists; nothing waits for a slot.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Optional

import numpy as np

from hybridkv import wire
from hybridkv.connectors.sglang.adopt import KV_GROUP, AdoptedLayout
from hybridkv.connectors.sglang.pairing import field_layout, held_keys, prefill_sources
from hybridkv.connectors.sglang.shapes import Parallel
from hybridkv.descriptors.staging import StagePlan
from hybridkv.layout import Layout
from hybridkv.layout.fields import FieldKey, FieldKind
from hybridkv.layout.kinds.attention import heads_of_rank
from hybridkv.transport import staging as st

logger = logging.getLogger(__name__)


def _kv_buffers(side: AdoptedLayout) -> set[int]:
    return {b.key for b in side.buffers if b.group_id == KV_GROUP}


def writer_keys(decode: AdoptedLayout, prefill_tp: int) -> dict[int, frozenset[FieldKey]] | None:
    """Per prefill rank that decode rank ``decode`` reads, the KV head slices it writes there (a head held by
    several prefill ranks, GQA, by the first: pairing.plan_peer's rule); None where the KV moves as whole items
    (nothing to stage)."""
    d = decode.parallel
    sources, _ = prefill_sources(prefill_tp, d.attn_tp, d.attn_rank)
    peer = dataclasses.replace(d, attn_tp=prefill_tp, attn_rank=0, state_tp=prefill_tp)
    keys = held_keys(decode, rank=d.attn_rank, peer=peer, only=_kv_buffers(decode))
    if not keys or any(k[0] is not FieldKind.KV for k in keys):
        return None
    out: dict[int, set[FieldKey]] = {r: set() for r in sources}
    for k in keys:
        head = k[2] % d.kv_heads
        writer = next((r for r in sources if head in heads_of_rank(d.kv_heads, prefill_tp, r)), None)
        if writer is None:
            return None
        out[writer].add(k)
    return {r: frozenset(ks) for r, ks in out.items() if ks}


def _kv_only(layout: Layout) -> Layout:
    """The KV group of a field layout (what is staged; state and aux stay rows)."""
    return dataclasses.replace(layout, groups=tuple(g for g in layout.groups if g.group_id == KV_GROUP))


def _compact_fields(plan: StagePlan) -> list[tuple]:
    return [(f.key, f.offset, f.nbytes) for g in plan.compact.groups for p in g.placements for f in p.fields]


def _runs(pages: np.ndarray) -> int:
    return 0 if not len(pages) else 1 + int(np.count_nonzero(np.diff(pages) != 1))


# --------------------------------------------------------------------------- prefill side


@dataclass(frozen=True, kw_only=True, eq=False)
class StagedPeer:
    """What this prefill rank stages for one decode rank: the plan, and the decode's pool (None: it has none, so
    only DIRECT writes)."""

    plan: StagePlan
    page_bytes: int  # compact bytes per page
    rows_per_page: int  # rows of a DIRECT write of one page
    merges: bool  # DIRECT rows of consecutive decode pages merge (one run, rows_per_page rows)
    region: Optional[wire.RegionInfo]

    @classmethod
    def make(cls, *, local: AdoptedLayout, peer: AdoptedLayout, src: Layout, dst: Layout,
             keys: frozenset[FieldKey], region: Optional[wire.RegionInfo]) -> tuple[Optional[StagedPeer], str]:
        """(the staged peer, "") or (None, why this pair is written sliced)."""
        p = local.parallel
        theirs = writer_keys(peer, p.attn_tp)
        if theirs is None or theirs.get(p.attn_rank, frozenset()) != keys:
            return None, "the decode would unpack other fields than this rank writes (one-sided buffers?)"
        src, dst = _kv_only(src), _kv_only(dst)
        plan = StagePlan(src, dst, keys, dst_order=True)
        if _compact_fields(plan) != _compact_fields(StagePlan(dst, dst, keys, dst_order=True)):
            return None, "the packed page is not the decode's page cut down (buffer order differs)"
        one = plan.read(0, 0, {KV_GROUP: np.arange(1)}, {KV_GROUP: np.arange(1)}).num_descriptors
        two = plan.read(0, 0, {KV_GROUP: np.arange(2)}, {KV_GROUP: np.arange(2)}).num_descriptors
        return cls(plan=plan, page_bytes=plan.page_bytes[KV_GROUP], rows_per_page=one, merges=two == one,
                   region=region), ""

    def direct_rows(self, dst_pages: np.ndarray) -> int:
        return self.rows_per_page * (_runs(dst_pages) if self.merges else len(dst_pages))


@dataclass(eq=False, kw_only=True)
class StagedWrite:
    """One chunk's staged WRITE to one decode rank: rows from this rank's slot."""

    route: st.Route
    slot: st.Slot
    local: np.ndarray
    remote: np.ndarray
    pages: tuple[int, int]  # the room's decode pages [start, stop) it covers (SLOT: named in LANDED)
    nbytes: int


class PrefillStaging:
    """This prefill rank's pool, shared by the workers (``lock``: the scheduler's)."""

    def __init__(self, pool: st.StagePool, lock: threading.RLock) -> None:
        self.pool = pool
        self.lock = lock

    def prepare(self, peer: StagedPeer, src_pages: np.ndarray, dst_pages: np.ndarray, pages: tuple[int, int],
                offer: Optional[tuple[int, int]], sliced: int) -> Optional[StagedWrite]:
        """The chunk packed into a slot of this rank's pool and its rows, or None: written sliced (the route,
        or no free slot). ``offer``: the decode's slot for this rank (offset, bytes in its region) or None."""
        start, stop = pages
        offered = offer is not None and peer.region is not None and stop * peer.page_bytes <= offer[1] \
            and offer[0] + offer[1] <= peer.region.stride * peer.region.num_pages
        direct = peer.direct_rows(dst_pages)
        if not offered and direct >= sliced:
            return None
        nbytes = peer.plan.nbytes({KV_GROUP: src_pages})
        way = st.route(self.pool.config, sliced=sliced, direct=direct, own_pool=offered, nbytes=nbytes,
                       mem=self.pool.region.mem)
        if way is st.Route.SLICED:
            return None
        with self.lock:
            slot = self.pool.take(nbytes)
        if slot is None:
            return None  # full: sliced, never waits
        try:
            self.pool.copier.run(peer.plan.pack({KV_GROUP: src_pages}, base=slot.offset))
            addr, dev = self.pool.base + slot.offset, self.pool.region.device_id
            if way is st.Route.DIRECT:
                rows = peer.plan.read(addr, dev, {KV_GROUP: np.arange(len(src_pages))}, {KV_GROUP: dst_pages})
            else:
                assert offer is not None and peer.region is not None
                rows = st.slot_rows(addr, dev, peer.region.base_addr + offer[0] + start * peer.page_bytes,
                                    peer.region.device_id, nbytes)
        except Exception:
            self.give_back([slot])
            raise
        return StagedWrite(route=way, slot=slot, local=rows.src, remote=rows.dst, pages=pages, nbytes=nbytes)

    def give_back(self, slots) -> None:
        with self.lock:
            for s in slots:
                self.pool.give_back(s)


def decode_region(memory_regions: tuple[wire.RegionInfo, ...], kv_mem: wire.Mem,
                  region: Optional[wire.RegionInfo]) -> tuple[Optional[wire.RegionInfo], str]:
    """A decode's staging region as its REGISTER names it, checked: the region after its layout's, of its KV's
    memory kind; (None, why) otherwise."""
    if region is None:
        return None, ""
    if region.region_id != len(memory_regions) or region.mem is not kv_mem:
        return None, (f"its staging region is region {region.region_id} of {region.mem.name}; expected region "
                      f"{len(memory_regions)} of {kv_mem.name}")
    return region, ""


# --------------------------------------------------------------------------- decode side


class DecodeSlots:
    """This decode rank's pool: a slot per prefill rank of a room at different TP, taken with its METADATA, and
    the unpack of what the writers put there. Not thread-safe: the imports' lock is held around each call."""

    def __init__(self, adopted: AdoptedLayout, pool: st.StagePool) -> None:
        self.adopted = adopted
        self.pool = pool
        self._plans: dict[int, Optional[dict[int, StagePlan]]] = {}

    @property
    def fence(self) -> bool:
        return self.pool.config.fence

    def plans(self, prefill_tp: int) -> Optional[dict[int, StagePlan]]:
        """Per prefill rank, the plan whose compact page that rank writes into its slot (None: no staging)."""
        if prefill_tp not in self._plans:
            got = None
            if prefill_tp != self.adopted.parallel.attn_tp:
                try:
                    keys = writer_keys(self.adopted, prefill_tp)
                except ValueError:
                    keys = None
                if keys:
                    d = self.adopted.parallel
                    mine = _kv_only(field_layout(self.adopted, peer=dataclasses.replace(
                        d, attn_tp=prefill_tp, attn_rank=0, state_tp=prefill_tp)))
                    got = {r: StagePlan(mine, mine, ks, dst_order=True) for r, ks in keys.items()}
            self._plans[prefill_tp] = got
        return self._plans[prefill_tp]

    def offer(self, prefill_tp: int, pages: int) -> dict[int, st.Slot]:
        """A slot per writer for a room of ``pages`` KV pages, or none at all (the pool is full: sliced)."""
        plans = self.plans(prefill_tp)
        if not plans or pages <= 0:
            return {}
        taken: dict[int, st.Slot] = {}
        for rank, plan in plans.items():
            slot = self.pool.take(pages * plan.page_bytes[KV_GROUP])
            if slot is None:
                self.give_back(taken)
                return {}
            taken[rank] = slot
        return taken

    def unpack(self, prefill_tp: int, slots: Mapping[int, st.Slot], staged: Mapping[int, tuple[int, ...]],
               kv_pages: np.ndarray) -> int:
        """Copy the pages each writer staged from its slot into this rank's pages; the pages unpacked.
        ValueError (nothing copied) for a range outside the room or a slot."""
        plans = self.plans(prefill_tp) or {}
        steps = []
        n = 0
        for rank, flat in staged.items():
            plan, slot = plans.get(rank), slots.get(rank)
            if plan is None or slot is None or len(flat) % 2:
                raise ValueError(f"prefill rank {rank} staged pages {list(flat)[:4]} with no slot of this room")
            pb = plan.page_bytes[KV_GROUP]
            for a, b in zip(flat[::2], flat[1::2]):
                if not 0 <= a < b <= len(kv_pages) or b * pb > slot.nbytes:
                    raise ValueError(f"prefill rank {rank} staged pages {a}..{b}; expected a range inside the "
                                     f"room's {len(kv_pages)} pages and its slot of {slot.nbytes} bytes")
                steps.append(plan.unpack({KV_GROUP: np.arange(b - a)}, {KV_GROUP: kv_pages[a:b]},
                                         base=slot.offset + a * pb))
                n += b - a
        self.pool.copier.run(st.CopySteps.concat(steps))
        return n

    def give_back(self, slots: Mapping[int, st.Slot]) -> None:
        for s in slots.values():
            self.pool.give_back(s)


__all__ = ["DecodeSlots", "PrefillStaging", "StagedPeer", "StagedWrite", "decode_region", "writer_keys"]
