"""The bootstrap server's answers a decode acts on, with a shared secret: a prefill rank's route (GET /route:
which address the decode dials) and which DP rank took a room (/query_dp_ranks) are taken only with the
server's MAC over the decode's question and its fresh nonce (connectors/sglang/routes.py). Before, a process
between the decode and the server (here a real HTTP proxy on loopback that alters, strips or replays
answers) pointed the decode at any address or sent its room to another DP rank. Lab mode is SGLang's own."""

from __future__ import annotations

import http.server
import json
import logging
import threading
import time
from types import SimpleNamespace

import pytest

from tests.sglang import pd_peer

ROOM = 5151
RANK = dict(attn_tp_size=1, attn_tp_rank=0, attn_cp_size=1, attn_cp_rank=0, attn_dp_size=1, attn_dp_rank=0,
            pp_size=1, pp_rank=0, system_dp_size=1, system_dp_rank=0, rank_ip="127.0.0.1", page_size=16,
            kv_cache_dtype="auto")


def _secret() -> bytes:
    return pd_peer.SECRET.encode()  # as auth.load_secret reads it from the variable


class _Between:
    """A real HTTP proxy between a decode and the bootstrap server (a man in the middle on loopback): passes
    answers on, or alters them (`tamper`), drops the server's MAC (`strip`), or answers with the last answer
    it passed on for the same path (`replay`)."""

    def __init__(self, server: str, tamper) -> None:
        import requests

        self.mode = "pass"
        self.recorded: dict[str, bytes] = {}
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def _forward(self, method: str) -> None:
                path = self.path.split("?", 1)[0]
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0)) or None
                r = requests.request(method, f"http://{server}{self.path}", data=body, timeout=5,
                                     headers={"Content-Type": "application/json"} if body else {})
                out = r.content
                if r.status_code == 200 and outer.mode != "pass":
                    got = json.loads(out)
                    if outer.mode == "tamper":
                        got = tamper(path, got)
                    elif outer.mode == "strip":
                        got.pop("hybridkv_answer_mac", None)
                    out = json.dumps(got).encode() if outer.mode != "replay" else outer.recorded[path]
                elif r.status_code == 200:
                    outer.recorded[path] = out
                self.send_response(r.status_code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            def do_GET(self) -> None:
                self._forward("GET")

            def do_POST(self) -> None:
                self._forward("POST")

            def log_message(self, *args) -> None:
                pass

        self._httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.addr = f"127.0.0.1:{self._httpd.server_address[1]}"
        threading.Thread(target=self._httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()


DEAD = pd_peer.free_port()  # where an altered route points


def _tamper(path: str, got: dict) -> dict:
    if path == "/route":
        return {**got, "rank_port": DEAD}
    return {k: (v if k == "hybridkv_answer_mac" else 1) for k, v in got.items()}  # the room to DP rank 1


@pytest.fixture(scope="module")
def authenticated():
    """A bootstrap server with the secret, one prefill rank's route and the room's DP rank registered MACed,
    and a proxy in front of it."""
    import requests

    from hybridkv.connectors.sglang import routes

    with pd_peer.bootstrap_server(pd_peer.SECRET_ENV) as addr:
        url = f"http://{addr}/route"
        rank_port = pd_peer.free_port()
        signed = routes.sign_route(_secret(), {**RANK, "rank_port": rank_port}, routes.fetch_nonce(url))
        assert requests.put(url, json=signed, timeout=5).status_code == 200
        assert routes.register_dp_rank(addr, _secret(), ROOM, 0)
        between = _Between(addr, _tamper)
        try:
            yield SimpleNamespace(addr=addr, rank_port=rank_port, between=between)
        finally:
            between.close()


def _stand_in_receiver(secret, bootstrap_addr: str):
    """hybridkv's receiver with only the two attributes its route lookup reads (a stand-in manager: a whole
    one needs a decode engine; the full path runs in test_auth.py)."""
    from hybridkv.connectors.sglang.receiver import HybridKVReceiver

    receiver = HybridKVReceiver.__new__(HybridKVReceiver)
    receiver.kv_mgr = SimpleNamespace(_route_secret=secret)
    receiver.bootstrap_addr = bootstrap_addr
    return receiver


def test_a_decode_takes_a_route_only_maced_for_its_own_question(authenticated, caplog):
    srv = authenticated
    decode = _stand_in_receiver(_secret(), srv.between.addr)

    def lookup():
        return decode._get_bootstrap_info_from_server(0, 0, 0, 0)

    srv.between.mode = "pass"
    assert lookup() == {"rank_ip": "127.0.0.1", "rank_port": srv.rank_port, "pp_rank": 0}
    for mode, why in (("tamper", "MAC does not prove"), ("strip", "carries no"), ("replay", "MAC does not prove")):
        srv.between.mode = mode
        caplog.clear()
        with caplog.at_level(logging.ERROR, logger="hybridkv.connectors.sglang.routes"):
            assert lookup() is None, mode  # SGLang then fails the room, with hybridkv's reason
        assert f"refused the bootstrap server {srv.between.addr}'s route" in caplog.text and why in caplog.text, \
            (mode, caplog.text)
    srv.between.mode = "pass"
    assert lookup()["rank_port"] == srv.rank_port


def test_a_route_lookup_maced_under_another_secret_is_refused_and_sglangs_own_answered(authenticated):
    import requests

    from hybridkv.connectors.sglang import routes

    other = b"5a" * 32
    with pytest.raises(routes.LookupRefused, match="HTTP 403 .*did not prove the shared secret"):
        routes.lookup_route(authenticated.addr, other, 0, 0, 0, 0)
    url = f"http://{authenticated.addr}/route"
    plain = requests.get(url, params=dict(prefill_dp_rank=0, prefill_cp_rank=0, target_tp_rank=0, target_pp_rank=0),
                         timeout=5)  # SGLang's own question (a decode without the secret): SGLang's answer
    assert plain.status_code == 200 and plain.json() == {"rank_ip": "127.0.0.1",
                                                         "rank_port": authenticated.rank_port}, plain.text


def test_a_decode_takes_dp_ranks_only_maced_for_its_own_question(authenticated, caplog):
    from hybridkv.connectors.sglang import routes
    from sglang.srt.disaggregation.common.conn import CommonKVReceiver

    srv = authenticated
    routes.sign_dp_queries(_secret())  # as a decode manager with the secret does
    srv.between.mode = "pass"
    assert CommonKVReceiver.query_prefill_dp_ranks(srv.between.addr, [ROOM, ROOM + 1]) == {str(ROOM): 0}
    for mode, why in (("tamper", "MAC does not prove"), ("strip", "carries no"), ("replay", "MAC does not prove")):
        srv.between.mode = mode
        caplog.clear()
        with caplog.at_level(logging.ERROR, logger="hybridkv.connectors.sglang.routes"):
            assert CommonKVReceiver.query_prefill_dp_ranks(srv.between.addr, [ROOM, ROOM + 1]) == {}, mode
        assert f"refused the bootstrap server {srv.between.addr}'s DP ranks" in caplog.text and why in caplog.text, \
            (mode, caplog.text)
    srv.between.mode = "pass"


def test_lab_mode_answers_as_sglang_does(monkeypatch):
    import requests

    from hybridkv.connectors.sglang import routes
    from sglang.srt.disaggregation.common.conn import CommonKVReceiver

    with pd_peer.bootstrap_server({"HYBRIDKV_SGLANG_INSECURE_NO_AUTH": "1"}) as addr:
        url = f"http://{addr}/route"
        rank_port = pd_peer.free_port()
        assert requests.put(url, json={**RANK, "rank_port": rank_port}, timeout=5).status_code == 200
        assert requests.post(f"http://{addr}/register_dp_rank", json={"bootstrap_room": ROOM, "dp_rank": 0},
                             timeout=5).status_code == 200
        got = _stand_in_receiver(None, addr)._get_bootstrap_info_from_server(0, 0, 0, 0)
        assert got == {"rank_ip": "127.0.0.1", "rank_port": rank_port, "pp_rank": 0}
        monkeypatch.setattr(CommonKVReceiver, "query_prefill_dp_ranks", routes.sglang_query_prefill_dp_ranks())
        assert CommonKVReceiver.query_prefill_dp_ranks(addr, [ROOM]) == {str(ROOM): 0}


def test_a_decode_with_a_secret_refuses_an_sglang_whose_lookup_hooks_changed(monkeypatch):
    from hybridkv.connectors.sglang import routes
    from sglang.srt.disaggregation.common.conn import CommonKVReceiver

    routes.check_decode_hooks()  # the SGLang installed
    monkeypatch.setattr(CommonKVReceiver, "_get_bootstrap_info_from_server", lambda self, dp_rank, tp_rank: None)
    with pytest.raises(RuntimeError, match=r"_get_bootstrap_info_from_server is \(self, dp_rank, tp_rank\)"):
        routes.check_decode_hooks()
