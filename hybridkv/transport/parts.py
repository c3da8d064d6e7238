"""What the consumer asked its producers for: one *part* per producer and request, and what it released.

An import from several producers (one per prefill TP rank it needs) has a :class:`Part` per
producer; the request lands only when every part did. :class:`Parts` is the consumer's table of
them, shared by what it hears on its control channels (:mod:`hybridkv.transport.links`) and what
runs an import (:mod:`hybridkv.transport.fetch`).
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from dataclasses import dataclass, field

from hybridkv.transport.metrics import FailureKind
from hybridkv.transport.side import Peer, remember


@dataclass(eq=False, kw_only=True)
class Part:
    """One producer's share of an import."""

    rid: str
    peer: Peer
    export: asyncio.Future  # -> (wire.Export, receipt time)
    token: bytes  # the request's capability, as the producer side issued it
    deadline: float = float("inf")
    landed: asyncio.Event = field(default_factory=asyncio.Event)
    failed: str | None = None  # the producer will not write / the blocks are gone / it refused
    kind: FailureKind | None = None  # why, for the metrics
    lease_lost: bool = False
    notified: bool = False
    wanted: bool = False
    fields: bytes | None = None  # what its Want asked staged (wire.Want.fields; None: unstaged)


class Parts:
    """The consumer's parts, by (producer agent, request id), in the order asked for."""

    def __init__(self) -> None:
        self._parts: dict[tuple[str, str], Part] = {}
        # (agent, request) this consumer released: an Export arriving after is refused at
        # once, not renewed for a reader that will never come (bounded).
        self._released: OrderedDict[tuple[str, str], bytes] = OrderedDict()  # -> the request's token

    def open(self, rid: str, peer: Peer, token: bytes) -> Part:
        """The request's part from ``peer``, made on first use; asked again, the token must match."""
        part = self._parts.get((peer.agent, rid))
        if part is None:
            part = Part(rid=rid, peer=peer, export=asyncio.get_running_loop().create_future(), token=token)
            self._parts[(peer.agent, rid)] = part
        elif part.token != token:
            raise ValueError(f"request {rid!r} was asked for with another capability token; expected the one "
                             "the producer side issued with it")
        return part

    def get(self, agent: str, rid: str) -> Part | None:
        return self._parts.get((agent, rid))

    def pop(self, agent: str, rid: str) -> Part | None:
        return self._parts.pop((agent, rid), None)

    def of(self, agent: str) -> list[Part]:
        """The producer's parts, in the order asked for."""
        return [p for (a, _), p in self._parts.items() if a == agent]

    def earliest_deadline(self, rid: str) -> float:
        """The request's lease is its shortest part's."""
        return min(p.deadline for (_, r), p in self._parts.items() if r == rid)

    def release(self, agent: str, rid: str, token: bytes) -> Part | None:
        """Remember that this consumer will not read the request from ``agent``; its part, if any, leaves."""
        remember(self._released, (agent, rid), token)
        return self._parts.pop((agent, rid), None)

    def released(self, agent: str, rid: str) -> bytes | None:
        """The token the request was released with, if this consumer released it."""
        return self._released.get((agent, rid))

    def describe(self) -> dict:
        return {f"{a}/{r}": {"wanted": p.wanted, "exported": p.export.done(), "landed": p.landed.is_set(),
                             "failed": p.failed, "lease_lost": p.lease_lost}
                for (a, r), p in self._parts.items()}


__all__ = ["Part", "Parts"]
