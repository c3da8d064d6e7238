"""Adopt vLLM 0.33's KV cache tensors into a hybridkv :class:`~hybridkv.layout.Layout`.

vLLM allocates one backing buffer; every KV-cache group overlays it from byte
0, and layer ``l`` of block ``b`` of a group starts at
``offset + l*layer_stride + b*block_stride`` (``KVCacheTensor``). Each layer's
tensor is a view into that buffer: attention ``[B, H, N, C]`` with C = K|V of
one head, GDN a raw ``int8`` page ``[conv | ssm | pad]``. hybridkv de-duplicates
the aliased views by address and merges side-by-side pages, so under a
block-outermost layout (BLHNC) one logical block of every group becomes one
span of one region.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch

from hybridkv.layout.alloc import MemKind
from hybridkv.layout.fields import PageContent
from hybridkv.layout.geometry import DType, LayerSpec, ModelGeometry, Paging
from hybridkv.layout.hf_config import geometry_from_config
from hybridkv.ids import GroupId
from hybridkv.layout import GroupSpec, Layout, LayerBuffer, adopt_layout

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

log = logging.getLogger(__name__)

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_TORCH_DTYPES = {torch.float32: DType.FLOAT32, torch.bfloat16: DType.BFLOAT16, torch.float16: DType.FLOAT16}


def layer_index(name: str) -> int:
    m = _LAYER.search(name)
    if m is None:
        raise ValueError(f"KV cache layer name {name!r}; expected one containing 'layers.<index>.'")
    return int(m.group(1))


def conv_layout_is_ds() -> bool:
    from vllm.model_executor.layers.mamba.mamba_utils import get_conv_state_layout

    return str(getattr(get_conv_state_layout(), "name", get_conv_state_layout())).upper() == "DS"


def adopt_vllm_kv_caches(
    vllm_config: VllmConfig,
    kv_cache_config: KVCacheConfig,
    kv_caches: Mapping[str, torch.Tensor],
    *,
    tp: int = 1,
    rank: int = 0,
) -> Layout:
    """The hybridkv layout of the tensors vLLM handed to ``register_kv_caches``."""
    from vllm.v1.kv_cache_interface import AttentionSpec, MambaSpec, UniformTypeKVCacheSpecs

    layout_name = vllm_config.cache_config.get_resolved_kv_cache_layout().name
    if kv_cache_config.has_mamba_layers and not conv_layout_is_ds():
        raise ValueError(
            "the GDN/Mamba conv state is in the SD layout; hybridkv moves it per TP sub-block and needs "
            "DS: start vLLM with VLLM_SSM_CONV_STATE_LAYOUT=DS on both prefill and decode"
        )
    ssm_dtype = None
    spec_of: dict[str, object] = {}
    group_of: dict[str, int] = {}
    for gid, group in enumerate(kv_cache_config.kv_cache_groups):
        spec = group.kv_cache_spec
        for name in group.layer_names:
            layer_spec = spec.kv_cache_specs[name] if isinstance(spec, UniformTypeKVCacheSpecs) else spec
            spec_of[name] = layer_spec
            group_of[name] = gid
        if isinstance(spec, MambaSpec):
            ssm_dtype = _TORCH_DTYPES.get(spec.dtypes[-1])
        elif not isinstance(spec, AttentionSpec):
            raise ValueError(f"KV cache group {gid} has a {type(spec).__name__}; expected attention or Mamba/GDN")
    hf = vllm_config.model_config.hf_text_config.to_dict()
    hf.setdefault("torch_dtype", str(vllm_config.model_config.dtype).removeprefix("torch."))
    geometry = geometry_from_config(hf, name=str(vllm_config.model_config.model), ssm_dtype=ssm_dtype)
    # A group's kind, its block tokens and its pages' content are its layers' spec's facts (issue 46 will
    # build that spec from vLLM's own instead of the HF config); vLLM's spec must agree with it.
    groups = [_group(gid, group, geometry) for gid, group in enumerate(kv_cache_config.kv_cache_groups)]
    # Head-outer pages for the layouts whose H sits outside N.
    head_outer = layout_name in ("LBHNC", "BLHNC", "BHLNC", "LHBNC")
    buffers = []
    for name, t in kv_caches.items():
        if name not in spec_of:
            raise ValueError(f"register_kv_caches got layer {name!r}, which no KV cache group holds")
        spec = spec_of[name]
        mem = MemKind.VRAM if t.device.type == "cuda" else MemKind.DRAM
        layer = layer_index(name)
        buffers.append(LayerBuffer(
            layer=layer, group_id=GroupId(group_of[name]), addr=int(t.data_ptr()),
            block_stride=int(t.stride(0)) * t.element_size(), page_bytes=int(spec.page_size_bytes),
            num_blocks=int(t.shape[0]),
            content=_layer_spec(geometry, layer).engine_content(head_outer=head_outer),
            mem=mem, device_id=int(t.device.index or 0),
        ))
    layout = adopt_layout(geometry, groups, buffers, tp=tp, rank=rank)
    if layout_name.startswith("B"):
        log.info("hybridkv adopted vLLM's %s KV cache: %d region(s) for %d layer tensors", layout_name,
                 len(layout.regions), len(buffers))
    else:
        log.warning("hybridkv adopted vLLM's %s KV cache: %d regions for %d layer tensors; not block-outermost, "
                    "so a request moves with one descriptor per layer slot per block (hybridkv asked for "
                    "BLHNC but the attention backends did not allow it)", layout_name, len(layout.regions),
                    len(buffers))
    return layout


def _layer_spec(geometry: ModelGeometry, layer: int) -> LayerSpec:
    if not 0 <= layer < geometry.num_layers:
        raise ValueError(f"vLLM KV cache layer {layer} is outside the model's {geometry.num_layers} layers")
    return geometry.layers[layer]


def _group(gid: int, group, geometry: ModelGeometry) -> GroupSpec:
    """One vLLM KV-cache group as a hybridkv GroupSpec, checked against the model's spec of its layers."""
    from vllm.v1.kv_cache_interface import MambaSpec

    spec = group.kv_cache_spec
    layers = tuple(layer_index(n) for n in group.layer_names)
    if not layers:
        raise ValueError(f"KV cache group {gid} holds no layers")
    ours = _layer_spec(geometry, layers[0])
    vllm_window = getattr(spec, "sliding_window", None) or None
    if isinstance(spec, MambaSpec) != (ours.paging is Paging.STATE) or (vllm_window is None) != (ours.window is None):
        raise ValueError(f"KV cache group {gid} is vLLM's {type(spec).__name__} (sliding window {vllm_window}), but "
                         f"layer {layers[0]} of the model config is {ours.kind.value}")
    return GroupSpec(group_id=GroupId(gid), kind=ours.kind, layer_indices=layers,
                     block_tokens=ours.block_tokens(spec.block_size))
