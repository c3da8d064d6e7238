"""hybridkv's planner for the transport: the descriptor compiler decides every pairing.

An endpoint (``hybridkv.transport``) is built with a planner and never pairs
blocks itself; connectors hand it a :class:`DescriptorPlanner`. Per set of
producers one import reads, :func:`pairing_of` decides, in this one place, how
blocks pair:

- whole pages (:class:`PagePlan`), when one producer cuts pages exactly as the
  consumer does (same page bytes group by group and, where both sent field tables,
  the same fields at the same offsets). The compiler's affine fast path emits the
  pages' prepped-list index pairs, which NIXL posts merged (as fast as hand-made
  prepped lists), and predicts NIXL's descriptor count;
- field by field (:class:`FieldPlan`) otherwise: heterogeneous TP (several
  producers, head slices) and different block sizes. :func:`plan_sources` says
  which producer feeds which field (GQA-replicated heads read once), a
  :class:`~hybridkv.descriptors.compiler.TransferPlanner` per producer matches the fields.

The analyzer (descriptors/schemes.py) counts through the same planner, so its
``hybridkv`` count is what NIXL posts for the same request.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from hybridkv.errors import HandshakeRefused
from hybridkv.transport.config import Pairing
from hybridkv.transport.memory import MemoryMap, check_peer_shapes, rebuild_layout
from hybridkv.transport.plan import TransferPlan

from .compiler import TransferPlanner, plan_sources
from .staging import StagePlan, masked_keys, shared_order

_NO_BLOCKS = np.zeros(0, dtype=np.int64)


def source_ranks(local_tp: int, local_rank: int, remote_tp: int) -> tuple[tuple[int, ...], int]:
    """The producer ranks decode rank ``local_rank`` reads, and how many decode ranks
    read each of them (NixlConnector's TP mapping: D >= P reads a head slice of one P
    rank; P > D reads several P ranks)."""
    for name, v in (("local_tp", local_tp), ("remote_tp", remote_tp)):
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise ValueError(f"{name} = {v!r}; expected a positive int")
    if isinstance(local_rank, bool) or not isinstance(local_rank, int) or not 0 <= local_rank < local_tp:
        raise ValueError(f"local_rank = {local_rank}; expected 0..{local_tp - 1}")
    if remote_tp >= local_tp:
        if remote_tp % local_tp:
            raise ValueError(f"producer TP {remote_tp} is not a multiple of consumer TP {local_tp}")
        r = remote_tp // local_tp
        return tuple(range(local_rank * r, (local_rank + 1) * r)), 1
    if local_tp % remote_tp:
        raise ValueError(f"consumer TP {local_tp} is not a multiple of producer TP {remote_tp}")
    r = local_tp // remote_tp
    return (local_rank // r,), r


def pairing_of(sources: Sequence[MemoryMap], dest: MemoryMap) -> Pairing:
    """How ``dest`` pairs with the producers of one import: PAGES where one producer cuts
    pages exactly as ``dest`` does (:func:`page_regions`), FIELDS otherwise. The only place
    this is decided."""
    return Pairing.FIELDS if page_regions(sources, dest) is None else Pairing.PAGES


def page_regions(sources: Sequence[MemoryMap], dest: MemoryMap) -> dict[int, tuple[tuple[int, int], ...]] | None:
    """Per group, which region of the one producer feeds which region of ``dest``, page for
    page; None unless there is one producer whose pages hold what ``dest``'s hold.

    Where both sent field tables, regions pair by content (the same fields at the same
    offsets, equal page bytes): engines number regions by address, so two instances may list
    a group's layers in different orders. Without tables the handshake compared the page
    format itself (PAGES), so the regions correspond in order when page bytes do."""
    if len(sources) != 1:
        return None
    src = sources[0]
    if src.table is None or dest.table is None:
        try:
            check_peer_shapes(dest, src.regions, src.groups)
        except HandshakeRefused:
            return None
        return {g.group_id: tuple(zip(src.group(g.group_id).region_ids, g.region_ids)) for g in dest.groups}
    theirs = {g.group_id: g for g in src.table.groups}
    if set(theirs) != {g.group_id for g in dest.table.groups}:
        return None
    out = {}
    for dg in dest.table.groups:
        sg = theirs[dg.group_id]
        if (sg.kind, sg.block_tokens, sg.window, sg.layers) != (dg.kind, dg.block_tokens, dg.window, dg.layers):
            return None
        by_rows = {p.rows: p.region_id for p in sg.placements}
        pairs = []
        for p in dg.placements:
            sr = by_rows.pop(p.rows, None)
            if sr is None or src.regions[sr].page_bytes != dest.regions[p.region_id].page_bytes:
                return None  # fields found in no src page of this cut (another TP rank's heads, ...)
            pairs.append((sr, p.region_id))
        if by_rows:
            return None
        out[dg.group_id] = tuple(pairs)
    return out


def _lists(source_blocks: Mapping[int, np.ndarray], dest_blocks: Mapping[int, np.ndarray]):
    """Both sides' lists for the groups ``dest`` lists. A group ``dest`` lists that the producer
    did not send pairs with an empty list (refused by the compiler unless ``dest`` wants none);
    a group only the producer sends is not the consumer's to read."""
    if source_blocks.keys() == dest_blocks.keys():
        return source_blocks, dest_blocks
    return {g: source_blocks.get(g, _NO_BLOCKS) for g in dest_blocks}, dest_blocks


