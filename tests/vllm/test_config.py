"""The vLLM connector's one configuration object: every extra-config key, its default, its checks."""

from __future__ import annotations

import logging
import re
import subprocess
import sys
from pathlib import Path

import pytest

from hybridkv.connectors.vllm.config import HybridKVVllmConfig
from hybridkv.fencing.fence import FencePolicy
from hybridkv.transport.staging import StagingMode

ROOT = Path(__file__).resolve().parents[2]

DEFAULTS = {
    "side_channel_host": "127.0.0.1",
    "side_channel_port": 5600,
    "kv_lease_duration": 30.0,
    "export_timeout_s": 30.0,
    "allowed_peers": (),
    "allowed_producers": (),
    "secret_file": None,
    "secret_env": None,
    "tp_rank": None,
    "insecure_no_auth": False,
    "insecure_host_memory": False,
    "staging": StagingMode.OFF,
    "staging_capacity_mb": 64,
    "prime_reads": True,
    "hybridkv_fence_policy": FencePolicy.FENCED,
}


def test_defaults_live_in_one_place():
    """An empty (or absent) extra config is the dataclass's defaults, and those are the documented ones."""
    assert set(HybridKVVllmConfig.keys()) == set(DEFAULTS)
    for extra in (None, {}):
        cfg = HybridKVVllmConfig.from_extra_config(extra, env={})
        assert cfg == HybridKVVllmConfig()
        assert {k: getattr(cfg, k) for k in DEFAULTS} == DEFAULTS


@pytest.mark.parametrize(("key", "given", "parsed"), [
    ("side_channel_host", "10.0.0.1", "10.0.0.1"),
    ("side_channel_host", " node-a ", "node-a"),
    ("side_channel_port", 5700, 5700),
    ("side_channel_port", "5700", 5700),  # templated configs write numbers as strings
    ("kv_lease_duration", 2, 2.0),
    ("kv_lease_duration", "0.5", 0.5),
    ("export_timeout_s", 7.5, 7.5),
    ("allowed_peers", "10.0.0.0/8, 127.0.0.1", ("10.0.0.0/8", "127.0.0.1")),
    ("allowed_peers", ["10.0.0.0/8", "fd00::/8"], ("10.0.0.0/8", "fd00::/8")),
    ("allowed_peers", "", ()),
    ("secret_file", "/etc/hybridkv/secret", "/etc/hybridkv/secret"),
    ("secret_env", " HYBRIDKV_SECRET ", "HYBRIDKV_SECRET"),
    ("tp_rank", 3, 3),
    ("tp_rank", None, None),
    ("insecure_no_auth", True, True),
    ("insecure_no_auth", "false", False),
    ("insecure_host_memory", "true", True),
    ("hybridkv_fence_policy", "none", FencePolicy.NONE),
    ("hybridkv_fence_policy", "FENCED", FencePolicy.FENCED),
    ("staging", "Auto", StagingMode.AUTO),
    ("staging", StagingMode.ON, StagingMode.ON),
    ("staging_capacity_mb", "16", 16),
    ("prime_reads", "false", False),
    ("prime_reads", False, False),
])
def test_each_key_parses(key, given, parsed):
    cfg = HybridKVVllmConfig.from_extra_config({key: given}, env={})
    assert getattr(cfg, key) == parsed
    # every other key keeps its default
    assert all(getattr(cfg, k) == v for k, v in DEFAULTS.items() if k != key)


@pytest.mark.parametrize(("key", "bad", "expected"), [
    ("side_channel_host", "", "a non-empty host name or address"),
    ("side_channel_host", 10, "a non-empty host name or address"),
    ("side_channel_port", True, "an int"),
    ("side_channel_port", "http", "an int"),
    ("side_channel_port", 5600.5, "an int"),
    ("side_channel_port", 0, "a TCP port, 1..65535"),
    ("staging", "always", "one of ['auto', 'off', 'on']"),
    ("staging_capacity_mb", 0, "an int of MiB, 1..65536"),
    ("side_channel_port", 65536, "a TCP port, 1..65535"),
    ("kv_lease_duration", 0, "a positive number of seconds"),
    ("kv_lease_duration", -1, "a positive number of seconds"),
    ("kv_lease_duration", "inf", "a positive number of seconds"),
    ("kv_lease_duration", "30s", "a positive number of seconds"),
    ("export_timeout_s", None, "a positive number of seconds"),
    ("allowed_peers", 10, "a list of addresses/CIDR networks or one comma-separated string"),
    ("allowed_peers", ["10.0.0.1", 5], "a list of addresses/CIDR networks or one comma-separated string"),
    ("tp_rank", -1, "null or a non-negative int"),
    ("tp_rank", "first", "an int"),
    ("hybridkv_fence_policy", "off", "one of ['fenced', 'none']"),
    ("hybridkv_fence_policy", False, "one of ['fenced', 'none']"),
    ("prime_reads", "sometimes", "true or false"),
])
def test_a_bad_value_names_the_key_the_value_and_what_was_expected(key, bad, expected):
    with pytest.raises(ValueError) as err:
        HybridKVVllmConfig.from_extra_config({key: bad})
    msg = str(err.value)
    assert f"kv_connector_extra_config[{key!r}]" in msg
    assert msg.endswith(f"expected {expected}")


