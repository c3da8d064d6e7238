"""A prefill request's ``decode_hosts`` (connectors/vllm/params.py): the decode its capability is bound to."""

from __future__ import annotations

import pytest

from hybridkv.connectors.vllm.params import DECODE_HOSTS, claimants


def test_decode_hosts_bind_the_capability_to_those_networks():
    assert claimants(None) is None and claimants({"do_remote_decode": True}) is None  # unbound
    bound = claimants({"do_remote_decode": True, DECODE_HOSTS: ["10.0.0.7", "10.0.1.0/24"]})
    assert bound.admit("any-agent", "10.0.0.7") and bound.admit("any-agent", "10.0.1.9")
    assert bound.admit("any-agent", "::ffff:10.0.0.7")  # a dual-stack listener's view of the same peer
    assert not bound.admit("any-agent", "10.0.0.8") and not bound.admit("any-agent", None)
    assert claimants({DECODE_HOSTS: "10.0.0.7"}).admit("a", "10.0.0.7")  # one address as a string


@pytest.mark.parametrize("bad", [[], [7], "decode-1.example", ["10.0.0.7", "not-an-ip"], {"h": 1}])
def test_bad_decode_hosts_are_refused_naming_the_value(bad):
    with pytest.raises(ValueError, match="decode_hosts|not an IP address"):
        claimants({DECODE_HOSTS: bad})
