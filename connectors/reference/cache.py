"""Torch views of hybridkv's planned layout: the reference engine computes in place on it.

The attention region's block is [kv head][layer][token][K|V]; the GDN region's block
is [key head][layer][conv Q rows | conv K rows | conv V rows | pad | SSM of its value
heads] (see `hybridkv.layout.plan_layout`). These views turn that into what a model
layer wants: a paged K/V cache per layer and a (conv, SSM) state per layer and slot.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hybridkv.layout.alloc import NumpyAllocator
from hybridkv.layout.fields import FieldKind, gdn_group_unit_fields, gdn_unit_bytes
from hybridkv.layout.geometry import AttentionSpec, GDNSpec, LayerKind, ModelGeometry
from hybridkv.layout import Layout, plan_layout


@dataclass(frozen=True, kw_only=True)
class CacheConfig:
    block_size: int = 16
    attention_blocks: int = 96
    state_slots: int = 8


class PagedCache:
    """The planned layout of one engine instance, and typed views into it."""

    def __init__(self, geometry: ModelGeometry, cfg: CacheConfig) -> None:
        self.geometry = geometry
        self.cfg = cfg
        self.layout: Layout = plan_layout(
            geometry, block_size=cfg.block_size,
            num_blocks={LayerKind.FULL_ATTENTION: cfg.attention_blocks, LayerKind.GDN: cfg.state_slots},
            allocator=NumpyAllocator(),
        )
        self.attn_group = next(g for g in self.layout.groups if g.kind is LayerKind.FULL_ATTENTION)
        self.gdn_group = next(g for g in self.layout.groups if g.kind is LayerKind.GDN)
        attn = geometry.spec_of(LayerKind.FULL_ATTENTION)
        gdn = geometry.spec_of(LayerKind.GDN)
        assert isinstance(attn, AttentionSpec) and isinstance(gdn, GDNSpec)
        self.attn_spec, self.gdn_spec = attn, gdn
        for spec_dtype in (attn.dtype, gdn.conv_dtype, gdn.ssm_dtype):
            if spec_dtype.itemsize != 4:
                raise ValueError(f"the reference engine computes in float32; got a {spec_dtype.value} cache")
        la, lg = len(self.attn_group.layer_indices), len(self.gdn_group.layer_indices)
        self.kv = self._region(self.attn_group).view(
            cfg.attention_blocks, attn.num_kv_heads, la, cfg.block_size, 2, attn.head_dim)
        unit = gdn_unit_bytes(gdn) // 4
        self.state = self._region(self.gdn_group).view(cfg.state_slots, gdn.num_k_heads, lg, unit)
        f: dict[FieldKind, object] = {}
        for fld in gdn_group_unit_fields(gdn, 0, 0):
            f.setdefault(fld.key[0], fld)  # the first field of each component starts its run
        self._q = (f[FieldKind.CONV_Q].offset // 4, f[FieldKind.CONV_Q].nbytes // 4)
        self._k = (f[FieldKind.CONV_K].offset // 4, f[FieldKind.CONV_K].nbytes // 4)
        vpk = gdn.v_heads_per_k_head
        self._v = (f[FieldKind.CONV_V].offset // 4, vpk * f[FieldKind.CONV_V].nbytes // 4)
        self._ssm = (f[FieldKind.SSM].offset // 4, vpk * f[FieldKind.SSM].nbytes // 4)
        self.attn_layer = {layer: i for i, layer in enumerate(self.attn_group.layer_indices)}
        self.gdn_layer = {layer: i for i, layer in enumerate(self.gdn_group.layer_indices)}

    def _region(self, group) -> torch.Tensor:
        rid = group.placements[0].region_id
        return torch.from_numpy(self.layout.allocations[rid].owner).view(torch.float32)

    def kv_view(self, layer: int, blocks: list[int]) -> KVView:
        return KVView(cache=self.kv[:, :, self.attn_layer[layer]], blocks=blocks, block_size=self.cfg.block_size)

    def state_view(self, layer: int, slot: int) -> StateView:
        return StateView(owner=self, unit=self.state[slot, :, self.gdn_layer[layer]])

    def zero_blocks(self, blocks: list[int]) -> None:
        """What vLLM does to new attention blocks of hybrid models (stale state bits read as NaN)."""
        if blocks:
            self.kv[torch.tensor(blocks)] = 0.0


@dataclass(frozen=True, kw_only=True)
class KVView:
    cache: torch.Tensor  # [blocks, heads, block_size, 2, D] for one layer
    blocks: list[int]
    block_size: int

    def _index(self, start: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        pos = torch.arange(start, start + n)
        table = torch.tensor(self.blocks)
        return table[pos // self.block_size], pos % self.block_size

    def write(self, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        blk, off = self._index(start, k.shape[0])
        self.cache[blk, :, off, 0] = k
        self.cache[blk, :, off, 1] = v

    def read(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        blk, off = self._index(0, n)
        return self.cache[blk, :, off, 0], self.cache[blk, :, off, 1]


@dataclass(frozen=True, kw_only=True)
class StateView:
    owner: PagedCache
    unit: torch.Tensor  # [key heads, unit floats] of one layer and slot

    def _rows(self, part: tuple[int, int]) -> torch.Tensor:
        off, n = part
        return self.unit[:, off: off + n].reshape(-1, self.owner.gdn_spec.conv_kernel - 1)

    def read_conv(self) -> torch.Tensor:
        """(conv_dim, W-1) in DS order: all Q rows, all K rows, all V rows (key head by key head)."""
        o = self.owner
        return torch.cat([self._rows(o._q), self._rows(o._k), self._rows(o._v)])

    def write_conv(self, conv: torch.Tensor) -> None:
        o, s = self.owner, self.owner.gdn_spec
        qd = s.num_k_heads * s.head_k_dim
        parts = (conv[:qd], conv[qd: 2 * qd], conv[2 * qd:])
        for (off, n), rows in zip((o._q, o._k, o._v), parts):
            self.unit[:, off: off + n] = rows.reshape(s.num_k_heads, -1)

    def read_ssm(self) -> torch.Tensor:
        s = self.owner.gdn_spec
        off, n = self.owner._ssm
        return self.unit[:, off: off + n].reshape(s.num_v_heads, s.head_v_dim, s.head_k_dim)

    def write_ssm(self, ssm: torch.Tensor) -> None:
        s = self.owner.gdn_spec
        off, n = self.owner._ssm
        self.unit[:, off: off + n] = ssm.reshape(s.num_k_heads, -1)