def test_a_bad_allowed_peer_is_named():
    with pytest.raises(ValueError, match=r"\['allowed_peers'\]: allowed peer '10.0.0.0/40' is not an IP address"):
        HybridKVVllmConfig.from_extra_config({"allowed_peers": "10.0.0.0/8,10.0.0.0/40"})


def test_direct_construction_is_checked_too():
    with pytest.raises(ValueError, match=r"\['side_channel_port'\] = 0; expected a TCP port"):
        HybridKVVllmConfig(side_channel_port=0)
    with pytest.raises(ValueError, match=r"\['hybridkv_fence_policy'\] = 'fenced'; expected a FencePolicy"):
        HybridKVVllmConfig(hybridkv_fence_policy="fenced")


def test_an_unknown_hybridkv_key_is_refused():
    """hybridkv_* is our namespace: an unknown key there is a typo, never another connector's setting."""
    with pytest.raises(ValueError, match=r"unknown hybridkv key\(s\) \['hybridkv_fence'\]; expected one of"):
        HybridKVVllmConfig.from_extra_config({"hybridkv_fence": "none"})


def test_nixl_connector_keys_are_accepted_and_other_unknown_keys_warn(caplog):
    """A deployment switching from NixlConnector keeps its keys; a key neither knows is named in the log."""
    nixl = {"backends": ["UCX"], "num_threads": 8, "enforce_handshake_compat": True, "kv_recompute_threshold": 4}
    with caplog.at_level(logging.INFO, logger="hybridkv.connectors.vllm.config"):
        cfg = HybridKVVllmConfig.from_extra_config({**nixl, "lmcache_chunk": 256}, env={})
    assert cfg == HybridKVVllmConfig()
    msgs = [r.getMessage() for r in caplog.records if r.name == "hybridkv.connectors.vllm.config"]
    assert any("NixlConnector's" in m and str(sorted(nixl)) in m for m in msgs)
    assert any(r.levelno == logging.WARNING and "['lmcache_chunk']" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize(("key", "meant"), [
    ("secret_flie", "secret_file"), ("side_chanel_host", "side_channel_host"), ("kv_lease_duraton", "kv_lease_duration"),
    ("secretfile", "secret_file"), ("insecure_noauth", "insecure_no_auth"), ("num_thread", "num_threads"),
])
def test_a_misspelt_key_is_refused_naming_the_key_meant(key, meant):
    """A NixlConnector recipe with a typo would otherwise run unauthenticated or advertise 127.0.0.1."""
    with pytest.raises(ValueError, match=rf"unknown key '{key}'; did you mean `{meant}`"):
        HybridKVVllmConfig.from_extra_config({key: "x"}, env={})


def test_the_secret_itself_is_refused_in_the_config():
    with pytest.raises(ValueError, match=r"\['secret'\]: the shared secret never goes in this config"):
        HybridKVVllmConfig.from_extra_config({"secret": "0123456789abcdef"}, env={})


def test_nixl_side_channel_environment_is_read_as_nixl_connector_reads_it():
    env = {"VLLM_NIXL_SIDE_CHANNEL_HOST": "10.2.3.4", "VLLM_NIXL_SIDE_CHANNEL_PORT": "5700"}
    cfg = HybridKVVllmConfig.from_extra_config({}, env=env)
    assert (cfg.side_channel_host, cfg.side_channel_port) == ("10.2.3.4", 5700)
    # The keys win when they say the same; when they disagree, start-up fails naming both.
    assert HybridKVVllmConfig.from_extra_config({"side_channel_port": 5700}, env=env).side_channel_port == 5700
    with pytest.raises(ValueError, match=r"\['side_channel_host'\] = '10.9.9.9' and the environment's "
                                         r"VLLM_NIXL_SIDE_CHANNEL_HOST = '10.2.3.4' disagree"):
        HybridKVVllmConfig.from_extra_config({"side_channel_host": "10.9.9.9"}, env=env)
    with pytest.raises(ValueError, match=r"environment variable VLLM_NIXL_SIDE_CHANNEL_PORT = 'x' .*; expected a TCP port"):
        HybridKVVllmConfig.from_extra_config({}, env={"VLLM_NIXL_SIDE_CHANNEL_PORT": "x"})
    with pytest.raises(ValueError, match=r"\['side_channel_port'\] = 70000; expected a TCP port"):
        HybridKVVllmConfig.from_extra_config({}, env={"VLLM_NIXL_SIDE_CHANNEL_PORT": "70000"})


def test_insecure_no_auth_and_a_secret_are_refused_together():
    with pytest.raises(ValueError, match=r"\['insecure_no_auth'\] = True with a shared secret "
                                         r"\(kv_connector_extra_config\['secret_file'\] or"):
        HybridKVVllmConfig.from_extra_config({"insecure_no_auth": True, "secret_env": "X"}, env={})


def test_extra_config_must_be_a_mapping():
    with pytest.raises(ValueError, match=r"kv_connector_extra_config = \['x'\]; expected a JSON object"):
        HybridKVVllmConfig.from_extra_config(["x"])


def test_every_key_is_documented():
    """In the class docstring (what an engineer reading the code sees) and docs/deploy-vllm.md (an operator)."""
    doc = HybridKVVllmConfig.__doc__
    page = (ROOT / "docs" / "deploy-vllm.md").read_text()
    for key in HybridKVVllmConfig.keys():
        assert f"``{key}``" in doc, key
        assert re.search(rf"`{key}`", page), f"docs/deploy-vllm.md does not document {key}"


def test_importable_without_vllm():
    """The config module is engine-independent: importing it does not import vLLM."""
    code = "import sys, hybridkv.connectors.vllm.config; assert 'vllm' not in sys.modules, 'vllm imported'"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]