class PagePlan:
    """One producer, pages cut alike: whole pages, posted as prepped-list index pairs."""

    def __init__(self, source: MemoryMap, dest: MemoryMap,
                 regions: Mapping[int, Sequence[tuple[int, int]]] | None = None) -> None:
        """``regions``: :func:`page_regions` of the two (computed when not given)."""
        regions = regions if regions is not None else page_regions([source], dest)
        if regions is None:
            raise ValueError("the producer's pages are not cut like the consumer's; expected a field plan")
        self.planner = TransferPlanner.pages(source, dest, regions)
        # A prepped list holds one memory kind: a side that mixes kinds is posted as rows.
        self._rows_only = len({r.mem for r in source.regions}) > 1 or len({r.mem for r in dest.regions}) > 1

    def plan(self, source: int, source_blocks: Mapping[int, np.ndarray],
             dest_blocks: Mapping[int, np.ndarray]) -> TransferPlan:
        if source != 0:
            raise ValueError(f"producer {source}; a page plan reads one producer (0)")
        plan = self.planner.compile(*_lists(source_blocks, dest_blocks))
        if self._rows_only:
            return dataclasses.replace(plan, src_index=None, dst_index=None)
        return plan


class FieldPlan:
    """Field by field over the producers one consumer rank reads (heterogeneous TP, block sizes).

    A producer that feeds no field (all its heads duplicate another's) gets an empty
    plan: the consumer tells it Done without reading. ``sources``: producer rank ->
    the field keys read from it.
    """

    def __init__(self, sources: Sequence[MemoryMap], dest: MemoryMap, *, bridge_padding: bool = False,
                 coalesce: bool = True) -> None:
        local = dest.layout
        if local is None:
            raise ValueError("the consumer's memory map has no layout; expected one made by from_layout "
                             "to pair by fields")
        layouts = [m.layout if m.layout is not None else rebuild_layout(m, local.geometry) for m in sources]
        ranks = [x.rank for x in layouts]
        if len(set(ranks)) != len(ranks):
            raise ValueError(f"producer ranks {ranks} repeat; expected one producer per rank")
        assigned = plan_sources(layouts, local)
        self.sources: dict[int, frozenset] = {layouts[i].rank: keys for i, keys in assigned.items()}
        self.planners: list[TransferPlanner | None] = [
            TransferPlanner(x, local, keys=assigned[i], bridge_padding=bridge_padding) if assigned.get(i) else None
            for i, x in enumerate(layouts)]
        self._layouts, self._local, self._assigned = layouts, local, assigned
        self._coalesce = coalesce
        self._stagers: dict[tuple[int, bytes | None], StagePlan | None] = {}

    def stager(self, source: int, fields: bytes | None = None) -> StagePlan | None:
        """How producer ``source`` stages what this rank reads from it, or None where it feeds nothing.
        It packs only the fields this rank reads from it (where GQA has this rank read a replicated head
        from another producer, not that head): the Want names them (:attr:`StagePlan.fields`). ``fields``:
        the mask a Want named instead (``b""``: every field of this rank it holds, as a Want without one
        asks), where this rank reads what it reads out of that."""
        key = (source, fields)
        if key not in self._stagers:
            reads = self._assigned.get(source)
            stager = None
            if reads:
                src = self._layouts[source]
                keys = reads if fields is None else masked_keys(shared_order(src, self._local), fields)
                stager = StagePlan(src, self._local, keys, reads)
            self._stagers[key] = stager
        return self._stagers[key]

    def plan(self, source: int, source_blocks: Mapping[int, np.ndarray],
             dest_blocks: Mapping[int, np.ndarray]) -> TransferPlan:
        if not 0 <= source < len(self.planners):
            raise ValueError(f"producer {source}; expected 0..{len(self.planners) - 1}")
        planner = self.planners[source]
        if planner is None:
            return TransferPlan.empty()
        return planner.compile(*_lists(source_blocks, dest_blocks), coalesce=self._coalesce)


