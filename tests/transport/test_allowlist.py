"""The control listener's peer allowlist: parsing, matching, and bad input named."""

from __future__ import annotations

import pytest

from hybridkv.transport.allowlist import PeerAllowlist
from hybridkv.transport.config import TransportConfig


def test_addresses_and_networks_match():
    allow = PeerAllowlist.parse(["10.0.0.0/8", "192.168.1.7", "fd00::/8"])
    assert allow.allows("10.3.4.5")
    assert allow.allows("192.168.1.7") and not allow.allows("192.168.1.8")
    assert allow.allows("fd00::1") and not allow.allows("fe80::1")
    assert allow.allows("::ffff:10.1.2.3")  # an IPv4 peer seen by a dual-stack listener
    assert not allow.allows("127.0.0.1")
    assert not allow.allows(None) and not allow.allows("not-an-ip")


@pytest.mark.parametrize("bad", ["10.0.0.0/33", "example.com", "", "10.0.0"])
def test_a_bad_entry_is_named(bad):
    with pytest.raises(ValueError, match=f"allowed peer {bad!r} is not an IP address or network"):
        TransportConfig(allowed_peers=("10.0.0.0/8", bad))


def test_config_refuses_a_bare_string_and_defaults_to_any_peer():
    with pytest.raises(ValueError, match="must be a tuple"):
        TransportConfig(allowed_peers="10.0.0.0/8")  # type: ignore[arg-type]
    assert TransportConfig().allowlist is None
    assert TransportConfig(allowed_peers=("127.0.0.1",)).allowlist.allows("127.0.0.1")
