"""The hybridkv exception hierarchy for peer and transfer failures.

Bad input stays a plain ``ValueError`` and a broken invariant a
``RuntimeError`` (docs/design.md, Conventions); what is here are the failures that come from the
other side of a connection or from the data path, which a caller handles by
policy (fail the request, or recompute it locally).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


class HybridKVError(Exception):
    """Base of every failure hybridkv reports that is not bad input or a bug."""


class PeerError(HybridKVError):
    """Something went wrong with a peer: connection, handshake, protocol."""


@dataclass(frozen=True, kw_only=True)
class Difference:
    """One field both sides must agree on, and what each side has."""

    field: str
    local: str | None
    remote: str | None

    def __str__(self) -> str:
        return f"{self.field}: local {self.local!r}, peer {self.remote!r}"


class HandshakeRefused(PeerError):
    """The peers are incompatible; ``differences`` says in what."""

    def __init__(self, message: str, differences: Sequence[Difference] = ()) -> None:
        self.differences = tuple(differences)
        detail = "; ".join(str(d) for d in self.differences)
        super().__init__(f"{message}: {detail}" if detail else message)

    @property
    def fields(self) -> frozenset[str]:
        return frozenset(d.field for d in self.differences)


class HandshakeTimeout(PeerError, TimeoutError):
    """The peer did not complete the handshake in time."""


class PeerLost(PeerError):
    """The peer's connection dropped (process killed, network gone, heartbeat missed)."""


class ProtocolViolation(PeerError):
    """The peer sent a well-formed message it had no right to send (e.g. unexported blocks)."""


class TransferError(HybridKVError):
    """A data-plane transfer failed; its request is failed or recomputed per policy."""

    def __init__(self, message: str, *, request_id: str | None = None) -> None:
        self.request_id = request_id
        super().__init__(message if request_id is None else f"request {request_id!r}: {message}")


__all__ = [
    "Difference",
    "HandshakeRefused",
    "HandshakeTimeout",
    "HybridKVError",
    "MissingExtra",
    "PeerError",
    "PeerLost",
    "ProtocolViolation",
    "TransferError",
    "install_hint",
]


def install_hint(extra: str) -> str:
    """How to install one of hybridkv's extras, in the same words everywhere: hybridkv comes from a
    checkout or a built wheel, not from the public package index."""
    return (f'install hybridkv\'s "{extra}" extra: pip install -e \'.[{extra}]\' in a checkout, '
            f"or pip install '<wheel>[{extra}]'")


class MissingExtra(ImportError):
    """An optional dependency is not installed: says what and which extra installs it. `detail`
    (e.g. what was tried) goes on the lines under the error line."""

    def __init__(self, what: str, extra: str, detail: str = "") -> None:
        self.extra = extra
        text = f"{what} is not installed; {install_hint(extra)}"
        super().__init__(f"{text}\n{detail}" if detail else text)
