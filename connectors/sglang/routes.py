"""Prefill ranks' routes on SGLang's bootstrap server, MACed under the shared secret.

SGLang's bootstrap server (``CommonKVBootstrapServer``, HTTP, no authentication) keeps one route per
prefill rank: ``PUT /route`` with the rank's (DP, CP, TP, PP) position and the ZMQ address decode
ranks then send their handshake, REGISTER and METADATA to. Any process that reaches it could put its
own address in a real rank's place: every decode that looked the rank up afterwards dialled that
address, and, with a secret, failed each room at the handshake timeout.

With a secret, a route is taken only from a rank that proves the secret:

1. the rank asks the server for a nonce (``GET /hybridkv/route_nonce``): random, kept by the server a
   short while, good once;
2. the rank's ``PUT /route`` carries the nonce and a MAC, under the secret, over the nonce and the whole
   registration (``ROUTE_NONCE`` and ``ROUTE_MAC`` fields);
3. the server checks the MAC, takes the nonce (never again, so a recorded registration cannot be
   replayed later, nor on another bootstrap server), and only then hands the registration to SGLang.
   SGLang retries a PUT whose answer it did not get: the same registration, MAC for MAC, as the one a
   slot holds now is answered OK again and changes nothing.

A registration without them, or with a wrong one, is answered 403 and changes nothing. Without a secret
(lab mode) the server is SGLang's own.

Under DP attention SGLang's server also keeps which prefill DP rank took a room: a prefill rank posts
``/register_dp_rank`` (room, DP rank) and a decode posts ``/query_dp_ranks`` (rooms) to learn it. With a
secret both bodies carry a MAC under it (``DP_MAC``, each with its own label) and the server refuses one
without (403): no process without the secret can send a room to the wrong DP rank (the room then failed
there) or read which rank took which room. No nonce: a recorded registration replayed says again what it
said (its room and rank are under the MAC), and a replayed query asks again. SGLang's decode calls
``CommonKVReceiver.query_prefill_dp_ranks`` itself, so a decode manager with a secret puts a MACing
version in its place (:func:`sign_dp_queries`).
"""

from __future__ import annotations

import collections
import json
import logging
import secrets
import threading
import time
from collections.abc import Mapping
from typing import Any, Optional

from hybridkv.transport import auth

logger = logging.getLogger(__name__)

NONCE_PATH = "/hybridkv/route_nonce"
ROUTE_NONCE = "hybridkv_route_nonce"
ROUTE_MAC = "hybridkv_route_mac"
_LABEL = b"hybridkv-sglang-v1 bootstrap route"
DP_MAC = "hybridkv_mac"
_DP_RANK_LABEL = b"hybridkv-sglang-v1 dp rank registration"
_DP_QUERY_LABEL = b"hybridkv-sglang-v1 dp rank query"
NONCE_TTL_S = 60.0  # a nonce not used within this long is forgotten
_MAX_NONCES = 4096  # nonces issued and not yet used (oldest forgotten first)


def route_mac(secret: bytes, payload: Mapping[str, Any]) -> str:
    """The MAC of a registration (every field but the MAC itself, the nonce included), hex."""
    body = {k: v for k, v in payload.items() if k != ROUTE_MAC}
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()
    return auth.labelled_proof(secret, _LABEL, canonical).hex()


def sign_route(secret: bytes, payload: Mapping[str, Any], nonce: str) -> dict[str, Any]:
    """The registration with the server's nonce and its MAC."""
    signed = {**payload, ROUTE_NONCE: nonce}
    signed[ROUTE_MAC] = route_mac(secret, signed)
    return signed


def _body_mac(secret: bytes, label: bytes, body: Mapping[str, Any]) -> str:
    canonical = json.dumps({k: v for k, v in body.items() if k != DP_MAC}, sort_keys=True, separators=(",", ":"),
                           ensure_ascii=True).encode()
    return auth.labelled_proof(secret, label, canonical).hex()


def sign_dp_rank(secret: bytes, room: int, dp_rank: int) -> dict[str, Any]:
    """A prefill rank's ``/register_dp_rank`` body (SGLang's fields), MACed."""
    body: dict[str, Any] = {"bootstrap_room": int(room), "dp_rank": int(dp_rank)}
    body[DP_MAC] = _body_mac(secret, _DP_RANK_LABEL, body)
    return body