# ------------------------------------------------------------ through vLLM's own config and factory
def test_from_vllm_config_reads_kv_transfer_config():
    from tests.vllm import harness as h

    vc = h.make_vllm_config(role="kv_producer", extra={"side_channel_port": 5611, "kv_lease_duration": 12,
                                                       "hybridkv_fence_policy": "none"})
    cfg = HybridKVVllmConfig.from_vllm_config(vc)
    assert (cfg.side_channel_port, cfg.kv_lease_duration, cfg.hybridkv_fence_policy) == (5611, 12.0, FencePolicy.NONE)


def test_both_halves_build_the_same_config():
    """The scheduler process and a worker read every key through the one object: no second set of defaults."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from tests.vllm import harness as h

    extra = {"side_channel_host": "10.1.2.3", "side_channel_port": "5620", "kv_lease_duration": 4,
             "export_timeout_s": 9, "allowed_peers": ["10.0.0.0/8"], "tp_rank": 0, "hybridkv_fence_policy": "fenced"}
    vc = h.make_vllm_config(role="kv_both", extra=extra)
    kcc = h.make_kv_cache_config(vc)
    sched = KVConnectorFactory.create_connector(config=vc, role=KVConnectorRole.SCHEDULER, kv_cache_config=kcc)
    work = KVConnectorFactory.create_connector(config=vc, role=KVConnectorRole.WORKER, kv_cache_config=kcc)
    assert sched.scheduler.config == work.worker.config == HybridKVVllmConfig.from_extra_config(h.with_secret(extra))
    s, w = sched.scheduler, work.worker
    assert (s.side_host, s.side_port, s.lease_s, s.hold_s) == ("10.1.2.3", 5620, 4.0, 6.0)
    assert (w.host, w.base_port, w.lease_s, w.export_timeout_s, w.allowed_peers, w.rank) == (
        "10.1.2.3", 5620, 4.0, 9.0, ("10.0.0.0/8",), 0)


@pytest.mark.parametrize("role", ["SCHEDULER", "WORKER"])
def test_an_unusable_secret_stops_either_half_at_startup(role, monkeypatch):
    """Never a warning: the scheduler half fails too, before vLLM loads any weight."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from tests.vllm import harness as h

    monkeypatch.delenv("HKV_UNSET_SECRET", raising=False)
    vc = h.make_vllm_config(role="kv_both", extra={"secret_env": "HKV_UNSET_SECRET"})
    with pytest.raises(ValueError, match=r"\['secret_env'\]: environment variable 'HKV_UNSET_SECRET' is not set"):
        KVConnectorFactory.create_connector(config=vc, role=KVConnectorRole[role],
                                            kv_cache_config=h.make_kv_cache_config(vc))


