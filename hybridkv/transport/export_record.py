"""One request the producer exports, as :class:`~hybridkv.transport.exports.Exports` keeps it.

An :class:`ExportRecord` lives from ``export()`` until the export ends: the request's blocks and
capability (its token, and the sessions it was issued for), who claimed it and what each reader
said, the WRITE in push mode and the staging slots in pull mode. :func:`holds` is the check a claim
on it passes; :class:`Finish` is how a part of ``Exports`` ends one.
"""

from __future__ import annotations

import asyncio
import hmac
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from hybridkv import wire
from hybridkv.transport.auth import Claimants
from hybridkv.transport.config import Outcome
from hybridkv.transport.dataplane import Transfer
from hybridkv.transport.side import Peer
from hybridkv.transport.staging import Slot


@dataclass(eq=False, kw_only=True)
class ExportRecord:
    rid: str
    tid: int
    token: bytes  # the request's capability: every message about it must carry this
    blocks: dict[int, np.ndarray]
    done: asyncio.Future
    #: ``blocks`` as an Export names them: made once at export(), not on each reader's Want
    wire_blocks: tuple[wire.GroupBlocks, ...] = ()
    claimants: Claimants | None = None  # the decode it was issued for (None: whoever holds the token)
    readers: int | None = None  # how many consumers share it (set by the first claim)
    claims: dict[str, Peer] = field(default_factory=dict)  # agent -> reader
    ended: dict[str, tuple[bool, str | None]] = field(default_factory=dict)  # agent -> (ok, detail)
    xfer: Transfer | None = None
    abort_asked: bool = False
    descriptors: int = 0  # push: what the WRITE posted, and when (for the metrics)
    posted_at: float = 0.0
    slots: dict[str, Slot] = field(default_factory=dict)  # agent -> its staging slot (pull, staged)

    @property
    def peer(self) -> Peer | None:
        """The reader, where there is exactly one (push mode has one)."""
        return next(iter(self.claims.values())) if len(self.claims) == 1 else None


def holds(rec: ExportRecord, peer: Peer, token: bytes) -> bool:
    """Whether ``peer`` presents ``rec``'s capability: its token, on a session the capability was issued
    for (an insider that saw the token elsewhere claims nothing: the decode it was issued for still can)."""
    if not hmac.compare_digest(rec.token, token):
        return False
    if rec.claimants is None:
        return True
    return rec.claimants.admit(peer.agent, peer.channel.peer[0] if peer.channel.peer else None)


class Finish(Protocol):
    """Ends an export (``Exports._finish``): its blocks go back to the scheduler, its readers are told."""

    def __call__(self, rec: ExportRecord, *, ok: bool, outcome: Outcome, error: str | None = None,
                 tell: wire.Message | None = None) -> None: ...


__all__ = ["ExportRecord", "Finish", "holds"]
