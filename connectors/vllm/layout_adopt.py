"""Adopt vLLM 0.33's KV cache tensors into a hybridkv :class:`~hybridkv.layout.Layout`.

What each layer holds comes from vLLM's ``KVCacheConfig`` (``specs.py``); where its
bytes are comes from the tensors vLLM hands to ``register_kv_caches``. vLLM allocates
one backing buffer; every KV-cache group overlays it from byte 0, and layer ``l`` of
block ``b`` of a group starts at ``offset + l*layer_stride + b*block_stride``
(``KVCacheTensor``). Each layer's tensor is a view into that buffer: attention
``[B, H, N, C]`` with C = K|V of one head (or MLA's latent), a Mamba-type state a raw
``int8`` page ``[conv | ssm | pad]``. Where the attention kernel's blocks are smaller
than the scheduler's (FlashInfer's 16-token kernel blocks under the hybrid allocator's
large blocks), the tensor's first dimension counts kernel blocks: ``ratio`` of them
make one logical block. hybridkv de-duplicates the aliased views by address and merges
side-by-side pages, so under a block-outermost layout (BLHNC) one logical block of every
group becomes one span of one region.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch

from hybridkv.ids import GroupId
from hybridkv.layout import LayerBuffer, Layout, adopt_layout
from hybridkv.layout.alloc import MemKind
from hybridkv.layout.kinds.base import Paging

from hybridkv.connectors.vllm.specs import AdoptedSpecs, adopt_specs

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

log = logging.getLogger(__name__)

#: vLLM's KV cache layouts whose H sits outside N (head-outer pages).
_HEAD_OUTER = ("LBHNC", "BLHNC", "BHLNC", "LHBNC")


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
    specs: AdoptedSpecs | None = None,
) -> Layout:
    """The hybridkv layout of the tensors vLLM handed to ``register_kv_caches``.

    ``specs``: what :func:`~hybridkv.connectors.vllm.specs.adopt_specs` made of ``kv_cache_config``
    (made here when not given)."""
    specs = adopt_specs(vllm_config, kv_cache_config, tp=tp) if specs is None else specs
    layout_name = vllm_config.cache_config.get_resolved_kv_cache_layout().name
    head_outer = layout_name in _HEAD_OUTER
    num_blocks = int(kv_cache_config.num_blocks)
    index = {n: i for i, n in enumerate(specs.layer_names)}
    buffers = []
    skipped = []
    for name, t in kv_caches.items():
        layer = index.get(name)
        if layer is None:
            # A layer that shares another's cache, or a group vLLM does not transfer (NixlConnector skips
            # them too): its bytes are not the request's to move.
            skipped.append(name)
            continue
        ours = specs.geometry.layers[layer]
        vllm_spec = specs.vllm_specs[name]
        rows = int(t.shape[0]) if t.dim() > 1 else 0
        if rows <= 0 or rows % num_blocks:
            raise ValueError(f"KV cache layer {name!r}: its tensor of shape {tuple(t.shape)} does not hold "
                             f"{num_blocks} blocks (or kernel blocks of them) in its first dimension")
        ratio = rows // num_blocks
        if ratio > 1 and ours.paging is not Paging.TOKENS:
            raise ValueError(f"KV cache layer {name!r}: a {ours.kind.value} state page split into {ratio} kernel "
                             "blocks; expected one page per block")
        buffers.append(LayerBuffer(
            layer=layer, group_id=GroupId(specs.group_of[name]), addr=int(t.data_ptr()),
            block_stride=int(t.stride(0)) * t.element_size() * ratio, page_bytes=int(vllm_spec.page_size_bytes),
            num_blocks=num_blocks, content=ours.engine_content(head_outer=head_outer),
            mem=MemKind.VRAM if t.device.type == "cuda" else MemKind.DRAM, device_id=int(t.device.index or 0),
            kernel_tokens=int(vllm_spec.block_size) // ratio if ratio > 1 else None,
        ))
    if skipped:
        log.debug("hybridkv: KV cache layers in no transfer group, not moved: %s", skipped)
    missing = [n for n in specs.layer_names if n not in kv_caches]
    if missing:
        raise ValueError(f"register_kv_caches got no tensor for KV cache layer(s) {missing} of vLLM's KVCacheConfig")
    try:
        layout = adopt_layout(specs.geometry, specs.groups, buffers, tp=tp, rank=rank)
    except ValueError as exc:
        names = ", ".join(f"{i}={n}" for i, n in enumerate(specs.layer_names))
        raise ValueError(f"{exc} (hybridkv's layer numbers: {names})") from exc
    if layout_name.startswith("B"):
        log.info("hybridkv adopted vLLM's %s KV cache: %d region(s) for %d layer tensors (%s)", layout_name,
                 len(layout.regions), len(buffers), specs.describe())
    else:
        log.warning("hybridkv adopted vLLM's %s KV cache: %d regions for %d layer tensors; not block-outermost, "
                    "so a request moves with one descriptor per layer slot per block (hybridkv asked for "
                    "BLHNC but the attention backends did not allow it)", layout_name, len(layout.regions),
                    len(buffers))
    return layout