@dataclass(frozen=True, kw_only=True)
class DescriptorPlanner:
    """The transport's :class:`~hybridkv.transport.plan.Planner`, made of the descriptor compiler.

    ``pairing``: what this side's handshake promises. PAGES: peers must cut pages
    alike (checked at handshake). FIELDS: field tables travel and page shapes may
    differ; pages still pair whole wherever :func:`pairing_of` finds them cut alike.
    ``bridge_padding``: see :class:`~hybridkv.descriptors.compiler.TransferPlanner`.
    ``coalesce``: False posts a field plan piece by piece, block by block, as engines build their lists
    (a baseline for benchmarks and tests; the transport never wants it).
    """

    pairing: Pairing = Pairing.FIELDS
    bridge_padding: bool = False
    coalesce: bool = True

    def prepare(self, sources: Sequence[MemoryMap], dest: MemoryMap) -> PagePlan | FieldPlan:
        if not sources:
            raise ValueError("no producers; expected at least one")
        regions = page_regions(sources, dest)  # what pairing_of decides by
        if regions is not None:
            return PagePlan(sources[0], dest, regions)
        if self.pairing is Pairing.PAGES:
            raise ValueError(f"{len(sources)} producer(s) whose pages are not cut like this side's; expected a "
                             "planner that pairs by fields (pairing=FIELDS)")
        return FieldPlan(sources, dest, bridge_padding=self.bridge_padding, coalesce=self.coalesce)

    def stager(self, source: MemoryMap, dest: MemoryMap, fields: bytes = b"") -> StagePlan | None:
        """Producer side: what it stages for consumer ``dest`` when asked, or None where pages pair whole
        (nothing to gather) or nothing is shared. ``fields``: the Want's mask over the fields of ``dest`` it
        holds (:func:`~hybridkv.descriptors.staging.field_mask`; empty: every one); ValueError naming a bad one."""
        if page_regions([source], dest) is not None or source.layout is None:
            return None
        local = source.layout
        remote = dest.layout if dest.layout is not None else rebuild_layout(dest, local.geometry)
        order = shared_order(local, remote)
        return StagePlan(local, remote, masked_keys(order, fields)) if order else None


__all__ = ["DescriptorPlanner", "FieldPlan", "PagePlan", "page_regions", "pairing_of", "source_ranks"]
