"""Who may talk to an endpoint: the shared secret, the handshake's proofs, request capabilities.

Peers prove they hold one shared secret before either sends its NIXL metadata or region table
(whoever has those can READ and WRITE the registered memory one-sidedly): the consumer sends a
fresh nonce, the producer answers with its own nonce and an HMAC-SHA256 over both, the consumer
checks it and answers with its HMAC over both. The two proofs carry different labels, so neither
side's proof can be replayed as the other's, and fresh nonces on both sides make a recorded
exchange useless. Without a secret (a lab) the same messages travel with empty proofs and each
side logs a warning when it starts.

A request's capability is a random token (:func:`new_token`) the producer side issues with the
request (vLLM: ``kv_transfer_params``; the demo: the router's hand-off); every message about the
request must carry it, so a peer that knows a request id but not its token can neither claim it,
renew it, end it, nor learn whether it exists.

The secret comes from a file or an environment variable (:func:`load_secret`), never a command
line, where every local user can read it (``/proc/*/cmdline``).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from pathlib import Path

from hybridkv import wire

MIN_SECRET_BYTES = 16  # 128 bits; a shorter secret is refused, not padded
_PRODUCER = b"hybridkv-auth-v2 producer"
_CONSUMER = b"hybridkv-auth-v2 consumer"


def load_secret(*, file: str | os.PathLike | None = None, env: str | None = None) -> bytes:
    """The shared secret from a file (one trailing newline dropped) or an environment variable;
    exactly one of the two. Raises ValueError naming the source and what was expected."""
    if (file is None) == (env is None):
        raise ValueError(f"secret file={file!r}, env={env!r}; expected exactly one of the two")
    if file is not None:
        path = Path(file)
        try:
            data = path.read_bytes()
        except OSError as exc:
            raise ValueError(f"secret file {str(path)!r} cannot be read: {exc.strerror}; "
                             "expected a readable file holding the shared secret") from None
        source = f"secret file {str(path)!r}"
        data = data[:-1] if data.endswith(b"\n") else data
    else:
        value = os.environ.get(env)
        if value is None:
            raise ValueError(f"environment variable {env!r} is not set; expected it to hold the shared secret")
        source = f"environment variable {env!r}"
        data = value.encode()
    check_secret(data, source)
    return data


def check_secret(secret: bytes, source: str = "secret") -> None:
    if not isinstance(secret, bytes):
        raise ValueError(f"{source} is {type(secret).__name__}; expected bytes")
    if len(secret) < MIN_SECRET_BYTES:
        raise ValueError(f"{source} has {len(secret)} bytes; expected at least {MIN_SECRET_BYTES} "
                         "(e.g. `head -c 32 /dev/urandom | base64 > secret`)")


def new_nonce() -> bytes:
    return secrets.token_bytes(wire.NONCE_BYTES)


def producer_proof(secret: bytes, consumer_nonce: bytes, producer_nonce: bytes) -> bytes:
    return hmac.new(secret, _PRODUCER + consumer_nonce + producer_nonce, hashlib.sha256).digest()


def consumer_proof(secret: bytes, consumer_nonce: bytes, producer_nonce: bytes) -> bytes:
    return hmac.new(secret, _CONSUMER + consumer_nonce + producer_nonce, hashlib.sha256).digest()


def proof(secret: bytes | None, prover: wire.Role, consumer_nonce: bytes, producer_nonce: bytes) -> bytes:
    """What ``prover`` sends in the handshake: its proof over both nonces, empty without a secret (a lab)."""
    if secret is None:
        return b""
    make = producer_proof if prover is wire.Role.PRODUCER else consumer_proof
    return make(secret, consumer_nonce, producer_nonce)


def proves(secret: bytes | None, prover: wire.Role, consumer_nonce: bytes, producer_nonce: bytes,
           got: bytes) -> bool:
    """Whether ``got`` is ``prover``'s proof; without a secret (a lab) any is, as both sides send none."""
    return secret is None or proven(proof(secret, prover, consumer_nonce, producer_nonce), got)


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


def check_token(token: object, what: str = "capability token") -> bytes:
    if not isinstance(token, bytes) or len(token) != wire.TOKEN_BYTES:
        raise ValueError(f"{what} {token!r}; expected {wire.TOKEN_BYTES} bytes (hybridkv.transport.auth.new_token())")
    return token


__all__ = ["MIN_SECRET_BYTES", "check_secret", "check_token", "consumer_proof", "labelled_proof", "load_secret",
           "new_nonce", "new_token", "producer_proof", "proof", "proves", "proven", "token_from_hex"]
