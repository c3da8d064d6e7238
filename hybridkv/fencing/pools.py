"""From a :class:`~hybridkv.layout.Layout` to what a :class:`TransferScheduler` is built from.

The scheduler knows blocks, not bytes: it needs to know which KV-cache groups
draw their block ids from one physical pool (a :class:`PoolLayout`), and which
separately-arriving pieces (:class:`Component`) a remote request must receive
before it may compute. Both follow from the layout, and :func:`scheduler_inputs`
derives them so that an engine adopting hybridkv does not re-derive them by hand:

- **pools**: groups placed in a common region share one pool. Block ``b`` of a
  group is page ``b`` of every region the group is placed in, so two groups that
  touch one region name the same pages with the same ids (vLLM's hybrid
  allocator: layer ``i`` of every group aliases one tensor). Such groups must
  share one namespace in the fence table, or a block freed through one group
  could be handed out through the other while still fenced. Groups with regions
  of their own (hybridkv's planned layout, SGLang's KV pages and Mamba slots)
  get a pool each.
- **components**: what a group's layer kind says arrives separately (its spec's
  ``components``): an attention group (full or sliding window) one piece, its KV;
  a GDN group two, conv state and SSM state, because engines move them as
  separate transfers and a request is complete only when both have landed
  (fencing rule 4, ``docs/design.md``). A group of opaque buffers
  (:func:`~hybridkv.layout.adopt_buffers`) carries no layer kind, so it is taken
  to arrive as one piece; an engine that moves one opaque group in several
  transfers names its components itself, as the SGLang connector does.
"""

from __future__ import annotations

from dataclasses import dataclass

# The package, not its modules: fencing's internal module names are not API.
from hybridkv.fencing import Component, ComponentKind, PoolLayout
from hybridkv.layout import Layout


@dataclass(frozen=True, kw_only=True)
class SchedulerInputs:
    """What one side's :class:`~hybridkv.fencing.TransferScheduler` is built from.

    ``pools`` goes to the constructor: ``TransferScheduler(inputs.pools)``.
    ``components`` is what a remote request must receive before it may compute,
    in group order: ``add_request(rid, expect=inputs.components)`` on the
    consumer, and ``post_import(rid, components=...)`` for the pieces one
    transfer carries (all of them when one transfer moves the whole request).
    """

    pools: PoolLayout
    components: tuple[Component, ...]

    def components_of(self, group: int) -> tuple[Component, ...]:
        """The components of one group, e.g. to import a GDN group's state apart from the KV."""
        if not isinstance(group, int) or not 0 <= group < self.pools.num_groups:
            raise ValueError(f"group {group!r}; expected a group index in [0, {self.pools.num_groups})")
        return tuple(c for c in self.components if c.group == group)


def scheduler_inputs(layout: Layout) -> SchedulerInputs:
    """The pool layout and the components of ``layout``, for its side's scheduler.

    The scheduler addresses groups by index, so the layout's group ids must be
    ``0 .. n-1``. Every region of one pool must hold the same number of pages:
    the pool's block ids have to be valid pages in each of them.
    """
    if not isinstance(layout, Layout):
        raise ValueError(f"layout {layout!r}; expected a hybridkv.layout.Layout")
    groups = sorted(layout.groups, key=lambda g: g.group_id)
    ids = [g.group_id for g in groups]
    if ids != list(range(len(ids))):
        raise ValueError(f"layout group ids {ids}; expected 0..{len(ids) - 1}, one per group")
    for g in groups:
        if not g.placements:
            raise ValueError(f"group {g.group_id} is placed in no region; expected at least one placement")

    # Union-find over groups: two groups are one pool when they are placed in a common region.
    parent = list(range(len(groups)))

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    first_group_of_region: dict[int, int] = {}
    for g in groups:
        for p in g.placements:
            other = first_group_of_region.setdefault(p.region_id, g.group_id)
            a, b = root(other), root(g.group_id)
            if a != b:
                parent[max(a, b)] = min(a, b)

    # Pools numbered by their lowest group id, so the numbering does not depend on region order.
    pool_of_root: dict[int, int] = {}
    group_pools = []
    for g in groups:
        group_pools.append(pool_of_root.setdefault(root(g.group_id), len(pool_of_root)))
    pages: list[dict[int, int]] = [{} for _ in pool_of_root]  # per pool: region id -> page count
    for g, pool in zip(groups, group_pools):
        for p in g.placements:
            pages[pool][p.region_id] = layout.region(p.region_id).num_pages
    pool_sizes = []
    for pool, counts in enumerate(pages):
        distinct = set(counts.values())
        if len(distinct) != 1:
            members = [g.group_id for g, q in zip(groups, group_pools) if q == pool]
            raise ValueError(
                f"the block pool of groups {members} spans regions with page counts "
                f"{dict(sorted(counts.items()))}; expected one page count in every region of a pool"
            )
        pool_sizes.append(distinct.pop())

    components: list[Component] = []
    for g in groups:
        # Opaque buffers carry no kind: one piece.
        kinds = (ComponentKind.KV,) if g.kind is None else g.kind.spec_class.components
        components.extend(Component(group=g.group_id, kind=k) for k in kinds)
    return SchedulerInputs(
        pools=PoolLayout(pool_sizes=tuple(pool_sizes), group_pools=tuple(group_pools)),
        components=tuple(components),
    )


__all__ = ["SchedulerInputs", "scheduler_inputs"]
