"""vLLM 0.33's KV cache planning for a weightless Qwen3-Next-shaped hybrid, in one place.

`hybridkv bench vllm-steps` (vllm_steps.py) and the vLLM tests' harness (tests/vllm/harness.py,
families.py) build the same thing the engine core does once the model's layers are known: per-layer
KV cache specs exactly as Qwen3-Next's layers declare them (full attention every
``full_attention_interval`` layers, GDN state otherwise, the state shapes and dtypes from vLLM's model
class), then vLLM's own layout resolution, grouping and tensor planning. Needs vLLM; imported only
by what already runs it.
"""

from __future__ import annotations

from typing import Any


def qwen3_next_layer_specs(vc: Any) -> dict[str, Any]:
    """Per-layer KV cache specs exactly as Qwen3-Next's layers declare them (attention heads split
    over the config's tensor-parallel size)."""
    from vllm.model_executor.models import ModelRegistry
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec

    hf = vc.model_config.hf_text_config
    tp = vc.parallel_config.tensor_parallel_size
    cls, _ = ModelRegistry.resolve_model_cls(vc.model_config.architecture, model_config=vc.model_config)
    shapes = tuple(tuple(s) for s in cls.get_mamba_state_shape_from_config(vc))
    dtypes = tuple(cls.get_mamba_state_dtype_from_config(vc))
    cache = vc.cache_config
    specs: dict[str, Any] = {}
    for i, kind in enumerate(hf.layer_types):
        if kind == "full_attention":
            specs[f"model.layers.{i}.self_attn.attn"] = FullAttentionSpec(
                block_size=cache.block_size, num_kv_heads=max(1, hf.num_key_value_heads // tp),
                head_size=hf.head_dim, dtype=vc.model_config.dtype)
        else:
            specs[f"model.layers.{i}.linear_attn"] = MambaSpec(
                shapes=shapes, dtypes=dtypes, block_size=cache.mamba_block_size,
                page_size_padded=cache.mamba_page_size_padded, mamba_type=MambaAttentionBackendEnum.GDN_ATTN,
                mamba_cache_mode=cache.mamba_cache_mode)
    return specs


def plan_kv_cache(vc: Any, specs: dict[str, Any], *, supported_layouts: list[str] | None = None,
                  available_memory: int = 1 << 40) -> Any:
    """vLLM's layout resolution (among FlashAttention's layouts unless ``supported_layouts`` names others),
    grouping and tensor planning: the ``KVCacheConfig`` the engine core hands the scheduler and the
    workers, with what the engine core records once it is sized."""
    from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend
    from vllm.v1.attention.backends.utils import get_supported_kv_cache_layouts, resolve_kv_cache_layout
    from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups, get_kv_cache_groups
    from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes

    if supported_layouts is None:
        supported_layouts = [m.name for m in get_supported_kv_cache_layouts([FlashAttentionBackend])]
    resolve_kv_cache_layout(vc, [supported_layouts], specs.values())
    kcc = get_kv_cache_config_from_groups(vc, get_kv_cache_groups(vc, specs), available_memory=available_memory)
    vc.cache_config.num_gpu_blocks = kcc.num_blocks
    _, kcc.hash_block_size = resolve_kv_cache_block_sizes(kcc, vc)
    return kcc


__all__ = ["plan_kv_cache", "qwen3_next_layer_specs"]
