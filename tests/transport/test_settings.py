"""hybridkv.transport.settings: the rules of the secret's keys, written once and named as each front end
spells its keys (TransportConfig, the vLLM connector's kv_connector_extra_config, the SGLang environment)."""

from __future__ import annotations

import re

import pytest

from hybridkv.transport.settings import check_secret_sources, require


def _vllm(key: str) -> str:
    return f"kv_connector_extra_config[{key!r}]"


@pytest.mark.parametrize("name, spelled", [(str, "secret_file"), (_vllm, "kv_connector_extra_config['secret_file']")])
def test_secret_rules_name_the_key_as_the_front_end_spells_it(name, spelled) -> None:
    ok = dict(secret_file=None, secret_env=None, insecure_no_auth=False, insecure_host_memory=False)
    check_secret_sources(**ok, name=name)
    check_secret_sources(**{**ok, "secret_file": "/run/s"}, name=name)
    with pytest.raises(ValueError, match=re.escape(f"{spelled} = ''; expected unset or a non-empty string")):
        check_secret_sources(**{**ok, "secret_file": ""}, name=name)
    with pytest.raises(ValueError, match="'/a' and .* = 'B' are both set; expected at most one source"):
        check_secret_sources(**{**ok, "secret_file": "/a", "secret_env": "B"}, name=name)
    with pytest.raises(ValueError, match=r"insecure_no_auth.* = True with a shared secret .*; expected one of the two"):
        check_secret_sources(**{**ok, "secret_env": "B", "insecure_no_auth": True}, name=name)
    with pytest.raises(ValueError, match=r"insecure_host_memory.* = 1; expected a bool"):
        check_secret_sources(**{**ok, "insecure_host_memory": 1}, name=name)


def test_require_names_value_and_expectation() -> None:
    require(True, "x", 1, "anything")
    with pytest.raises(ValueError, match=r"^workers = 0; expected an int >= 1$"):
        require(False, "workers", 0, "an int >= 1")
