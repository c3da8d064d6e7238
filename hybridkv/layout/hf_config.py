"""Build a ModelGeometry from a Hugging Face config.json.

Qwen3-Next (`full_attention_interval`, `linear_*`), Qwen3.5 (may nest under
`text_config`, may carry `layer_types` and `mamba_ssm_dtype`), Mamba2 hybrids
(Nemotron-H `hybrid_override_pattern`, Granite 4 `layer_types` with `mamba_*` keys),
DeepSeek MLA (`kv_lora_rank`), Gemma 3 (`sliding_window`, `sliding_window_pattern` or
`layer_types`) and dense decoders (Llama, Qwen2/3, Mistral: every layer attention,
sliding where one window applies to all). A missing or contradictory key is a
ValueError that names it. This is for offline analysis (`hybridkv analyze --config`).

A model family is parsed here; a kind's `layer_types` name is the kind's own
(`LayerKind.hf_layer_type`). Inside an engine the layout comes from the engine, not
from here (docs/design.md, "Derive from the engine").
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hybridkv.layout.geometry import AttentionSpec, DType, GDNSpec, LayerKind, LayerSpec, ModelGeometry, StateSpec

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


#: Mamba2 hybrids' key names: Nemotron-H (and most), Granite 4 (granitemoehybrid).
_MAMBA2_KEYS = {
    "nemotron": {"heads": "mamba_num_heads", "head_dim": "mamba_head_dim", "state": "ssm_state_size",
                 "groups": "n_groups", "kernel": "conv_kernel"},
    "granite": {"heads": "mamba_n_heads", "head_dim": "mamba_d_head", "state": "mamba_d_state",
                "groups": "mamba_n_groups", "kernel": "mamba_d_conv"},
}


def geometry_from_config(raw: dict[str, Any], *, name: str = "model", ssm_dtype=None) -> ModelGeometry:
    """The cache-bearing layers of a model from its config: Qwen3-Next / Qwen3.5 (GDN hybrids), Mamba2
    hybrids (Nemotron-H, Granite 4), DeepSeek MLA, Gemma 3 and other sliding-window models, and dense
    decoders (Llama, Qwen2/3, Mistral): every layer full attention unless the config says otherwise."""
    cfg: dict[str, Any] = raw["text_config"] if isinstance(raw.get("text_config"), dict) else raw
    model_type = str(cfg.get("model_type", raw.get("model_type", "")))
    dtype = DType.parse(_get(cfg, "torch_dtype", default=None) or _get(cfg, "dtype", default="bfloat16"),
                        what="torch_dtype")
    mamba2 = next((k for k, keys in _MAMBA2_KEYS.items() if keys["heads"] in cfg), None)
    if "linear_num_key_heads" in cfg or model_type.startswith(("qwen3_next", "qwen3_5")):
        layers = _qwen_layers(cfg, dtype, ssm_dtype)
    elif mamba2 is not None or model_type in ("nemotron_h", "granitemoehybrid"):
        layers = _mamba2_layers(cfg, dtype, ssm_dtype, _MAMBA2_KEYS[mamba2 or (
            "granite" if model_type == "granitemoehybrid" else "nemotron")], model_type)
    elif cfg.get("kv_lora_rank") is not None:
        layers = _mla_layers(cfg, dtype)
    elif model_type.startswith("gemma3") or _sliding_window(cfg) is not None and (
            "sliding_window_pattern" in cfg or "layer_types" in cfg):
        layers = _gemma_layers(cfg, dtype)
    else:
        layers = _dense_layers(cfg, dtype)
    return ModelGeometry(name=str(raw.get("_name_or_path") or name), layers=layers)


def _sliding_window(cfg: dict[str, Any]) -> int | None:
    """The config's sliding window where it applies: Qwen2/Qwen3 carry one with use_sliding_window false,
    and many configs carry `sliding_window: null`."""
    if cfg.get("use_sliding_window") is False or cfg.get("sliding_window") is None:
        return None
    return _int(cfg, "sliding_window")


def _attention(cfg: dict[str, Any], dtype: DType) -> AttentionSpec:
    heads = _int(cfg, "num_attention_heads")
    return AttentionSpec(num_kv_heads=_int(cfg, "num_key_value_heads", default=heads),
                         head_dim=_int(cfg, "head_dim", default=_int(cfg, "hidden_size") // heads), dtype=dtype)


def _dense_layers(cfg: dict[str, Any], dtype: DType) -> tuple[LayerSpec, ...]:
    """Every layer attention; all sliding where the config gives one window and no pattern (Mistral v0.1)."""
    if "num_attention_heads" not in cfg:
        model_type = cfg.get("model_type")
        raise ValueError(f"config model_type {model_type!r} has no 'num_attention_heads': not a decoder hybridkv "
                         "knows (expected a dense decoder, a GDN or Mamba2 hybrid, MLA or Gemma 3)")
    spec = _attention(cfg, dtype)
    window = _sliding_window(cfg)
    if window is not None:
        spec = AttentionSpec.windowed(window=window, num_kv_heads=spec.num_kv_heads, head_dim=spec.head_dim,
                                      dtype=dtype)
    return (spec,) * _int(cfg, "num_hidden_layers")


def _mla_layers(cfg: dict[str, Any], dtype: DType) -> tuple[LayerSpec, ...]:
    """DeepSeek MLA: one latent of kv_lora_rank + qk_rope_head_dim per token, which every TP rank holds."""
    latent = AttentionSpec(num_kv_heads=1, head_dim=_int(cfg, "kv_lora_rank") + _int(cfg, "qk_rope_head_dim"),
                           head_dim_v=0, dtype=dtype)
    return (latent,) * _int(cfg, "num_hidden_layers")


def _mamba2_kinds(cfg: dict[str, Any], model_type: str) -> list[str]:
    """'mamba' or 'attention' per cache-bearing layer (MLP / MoE layers hold no cache)."""
    pattern = cfg.get("hybrid_override_pattern")
    if isinstance(pattern, str):
        names = {"M": "mamba", "*": "attention", "-": None, "E": None}
        bad = sorted({c for c in pattern if c not in names})
        if bad:
            raise ValueError(f"config key 'hybrid_override_pattern' has {bad}; expected M (Mamba2), * (attention), "
                             "- (MLP) or E (MoE)")
        kinds = [names[c] for c in pattern]
    else:
        types = cfg.get("layers_block_type", cfg.get("layer_types"))
        if not isinstance(types, list):
            raise ValueError(f"config model_type {model_type!r}: 'hybrid_override_pattern' or 'layer_types' (a list "
                             "of mamba / attention per layer) is missing")
        aliases = {"mamba": "mamba", "mamba2": "mamba", "linear_attention": "mamba", "m": "mamba",
                   "attention": "attention", "full_attention": "attention", "mlp": None, "moe": None}
        kinds = []
        for i, t in enumerate(types):
            if str(t).lower() not in aliases:
                raise ValueError(f"config key 'layer_types'[{i}] is {t!r}, expected one of {sorted(aliases)}")
            kinds.append(aliases[str(t).lower()])
    n = cfg.get("num_hidden_layers")
    if n is not None and n != len(kinds):
        raise ValueError(f"config has {len(kinds)} layer types but num_hidden_layers is {n}")
    return [k for k in kinds if k is not None]


def _mamba2_layers(cfg: dict[str, Any], dtype: DType, ssm_dtype, keys: dict[str, str],
                   model_type: str) -> tuple[LayerSpec, ...]:
    """Mamba2 hybrids: each Mamba2 layer a state of conv (conv_dim, kernel - 1), conv_dim = heads * head_dim +
    2 * groups * state, and SSM (heads, head_dim, state); attention layers as dense models'."""
    heads, head_dim = _int(cfg, keys["heads"]), _int(cfg, keys["head_dim"])
    groups, state, kernel = _int(cfg, keys["groups"]), _int(cfg, keys["state"]), _int(cfg, keys["kernel"])
    if ssm_dtype is not None:
        ssm = DType.parse(ssm_dtype, what="ssm dtype")
    else:
        # Nemotron-H's config class defaults the SSM cache to float32 (what vLLM's "auto" then takes).
        default = DType.FLOAT32 if model_type == "nemotron_h" else dtype
        ssm = DType.parse(cfg.get("mamba_ssm_cache_dtype") or cfg.get("mamba_ssm_dtype") or default,
                          what="mamba_ssm_cache_dtype")
    mamba = StateSpec(shapes=((heads * head_dim + 2 * groups * state, kernel - 1), (heads, head_dim, state)),
                      state_dtypes=(dtype, ssm), family="mamba2", splits=True)
    kinds = _mamba2_kinds(cfg, model_type)
    attention = _attention(cfg, dtype) if "attention" in kinds else None
    return tuple(mamba if k == "mamba" else attention for k in kinds)


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
