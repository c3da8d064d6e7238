"""register_kv_caches adopts the tensors vLLM 0.33.0 allocates into a hybridkv layout."""

from __future__ import annotations

import pytest

from tests.vllm import harness as h


def _adopt(*, ssm_dtype="auto", supported=None):
    import torch
    from vllm.v1.worker.utils import allocate_kv_cache

    from hybridkv.connectors.vllm.layout_adopt import adopt_vllm_kv_caches

    vc = h.make_vllm_config(role="kv_consumer", ssm_dtype=ssm_dtype)
    kcc = h.make_kv_cache_config(vc, supported_layouts=supported)
    kv = allocate_kv_cache(kcc, torch.device("cpu"), vc.cache_config.get_resolved_kv_cache_layout(), None)
    return vc, kcc, kv, adopt_vllm_kv_caches(vc, kcc, kv)


@pytest.mark.parametrize("ssm_dtype", ["auto", "float32"])
def test_block_outermost_pages_become_one_region(ssm_dtype):
    from hybridkv.layout.fields import FieldKind

    vc, kcc, kv, layout = _adopt(ssm_dtype=ssm_dtype)
    assert vc.cache_config.kv_cache_layout == "BLHNC"
    [region] = layout.regions  # every group aliases the one block-outermost allocation
    tensor = kcc.kv_cache_tensors[0]
    assert region.stride == region.page_bytes == tensor.block_stride
    assert region.num_pages == kcc.num_blocks
    storage = next(iter(kv.values())).untyped_storage()
    assert region.base_addr == storage.data_ptr()
    # GDN groups: conv Q|K|V rows and the SSM state of each layer, at vLLM's offsets.
    for g in layout.groups[:3]:
        keys = {f.key[0] for p in g.placements for f in p.fields}
        assert keys == {FieldKind.CONV_Q, FieldKind.CONV_K, FieldKind.CONV_V, FieldKind.SSM}
        layers = sorted({f.key[1] for p in g.placements for f in p.fields})
        assert layers == [int(n.split(".")[2]) for n in kcc.kv_cache_groups[g.group_id].layer_names]
        ssm = [f for p in g.placements for f in p.fields if f.key[0] is FieldKind.SSM]
        conv_bytes = kcc.kv_cache_groups[g.group_id].kv_cache_spec.shapes[0]
        conv_bytes = conv_bytes[0] * conv_bytes[1] * 2  # bf16 conv state
        first_layer_ssm = min(f.offset for f in ssm)
        assert first_layer_ssm == conv_bytes  # SSM state right after the conv state, as vLLM packs it
    attn = layout.groups[3]
    assert {f.key[0] for p in attn.placements for f in p.fields} == {FieldKind.KV}


def test_fallback_layout_is_adopted_per_layer_slot(caplog):
    vc, kcc, kv, layout = _adopt(supported=["LBNHC", "LBHNC"])
    assert vc.cache_config.kv_cache_layout == "LBNHC"
    assert len(layout.regions) == 2  # one per layer slot: no longer one span per block
    assert any("not block-outermost" in r.getMessage() for r in caplog.records)


def test_sd_conv_layout_is_refused(monkeypatch):
    from vllm.model_executor.layers.mamba import mamba_utils

    monkeypatch.setenv("VLLM_SSM_CONV_STATE_LAYOUT", "SD")
    mamba_utils.get_conv_state_layout.cache_clear()
    try:
        assert str(mamba_utils.get_conv_state_layout()) == "SD"
        with pytest.raises(ValueError, match="VLLM_SSM_CONV_STATE_LAYOUT=DS"):
            _adopt()
    finally:
        monkeypatch.setenv("VLLM_SSM_CONV_STATE_LAYOUT", "DS")
        mamba_utils.get_conv_state_layout.cache_clear()
