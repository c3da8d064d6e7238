"""Geometries of the models hybridkv is measured on.

Qwen3.5 / Qwen3-Next values: docs/background/gdn.md section 2 (dk = dv = 128, conv kernel 4,
full_attention_interval 4, full-attention head_dim 256). gemma-3-4b-it: 34 layers,
every 6th full attention, the rest sliding window 1024, 4 KV heads, head_dim 256.
"""

from __future__ import annotations

from dataclasses import dataclass

from hybridkv.layout.geometry import AttentionSpec, DType, GDNSpec, LayerKind, LayerSpec, ModelGeometry


@dataclass(frozen=True, kw_only=True)
class _Qwen:
    layers: int
    kv_heads: int
    k_heads: int
    v_heads: int
    # Qwen3.5 configs carry mamba_ssm_dtype float32; Qwen3-Next's carries none, so
    # vLLM's `auto` follows the model dtype (bfloat16).
    ssm_dtype: DType = DType.FLOAT32


_QWEN = {
    "qwen3.5-397b-a17b": _Qwen(layers=60, kv_heads=2, k_heads=16, v_heads=64),
    "qwen3.5-122b-a10b": _Qwen(layers=48, kv_heads=2, k_heads=16, v_heads=64),
    "qwen3.5-35b-a3b": _Qwen(layers=40, kv_heads=2, k_heads=16, v_heads=32),
    "qwen3.5-27b": _Qwen(layers=64, kv_heads=4, k_heads=16, v_heads=48),
    "qwen3.5-9b": _Qwen(layers=32, kv_heads=4, k_heads=16, v_heads=32),
    "qwen3.5-4b": _Qwen(layers=32, kv_heads=4, k_heads=16, v_heads=32),
    "qwen3.5-2b": _Qwen(layers=24, kv_heads=2, k_heads=16, v_heads=16),
    "qwen3.5-0.8b": _Qwen(layers=24, kv_heads=2, k_heads=16, v_heads=16),
    "qwen3-next-80b-a3b": _Qwen(layers=48, kv_heads=2, k_heads=16, v_heads=32, ssm_dtype=DType.BFLOAT16),
}


def qwen_hybrid(
    name: str,
    *,
    num_layers: int,
    num_kv_heads: int,
    num_k_heads: int,
    num_v_heads: int,
    head_dim: int = 256,
    head_k_dim: int = 128,
    head_v_dim: int = 128,
    conv_kernel: int = 4,
    full_attention_interval: int = 4,
    dtype: DType = DType.BFLOAT16,
    ssm_dtype: DType = DType.FLOAT32,
) -> ModelGeometry:
    """3 GDN layers then 1 full-attention layer, repeated (Qwen3-Next / Qwen3.5)."""
    attn = AttentionSpec(num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype)
    gdn = GDNSpec(
        num_k_heads=num_k_heads, num_v_heads=num_v_heads, head_k_dim=head_k_dim,
        head_v_dim=head_v_dim, conv_kernel=conv_kernel, conv_dtype=dtype, ssm_dtype=ssm_dtype,
    )
    layers: tuple[LayerSpec, ...] = tuple(
        attn if (i + 1) % full_attention_interval == 0 else gdn for i in range(num_layers)
    )
    return ModelGeometry(name=name, layers=layers)


def gemma3(
    name: str = "gemma-3-4b-it",
    *,
    num_layers: int = 34,
    num_kv_heads: int = 4,
    head_dim: int = 256,
    window: int = 1024,
    pattern: int = 6,
    dtype: DType = DType.BFLOAT16,
) -> ModelGeometry:
    full = AttentionSpec(num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype)
    local = AttentionSpec(
        kind=LayerKind.SLIDING_WINDOW, num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype, window=window
    )
    layers = tuple(full if (i + 1) % pattern == 0 else local for i in range(num_layers))
    return ModelGeometry(name=name, layers=layers)


PRESET_NAMES: tuple[str, ...] = (*_QWEN, "gemma-3-4b-it")


def get_preset(name: str, *, ssm_dtype: DType | str | None = None) -> ModelGeometry:
    key = name.lower()
    if key in _QWEN:
        q = _QWEN[key]
        geometry = qwen_hybrid(
            key, num_layers=q.layers, num_kv_heads=q.kv_heads, num_k_heads=q.k_heads,
            num_v_heads=q.v_heads, ssm_dtype=q.ssm_dtype,
        )
    elif key == "gemma-3-4b-it":
        geometry = gemma3()
    else:
        raise ValueError(f"unknown model {name!r}; presets are: {', '.join(PRESET_NAMES)}")
    if ssm_dtype is not None:
        if not geometry.has_ssm_state:
            raise ValueError(f"--ssm-dtype applies to GDN models; {key} has no GDN layers")
        geometry = geometry.with_ssm_dtype(DType.parse(ssm_dtype, what="ssm dtype"))
    return geometry
