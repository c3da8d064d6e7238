"""kv_transfer_params as hybridkv writes and reads them: the request's capability travels with them."""

from __future__ import annotations

import pytest

from hybridkv.connectors.vllm.params import RemotePrefill, producer_params
from hybridkv.transport.auth import new_token


def _params(token: bytes) -> dict:
    return producer_params(engine_id="p", request_id="r1", host="10.0.0.1", port=5600, block_ids=[[1, 2], [3]],
                           tp_size=1, num_tokens=20, lease_s=30.0, token=token)


def test_the_capability_round_trips_and_stays_out_of_repr():
    token = new_token()
    params = _params(token)
    assert params["remote_capability"] == token.hex()  # JSON-safe, as routers forward it
    remote = RemotePrefill.from_params(params)
    assert remote.token == token and remote.block_ids == ((1, 2), (3,))
    assert token.hex() not in repr(remote)


@pytest.mark.parametrize(("capability", "message"), [
    (None, r"kv_transfer_params lacks \['remote_capability'\]"),
    ("abc", r"remote_capability 'abc'; expected 32 hex digits"),
    (7, r"remote_capability 7; expected 32 hex digits"),
])
def test_a_load_without_a_usable_capability_is_refused(capability, message):
    params = _params(new_token())
    params["remote_capability"] = capability
    with pytest.raises(ValueError, match=message):
        RemotePrefill.from_params(params)


@pytest.mark.parametrize("num_tokens", [-1, "20", 2.5, True])
def test_a_token_count_that_is_not_one_is_refused(num_tokens):
    params = _params(new_token())
    params["remote_num_tokens"] = num_tokens
    with pytest.raises(ValueError, match=r"remote_num_tokens = .*; expected a non-negative int"):
        RemotePrefill.from_params(params)


def test_the_token_count_travels_and_may_be_absent():
    params = _params(new_token())
    assert RemotePrefill.from_params(params).num_tokens == 20
    del params["remote_num_tokens"]
    assert RemotePrefill.from_params(params).num_tokens is None  # not hybridkv's producer: not checked
