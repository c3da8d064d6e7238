"""The layout engine: what a model's caches are and where every byte of every block lives.

- :mod:`~hybridkv.layout.kinds`: the layer kinds, one spec class per kind holding its facts (bytes,
  paging, components, TP sharding, page fields); :class:`LayerKind` names each kind's spec class;
- :mod:`~hybridkv.layout.geometry`: a model's layers (one spec each) and TP sharding;
- :mod:`~hybridkv.layout.presets` / :mod:`~hybridkv.layout.hf_config`: geometries by name or from a
  Hugging Face ``config.json``;
- :mod:`~hybridkv.layout.fields`: what sits inside one page (named byte ranges with a logical identity);
- :mod:`~hybridkv.layout.regions`: :class:`Layout` (regions + group placements), planned by
  :func:`plan_layout` or adopted from an engine's tensors by :func:`adopt_layout` / :func:`adopt_buffers`;
- :mod:`~hybridkv.layout.alloc`: where planned regions get their memory (numpy, torch, virtual).
"""

from hybridkv.layout.alloc import Allocation, Allocator, MemKind, NumpyAllocator, TorchAllocator, VirtualAllocator
from hybridkv.layout.fields import Field, FieldKey, FieldKind, PageContent
from hybridkv.layout.geometry import (
    AttentionSpec, ConvLayout, DType, GDNSpec, LayerKind, LayerSpec, ModelGeometry, Paging, StateSpec,
)
from hybridkv.layout.hf_config import geometry_from_config, load_hf_config
from hybridkv.layout.presets import PRESET_NAMES, get_preset
from hybridkv.layout.regions import (
    KERNEL_ALIGNMENT,
    Buffer,
    GroupLayout,
    GroupSpec,
    LayerBuffer,
    Layout,
    Placement,
    Region,
    RegionId,
    adopt_buffers,
    adopt_layout,
    check_block_size,
    plan_layout,
)

__all__ = [
    "KERNEL_ALIGNMENT", "Allocation", "Allocator", "AttentionSpec", "Buffer", "ConvLayout", "DType", "Field",
    "FieldKey", "FieldKind", "GDNSpec", "GroupLayout", "GroupSpec", "LayerBuffer", "LayerKind", "LayerSpec",
    "Layout", "MemKind", "ModelGeometry", "NumpyAllocator", "PRESET_NAMES", "PageContent", "Paging", "Placement",
    "Region", "RegionId", "StateSpec",
    "TorchAllocator", "VirtualAllocator", "adopt_buffers", "adopt_layout", "check_block_size",
    "geometry_from_config", "get_preset", "load_hf_config", "plan_layout",
]
