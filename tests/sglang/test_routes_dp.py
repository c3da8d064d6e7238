"""SGLang's bootstrap server under DP attention, with a shared secret: which prefill DP rank took a room
(/register_dp_rank) and the decode's question (/query_dp_ranks) are taken only MACed under the secret
(connectors/sglang/routes.py). Before, anyone reaching the server could send a room to the wrong DP rank
(the room then failed there) or read which rank took which room. The full path (a prefill DP rank's sender
registering, SGLang's decode querying) runs in test_dp_attention.py."""

from __future__ import annotations

import pytest

from tests.sglang import pd_peer

ROOM = 4242


@pytest.fixture(scope="module")
def server():
    # The server reads the ranks' secret from the environment; an in-process rank set up earlier in this
    # session may have left lab mode there (pd_peer.configure), which a secret refuses beside it:
    # bootstrap_server sets exactly the secret's variables while it starts.
    with pd_peer.bootstrap_server(pd_peer.SECRET_ENV) as addr:
        yield addr


def test_dp_rank_registrations_and_queries_need_the_secret(server, monkeypatch):
    import requests

    from hybridkv.connectors.sglang import routes
    from hybridkv.transport.auth import load_secret
    from sglang.srt.disaggregation.common.conn import CommonKVReceiver

    url = f"http://{server}"
    # Without the secret: refused, nothing registered, nothing told.
    forged = requests.post(f"{url}/register_dp_rank", json={"bootstrap_room": ROOM, "dp_rank": 1}, timeout=5)
    assert forged.status_code == 403 and "not MACed under the shared secret" in forged.text, forged.text
    asked = requests.post(f"{url}/query_dp_ranks", json={"bootstrap_rooms": [ROOM]}, timeout=5)
    assert asked.status_code == 403 and "not MACed under the shared secret" in asked.text, asked.text

    monkeypatch.setenv("HKV_TEST_SECRET", pd_peer.SECRET)
    secret = load_secret(env="HKV_TEST_SECRET")
    assert routes.register_dp_rank(server, secret, ROOM, 0)  # the prefill DP rank that took the room
    # A registration MACed for DP rank 0 and altered to 1, a query's MAC on a registration, another secret: refused.
    altered = {**routes.sign_dp_rank(secret, ROOM, 0), "dp_rank": 1}
    assert requests.post(f"{url}/register_dp_rank", json=altered, timeout=5).status_code == 403
    crossed = {"bootstrap_room": ROOM, "dp_rank": 1,
               routes.DP_MAC: routes.sign_dp_query(secret, [ROOM])[routes.DP_MAC]}
    assert requests.post(f"{url}/register_dp_rank", json=crossed, timeout=5).status_code == 403
    other = bytes.fromhex("5a" * 16 + "a5" * 16).hex().encode()
    assert requests.post(f"{url}/register_dp_rank", json=routes.sign_dp_rank(other, ROOM, 1),
                         timeout=5).status_code == 403
    assert routes.query_dp_ranks(server, other, [ROOM]) == {}

    # SGLang's decode asks through CommonKVReceiver itself; a decode manager with the secret MACs its questions.
    # SGLang's own query, even where an in-process decode manager of an earlier test replaced it already.
    monkeypatch.setattr(CommonKVReceiver, "query_prefill_dp_ranks", routes.sglang_query_prefill_dp_ranks())
    assert CommonKVReceiver.query_prefill_dp_ranks(server, [ROOM]) == {}  # SGLang's own query: refused
    routes.sign_dp_queries(secret)
    assert CommonKVReceiver.query_prefill_dp_ranks(server, [ROOM, ROOM + 1]) == {str(ROOM): 0}
