"""The SGLang backend's settings: defaults in one place, HYBRIDKV_SGLANG_* read once."""

from __future__ import annotations

import dataclasses

import pytest

from connectors.sglang.config import SGLangConfig


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
           "HYBRIDKV_SGLANG_PROGRESS_THREAD": "off", "HYBRIDKV_SGLANG_UNKNOWN": "x"}
    c = SGLangConfig.from_server_args(None, environ=env)
    assert c == SGLangConfig(transfer_timeout_s=1.5, drain_timeout_s=9.0, min_lease_s=5.0, workers=4,
                             poll_interval_s=0.05, settle_poll_s=0.001, progress_thread=False)
    assert {f"HYBRIDKV_SGLANG_{f.name.upper()}" for f in dataclasses.fields(SGLangConfig)} == set(env) - {
        "HYBRIDKV_SGLANG_UNKNOWN"}
    assert c.drain_timeout(120.0) == 9.0 and c.lease_s(c.drain_timeout(None)) == 9.0


@pytest.mark.parametrize("var, value, match", [
    ("HYBRIDKV_SGLANG_TRANSFER_TIMEOUT_S", "soon", "HYBRIDKV_SGLANG_TRANSFER_TIMEOUT_S='soon'; expected a number"),
    ("HYBRIDKV_SGLANG_TRANSFER_TIMEOUT_S", "0", "transfer_timeout_s = 0.0; expected a number > 0"),
    ("HYBRIDKV_SGLANG_WORKERS", "1.5", "HYBRIDKV_SGLANG_WORKERS='1.5'; expected an int"),
    ("HYBRIDKV_SGLANG_WORKERS", "0", "workers = 0; expected an int >= 1"),
    ("HYBRIDKV_SGLANG_PROGRESS_THREAD", "maybe", "HYBRIDKV_SGLANG_PROGRESS_THREAD='maybe'; expected one of"),
])
def test_bad_values_are_refused_naming_the_variable(var, value, match):
    with pytest.raises(ValueError, match=match):
        SGLangConfig.from_server_args(None, environ={var: value})
