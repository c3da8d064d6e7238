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
