"""The SGLang backend's settings: defaults in one place, HYBRIDKV_SGLANG_* read once."""

from __future__ import annotations

import dataclasses

import pytest

from hybridkv.connectors.sglang.config import SGLangConfig
from hybridkv.transport.staging import StagingMode


def test_defaults_without_environment():
    c = SGLangConfig.from_server_args(None, environ={})
    assert c == SGLangConfig()
    assert (c.transfer_timeout_s, c.workers, c.progress_thread) == (30.0, 4, True)
    # Unset drain timeout: SGLang's waiting timeout, 300 s where the manager has none.
    assert c.drain_timeout(120.0) == 120.0 and c.drain_timeout(None) == 300.0
    assert c.lease_s(10.0) == 60.0 and c.lease_s(300.0) == 300.0
    dp = c.dataplane(environ={})
    assert dp.progress_thread and not dp.telemetry
    assert dict(dp.ucx_params) == {"ucx_error_handling_mode": "peer"}  # a decode rank: no UCX threads


def test_every_key_is_read_from_its_variable():
    env = {"HYBRIDKV_SGLANG_TRANSFER_TIMEOUT_S": "1.5", "HYBRIDKV_SGLANG_DRAIN_TIMEOUT_S": "9",
           "HYBRIDKV_SGLANG_MIN_LEASE_S": "5", "HYBRIDKV_SGLANG_WORKERS": "4",
           "HYBRIDKV_SGLANG_POLL_INTERVAL_S": "0.05", "HYBRIDKV_SGLANG_SETTLE_POLL_S": "0.001",
           "HYBRIDKV_SGLANG_PROGRESS_THREAD": "off", "HYBRIDKV_SGLANG_SECRET_FILE": "/run/secret",
           "HYBRIDKV_SGLANG_SECRET_ENV": "", "HYBRIDKV_SGLANG_HANDSHAKE_TIMEOUT_S": "2",
           "HYBRIDKV_SGLANG_MAX_SESSIONS": "3", "HYBRIDKV_SGLANG_INSECURE_NO_AUTH": "no",
           "HYBRIDKV_SGLANG_INSECURE_HOST_MEMORY": "yes",
           "HYBRIDKV_SGLANG_ALLOWED_DECODE_HOSTS": "10.0.0.0/8, 192.168.1.7", "HYBRIDKV_SGLANG_STAGING": "Auto",
           "HYBRIDKV_SGLANG_STAGING_POOL_MB": "0.5", "HYBRIDKV_SGLANG_UNKNOWN": "x"}
    c = SGLangConfig.from_server_args(None, environ=env)
    assert c == SGLangConfig(transfer_timeout_s=1.5, drain_timeout_s=9.0, min_lease_s=5.0, workers=4,
                             poll_interval_s=0.05, settle_poll_s=0.001, progress_thread=False,
                             secret_file="/run/secret", handshake_timeout_s=2.0, max_sessions=3,
                             insecure_host_memory=True, allowed_decode_hosts=("10.0.0.0/8", "192.168.1.7"),
                             staging=StagingMode.AUTO, staging_pool_mb=0.5)
    assert {f"HYBRIDKV_SGLANG_{f.name.upper()}" for f in dataclasses.fields(SGLangConfig)} == set(env) - {
        "HYBRIDKV_SGLANG_UNKNOWN"}
    assert c.drain_timeout(120.0) == 9.0 and c.lease_s(c.drain_timeout(None)) == 9.0
    staging = c.staging_config()
    assert staging.mode is StagingMode.AUTO and staging.capacity_bytes == 512 << 10
    assert SGLangConfig().staging_config() is None  # off by default: no pool