def sign_dp_query(secret: bytes, rooms: list) -> dict[str, Any]:
    """A decode's ``/query_dp_ranks`` body (SGLang's field), MACed."""
    body: dict[str, Any] = {"bootstrap_rooms": [int(r) for r in rooms]}
    body[DP_MAC] = _body_mac(secret, _DP_QUERY_LABEL, body)
    return body


def register_dp_rank(server: str, secret: bytes, room: int, dp_rank: int, *, timeout_s: float = 5.0) -> bool:
    """Post this prefill DP rank for ``room`` to the bootstrap server at ``server`` (host:port), MACed.
    Failures are logged, never raised (SGLang's own registration does the same)."""
    import requests

    try:
        r = requests.post(f"http://{server}/register_dp_rank", json=sign_dp_rank(secret, room, dp_rank),
                          timeout=timeout_s)
    except requests.RequestException as e:
        logger.error("hybridkv: could not register DP rank %d for room %d at %s: %s", dp_rank, room, server, e)
        return False
    if r.status_code != 200:
        logger.error("hybridkv: the bootstrap server at %s refused DP rank %d for room %d: HTTP %d %s", server,
                     dp_rank, room, r.status_code, r.text[:200])
        return False
    return True


def query_dp_ranks(server: str, secret: bytes, rooms: list, *, timeout_s: float = 5.0) -> dict[str, int]:
    """{room (str): prefill DP rank} for the rooms the bootstrap server at ``server`` knows, asked MACed
    ({} on any failure, logged, as SGLang's own query answers)."""
    import requests

    try:
        from sglang.srt.disaggregation.common.conn import _get_bootstrap_session  # SGLang's pooled connection

        post = _get_bootstrap_session(server).post
    except ImportError:
        post = requests.post
    try:
        r = post(f"http://{server}/query_dp_ranks", json=sign_dp_query(secret, rooms), timeout=timeout_s)
        if r.status_code == 200:
            got = r.json()
            if isinstance(got, dict):
                return got
        logger.error("hybridkv: DP rank query at %s failed: HTTP %d %s", server, r.status_code, r.text[:200])
    except (requests.RequestException, ValueError) as e:
        logger.error("hybridkv: DP rank query at %s failed: %s", server, e)
    return {}


def sign_dp_queries(secret: bytes) -> None:
    """Make SGLang's ``CommonKVReceiver.query_prefill_dp_ranks`` (which its decode scheduler calls on the
    class itself) ask MACed under ``secret``, in this process."""
    from sglang.srt.disaggregation.common.conn import CommonKVReceiver

    def query_prefill_dp_ranks(bootstrap_addr: str, bootstrap_rooms: list) -> dict[str, int]:
        return query_dp_ranks(bootstrap_addr, secret, bootstrap_rooms)

    _SGLANG_QUERY.setdefault("query_prefill_dp_ranks", CommonKVReceiver.__dict__["query_prefill_dp_ranks"])
    CommonKVReceiver.query_prefill_dp_ranks = staticmethod(query_prefill_dp_ranks)


#: SGLang's own ``CommonKVReceiver.query_prefill_dp_ranks``, kept the first time :func:`sign_dp_queries` replaces it.
_SGLANG_QUERY: dict[str, Any] = {}


def sglang_query_prefill_dp_ranks() -> Any:
    """SGLang's own (unMACed) DP-rank query of this process, whether or not :func:`sign_dp_queries` replaced it."""
    from sglang.srt.disaggregation.common.conn import CommonKVReceiver

    return _SGLANG_QUERY.get("query_prefill_dp_ranks", CommonKVReceiver.__dict__["query_prefill_dp_ranks"])


def _slot(data: Mapping[str, Any]) -> tuple:
    """The rank position a registration claims (what SGLang keys its route table by)."""
    return tuple(data.get(k) for k in ("system_dp_size", "system_dp_rank", "attn_dp_rank", "attn_cp_rank",
                                       "attn_tp_rank", "pp_rank"))


