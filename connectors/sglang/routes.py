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

The server's answers a decode acts on are MACed too, so a process between a decode and the server (or
posing as the server) can neither point the decode at another address nor send a room to another DP
rank. The decode sends a fresh random nonce with each question (``hybridkv_nonce``, a query parameter of
``GET /route``, a field of ``/query_dp_ranks``, under the question's MAC); the server answers with a MAC
under the secret over the question, nonce included, and the answer (``ANSWER_MAC``). The decode takes an
answer only with that MAC: one without it, with a wrong one, or recorded for another question (another
nonce) is refused with a log line naming the server and what failed, and the room fails as SGLang fails a
room whose route it could not fetch. SGLang's decode looks a rank's route up through
``CommonKVReceiver._get_bootstrap_info_from_server``: hybridkv's receiver overrides it
(:func:`lookup_route`), and a decode manager with a secret checks at start that the SGLang installed still
calls these two hooks with the arguments they take here (:func:`check_decode_hooks`), else refuses to
start naming the version.

``GET /route`` without the secret stays open, answered as SGLang answers it: the rank addresses it
reveals are the ports every rank listens on anyway (found by a scan of the prefill hosts; firewall them),
and refusing it would cost a decode without the secret the diagnosis it gets today, at the prefill rank,
of which setting it lacks. A MACed question whose MAC does not prove the secret is refused (403), so a
decode with another secret fails its room at the lookup, naming why. The prefill's parallel info
(``GET /route`` with every rank -1: sizes, page size, KV dtype, the prefill's HTTP port; no rank address)
is answered unMACed even to a decode with the secret: SGLang's decode manager asks it itself
(``CommonKVManager.try_ensure_parallel_info``). A forged one can make a decode map ranks wrongly (its rooms
then fail; every address it dials still comes from a MACed answer) or send its prefill-recompute requests to
another port of the bootstrap host: still open. A recorded MACed question replayed gets the current answer
again (what an observer of the plain-HTTP exchange saw anyway).
"""

from __future__ import annotations

import inspect
import json
import logging
import secrets
import threading
import time
from collections.abc import Mapping
from typing import Any, Optional

from hybridkv.transport import auth
from hybridkv.transport.recent import Recent

logger = logging.getLogger(__name__)

NONCE_PATH = "/hybridkv/route_nonce"
ROUTE_NONCE = "hybridkv_route_nonce"
ROUTE_MAC = "hybridkv_route_mac"
_LABEL = b"hybridkv-sglang-v1 bootstrap route"
REQUEST_MAC = "hybridkv_mac"  # a question's MAC (a DP-rank body, a route lookup's query parameters)
DP_MAC = REQUEST_MAC
ANSWER_NONCE = "hybridkv_nonce"  # the decode's fresh nonce in a question the server's answer is bound to
ANSWER_MAC = "hybridkv_answer_mac"  # the server's MAC over the question and its answer
_DP_RANK_LABEL = b"hybridkv-sglang-v1 dp rank registration"
_DP_QUERY_LABEL = b"hybridkv-sglang-v1 dp rank query"
_DP_ANSWER_LABEL = b"hybridkv-sglang-v1 dp rank answer"
_LOOKUP_LABEL = b"hybridkv-sglang-v1 route lookup"
_LOOKUP_ANSWER_LABEL = b"hybridkv-sglang-v1 route answer"
_RANK_PARAMS = ("prefill_dp_rank", "prefill_cp_rank", "target_tp_rank", "target_pp_rank")
NONCE_TTL_S = 60.0  # a nonce not used within this long is forgotten
_MAX_NONCES = 4096  # nonces issued and not yet used (oldest forgotten first)


def route_mac(secret: bytes, payload: Mapping[str, Any]) -> str:
    """The MAC of a registration (every field but the MAC itself, the nonce included), hex."""
    return auth.labelled_proof(secret, _LABEL, _canonical(payload, leave_out=ROUTE_MAC)).hex()


def sign_route(secret: bytes, payload: Mapping[str, Any], nonce: str) -> dict[str, Any]:
    """The registration with the server's nonce and its MAC."""
    signed = {**payload, ROUTE_NONCE: nonce}
    signed[ROUTE_MAC] = route_mac(secret, signed)
    return signed


def _canonical(body: Mapping[str, Any], *, leave_out: str) -> bytes:
    return json.dumps({k: v for k, v in body.items() if k != leave_out}, sort_keys=True, separators=(",", ":"),
                      ensure_ascii=True).encode()


def _body_mac(secret: bytes, label: bytes, body: Mapping[str, Any]) -> str:
    return auth.labelled_proof(secret, label, _canonical(body, leave_out=REQUEST_MAC)).hex()


def answer_mac(secret: bytes, label: bytes, question: Mapping[str, Any], answer: Mapping[str, Any]) -> str:
    """The server's MAC over a question (its nonce included, its own MAC left out) and the answer, hex."""
    return auth.labelled_proof(secret, label, _canonical(question, leave_out=REQUEST_MAC),
                               _canonical(answer, leave_out=ANSWER_MAC)).hex()


def _answer_fault(secret: bytes, label: bytes, question: Mapping[str, Any], got: Any) -> Optional[str]:
    """None if `got` is the server's answer to `question` MACed under the secret, else why not."""
    if not isinstance(got, dict):
        return f"the answer is not a JSON object ({type(got).__name__})"
    mac = got.get(ANSWER_MAC)
    if not isinstance(mac, str):
        return (f"the answer carries no {ANSWER_MAC} (a bootstrap server without the shared secret, not "
                "hybridkv's, or something between it and this decode)")
    if not auth.proven(answer_mac(secret, label, question, got).encode(), mac.encode()):
        return ("its MAC does not prove the shared secret over this question and its nonce (altered on the way, "
                "recorded for another question, or another secret)")
    return None


class LookupRefused(RuntimeError):
    """A rank's route did not come, or came without the server's valid MAC (the message names both)."""


def is_rank_lookup(query: Mapping[str, Any]) -> bool:
    """Whether a ``GET /route`` asks a rank's address (not the prefill's parallel info: every rank -1)."""
    try:
        return not all(int(query[k]) == -1 for k in _RANK_PARAMS)
    except (KeyError, TypeError, ValueError):
        return True


def wants_sealed_answer(query: Mapping[str, Any]) -> bool:
    """Whether a ``GET /route`` is a hybridkv decode's MACed question (answered MACed) or SGLang's own."""
    return ANSWER_NONCE in query or REQUEST_MAC in query


def _session_get_post(server: str) -> tuple[Any, Any]:
    import requests

    try:
        from sglang.srt.disaggregation.common.conn import _get_bootstrap_session  # SGLang's pooled connection

        session = _get_bootstrap_session(server)
        return session.get, session.post
    except ImportError:
        return requests.get, requests.post


def lookup_route(server: str, secret: bytes, prefill_dp_rank: int, prefill_cp_rank: int, target_tp_rank: int,
                 target_pp_rank: int, *, timeout_s: float = 5.0) -> dict[str, Any]:
    """The route (``rank_ip``, ``rank_port``) of one prefill rank from the bootstrap server at ``server``,
    asked MACed with a fresh nonce and taken only with the server's MAC over question and answer;
    :class:`LookupRefused` naming the server and what failed (logged) otherwise."""
    import requests

    question: dict[str, Any] = {"prefill_dp_rank": str(int(prefill_dp_rank)),
                                "prefill_cp_rank": str(int(prefill_cp_rank)),
                                "target_tp_rank": str(int(target_tp_rank)),
                                "target_pp_rank": str(int(target_pp_rank)), ANSWER_NONCE: secrets.token_hex(16)}
    question[REQUEST_MAC] = _body_mac(secret, _LOOKUP_LABEL, question)
    rank = (f"prefill rank (DP {prefill_dp_rank}, CP {prefill_cp_rank}, TP {target_tp_rank}, "
            f"PP {target_pp_rank})")
    get, _ = _session_get_post(server)
    try:
        r = get(f"http://{server}/route", params=question, timeout=timeout_s)
        if r.status_code != 200:
            why = f"the bootstrap server at {server} gave no route for {rank}: HTTP {r.status_code} {r.text[:200]}"
            logger.error("hybridkv: %s", why)
            raise LookupRefused(why)
        got = r.json()
    except (requests.RequestException, ValueError) as e:
        logger.error("hybridkv: route lookup of %s at the bootstrap server %s failed: %s", rank, server, e)
        raise LookupRefused(f"route lookup of {rank} at the bootstrap server {server} failed: {e}") from e
    why = _answer_fault(secret, _LOOKUP_ANSWER_LABEL, question, got)
    if why is None and not (isinstance(got.get("rank_ip"), str) and isinstance(got.get("rank_port"), int)):
        why = f"the answer names no rank_ip (str) and rank_port (int): {str(got)[:200]}"
    if why is not None:
        logger.error("hybridkv: refused the bootstrap server %s's route for %s: %s", server, rank, why)
        raise LookupRefused(f"refused the bootstrap server {server}'s route for {rank}: {why}")
    return {k: v for k, v in got.items() if k != ANSWER_MAC}


def sign_dp_rank(secret: bytes, room: int, dp_rank: int) -> dict[str, Any]:
    """A prefill rank's ``/register_dp_rank`` body (SGLang's fields), MACed."""
    body: dict[str, Any] = {"bootstrap_room": int(room), "dp_rank": int(dp_rank)}
    body[DP_MAC] = _body_mac(secret, _DP_RANK_LABEL, body)
    return body


def sign_dp_query(secret: bytes, rooms: list, nonce: Optional[str] = None) -> dict[str, Any]:
    """A decode's ``/query_dp_ranks`` body (SGLang's field), with a fresh nonce the answer is bound to, MACed."""
    body: dict[str, Any] = {"bootstrap_rooms": [int(r) for r in rooms],
                            ANSWER_NONCE: nonce if nonce is not None else secrets.token_hex(16)}
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
    """{room (str): prefill DP rank} for the rooms the bootstrap server at ``server`` knows, asked MACed and
    taken only with the server's MAC over question and answer ({} on any failure, logged naming the server
    and what failed, as SGLang's own query answers)."""
    import requests

    _, post = _session_get_post(server)
    question = sign_dp_query(secret, rooms)
    try:
        r = post(f"http://{server}/query_dp_ranks", json=question, timeout=timeout_s)
        if r.status_code != 200:
            logger.error("hybridkv: DP rank query at %s failed: HTTP %d %s", server, r.status_code, r.text[:200])
            return {}
        got = r.json()
    except (requests.RequestException, ValueError) as e:
        logger.error("hybridkv: DP rank query at %s failed: %s", server, e)
        return {}
    why = _answer_fault(secret, _DP_ANSWER_LABEL, question, got)
    answer = {k: v for k, v in got.items() if k != ANSWER_MAC} if why is None else {}
    if why is None and not all(isinstance(k, str) and k.lstrip("-").isdigit() and isinstance(v, int)
                               for k, v in answer.items()):
        why = f"the answer is not {{room: DP rank}}: {str(answer)[:200]}"
    if why is not None:
        logger.error("hybridkv: refused the bootstrap server %s's DP ranks for rooms %s: %s", server,
                     str(question["bootstrap_rooms"])[:200], why)
        return {}
    return answer


def check_decode_hooks() -> None:
    """RuntimeError naming the installed SGLang where its decode no longer asks the bootstrap server through
    the two hooks hybridkv replaces (``CommonKVReceiver._get_bootstrap_info_from_server``, overridden by
    hybridkv's receiver, and ``query_prefill_dp_ranks``, :func:`sign_dp_queries`) with the arguments they
    take here: the decode would otherwise take routes and DP ranks unauthenticated without a word."""
    from importlib import metadata

    from sglang.srt.disaggregation.common.conn import CommonKVReceiver

    wanted = {"_get_bootstrap_info_from_server": ["self", *_RANK_PARAMS],
              "query_prefill_dp_ranks": ["bootstrap_addr", "bootstrap_rooms"]}
    for name, params in wanted.items():
        hook = CommonKVReceiver.__dict__.get(name)
        if name == "query_prefill_dp_ranks" and not isinstance(hook, staticmethod):
            hook = None
        fn = hook.__func__ if isinstance(hook, staticmethod) else hook
        have = list(inspect.signature(fn).parameters) if callable(fn) else None
        if have != params:
            found = "missing" if have is None else "(" + ", ".join(have) + ")"
            raise RuntimeError(
                f"hybridkv: sglang {metadata.version('sglang')}'s CommonKVReceiver.{name} is {found}; expected "
                f"({', '.join(params)}): with a "
                "shared secret hybridkv replaces it to authenticate the bootstrap server's answers, and will not "
                "run a decode that would take them unauthenticated (install the SGLang version hybridkv was "
                "tested with, connectors/versions.py)")


def sign_dp_queries(secret: bytes) -> None:
    """Make SGLang's ``CommonKVReceiver.query_prefill_dp_ranks`` (which its decode scheduler calls on the
    class itself) ask MACed under ``secret`` and take only MACed answers, in this process; first check that
    SGLang's decode still asks through the hooks hybridkv replaces (:func:`check_decode_hooks`)."""
    from sglang.srt.disaggregation.common.conn import CommonKVReceiver

    if "query_prefill_dp_ranks" not in _SGLANG_QUERY:  # once ours replaced it, it is checked already
        check_decode_hooks()

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
    """The bootstrap server's side: issues nonces, tells a registration or question a rank that holds the
    secret made from one that it did not, and MACs the answers a decode acts on. Called from the server's
    event loop thread (and tests)."""

    def __init__(self, secret: bytes) -> None:
        self._secret = secret
        self._lock = threading.Lock()
        self._nonces: Recent[str, float] = Recent(_MAX_NONCES)
        self._accepted: dict[tuple, str] = {}  # rank position -> the MAC of the registration it holds
        self.refused = 0

    def nonce(self) -> str:
        n = secrets.token_hex(16)
        now = time.monotonic()
        with self._lock:
            self._nonces[n] = now + NONCE_TTL_S
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
        """None if a ``/query_dp_ranks`` body carries a nonce and is MACed under the secret, else why not."""
        return self._check_body(data, _DP_QUERY_LABEL, "DP rank query", nonce=True)

    def check_lookup(self, query: Mapping[str, Any]) -> Optional[str]:
        """None unless a ``GET /route`` asks a rank's route MACed (a nonce or a MAC) and its MAC does not
        prove the secret: then why not."""
        if not is_rank_lookup(query) or not wants_sealed_answer(query):
            return None  # SGLang's own question, answered as SGLang answers it (the docstring says why)
        return self._check_body(dict(query), _LOOKUP_LABEL, "route lookup", nonce=True)

    def seal_lookup(self, query: Mapping[str, Any], answer: Mapping[str, Any]) -> dict[str, Any]:
        """A rank's route as answered to `query`, with the MAC over both (:func:`lookup_route` checks it)."""
        return {**answer, ANSWER_MAC: answer_mac(self._secret, _LOOKUP_ANSWER_LABEL, dict(query), answer)}

    def seal_dp_answer(self, question: Mapping[str, Any], answer: Mapping[str, Any]) -> dict[str, Any]:
        """The DP ranks as answered to `question`, with the MAC over both (:func:`query_dp_ranks` checks it)."""
        return {**answer, ANSWER_MAC: answer_mac(self._secret, _DP_ANSWER_LABEL, question, answer)}

    def _check_body(self, data: Any, label: bytes, what: str, *, nonce: bool = False) -> Optional[str]:
        if not isinstance(data, dict):
            return self._refuse(f"the {what} is not a JSON object")
        if nonce and not isinstance(data.get(ANSWER_NONCE), str):
            return self._refuse(f"the {what} has no {ANSWER_NONCE}: it is not MACed under the shared secret "
                                "(hybridkv decode ranks with HYBRIDKV_SGLANG_SECRET_FILE / _SECRET_ENV send one, and "
                                "take the answer only MACed over it)")
        mac = data.get(DP_MAC)
        if not isinstance(mac, str):
            return self._refuse(f"the {what} has no {DP_MAC}: it is not MACed under the shared secret (hybridkv "
                                "ranks with HYBRIDKV_SGLANG_SECRET_FILE / _SECRET_ENV send it)")
        if not auth.proven(_body_mac(self._secret, label, data).encode(), mac.encode()):
            return self._refuse(f"the {what}'s MAC did not prove the shared secret")
        return None

    def _refuse(self, why: str) -> str:
        self.refused += 1
        logger.warning("hybridkv: bootstrap server refused a request: %s", why)
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
