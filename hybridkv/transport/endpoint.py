"""Producer and consumer endpoints: handshake, exports, pulls/pushes, leases, failures.

A :class:`Producer` (prefill) listens; a :class:`Consumer` (decode) dials it and
asks for the requests it wants (``wire.Want``): the prefill side need not know
which decode instance will read a request. The producer exports a request to
whoever asked; a request several decode ranks share (``readers``, heterogeneous
TP) ends when every reader is done; any other claim on it is refused
(``FailureCode.CLAIMED``). The producer lives in :mod:`hybridkv.transport.producer`
(its side of the handshake in :mod:`hybridkv.transport.admission`), the consumer in
:mod:`hybridkv.transport.consumer` (its side in :mod:`hybridkv.transport.dial`, its imports in
:mod:`hybridkv.transport.fetch`), the base they share in
:mod:`hybridkv.transport.side` and their configuration and results in
:mod:`hybridkv.transport.config`.
Both drive their transfers through a :class:`~hybridkv.fencing.scheduler.TransferScheduler`:
a transfer is posted only when the fence allows it (``post_export`` /
``post_import``) and its end is reported back (``transfer_landed`` /
``transfer_failed``), so the fence table stays consistent on every path.

Completion travels as a NIXL notification (``hkv:<request id>``), which
reaches the target after the data: in pull mode the consumer's READ tells the
producer it may free the blocks; in push mode the producer's WRITE tells the
consumer its blocks are filled. The control channel carries the rest
(:mod:`hybridkv.wire`). A push transfer is terminal for the consumer only on
the notification, on the producer's word that it will not write (``Done``/
``Failure``) or on losing the producer, never on a timer alone: bytes may still
land in the blocks otherwise (rule 5).

Everything runs on one asyncio loop, which also pumps the NIXL agent (the
progress thread is off by default; docs/background/nixl.md §1.3).
"""

from __future__ import annotations

# The endpoint is split by what each part holds: configuration and results
# (config), the base both sides share (side), the producer (producer, admission)
# and the consumer (consumer, dial, fetch). Callers import from here.
from hybridkv.transport.config import FailurePolicy, Outcome, Pairing, Result, Stats, TransportConfig
from hybridkv.transport.consumer import Consumer
from hybridkv.transport.plan import PeerPlanner, Planner, TransferPlan
from hybridkv.transport.producer import Producer
from hybridkv.transport.side import NOTIF_PREFIX as NOTIF_PREFIX
from hybridkv.transport.side import _Peer as _Peer
from hybridkv.transport.side import _rid_of as _rid_of
from hybridkv.transport.side import _send_quietly as _send_quietly
from hybridkv.transport.side import _Side as _Side

__all__ = ["Consumer", "FailurePolicy", "Outcome", "Pairing", "PeerPlanner", "Planner", "Producer", "Result", "Stats",
           "TransferPlan", "TransportConfig"]
