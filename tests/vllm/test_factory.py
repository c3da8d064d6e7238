"""vLLM's own factory loads HybridKVConnector by module path, for every role."""

from __future__ import annotations

import pytest

from tests.vllm import harness as h


@pytest.mark.parametrize("kv_role", ["kv_producer", "kv_consumer", "kv_both"])
def test_factory_loads_connector_for_every_role(kv_role):
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole, SupportsHMA, supports_hma

    from hybridkv.connectors.vllm import HybridKVConnector

    vc = h.make_vllm_config(role=kv_role)
    assert not vc.scheduler_config.disable_hybrid_kv_cache_manager  # HMA stayed on
    kvt = vc.kv_transfer_config
    cls = KVConnectorFactory.get_connector_class(kvt)
    assert cls is HybridKVConnector
    assert issubclass(cls, SupportsHMA) and supports_hma(cls)
    assert KVConnectorFactory.supports_hma_config(kvt)
    kcc = h.make_kv_cache_config(vc)
    for role in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER):
        conn = KVConnectorFactory.create_connector(config=vc, role=role, kv_cache_config=kcc)
        assert isinstance(conn, HybridKVConnector)
        assert (conn.scheduler is not None) is (role is KVConnectorRole.SCHEDULER)
        assert (conn.worker is not None) is (role is KVConnectorRole.WORKER)


def test_vllm_resolves_the_requested_block_outermost_layout():
    vc = h.make_vllm_config(role="kv_consumer")
    kcc = h.make_kv_cache_config(vc)
    assert vc.cache_config.kv_cache_layout == "BLHNC"
    # Block-outermost: a block of a group holds both of its layers side by side.
    for t in kcc.kv_cache_tensors:
        assert t.block_stride == len(t.layers) * t.layer_stride


def test_layout_falls_back_when_backends_refuse_block_outermost(caplog):
    vc = h.make_vllm_config(role="kv_consumer")
    h.make_kv_cache_config(vc, supported_layouts=["LBNHC", "LBHNC"])
    assert vc.cache_config.kv_cache_layout == "LBNHC"


def test_vllm_groups_the_tiny_hybrid_model_as_documented():
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec

    vc = h.make_vllm_config(role="kv_consumer")
    kcc = h.make_kv_cache_config(vc)
    kinds = [type(g.kv_cache_spec) for g in kcc.kv_cache_groups]
    assert kinds == [MambaSpec, MambaSpec, MambaSpec, FullAttentionSpec]
    assert [len(g.layer_names) for g in kcc.kv_cache_groups] == [2, 2, 2, 2]
    # Page unification: the attention block grew until its page holds a GDN state.
    assert vc.cache_config.block_size == 32
    assert kcc.kv_cache_groups[3].kv_cache_spec.page_size_bytes == kcc.kv_cache_groups[0].kv_cache_spec.page_size_bytes


@pytest.mark.parametrize("given", ["10.0.0.0/8, 127.0.0.1", ["10.0.0.0/8", "127.0.0.1"]])
def test_allowed_peers_reach_the_producer_listener(given):
    """kv_connector_extra_config["allowed_peers"] (a JSON list or a comma-separated string) becomes the
    producer's allowlist: its listener is open on every interface, this keeps other networks out."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    vc = h.make_vllm_config(role="kv_producer", extra={"allowed_peers": given})
    conn = KVConnectorFactory.create_connector(config=vc, role=KVConnectorRole.WORKER,
                                               kv_cache_config=h.make_kv_cache_config(vc))
    assert conn.worker.allowed_peers == ("10.0.0.0/8", "127.0.0.1")
    allow = conn.worker._config().allowlist
    assert allow.allows("10.9.8.7") and allow.allows("127.0.0.1") and not allow.allows("192.168.0.1")


def test_a_bad_allowed_peer_fails_at_startup_named():
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    vc = h.make_vllm_config(role="kv_producer", extra={"allowed_peers": "10.0.0.0/8,10.0.0.0/40"})
    with pytest.raises(ValueError, match=r"allowed peer '10.0.0.0/40' is not an IP address or network"):
        KVConnectorFactory.create_connector(config=vc, role=KVConnectorRole.WORKER,
                                            kv_cache_config=h.make_kv_cache_config(vc))