class RouteGuard:
    """The bootstrap server's side: issues nonces and tells a registration a rank that holds the secret made
    from one that it did not. Called from the server's event loop thread (and tests)."""

    def __init__(self, secret: bytes) -> None:
        self._secret = secret
        self._lock = threading.Lock()
        self._nonces: collections.OrderedDict[str, float] = collections.OrderedDict()
        self._accepted: dict[tuple, str] = {}  # rank position -> the MAC of the registration it holds
        self.refused = 0

    def nonce(self) -> str:
        n = secrets.token_hex(16)
        now = time.monotonic()
        with self._lock:
            self._nonces[n] = now + NONCE_TTL_S
            while len(self._nonces) > _MAX_NONCES:
                self._nonces.popitem(last=False)
        return n

    def check(self, data: Any) -> Optional[str]:
        """None if the registration is a rank's that proved the secret (its nonce is used up then), else why not."""
        if not isinstance(data, dict):
            return self._refuse("the registration is not a JSON object")
        nonce, mac = data.get(ROUTE_NONCE), data.get(ROUTE_MAC)
        if not isinstance(nonce, str) or not isinstance(mac, str):
            return self._refuse(f"no {ROUTE_NONCE} / {ROUTE_MAC}: the registration is not MACed under the shared "
                                "secret (a hybridkv prefill rank with HYBRIDKV_SGLANG_SECRET_FILE / _SECRET_ENV sends "
                                "them)")
        if not auth.proven(route_mac(self._secret, data), mac):
            return self._refuse("its MAC does not prove the shared secret")
        slot = _slot(data)
        now = time.monotonic()
        with self._lock:
            for n in [n for n, until in self._nonces.items() if until < now]:
                del self._nonces[n]
            if self._nonces.pop(nonce, None) is None and self._accepted.get(slot) != mac:
                return self._refuse("its nonce was never issued here, was used already, or is older than "
                                    f"{NONCE_TTL_S:.0f} s")
            self._accepted[slot] = mac
        return None

    def check_dp_rank(self, data: Any) -> Optional[str]:
        """None if a ``/register_dp_rank`` body is MACed under the secret, else why not."""
        return self._check_body(data, _DP_RANK_LABEL, "DP rank registration")

    def check_dp_query(self, data: Any) -> Optional[str]:
        """None if a ``/query_dp_ranks`` body is MACed under the secret, else why not."""
        return self._check_body(data, _DP_QUERY_LABEL, "DP rank query")

    def _check_body(self, data: Any, label: bytes, what: str) -> Optional[str]:
        if not isinstance(data, dict):
            return self._refuse(f"the {what} is not a JSON object")
        mac = data.get(DP_MAC)
        if not isinstance(mac, str):
            return self._refuse(f"the {what} has no {DP_MAC}: it is not MACed under the shared secret (hybridkv "
                                "ranks with HYBRIDKV_SGLANG_SECRET_FILE / _SECRET_ENV send it)")
        if not auth.proven(_body_mac(self._secret, label, data).encode(), mac.encode()):
            return self._refuse(f"the {what}'s MAC does not prove the shared secret")
        return None

    def _refuse(self, why: str) -> str:
        self.refused += 1
        logger.warning("hybridkv: bootstrap server refused a route registration: %s", why)
        return why


def fetch_nonce(route_url: str, *, attempts: int = 5, timeout_s: float = 5.0) -> str:
    """A nonce from the bootstrap server whose ``/route`` is `route_url` (the prefill rank's side). Retried
    as SGLang retries its registration (the server may start after the rank); RuntimeError naming the server
    if none comes, or if the server does not check registrations (no secret there, or SGLang's Rust server)."""
    import requests

    base = route_url.rsplit("/route", 1)[0]
    why = "no answer"
    delay = 1.0
    for attempt in range(attempts):
        try:
            r = requests.get(base + NONCE_PATH, timeout=timeout_s)
            if r.status_code == 200 and isinstance(nonce := r.json().get("nonce"), str):
                return nonce
            why = f"HTTP {r.status_code}"
            if r.status_code == 404:
                break  # a bootstrap server that takes any registration: retrying changes nothing
        except (requests.RequestException, ValueError, AttributeError) as e:
            why = str(e)
        if attempt < attempts - 1:
            time.sleep(delay)
            delay = min(2 * delay, 8.0)
    raise RuntimeError(
        f"hybridkv: the bootstrap server at {base} gave no route nonce ({why}); with a shared secret, expected "
        "hybridkv's bootstrap server (not SGLang's Rust server, SGLANG_RUST_SERVER) started with the same secret "
        "(HYBRIDKV_SGLANG_SECRET_FILE / _SECRET_ENV), which takes a rank's route only MACed under it")
