"""Configs that read literally give a model nobody meant are refused, naming the values."""

from __future__ import annotations

import json

import pytest

from hybridkv.layout.geometry import LayerKind
from hybridkv.layout.hf_config import geometry_from_config, load_hf_config

QWEN_NEXT = {
    "model_type": "qwen3_next", "num_hidden_layers": 8, "full_attention_interval": 4, "num_key_value_heads": 2,
    "head_dim": 256, "hidden_size": 2048, "num_attention_heads": 16, "linear_num_key_heads": 16,
    "linear_num_value_heads": 32, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4, "torch_dtype": "bfloat16",
}
GEMMA3 = {"model_type": "gemma3_text", "num_hidden_layers": 12, "sliding_window": 1024, "sliding_window_pattern": 6,
          "num_key_value_heads": 4, "head_dim": 256, "torch_dtype": "bfloat16"}


def test_full_attention_interval_beyond_the_layer_count_is_refused():
    with pytest.raises(ValueError, match=r"'full_attention_interval' is 9, more than num_hidden_layers 8"):
        geometry_from_config(dict(QWEN_NEXT, full_attention_interval=9))


def test_refused_through_a_config_file_too(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(dict(QWEN_NEXT, num_hidden_layers=3)))
    with pytest.raises(ValueError, match=r"'full_attention_interval' is 4, more than num_hidden_layers 3"):
        load_hf_config(tmp_path)


def test_nested_text_config_is_checked():
    text = dict(QWEN_NEXT, model_type="qwen3_5_text", full_attention_interval=64)
    with pytest.raises(ValueError, match=r"is 64, more than num_hidden_layers 8"):
        geometry_from_config({"model_type": "qwen3_5", "text_config": text})


def test_sliding_window_pattern_beyond_the_layer_count_is_refused():
    # The same reading for Gemma 3: a pattern longer than the model leaves no full-attention layer.
    with pytest.raises(ValueError, match=r"'sliding_window_pattern' is 13, more than num_hidden_layers 12"):
        geometry_from_config(dict(GEMMA3, sliding_window_pattern=13))


def test_interval_equal_to_the_layer_count_is_fine():
    g = geometry_from_config(dict(QWEN_NEXT, full_attention_interval=8))
    assert g.layer_indices(LayerKind.FULL_ATTENTION) == (7,)


# --------------------------------------------------------------------------- the families beside the GDN hybrids

LLAMA = {"model_type": "llama", "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2,
         "hidden_size": 512, "torch_dtype": "bfloat16"}


@pytest.mark.parametrize("extra", [{}, {"model_type": "qwen3", "sliding_window": None},
                                   {"model_type": "qwen2", "sliding_window": 4096, "use_sliding_window": False}])
def test_dense_models_are_full_attention(extra):
    """Llama, Qwen2/3 (which carry a sliding window they do not use): every layer full attention, not the
    misleading "sliding_window must be a positive integer" of a Gemma parse."""
    g = geometry_from_config(dict(LLAMA, **extra))
    assert g.kinds() == (LayerKind.FULL_ATTENTION,) and g.num_layers == 4
    assert (g.layers[0].num_kv_heads, g.layers[0].head_dim) == (2, 64)


def test_mistral_window_applies_to_every_layer():
    g = geometry_from_config(dict(LLAMA, model_type="mistral", sliding_window=4096))
    assert g.kinds() == (LayerKind.SLIDING_WINDOW,) and g.layers[0].window == 4096


NEMOTRON_H = {"model_type": "nemotron_h", "hybrid_override_pattern": "M-M*-M", "num_hidden_layers": 6,
              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "hidden_size": 256,
              "mamba_num_heads": 8, "mamba_head_dim": 32, "ssm_state_size": 16, "n_groups": 2, "conv_kernel": 4,
              "torch_dtype": "bfloat16"}


def test_nemotron_h_mamba2_hybrid():
    g = geometry_from_config(NEMOTRON_H)
    assert [s.kind for s in g.layers] == [LayerKind.MAMBA, LayerKind.MAMBA, LayerKind.FULL_ATTENTION,
                                          LayerKind.MAMBA]  # MLP layers hold no cache
    mamba = g.layers[0]
    assert mamba.shapes == ((8 * 32 + 2 * 2 * 16, 3), (8, 32, 16))
    # vLLM 0.33 sizes this model's Mamba2 page at 18,304 bytes (conv bf16 + SSM fp32, tests/vllm/models).
    assert mamba.page_bytes(16) == 18304
    assert g.shard(2).layers[0].shapes == ((160, 3), (4, 32, 16))


def test_granite_4_mamba2_hybrid():
    cfg = {"model_type": "granitemoehybrid", "num_hidden_layers": 4, "num_attention_heads": 8,
           "num_key_value_heads": 2, "hidden_size": 512, "layer_types": ["mamba", "mamba", "mamba", "attention"],
           "mamba_n_heads": 16, "mamba_d_head": 64, "mamba_d_state": 128, "mamba_n_groups": 1, "mamba_d_conv": 4,
           "torch_dtype": "bfloat16"}
    g = geometry_from_config(cfg)
    assert g.kinds() == (LayerKind.MAMBA, LayerKind.FULL_ATTENTION) and g.num_layers == 4


def test_mamba2_pattern_refuses_an_unknown_layer():
    with pytest.raises(ValueError, match=r"'hybrid_override_pattern' has \['X'\]; expected M \(Mamba2\)"):
        geometry_from_config(dict(NEMOTRON_H, hybrid_override_pattern="MX*"))


def test_deepseek_mla_is_one_latent_per_token():
    cfg = {"model_type": "deepseek_v3", "num_hidden_layers": 3, "num_attention_heads": 128, "kv_lora_rank": 512,
           "qk_rope_head_dim": 64, "torch_dtype": "bfloat16"}
    g = geometry_from_config(cfg)
    spec = g.layers[0]
    assert (spec.num_kv_heads, spec.head_dim, spec.head_dim_v, spec.bytes_per_token) == (1, 576, 0, 576 * 2)
    assert g.shard(8).layers[0].num_kv_heads == 1  # every rank holds the whole latent


def test_a_config_without_attention_is_named():
    with pytest.raises(ValueError, match=r"model_type 'whisper_encoder' has no 'num_attention_heads'"):
        geometry_from_config({"model_type": "whisper_encoder", "num_hidden_layers": 2})
