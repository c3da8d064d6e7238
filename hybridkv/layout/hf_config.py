"""Build a ModelGeometry from a Hugging Face config.json.

Qwen3-Next (`full_attention_interval`, `linear_*`), Qwen3.5 (may nest under
`text_config`, may carry `layer_types` and `mamba_ssm_dtype`) and Gemma 3
(`sliding_window`, `sliding_window_pattern` or `layer_types`). A missing or
contradictory key is a ValueError that names it.

A model family is parsed here; a kind's `layer_types` name is the kind's own
(`LayerKind.hf_layer_type`). Inside an engine the layout comes from the engine, not
from here (docs/design.md, "Derive from the engine").
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hybridkv.layout.geometry import AttentionSpec, DType, GDNSpec, LayerKind, LayerSpec, ModelGeometry

_MISSING = object()


def load_hf_config(path: str | Path, *, ssm_dtype: DType | str | None = None) -> ModelGeometry:
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    try:
        raw = json.loads(p.read_text())
    except FileNotFoundError:
        raise ValueError(f"config file {str(p)!r} does not exist") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"config file {str(p)!r} is not valid JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"config file {str(p)!r} must hold a JSON object, got {type(raw).__name__}")
    return geometry_from_config(raw, name=p.parent.name or p.stem, ssm_dtype=ssm_dtype)


def geometry_from_config(raw: dict[str, Any], *, name: str = "model", ssm_dtype=None) -> ModelGeometry:
    cfg: dict[str, Any] = raw["text_config"] if isinstance(raw.get("text_config"), dict) else raw
    model_type = str(cfg.get("model_type", raw.get("model_type", "")))
    dtype = DType.parse(_get(cfg, "torch_dtype", default=None) or _get(cfg, "dtype", default="bfloat16"),
                        what="torch_dtype")
    if model_type.startswith("gemma3") or "sliding_window" in cfg and "linear_num_key_heads" not in cfg:
        layers = _gemma_layers(cfg, dtype)
    elif "linear_num_key_heads" in cfg or model_type.startswith(("qwen3_next", "qwen3_5")):
        layers = _qwen_layers(cfg, dtype, ssm_dtype)
    else:
        raise ValueError(
            f"config model_type {model_type!r} is not a supported hybrid model "
            "(expected Qwen3-Next / Qwen3.5 `linear_*` keys or Gemma 3 `sliding_window`)"
        )
    return ModelGeometry(name=str(raw.get("_name_or_path") or name), layers=layers)


def _get(cfg: dict[str, Any], key: str, *, default: Any = _MISSING) -> Any:
    value = cfg.get(key, default)
    if value is _MISSING:
        raise ValueError(f"config key {key!r} is missing")
    return value


def _int(cfg: dict[str, Any], key: str, default: Any = _MISSING) -> int:
    value = _get(cfg, key, default=default)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"config key {key!r} must be a positive integer, got {value!r}")
    return value


def _layer_kinds_from_types(cfg: dict[str, Any], n: int, family: tuple[LayerKind, ...]) -> list[LayerKind] | None:
    names = {k.hf_layer_type: k for k in family}
    types = cfg.get("layer_types")
    if types is None:
        return None
    if not isinstance(types, list) or len(types) != n:
        got = len(types) if isinstance(types, list) else type(types).__name__
        raise ValueError(f"config key 'layer_types' has {got} entries, but num_hidden_layers is {n}")
    kinds = []
    for i, t in enumerate(types):
        if t not in names:
            raise ValueError(f"config key 'layer_types'[{i}] is {t!r}, expected one of {sorted(names)}")
        kinds.append(names[t])
    return kinds


def _layer_kinds(cfg: dict[str, Any], family: tuple[LayerKind, ...], *, every_key: str,
                 other: LayerKind) -> list[LayerKind]:
    """Layer kinds (of the model family's `family`) from `layer_types` (each kind's HF name), or from
    "every Nth layer is full attention"; both must agree."""
    n = _int(cfg, "num_hidden_layers")
    kinds = _layer_kinds_from_types(cfg, n, family)
    if cfg.get(every_key) is not None:
        every = _int(cfg, every_key)
        if every > n:
            # Read literally it gives a model without a single full-attention layer, which no
            # config means: more likely the layer count or the interval is wrong.
            raise ValueError(f"config key '{every_key}' is {every}, more than num_hidden_layers {n}; "
                             f"expected 1 to {n}")
        by_every = [LayerKind.FULL_ATTENTION if (i + 1) % every == 0 else other for i in range(n)]
        if kinds is not None and kinds != by_every:
            raise ValueError(f"config keys 'layer_types' and '{every_key}'={every} contradict each other")
        kinds = by_every
    if kinds is None:
        raise ValueError(f"config key 'layer_types' or '{every_key}' is missing")
    return kinds


def _qwen_layers(cfg: dict[str, Any], dtype: DType, ssm_dtype) -> tuple[LayerSpec, ...]:
    kinds = _layer_kinds(cfg, (LayerKind.GDN, LayerKind.FULL_ATTENTION), every_key="full_attention_interval",
                         other=LayerKind.GDN)
    if ssm_dtype is not None:
        ssm = DType.parse(ssm_dtype, what="ssm dtype")
    else:
        ssm = DType.parse(cfg.get("mamba_ssm_dtype") or dtype, what="mamba_ssm_dtype")
    attn = AttentionSpec(
        num_kv_heads=_int(cfg, "num_key_value_heads"),
        head_dim=_int(cfg, "head_dim", default=_int(cfg, "hidden_size") // _int(cfg, "num_attention_heads")),
        dtype=dtype,
    )
    gdn = GDNSpec(
        num_k_heads=_int(cfg, "linear_num_key_heads"),
        num_v_heads=_int(cfg, "linear_num_value_heads"),
        head_k_dim=_int(cfg, "linear_key_head_dim"),
        head_v_dim=_int(cfg, "linear_value_head_dim"),
        conv_kernel=_int(cfg, "linear_conv_kernel_dim"),
        conv_dtype=dtype,
        ssm_dtype=ssm,
    )
    specs: dict[LayerKind, LayerSpec] = {LayerKind.GDN: gdn, LayerKind.FULL_ATTENTION: attn}
    return tuple(specs[k] for k in kinds)


def _gemma_layers(cfg: dict[str, Any], dtype: DType) -> tuple[LayerSpec, ...]:
    window = _int(cfg, "sliding_window")
    kinds = _layer_kinds(cfg, (LayerKind.SLIDING_WINDOW, LayerKind.FULL_ATTENTION),
                         every_key="sliding_window_pattern", other=LayerKind.SLIDING_WINDOW)
    heads = _int(cfg, "num_key_value_heads")
    head_dim = _int(cfg, "head_dim")
    full = AttentionSpec(num_kv_heads=heads, head_dim=head_dim, dtype=dtype)
    local = AttentionSpec(kind=LayerKind.SLIDING_WINDOW, num_kv_heads=heads, head_dim=head_dim,
                          dtype=dtype, window=window)
    specs: dict[LayerKind, LayerSpec] = {LayerKind.SLIDING_WINDOW: local, LayerKind.FULL_ATTENTION: full}
    return tuple(specs[k] for k in kinds)
