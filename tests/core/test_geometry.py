import json

import pytest

from hybridkv.layout.geometry import AttentionSpec, ConvLayout, DType, GDNSpec, LayerKind, kv_heads_of_rank
from hybridkv.layout.hf_config import geometry_from_config, load_hf_config
from hybridkv.layout.presets import PRESET_NAMES, get_preset


def test_gdn_byte_math_qwen35_397b():
    spec = get_preset("qwen3.5-397b-a17b").spec_of(LayerKind.GDN)
    assert spec.conv_dim == 2 * 16 * 128 + 64 * 128 == 12288
    assert spec.conv_shape == (12288, 3)
    assert spec.conv_bytes == 36_864 * 2  # 72 KiB bf16 (docs/background/gdn.md section 2)
    assert spec.ssm_shape == (64, 128, 128)
    assert spec.ssm_bytes == 1_048_576 * 4  # 4 MiB fp32
    assert get_preset("qwen3.5-397b-a17b", ssm_dtype="bfloat16").spec_of(LayerKind.GDN).ssm_bytes == 2 * 2**20


def test_sd_conv_layout_shape_and_attention_bytes():
    g = GDNSpec(num_k_heads=2, num_v_heads=4, head_k_dim=8, head_v_dim=4, conv_kernel=4, conv_layout=ConvLayout.SD)
    assert g.conv_dim == 2 * 2 * 8 + 4 * 4 == 48
    assert g.conv_shape == (3, 48)
    a = AttentionSpec(num_kv_heads=4, head_dim=256, dtype=DType.BFLOAT16)
    assert a.bytes_per_token == 2 * 4 * 256 * 2
    assert a.page_bytes(64) == 64 * 4096


@pytest.mark.parametrize("name,layers,gdn", [
    ("qwen3.5-397b-a17b", 60, 45), ("qwen3.5-122b-a10b", 48, 36), ("qwen3.5-35b-a3b", 40, 30),
    ("qwen3.5-27b", 64, 48), ("qwen3.5-9b", 32, 24), ("qwen3.5-4b", 32, 24), ("qwen3.5-2b", 24, 18),
    ("qwen3.5-0.8b", 24, 18), ("qwen3-next-80b-a3b", 48, 36),
])
def test_qwen_presets_follow_the_3_to_1_pattern(name, layers, gdn):
    g = get_preset(name)
    assert g.num_layers == layers
    assert len(g.layer_indices(LayerKind.GDN)) == gdn
    assert g.layer_indices(LayerKind.FULL_ATTENTION)[:2] == (3, 7)
    assert g.spec_of(LayerKind.FULL_ATTENTION).head_dim == 256


def test_gemma_preset():
    g = get_preset("gemma-3-4b-it")
    assert g.num_layers == 34
    assert g.layer_indices(LayerKind.FULL_ATTENTION) == (5, 11, 17, 23, 29)
    sw = g.spec_of(LayerKind.SLIDING_WINDOW)
    assert (sw.window, sw.num_kv_heads, sw.head_dim) == (1024, 4, 256)


def test_unknown_preset_lists_presets():
    with pytest.raises(ValueError) as e:
        get_preset("llama")
    assert "'llama'" in str(e.value) and all(n in str(e.value) for n in PRESET_NAMES)


def test_tp_sharding():
    g = get_preset("qwen3.5-397b-a17b")
    s = g.shard(8)
    assert s.spec_of(LayerKind.FULL_ATTENTION).num_kv_heads == 1  # 2 heads replicated over 8 ranks
    gdn = s.spec_of(LayerKind.GDN)
    assert (gdn.num_k_heads, gdn.num_v_heads, gdn.conv_dim) == (2, 8, 12288 // 8)
    assert kv_heads_of_rank(g.spec_of(LayerKind.FULL_ATTENTION), 8, 5) == range(1, 2)
    with pytest.raises(ValueError, match="tp 3"):
        g.shard(3)
    with pytest.raises(ValueError, match="already at tp=8"):
        s.shard(2)


QWEN_NEXT = {
    "model_type": "qwen3_next", "num_hidden_layers": 8, "full_attention_interval": 4, "num_key_value_heads": 2,
    "head_dim": 256, "hidden_size": 2048, "num_attention_heads": 16, "linear_num_key_heads": 16,
    "linear_num_value_heads": 32, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4, "torch_dtype": "bfloat16",
}


def test_hf_qwen3_next(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(QWEN_NEXT))
    g = load_hf_config(tmp_path)
    assert g.layer_indices(LayerKind.FULL_ATTENTION) == (3, 7)
    assert g.spec_of(LayerKind.GDN).ssm_dtype is DType.BFLOAT16


def test_hf_qwen35_nested_with_layer_types_and_ssm_dtype():
    text = {k: v for k, v in QWEN_NEXT.items() if k != "full_attention_interval"}
    text.update(model_type="qwen3_5_text", mamba_ssm_dtype="float32",
                layer_types=["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3 + ["full_attention"])
    g = geometry_from_config({"model_type": "qwen3_5", "text_config": text})
    assert g.spec_of(LayerKind.GDN).ssm_dtype is DType.FLOAT32
    assert len(g.layer_indices(LayerKind.GDN)) == 6


def test_hf_gemma3():
    cfg = {"model_type": "gemma3_text", "num_hidden_layers": 12, "sliding_window": 1024, "sliding_window_pattern": 6,
           "num_key_value_heads": 4, "head_dim": 256, "torch_dtype": "bfloat16"}
    g = geometry_from_config(cfg)
    assert g.layer_indices(LayerKind.FULL_ATTENTION) == (5, 11)


@pytest.mark.parametrize("drop,match", [("linear_num_value_heads", "'linear_num_value_heads'"),
                                        ("num_hidden_layers", "'num_hidden_layers'")])
def test_hf_missing_key_is_named(drop, match):
    cfg = {k: v for k, v in QWEN_NEXT.items() if k != drop}
    with pytest.raises(ValueError, match=match):
        geometry_from_config(cfg)


def test_hf_contradiction_is_named():
    cfg = dict(QWEN_NEXT, layer_types=["full_attention"] * 8)
    with pytest.raises(ValueError, match="contradict"):
        geometry_from_config(cfg)
    with pytest.raises(ValueError, match="'layer_types' has 3 entries"):
        geometry_from_config(dict(QWEN_NEXT, layer_types=["full_attention"] * 3))


def test_bad_config_file(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_hf_config(tmp_path / "nope.json")
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_hf_config(tmp_path)
