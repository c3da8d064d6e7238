"""The SGLang backend's settings: defaults in one place, HYBRIDKV_SGLANG_* read once."""

from __future__ import annotations

import dataclasses

import pytest

from hybridkv.connectors.sglang.config import SGLangConfig


def test_defaults_without_environment():
    c = SGLangConfig.from_server_args(None, environ={})
    assert c == SGLangConfig()
    assert (c.transfer_timeout_s, c.workers, c.progress_thread) == (30.0, 2, True)
    # Unset drain timeout: SGLang's waiting timeout, 300 s where the manager has none.
    assert c.drain_timeout(120.0) == 120.0 and c.drain_timeout(None) == 300.0
    assert c.lease_s(10.0) == 60.0 and c.lease_s(300.0) == 300.0
    dp = c.dataplane()
    assert dp.progress_thread and not dp.telemetry


def test_every_key_is_read_from_its_variable():
    env = {"HYBRIDKV_SGLANG_TRANSFER_TIMEOUT_S": "1.5", "HYBRIDKV_SGLANG_DRAIN_TIMEOUT_S": "9",
           "HYBRIDKV_SGLANG_MIN_LEASE_S": "5", "HYBRIDKV_SGLANG_WORKERS": "4",
           "HYBRIDKV_SGLANG_POLL_INTERVAL_S": "0.05", "HYBRIDKV_SGLANG_SETTLE_POLL_S": "0.001",
           "HYBRIDKV_SGLANG_PROGRESS_THREAD": "off", "HYBRIDKV_SGLANG_SECRET_FILE": "/run/secret",
           "HYBRIDKV_SGLANG_SECRET_ENV": "", "HYBRIDKV_SGLANG_HANDSHAKE_TIMEOUT_S": "2",
           "HYBRIDKV_SGLANG_MAX_SESSIONS": "3", "HYBRIDKV_SGLANG_INSECURE_NO_AUTH": "no",
           "HYBRIDKV_SGLANG_UNKNOWN": "x"}
    c = SGLangConfig.from_server_args(None, environ=env)
    assert c == SGLangConfig(transfer_timeout_s=1.5, drain_timeout_s=9.0, min_lease_s=5.0, workers=4,
                             poll_interval_s=0.05, settle_poll_s=0.001, progress_thread=False,
                             secret_file="/run/secret", handshake_timeout_s=2.0, max_sessions=3)
    assert {f"HYBRIDKV_SGLANG_{f.name.upper()}" for f in dataclasses.fields(SGLangConfig)} == set(env) - {
        "HYBRIDKV_SGLANG_UNKNOWN"}
    assert c.drain_timeout(120.0) == 9.0 and c.lease_s(c.drain_timeout(None)) == 9.0


@pytest.mark.parametrize("var, value, match", [
    ("HYBRIDKV_SGLANG_TRANSFER_TIMEOUT_S", "soon", "HYBRIDKV_SGLANG_TRANSFER_TIMEOUT_S='soon'; expected a number"),
    ("HYBRIDKV_SGLANG_TRANSFER_TIMEOUT_S", "0", "transfer_timeout_s = 0.0; expected a number > 0"),
    ("HYBRIDKV_SGLANG_WORKERS", "1.5", "HYBRIDKV_SGLANG_WORKERS='1.5'; expected an int"),
    ("HYBRIDKV_SGLANG_WORKERS", "0", "workers = 0; expected an int >= 1"),
    ("HYBRIDKV_SGLANG_MAX_SESSIONS", "0", "max_sessions = 0; expected an int >= 1"),
    ("HYBRIDKV_SGLANG_PROGRESS_THREAD", "maybe", "HYBRIDKV_SGLANG_PROGRESS_THREAD='maybe'; expected one of"),
])
def test_bad_values_are_refused_naming_the_variable(var, value, match):
    with pytest.raises(ValueError, match=match):
        SGLangConfig.from_server_args(None, environ={var: value})


def test_secret_file_and_env_name_where_the_secret_is(tmp_path):
    f = tmp_path / "secret"
    f.write_bytes(b"s" * 32 + b"\n")
    c = SGLangConfig.from_server_args(None, environ={"HYBRIDKV_SGLANG_SECRET_FILE": str(f)})
    assert c.secret_file == str(f) and c.secret() == b"s" * 32  # one trailing newline dropped
    env = {"HYBRIDKV_SGLANG_SECRET_ENV": "MY_SECRET", "MY_SECRET": "e" * 20}
    assert SGLangConfig.from_server_args(None, environ=env).secret_env == "MY_SECRET"
    assert SGLangConfig.from_server_args(None, environ={}).secret() is None  # lab mode


def test_secret_sources_both_set_or_short_are_refused(tmp_path, monkeypatch):
    both = {"HYBRIDKV_SGLANG_SECRET_FILE": "/run/secret", "HYBRIDKV_SGLANG_SECRET_ENV": "MY_SECRET"}
    with pytest.raises(ValueError, match=r"secret_file = '/run/secret' and secret_env = 'MY_SECRET' are both set"):
        SGLangConfig.from_server_args(None, environ=both)
    f = tmp_path / "short"
    f.write_bytes(b"tooshort")
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
