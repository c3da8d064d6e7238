"""Torch views of hybridkv's planned layout: the reference engine computes in place on it.

The attention region's block is [kv head][layer][token][K|V]; the GDN region's block
is [key head][layer][conv Q rows | conv K rows | conv V rows | pad | SSM of its value
heads] (see `hybridkv.layout.plan_layout`). These views turn that into what a model
layer wants: a paged K/V cache per layer and a (conv, SSM) state per layer and slot.
The memory is host memory (numpy) on the CPU and VRAM (torch) on a CUDA device, which
is what NIXL registers either way. Conv and SSM may have different dtypes (Qwen3.5:
bf16 conv, fp32 SSM): each field is viewed with its own dtype over the raw bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hybridkv.layout import Layout, plan_layout
from hybridkv.layout.alloc import NumpyAllocator, TorchAllocator
from hybridkv.layout.fields import FieldKind
from hybridkv.layout.kinds.gdn import gdn_group_unit_fields, gdn_unit_bytes
from hybridkv.layout.geometry import AttentionSpec, DType, GDNSpec, LayerKind, ModelGeometry

TORCH_DTYPES = {DType.FLOAT32: torch.float32, DType.BFLOAT16: torch.bfloat16, DType.FLOAT16: torch.float16}


def torch_dtype(dtype: DType) -> torch.dtype:
    if dtype not in TORCH_DTYPES:
        raise ValueError(f"the reference engine computes on float32, bfloat16 or float16 caches; got {dtype.value}")
    return TORCH_DTYPES[dtype]


@dataclass(frozen=True, kw_only=True)
class CacheConfig:
    block_size: int = 16
    attention_blocks: int = 96
    state_slots: int = 8


class PagedCache:
    """The planned layout of one engine instance, and typed views into it."""

    def __init__(self, geometry: ModelGeometry, cfg: CacheConfig, *, device: str = "cpu") -> None:
        self.geometry = geometry
        self.cfg = cfg
        self.device = torch.device(device)
        allocator = NumpyAllocator() if self.device.type == "cpu" else TorchAllocator(str(self.device))
        self.layout: Layout = plan_layout(
            geometry, block_size=cfg.block_size,
            num_blocks={LayerKind.FULL_ATTENTION: cfg.attention_blocks, LayerKind.GDN: cfg.state_slots},
            allocator=allocator,
        )
        self.attn_group = next(g for g in self.layout.groups if g.kind is LayerKind.FULL_ATTENTION)
        self.gdn_group = next(g for g in self.layout.groups if g.kind is LayerKind.GDN)
        attn = geometry.spec_of(LayerKind.FULL_ATTENTION)
        gdn = geometry.spec_of(LayerKind.GDN)
        assert isinstance(attn, AttentionSpec) and isinstance(gdn, GDNSpec)
        self.attn_spec, self.gdn_spec = attn, gdn
        self.kv_dtype = torch_dtype(attn.dtype)
        self.conv_dtype, self.ssm_dtype = torch_dtype(gdn.conv_dtype), torch_dtype(gdn.ssm_dtype)
        la, lg = len(self.attn_group.layer_indices), len(self.gdn_group.layer_indices)
        self.attn_pages = self._pages(self.attn_group)
        self.state_pages = self._pages(self.gdn_group)
        self.kv = self.attn_pages.view(self.kv_dtype).view(
            cfg.attention_blocks, attn.num_kv_heads, la, cfg.block_size, 2, attn.head_dim)
        units = self.state_pages.view(cfg.state_slots, gdn.num_k_heads, lg, gdn_unit_bytes(gdn))
        f: dict[FieldKind, object] = {}
        for fld in gdn_group_unit_fields(gdn, 0, 0):
            f.setdefault(fld.key[0], fld)  # the first field of each component starts its run
        vpk = gdn.v_heads_per_k_head

        def field(kind: FieldKind, count: int, dtype: torch.dtype) -> torch.Tensor:
            off, n = f[kind].offset, count * f[kind].nbytes
            return units[..., off: off + n].view(dtype)  # [slots, key heads, layers, elements]

        self._q = field(FieldKind.CONV_Q, 1, self.conv_dtype)
        self._k = field(FieldKind.CONV_K, 1, self.conv_dtype)
        self._v = field(FieldKind.CONV_V, vpk, self.conv_dtype)
        self._ssm = field(FieldKind.SSM, vpk, self.ssm_dtype)
        self.attn_layer = {layer: i for i, layer in enumerate(self.attn_group.layer_indices)}
        self.gdn_layer = {layer: i for i, layer in enumerate(self.gdn_group.layer_indices)}
        self._weights: dict[int, torch.Tensor] = {}

    def _pages(self, group) -> torch.Tensor:
        """The group's region as [pages, page bytes] (uint8), whatever memory holds it."""
        rid = group.placements[0].region_id
        region = next(r for r in self.layout.regions if r.region_id == rid)
        owner = self.layout.allocations[rid].owner
        raw = owner if isinstance(owner, torch.Tensor) else torch.from_numpy(owner)
        return raw[: region.num_pages * region.stride].view(region.num_pages, region.stride)[:, : region.page_bytes]

    def kv_view(self, layer: int, table: torch.Tensor) -> KVView:
        """`table`: the request's attention blocks as a tensor on this cache's device."""
        return KVView(cache=self.kv[:, :, self.attn_layer[layer]], table=table, block_size=self.cfg.block_size)

    def block_table(self, blocks: list[int]) -> torch.Tensor:
        return torch.tensor(blocks, dtype=torch.int64).to(self.device, non_blocking=True)

    def state_view(self, layer: int, slot: int) -> StateView:
        return StateView(owner=self, slot=slot, layer=self.gdn_layer[layer])

    def zero_blocks(self, blocks: list[int]) -> None:
        """What vLLM does to new attention blocks of hybrid models (stale state bits read as NaN)."""
        if blocks:
            self.kv[self.block_table(blocks)] = 0

    # ------------------------------------------------------------ byte checks
    def checksums(self, blocks: list[int], slot: int) -> torch.Tensor:
        """One 64-bit checksum per attention page in `blocks`, then one for the state page of
        `slot`: exactly the bytes a page-paired transfer moves, computed where they live (on
        the GPU for VRAM) and left there; the caller copies them out when its stream got there.
        Integer sums wrap identically in any order, so both sides agree on equal bytes."""
        pages = [self._page_sums(self.attn_pages[self.block_table(blocks)])] if blocks else []
        pages.append(self._page_sums(self.state_pages[slot: slot + 1]))
        return torch.cat(pages)

    def _page_sums(self, pages: torch.Tensor) -> torch.Tensor:
        words = pages.view(torch.int32)
        n = words.shape[1]
        w = self._weights.get(n)
        if w is None:
            # position weights: a word moved within a page changes the sum, not only a changed word
            w = (torch.arange(n, dtype=torch.int64) * 2654435761 % (1 << 31)) | 1
            w = self._weights[n] = w.to(self.device)
        return (words.to(torch.int64) * w).sum(dim=1)