@pytest.mark.parametrize("var, value, match", [
    ("HYBRIDKV_SGLANG_TRANSFER_TIMEOUT_S", "soon", "HYBRIDKV_SGLANG_TRANSFER_TIMEOUT_S='soon'; expected a number"),
    ("HYBRIDKV_SGLANG_TRANSFER_TIMEOUT_S", "0", "transfer_timeout_s = 0.0; expected a number > 0"),
    ("HYBRIDKV_SGLANG_WORKERS", "1.5", "HYBRIDKV_SGLANG_WORKERS='1.5'; expected an int"),
    ("HYBRIDKV_SGLANG_WORKERS", "0", "workers = 0; expected an int >= 1"),
    ("HYBRIDKV_SGLANG_MAX_SESSIONS", "0", "max_sessions = 0; expected an int >= 1"),
    ("HYBRIDKV_SGLANG_PROGRESS_THREAD", "maybe", "HYBRIDKV_SGLANG_PROGRESS_THREAD='maybe'; expected one of"),
    ("HYBRIDKV_SGLANG_STAGING", "always", "HYBRIDKV_SGLANG_STAGING='always'; expected one of"),
    ("HYBRIDKV_SGLANG_STAGING_POOL_MB", "0", "staging_pool_mb = 0.0; expected a number > 0"),
])
def test_bad_values_are_refused_naming_the_variable(var, value, match):
    with pytest.raises(ValueError, match=match):
        SGLangConfig.from_server_args(None, environ={var: value})


def test_secret_file_and_env_name_where_the_secret_is(tmp_path):
    import secrets

    strong = secrets.token_hex(32).encode()  # what `hybridkv secret` writes
    f = tmp_path / "secret"
    f.write_bytes(strong + b"\n")
    f.chmod(0o600)  # group- or other-readable secret files are refused
    c = SGLangConfig.from_server_args(None, environ={"HYBRIDKV_SGLANG_SECRET_FILE": str(f)})
    assert c.secret_file == str(f) and c.secret() == strong  # one trailing newline dropped
    env = {"HYBRIDKV_SGLANG_SECRET_ENV": "MY_SECRET", "MY_SECRET": "e" * 20}
    assert SGLangConfig.from_server_args(None, environ=env).secret_env == "MY_SECRET"
    # No secret: lab mode only by name (secure by default: neither is refused, test_startup.py).
    assert SGLangConfig.from_server_args(None, environ={"HYBRIDKV_SGLANG_INSECURE_NO_AUTH": "1"}).secret() is None


def test_secret_sources_both_set_or_short_are_refused(tmp_path, monkeypatch):
    both = {"HYBRIDKV_SGLANG_SECRET_FILE": "/run/secret", "HYBRIDKV_SGLANG_SECRET_ENV": "MY_SECRET"}
    with pytest.raises(ValueError, match=r"secret_file = '/run/secret' and secret_env = 'MY_SECRET' are both set"):
        SGLangConfig.from_server_args(None, environ=both)
    f = tmp_path / "short"
    f.write_bytes(b"tooshort")
    f.chmod(0o600)
    with pytest.raises(ValueError, match=r"HYBRIDKV_SGLANG_SECRET_FILE: secret file .* has 8 bytes; expected at "
                                         r"least \d+"):
        SGLangConfig(secret_file=str(f)).secret()
    monkeypatch.delenv("NO_SUCH_SECRET_VAR", raising=False)
    with pytest.raises(ValueError, match="HYBRIDKV_SGLANG_SECRET_ENV: environment variable 'NO_SUCH_SECRET_VAR' is "
                                         "not set"):
        SGLangConfig(secret_env="NO_SUCH_SECRET_VAR").secret()


def test_insecure_no_auth_names_lab_mode_and_is_refused_with_a_secret(monkeypatch):
    from hybridkv.transport import config as transport_config

    c = SGLangConfig.from_server_args(None, environ={"HYBRIDKV_SGLANG_INSECURE_NO_AUTH": "1"})
    assert c.insecure_no_auth and c.secret() is None
    with pytest.raises(ValueError, match="insecure_no_auth = True with a shared secret"):
        SGLangConfig.from_server_args(None, environ={"HYBRIDKV_SGLANG_INSECURE_NO_AUTH": "yes",
                                                     "HYBRIDKV_SGLANG_SECRET_ENV": "MY_SECRET"})
    with pytest.raises(ValueError, match="HYBRIDKV_SGLANG_INSECURE_NO_AUTH='maybe'; expected one of"):
        SGLangConfig.from_server_args(None, environ={"HYBRIDKV_SGLANG_INSECURE_NO_AUTH": "maybe"})
    # Once hybridkv's transport requires a secret, no secret starts only in lab mode by name.
    monkeypatch.setattr(transport_config, "REQUIRE_SECRET", True)
    with pytest.raises(ValueError, match="no shared secret .*HYBRIDKV_SGLANG_INSECURE_NO_AUTH=1"):
        SGLangConfig().secret()
    assert c.secret() is None


