"""Hybrid-allocator grouping and page-size unification, as vLLM 0.33 does it.

vLLM puts layers of different kinds into KV-cache groups of one page size so one
pool serves all (docs/background/vllm.md section 3):
- group_size = the smallest per-kind layer count (the largest if max < 1.5 * min);
- each kind's layers are split as layers[i::num_groups], the last group padded;
- the attention block size is raised to the smallest multiple of the kernel
  alignment whose attention page holds a GDN state (the largest state of any
  state kind), and the state page is padded to the attention page;
- a sliding-window group keeps only its tail: cdiv(window, block) + 1 blocks.
Layer i of every group aliases the same physical tensor, so there are
group_size shared tensors.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from hybridkv.ids import GroupId
from hybridkv.layout.alloc import MemKind
from hybridkv.layout.fields import PageContent
from hybridkv.layout.geometry import LayerKind, LayerSpec, ModelGeometry, Paging
from hybridkv.layout.regions import KERNEL_ALIGNMENT, GroupSpec, LayerBuffer, check_block_size


@dataclass(frozen=True, kw_only=True)
class KVCacheGroup:
    group_id: GroupId
    kind: LayerKind
    layer_indices: tuple[int, ...]
    block_size: int
    window: int | None = None
    spec: LayerSpec = field(repr=False)  # the (per-rank) spec of its layers

    def blocks_for_tokens(self, tokens: int) -> int:
        """Blocks this group holds for a request of `tokens` prompt tokens."""
        if tokens <= 0:
            raise ValueError(f"tokens must be positive, got {tokens}")
        return self.spec.blocks_for_tokens(tokens, self.block_size)


@dataclass(frozen=True, kw_only=True)
class HMAPlan:
    geometry: ModelGeometry
    groups: tuple[KVCacheGroup, ...]
    block_size: int
    page_bytes: int
    group_size: int

    @property
    def num_tensors(self) -> int:
        """Shared physical tensors: tensor i is layer i of every group."""
        return self.group_size

    def blocks_per_group(self, tokens: int) -> dict[GroupId, int]:
        return {g.group_id: g.blocks_for_tokens(tokens) for g in self.groups}


def aligned_block_size(geometry: ModelGeometry, block_size: int | None = None,
                       alignment: int = KERNEL_ALIGNMENT) -> int:
    """The attention block size vLLM ends up with (raised so a page holds a GDN state)."""
    if block_size is not None:
        check_block_size(block_size, alignment)
    base = block_size if block_size is not None else alignment
    states = _state_bytes(geometry)
    if not _paged(geometry, Paging.TOKENS) or not states:
        return base
    per_token = _attention_bytes_per_token(geometry)
    needed = alignment * math.ceil(max(states) / (alignment * per_token))
    return max(base, needed)


def _paged(geometry: ModelGeometry, paging: Paging) -> list[LayerSpec]:
    return [s for s in geometry.specs() if s.paging is paging]


def _state_bytes(geometry: ModelGeometry) -> list[int]:
    # A state page does not depend on the block size.
    return [s.page_bytes(KERNEL_ALIGNMENT) for s in _paged(geometry, Paging.STATE)]


def _attention_bytes_per_token(geometry: ModelGeometry) -> int:
    # A token page is linear in its tokens: its bytes for one token.
    sizes = {s.page_bytes(1) for s in _paged(geometry, Paging.TOKENS)}
    if len(sizes) != 1:
        raise ValueError(
            f"attention kinds of {geometry.name!r} have different page sizes per token {sorted(sizes)}; "
            "page unification by scaling is not supported"
        )
    return sizes.pop()


def plan_hma(geometry: ModelGeometry, block_size: int | None = None,
             alignment: int = KERNEL_ALIGNMENT) -> HMAPlan:
    """Group `geometry` (already sharded to a rank if TP > 1) the way vLLM 0.33 does."""
    bs = aligned_block_size(geometry, block_size, alignment)
    kinds = geometry.kinds()
    counts = {k: len(geometry.layer_indices(k)) for k in kinds}
    lo, hi = min(counts.values()), max(counts.values())
    group_size = hi if hi < 1.5 * lo else lo
    groups: list[KVCacheGroup] = []
    for kind in kinds:
        layers = geometry.layer_indices(kind)
        num_groups = math.ceil(len(layers) / group_size)
        spec = geometry.spec_of(kind)
        for i in range(num_groups):
            groups.append(KVCacheGroup(
                group_id=GroupId(len(groups)), kind=kind, layer_indices=tuple(layers[i::num_groups]),
                block_size=bs, window=spec.window, spec=spec,
            ))
    if _paged(geometry, Paging.TOKENS):
        page = bs * _attention_bytes_per_token(geometry)
    else:
        page = max(_state_bytes(geometry))
    return HMAPlan(geometry=geometry, groups=tuple(groups), block_size=bs, page_bytes=page,
                   group_size=group_size)


def hma_buffers(plan: HMAPlan, tensors: Sequence[int], *, block_stride: int, pages: int,
                mem: MemKind = MemKind.DRAM, device_id: int = 0,
                kernel_tokens: int | None = None) -> tuple[list[GroupSpec], list[LayerBuffer]]:
    """The groups and layer buffers of vLLM's hybrid-allocator tensors over ``plan``, for adopt_layout: layer i
    of every group on the tensor at address ``tensors[i]``, ``pages`` pages ``block_stride`` bytes apart (the
    page size where each tensor is its own allocation, more where blocks are outermost). Attention pages are
    head-major, in kernel blocks of ``kernel_tokens`` where vLLM splits the block; GDN pages hold the state."""
    if len(tensors) != plan.num_tensors:
        raise ValueError(f"{len(tensors)} tensor addresses; expected {plan.num_tensors} (the plan's shared tensors)")
    split = kernel_tokens not in (None, plan.block_size)
    groups, buffers = [], []
    for grp in plan.groups:
        state = grp.spec.paging is Paging.STATE  # a page per request: the state at its front
        groups.append(GroupSpec(group_id=grp.group_id, kind=grp.kind, layer_indices=grp.layer_indices,
                                block_tokens=None if state else grp.block_size))
        for i, layer in enumerate(grp.layer_indices):
            buffers.append(LayerBuffer(layer=layer, group_id=grp.group_id, addr=tensors[i], block_stride=block_stride,
                                       page_bytes=plan.page_bytes, num_blocks=pages,
                                       content=PageContent.GDN if state else PageContent.ATTN_HND,
                                       mem=mem, device_id=device_id,
                                       kernel_tokens=kernel_tokens if split and not state else None))
    return groups, buffers


class PageOrder(enum.Enum):
    """How vLLM lays its hybrid-allocator tensors out in memory."""

    BLOCK_OUTERMOST = "BLHNC"  # one allocation, [block][tensor slot][page]: what the vLLM connector asks for
    LAYER_OUTERMOST = "LBHNC"  # a tensor slot per allocation: the only order where vLLM splits kernel blocks


def vllm_layout(geometry: ModelGeometry, *, tp: int, rank: int, block: int, pages: int, allocator,
                order: PageOrder, kernel: int | None = None):
    """vLLM 0.33's hybrid-allocator tensors of one rank as ``allocate_kv_cache`` lays them out and the vLLM
    connector adopts them: ``pages`` pages of the hybrid page size per tensor slot (layer i of every group on
    slot i), allocated from ``allocator``, in ``order``; attention pages split into kernel blocks of
    ``kernel`` tokens where that is below the block (``prepare_kernel_block_sizes`` splits layer-outermost
    pages only). A Layout whose allocations are the regions' memory."""
    from hybridkv.layout import Layout, adopt_layout

    hma = plan_hma(geometry.shard(tp), block)
    page, slots = hma.page_bytes, hma.num_tensors
    if order is PageOrder.LAYER_OUTERMOST:
        allocs = [allocator.allocate(page * pages) for _ in range(slots)]
        addrs, stride = [a.addr for a in allocs], page
    else:
        allocs = [allocator.allocate(page * slots * pages)]
        addrs, stride = [allocs[0].addr + i * page for i in range(slots)], page * slots
    groups, buffers = hma_buffers(hma, addrs, block_stride=stride, pages=pages, mem=allocs[0].mem,
                                  device_id=allocs[0].device_id,
                                  kernel_tokens=kernel if order is PageOrder.LAYER_OUTERMOST else None)
    got = adopt_layout(geometry, groups, buffers, tp=tp, rank=rank)
    if order is PageOrder.LAYER_OUTERMOST:  # region i's bytes are the allocation at its base
        by_addr = {a.addr: a for a in allocs}
        allocs = [by_addr[r.base_addr] for r in got.regions]
    return Layout(geometry=got.geometry, tp=tp, rank=rank, regions=got.regions, groups=got.groups,
                  allocations=tuple(allocs))