@dataclass(frozen=True, kw_only=True)
class KVView:
    cache: torch.Tensor  # [blocks, heads, block_size, 2, D] for one layer
    table: torch.Tensor  # the request's blocks, on the cache's device
    block_size: int

    def _index(self, start: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        pos = torch.arange(start, start + n, device=self.table.device)
        return self.table[pos // self.block_size], pos % self.block_size

    def write(self, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        blk, off = self._index(start, k.shape[0])
        self.cache[blk, :, off, 0] = k.to(self.cache.dtype)
        self.cache[blk, :, off, 1] = v.to(self.cache.dtype)

    def read(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of positions < n, [n, heads, D] each (a paged gather)."""
        blk, off = self._index(0, n)
        return self.cache[blk, :, off, 0], self.cache[blk, :, off, 1]


@dataclass(frozen=True, kw_only=True)
class StateView:
    owner: PagedCache
    slot: int
    layer: int

    def _rows(self, part: torch.Tensor) -> torch.Tensor:
        return part[self.slot, :, self.layer].reshape(-1, self.owner.gdn_spec.conv_kernel - 1)

    def read_conv(self) -> torch.Tensor:
        """(conv_dim, W-1) in DS order: all Q rows, all K rows, all V rows (key head by key head)."""
        o = self.owner
        return torch.cat([self._rows(o._q), self._rows(o._k), self._rows(o._v)])

    def write_conv(self, conv: torch.Tensor) -> None:
        o, s = self.owner, self.owner.gdn_spec
        qd = s.num_k_heads * s.head_k_dim
        parts = (conv[:qd], conv[qd: 2 * qd], conv[2 * qd:])
        for dst, rows in zip((o._q, o._k, o._v), parts):
            dst[self.slot, :, self.layer] = rows.reshape(s.num_k_heads, -1).to(dst.dtype)

    def read_ssm(self) -> torch.Tensor:
        """(HV, dv, dk), value-major as stored."""
        s = self.owner.gdn_spec
        return self.owner._ssm[self.slot, :, self.layer].reshape(s.num_v_heads, s.head_v_dim, s.head_k_dim)

    def write_ssm(self, ssm: torch.Tensor) -> None:
        s = self.owner.gdn_spec
        self.owner._ssm[self.slot, :, self.layer] = ssm.reshape(s.num_k_heads, -1).to(self.owner.ssm_dtype)