def test_decode_hosts_a_prefill_answers_a_handshake_at():
    """Unset: only the address the handshake came from (a Hello cannot make a prefill rank dial a third host);
    set: the hosts and networks named, whatever the handshake came from."""
    c = SGLangConfig()
    assert c.decode_host_allowed("127.0.0.1", "127.0.0.1") and c.decode_host_allowed("10.1.2.3", "::ffff:10.1.2.3")
    assert not c.decode_host_allowed("127.0.0.2", "127.0.0.1") and not c.decode_host_allowed("127.0.0.1", None)
    assert not c.decode_host_allowed("decode-host", "127.0.0.1")  # a name, not an address: never dialled
    c = SGLangConfig.from_server_args(None, environ={"HYBRIDKV_SGLANG_ALLOWED_DECODE_HOSTS": "10.0.0.0/8,fd00::1"})
    assert c.decode_host_allowed("10.9.8.7", "192.168.0.1") and c.decode_host_allowed("fd00::1", None)
    assert not c.decode_host_allowed("11.0.0.1", "11.0.0.1")
    with pytest.raises(ValueError, match=r"allowed_decode_hosts: allowed peer 'decode-host' is not an IP address or network"):
        SGLangConfig.from_server_args(None, environ={"HYBRIDKV_SGLANG_ALLOWED_DECODE_HOSTS": "decode-host"})


def test_dataplane_takes_sglang_nixl_backend_settings_and_the_ib_device_flag():
    """As SGLang's NIXL backend: its backend parameters (JSON), 8 UCX threads on a prefill rank unless they say
    otherwise, the NICs --disaggregation-ib-device gives this rank's GPU as UCX's device_list (not over
    UCX_NET_DEVICES); UCX only; bad or contradicting values are refused naming the setting."""
    c = SGLangConfig()
    params = '{"num_workers": "2"}'
    env = {"SGLANG_DISAGGREGATION_NIXL_BACKEND_PARAMS": params}
    assert dict(c.dataplane(prefill=True, environ=env).ucx_params) == {
        "ucx_error_handling_mode": "peer", "num_workers": "2", "num_threads": "8"}
    env = {"SGLANG_DISAGGREGATION_NIXL_BACKEND_PARAMS": '{"num_threads": "4", "ucx_error_handling_mode": "none"}'}
    assert dict(c.dataplane(prefill=True, environ=env).ucx_params) == {
        "ucx_error_handling_mode": "none", "num_threads": "4"}
    nics = '{"0": "mlx5_0,mlx5_1", "1": "mlx5_2"}'
    assert dict(c.dataplane(ib_device=nics, gpu_id=0, environ={}).ucx_params)["device_list"] == "mlx5_0, mlx5_1"
    assert dict(c.dataplane(ib_device="mlx5_3", gpu_id=5, environ={}).ucx_params)["device_list"] == "mlx5_3"
    assert "device_list" not in dict(c.dataplane(ib_device=nics, environ={"UCX_NET_DEVICES": "mlx5_4:1"}).ucx_params)
    same = {"SGLANG_DISAGGREGATION_NIXL_BACKEND_PARAMS": '{"device_list": "mlx5_2"}'}
    assert dict(c.dataplane(ib_device=nics, gpu_id=1, environ=same).ucx_params)["device_list"] == "mlx5_2"
    with pytest.raises(ValueError, match=r"device_list='mlx5_2' and --disaggregation-ib-device maps GPU 0 to "
                                         r"'mlx5_0, mlx5_1'"):
        c.dataplane(ib_device=nics, gpu_id=0, environ=same)
    with pytest.raises(ValueError, match=r"expected NIC names without a port"):
        c.dataplane(ib_device="mlx5_0:1", environ={})
    with pytest.raises(ValueError, match=r"SGLANG_DISAGGREGATION_NIXL_BACKEND='LIBFABRIC': .* expected UCX"):
        c.dataplane(environ={"SGLANG_DISAGGREGATION_NIXL_BACKEND": "LIBFABRIC"})
    for bad in ("{num_threads: 8}", '{"num_threads": 8}', '["UCX"]'):
        with pytest.raises(ValueError, match="SGLANG_DISAGGREGATION_NIXL_BACKEND_PARAMS="):
            c.dataplane(environ={"SGLANG_DISAGGREGATION_NIXL_BACKEND_PARAMS": bad})
