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
