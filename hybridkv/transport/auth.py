"""Who may talk to an endpoint: the shared secret, the handshake's proofs, request capabilities.

Peers prove they hold one shared secret before either sends its NIXL metadata or region table
(whoever has those can READ and WRITE the registered memory one-sidedly). The consumer sends a
fresh nonce, the address it dialled and its agent name; the producer answers with its own nonce,
its own address and agent name, and nothing else. The consumer proves first (an HMAC-SHA256 over
all of it, the :class:`Transcript`), so the producer hands no HMAC to a peer that did not prove
the secret (no offline guessing from its answers); the producer checks that proof and that the
address dialled is its own, then proves in turn. The two proofs carry different labels, so neither
replays as the other; fresh nonces make a recorded exchange useless; the addresses make a relayed
one fail (a relay is dialled at its own address). Every frame after the proofs, the Hellos first,
is sealed under a session key derived from the secret and the transcript (:class:`Sealer`).
Without a secret (a lab, ``insecure_no_auth``) the same messages travel with empty proofs, nothing
is sealed, and each side logs a warning when it starts.

A request's capability is a random token (:func:`new_token`) the producer side issues with the
request (vLLM: ``kv_transfer_params``; the demo: the router's hand-off); every message about the
request must carry it, so a peer that knows a request id but not its token can neither claim it,
renew it, end it, nor learn whether it exists.

The secret comes from a file or an environment variable (:func:`load_secret`), never a command
line, where every local user can read it (``/proc/*/cmdline``).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import logging
import os
import re
import secrets
import stat
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from hybridkv import wire
from hybridkv.transport.allowlist import PeerAllowlist

MIN_SECRET_BYTES = 32  # 256 bits: a shorter secret is refused (STRICT_SECRETS), not padded
LEGACY_MIN_SECRET_BYTES = 16  # refused whatever STRICT_SECRETS says (the rule before it)
MIN_DISTINCT_BYTES = 16  # 32 random bytes have ~30 distinct values; a pattern or a word has far fewer
#: Whether a secret that breaks a strength rule (:func:`secret_weakness`), or a secret file that
#: group or others can read, is refused (on; off gives a warning naming the rule instead).
STRICT_SECRETS = True
SECRET_FIX = "make one with `hybridkv secret FILE` (32 random bytes as hex, a file of mode 0600)"
# Labels of protocol 3; distinct from every other protocol's (the SGLang sessions'), so no proof or
# key of one is accepted by another.
_PRODUCER = b"hybridkv-transport-v3 producer proof"
_CONSUMER = b"hybridkv-transport-v3 consumer proof"
_SESSION = b"hybridkv-transport-v3 session key"
_P2C = b"hybridkv-transport-v3 producer to consumer"
_C2P = b"hybridkv-transport-v3 consumer to producer"
_NOTIF = b"hybridkv-transport-v3 completion notification"
NOTIF_TAG_BYTES = 16  # a notification's tag (Sealer.tag): 128 bits, unforgeable without the session key

log = logging.getLogger(__name__)
_warned: set[str] = set()


def load_secret(*, file: str | os.PathLike | None = None, env: str | None = None) -> bytes:
    """The shared secret from a file (one trailing newline dropped) or an environment variable;
    exactly one of the two. Raises ValueError naming the source and what was expected: a file group
    or others can read, or a weak secret (:func:`check_secret`), is refused (``STRICT_SECRETS``)."""
    if (file is None) == (env is None):
        raise ValueError(f"secret file={file!r}, env={env!r}; expected exactly one of the two")
    if file is not None:
        path = Path(file)
        try:
            mode = path.stat().st_mode
            data = path.read_bytes()
        except OSError as exc:
            raise ValueError(f"secret file {str(path)!r} cannot be read: {exc.strerror}; "
                             "expected a readable file holding the shared secret") from None
        source = f"secret file {str(path)!r}"
        if stat.S_IMODE(mode) & 0o077:
            # Any local user who can read it can authenticate as a peer (and read registered memory).
            _refuse_or_warn(f"{source} has mode {stat.S_IMODE(mode):04o}: group or others can access it; "
                            f"expected mode 0600 or 0400 (chmod 600 {str(path)!r}), or {SECRET_FIX}")
        data = data[:-1] if data.endswith(b"\n") else data
    else:
        value = os.environ.get(env)
        if value is None:
            raise ValueError(f"environment variable {env!r} is not set; expected it to hold the shared secret")
        source = f"environment variable {env!r}"
        data = value.encode()
    check_secret(data, source)
    return data


def load_configured_secret(*, file: str | None, env: str | None, key: Callable[[str], str]) -> bytes | None:
    """A connector's secret from the setting that names its source (``secret_file`` or ``secret_env``, the
    connector checked that at most one is set), None with neither; a ValueError of :func:`load_secret` is
    prefixed by that setting as the connector spells it (``key("secret_file")``)."""
    if file is None and env is None:
        return None
    try:
        return load_secret(file=file, env=env)
    except ValueError as e:
        raise ValueError(f"{key('secret_file' if file is not None else 'secret_env')}: {e}") from None


def check_secret(secret: bytes, source: str = "secret") -> None:
    """Refuse a secret that can be guessed: fewer than ``MIN_SECRET_BYTES`` bytes, text that is not
    the hex or base64 of as many random bytes (a passphrase), or fewer than ``MIN_DISTINCT_BYTES``
    distinct byte values (a pattern). ValueError naming the source, the rule and the fix; with
    ``STRICT_SECRETS`` off a warning only, except below ``LEGACY_MIN_SECRET_BYTES``."""
    if not isinstance(secret, bytes):
        raise ValueError(f"{source} is {type(secret).__name__}; expected bytes")
    weakness = secret_weakness(secret)
    if weakness is None:
        return
    if len(secret) < LEGACY_MIN_SECRET_BYTES and not STRICT_SECRETS:
        raise ValueError(f"{source} has {len(secret)} bytes; expected at least {LEGACY_MIN_SECRET_BYTES} "
                         f"({MIN_SECRET_BYTES} random bytes once STRICT_SECRETS is on); {SECRET_FIX}")
    _refuse_or_warn(f"{source} {weakness}; {SECRET_FIX}")


def secret_weakness(secret: bytes) -> str | None:
    """Which strength rule ``secret`` breaks (words to follow its source's name), or None.

    The bytes as given are the key both sides use; the decoding is only how its strength is judged:
    a secret that is all printable text must be hex or base64 (mixed case, as base64 of random bytes
    always is) of at least ``MIN_SECRET_BYTES`` bytes, since text of that length is otherwise a
    passphrase, guessable far below its length."""
    if len(secret) < MIN_SECRET_BYTES:
        return f"has {len(secret)} bytes; expected at least {MIN_SECRET_BYTES} random bytes"
    raw, kind = _decoded(secret)
    if raw is None:
        return (f"is text of {len(secret)} characters that is neither hex nor base64 (a passphrase can be "
                f"guessed offline); expected the hex or base64 of at least {MIN_SECRET_BYTES} random bytes")
    if len(raw) < MIN_SECRET_BYTES:
        return f"is {kind} of {len(raw)} bytes; expected at least {MIN_SECRET_BYTES} decoded bytes"
    distinct = len(set(raw))
    if distinct < MIN_DISTINCT_BYTES:
        what = f"decoded from {kind}" if kind != "binary" else "binary"
        return (f"has {distinct} distinct byte values ({what}); expected at least {MIN_DISTINCT_BYTES}, "
                "as random bytes have (a pattern or a repeated value is not a secret)")
    return None


_HEX = re.compile(rb"(?:[0-9a-fA-F]{2})+")
_B64 = re.compile(rb"[A-Za-z0-9+/]+={0,2}|[A-Za-z0-9_-]+={0,2}")


def _decoded(secret: bytes) -> tuple[bytes | None, str]:
    """The bytes a secret stands for and how it was read: as is (binary), or decoded from hex or
    base64 where it is printable text; (None, "text") for text that is neither."""
    try:
        text = secret.decode("utf-8")
    except UnicodeDecodeError:
        return secret, "binary"
    if not text.isprintable():
        return secret, "binary"
    if _HEX.fullmatch(secret):
        return bytes.fromhex(text), "hex"
    letters = [c for c in text if c.isalpha()]
    mixed = any(c.isupper() for c in letters) and any(c.islower() for c in letters)
    if _B64.fullmatch(secret) and mixed:
        padded = secret.rstrip(b"=")
        padded += b"=" * (-len(padded) % 4)
        try:
            return base64.b64decode(padded.replace(b"-", b"+").replace(b"_", b"/"), validate=True), "base64"
        except (binascii.Error, ValueError):
            pass
    return None, "text"


def _refuse_or_warn(message: str) -> None:
    if STRICT_SECRETS:
        raise ValueError(message)
    if message not in _warned:  # once per process and source: configs are built often
        _warned.add(message)
        log.warning("weak shared secret (refused once hybridkv.transport.auth.STRICT_SECRETS is on): %s", message)


def new_nonce() -> bytes:
    return secrets.token_bytes(wire.NONCE_BYTES)


def address(host: str, port: int) -> str:
    """An address as both sides of a handshake name it: ``host:port`` (``[v6]:port``)."""
    return f"[{host}]:{int(port)}" if ":" in host else f"{host}:{int(port)}"


@dataclass(frozen=True, kw_only=True)
class Transcript:
    """What a handshake's proofs and its session key cover: both nonces and the connection as the
    consumer dialled it and as the producer names itself. A relay between them changes the
    address the consumer dialled (its own, not the producer's), so its transcript is not the
    producer's and no proof or key carries over."""

    consumer_nonce: bytes
    producer_nonce: bytes
    dialled: str  # the address the consumer dialled
    producer: str  # the producer's own address (TransportConfig.host and its listening port)
    consumer_agent: str
    producer_agent: str

    def parts(self) -> tuple[bytes, ...]:
        return (self.consumer_nonce, self.producer_nonce, self.dialled.encode(), self.producer.encode(),
                self.consumer_agent.encode(), self.producer_agent.encode())


_LABEL = {wire.Role.PRODUCER: _PRODUCER, wire.Role.CONSUMER: _CONSUMER}


def proof(secret: bytes | None, prover: wire.Role, transcript: Transcript) -> bytes:
    """What ``prover`` sends in the handshake: its proof over the transcript, empty without a secret (a lab)."""
    if secret is None:
        return b""
    return labelled_proof(secret, _LABEL[prover], *transcript.parts())


def proves(secret: bytes | None, prover: wire.Role, transcript: Transcript, got: bytes) -> bool:
    """Whether ``got`` is ``prover``'s proof; without a secret (a lab) any is, as both sides send none."""
    return secret is None or proven(proof(secret, prover, transcript), got)


def session_key(secret: bytes, transcript: Transcript) -> bytes:
    """The key every frame after the proofs is sealed with (:class:`Sealer`)."""
    return labelled_proof(secret, _SESSION, *transcript.parts())


class Sealer:
    """Seals and opens one channel's frames under its session key: each frame's body is followed
    by an HMAC-SHA256 over the direction, the frame's number in that direction and the body, so
    a frame injected, altered, replayed, reordered or reflected does not open. The numbers are
    implicit (a channel is one ordered stream), so nothing about them travels."""

    def __init__(self, key: bytes, role: wire.Role) -> None:
        self._key = key
        self._out, self._in = (_P2C, _C2P) if role is wire.Role.PRODUCER else (_C2P, _P2C)
        self._sent = 0
        self._opened = 0

    def _mac(self, direction: bytes, n: int, body: bytes) -> bytes:
        h = hmac.new(self._key, direction, hashlib.sha256)
        h.update(n.to_bytes(8, "big"))
        h.update(body)
        return h.digest()

    def seal(self, body: bytes) -> bytes:
        """The frame to send (callers serialise sends: the numbers follow the order of calls)."""
        mac = self._mac(self._out, self._sent, body)
        self._sent += 1
        return body + mac

    def tag(self, body: bytes) -> bytes:
        """The tag of a NIXL completion notification this side sends on the session's behalf:
        notifications travel outside the channel (a UCX active message naming only an agent, which
        anyone who loaded the peer's metadata can send under any name), so the tag is what binds one
        to this session. Not numbered: a repeated notification is a duplicate, told apart by its id."""
        return self._notif_mac(self._out, body)

    def tag_ok(self, body: bytes, tag: bytes) -> bool:
        """Whether ``tag`` is the session peer's tag of the notification ``body``."""
        return proven(self._notif_mac(self._in, body), tag)

    def _notif_mac(self, direction: bytes, body: bytes) -> bytes:
        h = hmac.new(self._key, _NOTIF, hashlib.sha256)
        h.update(direction)
        h.update(body)
        return h.digest()[:NOTIF_TAG_BYTES]

    def open(self, frame: bytes) -> bytes:
        """The body of the next frame received; ValueError where it does not open (the channel is
        then useless: the caller drops it)."""
        if len(frame) <= wire.MAC_BYTES:
            raise ValueError(f"sealed frame of {len(frame)} bytes; expected a body and a {wire.MAC_BYTES}-byte MAC")
        body, mac = frame[:-wire.MAC_BYTES], frame[-wire.MAC_BYTES:]
        if not proven(self._mac(self._in, self._opened, body), mac):
            raise ValueError(f"frame {self._opened} from the peer does not carry the session's MAC (altered, "
                             "injected, replayed or out of order)")
        self._opened += 1
        return body


def labelled_proof(secret: bytes, label: bytes, *parts: bytes) -> bytes:
    """HMAC-SHA256 of the secret over a protocol's label and its parts, each length-prefixed (no two
    different part lists hash the same). For protocols other than the transport's handshake (the SGLang
    backend's): a distinct label keeps one protocol's proof from being accepted by another."""
    h = hmac.new(secret, label, hashlib.sha256)
    for p in parts:
        h.update(len(p).to_bytes(4, "big"))
        h.update(p)
    return h.digest()


def proven(expected: bytes, got: bytes) -> bool:
    return hmac.compare_digest(expected, got)


def new_token() -> bytes:
    """A request's capability: 128 random bits, unguessable."""
    return secrets.token_bytes(wire.TOKEN_BYTES)


def token_from_hex(text: object, what: str = "capability token") -> bytes:
    """A token as it travels in JSON (``kv_transfer_params``): hex. ValueError for anything else."""
    try:
        token = bytes.fromhex(text) if isinstance(text, str) else None
    except ValueError:
        token = None
    if token is None or len(token) != wire.TOKEN_BYTES:
        raise ValueError(f"{what} {text!r}; expected {2 * wire.TOKEN_BYTES} hex digits")
    return token


@dataclass(frozen=True, kw_only=True)
class Claimants:
    """Who may present a request's capability: the decode it was issued for, named when it is issued
    (``Producer.export(claimants=...)``). A session counts only if it proved the secret under one of
    ``agents`` (its NIXL agent name, in the handshake's transcript), and, with ``networks``, if its
    connection comes from one of them (a ``PeerAllowlist``). Empty (the default): whoever holds the token."""

    agents: frozenset[str] = frozenset()
    networks: PeerAllowlist | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.agents, frozenset) or not all(isinstance(a, str) and a for a in self.agents):
            raise ValueError(f"Claimants.agents = {self.agents!r}; expected a frozenset of NIXL agent names")

    def admit(self, agent: str, address: str | None) -> bool:
        """Whether the session of ``agent``, connected from ``address``, may claim with the token."""
        if self.agents and agent not in self.agents:
            return False
        return self.networks is None or self.networks.allows(address)


def check_token(token: object, what: str = "capability token") -> bytes:
    if not isinstance(token, bytes) or len(token) != wire.TOKEN_BYTES:
        raise ValueError(f"{what} {token!r}; expected {wire.TOKEN_BYTES} bytes (hybridkv.transport.auth.new_token())")
    return token


__all__ = ["Claimants", "LEGACY_MIN_SECRET_BYTES", "MIN_DISTINCT_BYTES", "NOTIF_TAG_BYTES", "MIN_SECRET_BYTES", "SECRET_FIX", "STRICT_SECRETS", "Sealer", "Transcript", "address", "check_secret", "check_token", "labelled_proof",
           "load_configured_secret", "load_secret", "new_nonce", "secret_weakness", "new_token", "proof", "proves", "proven", "session_key", "token_from_hex"]
