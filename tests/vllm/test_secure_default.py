"""Secure by default in the vLLM connector, with both gates on as they will be
(``hybridkv.transport.config.REQUIRE_SECRET``, ``hybridkv.transport.auth.STRICT_SECRETS``):
without a secret either half refuses to start (vLLM's own factory, before vLLM loads weights or a
decode's first load), naming the opt-in ``insecure_no_auth`` and ``hybridkv secret``; lab mode by
name starts and says so loudly; a secret `hybridkv secret FILE` wrote starts both halves quietly;
a weak secret, or a secret file others can read, is refused at start-up naming its key."""

from __future__ import annotations

import logging

import pytest

from tests.ports import free_ports
from tests.vllm import harness as h

HALVES = ["SCHEDULER", "WORKER"]
ROLES = ["kv_producer", "kv_consumer"]


@pytest.fixture
def gates_on(monkeypatch):
    from hybridkv.transport import auth
    from hybridkv.transport import config as transport_config

    monkeypatch.setattr(transport_config, "REQUIRE_SECRET", True)
    monkeypatch.setattr(auth, "STRICT_SECRETS", True)


@pytest.fixture
def warnings_logged():
    """hybridkv's warnings, taken at its own logger (under vLLM it is parented to ``vllm``, which may
    not propagate to the root, where caplog listens)."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append  # type: ignore[method-assign]
    logger = logging.getLogger("hybridkv")
    logger.addHandler(handler)
    yield records
    logger.removeHandler(handler)


def _vllm_config(role: str, extra: dict):
    """vLLM's config with exactly this kv_connector_extra_config (not the harness's test secret)."""
    vc = h.make_vllm_config(role=role, extra=extra)
    vc.kv_transfer_config.kv_connector_extra_config = dict(extra)
    return vc


def _create(vc, half: str):
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    return KVConnectorFactory.create_connector(config=vc, role=KVConnectorRole[half],
                                               kv_cache_config=h.make_kv_cache_config(vc))


@pytest.mark.parametrize("role", ROLES)
@pytest.mark.parametrize("half", HALVES)
def test_without_a_secret_either_half_refuses_to_start_naming_the_opt_in(half, role, gates_on):
    vc = _vllm_config(role, {"side_channel_port": 5600})
    with pytest.raises(ValueError) as err:
        _create(vc, half)
    msg = str(err.value)
    assert msg.startswith("HybridKVConnector has no shared secret"), msg
    assert "'secret_file' nor 'secret_env'" in msg and "`hybridkv secret FILE`" in msg, msg
    assert "'insecure_no_auth': true" in msg, msg


def test_lab_mode_by_name_starts_both_halves_and_says_so_loudly(gates_on, warnings_logged):
    vc = _vllm_config("kv_producer", {"insecure_no_auth": True, "side_channel_port": free_ports()})
    _create(vc, "SCHEDULER")
    conn, _ = h.make_worker(vc, h.make_kv_cache_config(vc))  # the producer listens: the transport started
    try:
        assert conn.worker.listen_port is not None
        assert conn.worker._producer.metrics.take().insecure_no_auth == 1
    finally:
        conn.shutdown()
    insecure = [r.getMessage() for r in warnings_logged if r.getMessage().startswith("INSECURE")]
    # each half, from the connector's config, and the transport endpoint when it starts
    assert sum("HybridKVConnector runs in lab mode" in m and "'insecure_no_auth'" in m for m in insecure) >= 2, insecure
    assert any("producer listening" in m and "(insecure_no_auth)" in m for m in insecure), insecure


@pytest.mark.parametrize("source", ["secret_file", "secret_env"])
def test_a_secret_hybridkv_secret_wrote_starts_both_halves(source, gates_on, warnings_logged, tmp_path, monkeypatch):
    from hybridkv.transport.secret_cli import write_secret

    path = tmp_path / "hkv.secret"
    write_secret(path)  # what `hybridkv secret FILE` does
    if source == "secret_env":
        monkeypatch.setenv("HKV_TEST_SECURE_DEFAULT", path.read_text().strip())
        auth = {"secret_env": "HKV_TEST_SECURE_DEFAULT"}
    else:
        auth = {"secret_file": str(path)}
    # these caches are CPU tensors: host memory, accepted by name (test below)
    vc = _vllm_config("kv_producer", {**auth, "side_channel_port": free_ports(), "insecure_host_memory": True})
    _create(vc, "SCHEDULER")
    conn, _ = h.make_worker(vc, h.make_kv_cache_config(vc))
    try:
        assert conn.worker.listen_port is not None and conn.worker.secret == path.read_bytes().rstrip(b"\n")
        assert conn.worker._producer.metrics.take().insecure_no_auth == 0
    finally:
        conn.shutdown()
    assert not [r.getMessage() for r in warnings_logged
                if "INSECURE" in r.getMessage() or "secret" in r.getMessage()]


@pytest.mark.parametrize("role", ROLES)
def test_a_secret_on_host_memory_is_refused_at_start_naming_the_key(role, gates_on, monkeypatch):
    """CPU caches (host memory) with a secret: UCX may serve them over tcp, shm or cma, which do not bound a peer
    to the registration (hybridkv.transport.host_memory), so the worker refuses when it registers its caches,
    before any endpoint or thread exists, naming UCX_TLS and the connector's key."""
    monkeypatch.delenv("UCX_TLS", raising=False)
    vc = _vllm_config(role, {"secret_env": h.SECRET_ENV, "side_channel_port": free_ports()})
    with pytest.raises(ValueError) as err:
        h.make_worker(vc, h.make_kv_cache_config(vc))
    msg = str(err.value)
    assert msg.startswith("hybridkv HybridKVConnector: host-memory KV cache with a shared secret"), msg
    assert "UCX_TLS=rc,cuda_ipc" in msg and "kv_connector_extra_config 'insecure_host_memory': true" in msg, msg