@pytest.mark.parametrize("role", ["SCHEDULER", "WORKER"])
def test_a_bad_key_stops_either_half_at_startup(role):
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from tests.vllm import harness as h

    vc = h.make_vllm_config(role="kv_both", extra={"kv_lease_duration": "soon"})
    with pytest.raises(ValueError, match=r"\['kv_lease_duration'\] = 'soon'; expected a positive number"):
        KVConnectorFactory.create_connector(config=vc, role=KVConnectorRole[role],
                                            kv_cache_config=h.make_kv_cache_config(vc))


@pytest.fixture(params=[False, True], ids=["lenient", "strict"])
def strict_secrets(request, monkeypatch) -> bool:
    """auth.STRICT_SECRETS off (today) and on (the flip): what must hold either way."""
    from hybridkv.transport import auth

    monkeypatch.setattr(auth, "STRICT_SECRETS", request.param)
    return request.param


def test_the_secret_comes_from_a_file_or_an_environment_variable(tmp_path, monkeypatch, strict_secrets):
    import base64
    import os
    import secrets

    text = secrets.token_hex(32)  # what `hybridkv secret FILE` writes
    path = tmp_path / "secret"
    path.write_text(text + "\n")
    os.chmod(path, 0o600)
    assert HybridKVVllmConfig.from_extra_config({"secret_file": str(path)}).secret() == text.encode()
    b64 = base64.b64encode(secrets.token_bytes(32)).decode()
    monkeypatch.setenv("HKV_TEST_SECRET", b64)
    assert HybridKVVllmConfig.from_extra_config({"secret_env": "HKV_TEST_SECRET"}).secret() == b64.encode()
    assert HybridKVVllmConfig().secret() is None  # no secret: refused at start-up unless insecure_no_auth


@pytest.mark.parametrize(("extra", "message"), [
    ({"secret_file": "/nonexistent/hkv-secret"}, r"\['secret_file'\]: secret file '/nonexistent/hkv-secret' cannot be read"),
    ({"secret_env": "HKV_UNSET_SECRET"}, r"\['secret_env'\]: environment variable 'HKV_UNSET_SECRET' is not set"),
    ({"secret_env": "HKV_SHORT_SECRET"}, r"\['secret_env'\]: environment variable 'HKV_SHORT_SECRET' has 5 bytes; "
                                         r"expected at least (16 \(32 random bytes once STRICT_SECRETS is on\)"
                                         r"|32 random bytes); make one with `hybridkv secret FILE`"),
])
def test_an_unusable_secret_fails_at_start_up_naming_its_key(extra, message, monkeypatch, strict_secrets):
    monkeypatch.delenv("HKV_UNSET_SECRET", raising=False)
    monkeypatch.setenv("HKV_SHORT_SECRET", "short")
    with pytest.raises(ValueError, match=message) as err:
        HybridKVVllmConfig.from_extra_config(extra).secret()
    if "SHORT" in str(extra):  # the bound the message names is the one in force
        assert ("at least 32 random bytes" in str(err.value)) is strict_secrets


def test_both_secret_sources_are_refused():
    with pytest.raises(ValueError, match=r"\['secret_file'\] = '/a' and kv_connector_extra_config\['secret_env'\] = "
                                         "'B' are both set; expected at most one source"):
        HybridKVVllmConfig.from_extra_config({"secret_file": "/a", "secret_env": "B"})


@pytest.mark.parametrize("role", ["SCHEDULER", "WORKER"])
def test_a_staging_buffer_device_is_refused_not_ignored(role, monkeypatch):
    """NixlConnector's host buffer (kv_buffer_device='cpu' on a GPU) is something hybridkv does not do."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.platforms import current_platform

    from tests.vllm import harness as h

    vc = h.make_vllm_config(role="kv_both")
    kcc = h.make_kv_cache_config(vc)
    assert vc.kv_transfer_config.kv_buffer_device == current_platform.device_type  # vLLM's default: accepted
    HybridKVVllmConfig.from_vllm_config(vc)
    vc.kv_transfer_config.kv_buffer_device = "xpu" if current_platform.device_type == "cpu" else "cpu"
    with pytest.raises(ValueError, match=r"kv_buffer_device = '\w+'; HybridKVConnector moves the KV cache in place"):
        KVConnectorFactory.create_connector(config=vc, role=KVConnectorRole[role], kv_cache_config=kcc)
