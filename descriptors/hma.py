"""Hybrid-allocator grouping and page-size unification, as vLLM 0.33 does it.

vLLM puts layers of different kinds into KV-cache groups of one page size so one
pool serves all (docs/background/vllm.md section 3):
- group_size = the smallest per-kind layer count (the largest if max < 1.5 * min);
- each kind's layers are split as layers[i::num_groups], the last group padded;
- the attention block size is raised to the smallest multiple of the kernel
  alignment whose attention page holds a GDN state, and the state page is padded
  to the attention page;
- a sliding-window group keeps only its tail: cdiv(window, block) + 1 blocks.
Layer i of every group aliases the same physical tensor, so there are
group_size shared tensors.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from hybridkv.ids import GroupId
from hybridkv.layout.geometry import AttentionSpec, GDNSpec, LayerKind, ModelGeometry
from hybridkv.layout.regions import KERNEL_ALIGNMENT, check_block_size


@dataclass(frozen=True, kw_only=True)
class KVCacheGroup:
    group_id: GroupId
    kind: LayerKind
    layer_indices: tuple[int, ...]
    block_size: int
    window: int | None = None

    def blocks_for_tokens(self, tokens: int) -> int:
        """Blocks this group holds for a request of `tokens` prompt tokens."""
        if tokens <= 0:
            raise ValueError(f"tokens must be positive, got {tokens}")
        if self.kind is LayerKind.GDN:
            return 1
        blocks = math.ceil(tokens / self.block_size)
        if self.kind is LayerKind.SLIDING_WINDOW:
            assert self.window is not None
            blocks = min(blocks, math.ceil(self.window / self.block_size) + 1)
        return blocks


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
    attn_kinds = [k for k in geometry.kinds() if k.is_attention]
    gdn = LayerKind.GDN in geometry.kinds()
    base = block_size if block_size is not None else alignment
    if not attn_kinds or not gdn:
        return block_size if block_size is not None else alignment
    per_token = _attention_bytes_per_token(geometry)
    state = geometry.spec_of(LayerKind.GDN).state_bytes  # type: ignore[union-attr]
    needed = alignment * math.ceil(state / (alignment * per_token))
    return max(base, needed)


def _attention_bytes_per_token(geometry: ModelGeometry) -> int:
    sizes = {geometry.spec_of(k).bytes_per_token for k in geometry.kinds() if k.is_attention}  # type: ignore[union-attr]
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
        window = spec.window if isinstance(spec, AttentionSpec) else None
        for i in range(num_groups):
            groups.append(KVCacheGroup(
                group_id=GroupId(len(groups)), kind=kind, layer_indices=tuple(layers[i::num_groups]),
                block_size=bs, window=window,
            ))
    if any(k.is_attention for k in kinds):
        page = bs * _attention_bytes_per_token(geometry)
    else:
        spec = geometry.spec_of(LayerKind.GDN)
        assert isinstance(spec, GDNSpec)
        page = spec.state_bytes
    return HMAPlan(geometry=geometry, groups=tuple(groups), block_size=bs, page_bytes=page,
                   group_size=group_size)