@pytest.mark.parametrize(("data", "mode", "rule"), [
    (b"correct horse battery staple 42!\n", 0o600, "is text of 32 characters that is neither hex nor base64"),
    (b"0123456789abcdef-file\n", 0o600, "has 21 bytes; expected at least 32 random bytes"),
    (None, 0o644, "has mode 0644: group or others can access it"),
], ids=["passphrase", "short", "readable-by-others"])
@pytest.mark.parametrize("half", HALVES)
def test_a_weak_secret_is_refused_at_start_up_naming_its_key(half, data, mode, rule, gates_on, tmp_path):
    from hybridkv.transport.secret_cli import write_secret

    path = tmp_path / "hkv.secret"
    if data is None:
        write_secret(path)  # strong, but in a file any local user can read
    else:
        path.write_bytes(data)
    path.chmod(mode)
    vc = _vllm_config("kv_consumer", {"secret_file": str(path)})
    with pytest.raises(ValueError, match=rf"kv_connector_extra_config\['secret_file'\]: secret file '{path}' "
                                         rf"{rule}.*`hybridkv secret FILE`"):
        _create(vc, half)


def _deployment_configs(page: str) -> list[dict]:
    """Every HybridKVConnector ``--kv-transfer-config`` of a page's bash blocks, as JSON."""
    import json
    import re

    text = (h.TINY_MODEL.parents[2] / page).read_text()
    found = re.findall(r"'(\{\"kv_connector\":\"HybridKVConnector\".*?\}\})'", text, flags=re.DOTALL)
    assert found, f"{page}: no HybridKVConnector --kv-transfer-config"
    return [json.loads(re.sub(r":PORT\b", ":5600", cfg)) for cfg in found]


@pytest.mark.parametrize("page", ["README.md", "docs/deploy-vllm.md"])
def test_the_deployment_lines_start_as_written_with_the_gates_on(page, gates_on, tmp_path):
    """The page's own secret line and configs: both halves of each instance start; with the secret key
    swapped for lab mode by name they start too; with neither they refuse."""
    from hybridkv.transport.secret_cli import write_secret

    text = (h.TINY_MODEL.parents[2] / page).read_text()
    assert "hybridkv secret /etc/hybridkv/secret" in text  # how the page makes the secret
    path = tmp_path / "secret"
    write_secret(path)
    for kvt in _deployment_configs(page):
        extra = kvt["kv_connector_extra_config"]
        assert extra["secret_file"] == "/etc/hybridkv/secret"
        lab = {k: v for k, v in extra.items() if k != "secret_file"}
        for given, starts in (({**extra, "secret_file": str(path)}, True), ({**lab, "insecure_no_auth": True}, True),
                              (lab, False)):
            vc = _vllm_config(kvt["kv_role"], given)
            for half in HALVES:
                if starts:
                    _create(vc, half)
                else:
                    with pytest.raises(ValueError, match="'insecure_no_auth': true"):
                        _create(vc, half)
