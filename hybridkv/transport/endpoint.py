"""Producer and consumer endpoints: handshake, exports, pulls/pushes, leases, failures.

A :class:`Producer` (prefill) listens; a :class:`Consumer` (decode) dials it and
asks for the requests it wants (``wire.Want``): the prefill side need not know
which decode instance will read a request. The producer exports a request to
whoever asked; a request several decode ranks share (``readers``, heterogeneous
TP) ends when every reader is done; any other claim on it is refused
(``FailureCode.CLAIMED``).

Each endpoint holds its parts, one object per module, each given what it uses
(as :class:`~hybridkv.fencing.scheduler.TransferScheduler` holds its rules):

- both: :class:`~hybridkv.transport.side.Side` (:mod:`~hybridkv.transport.side`), the core
  the other parts share: memory map, scheduler, config, planner, data plane, peers, counters,
  the ``Hello`` and the pump;
- :class:`Producer` (:mod:`~hybridkv.transport.producer`): its listener and side of the
  handshake, :class:`~hybridkv.transport.admission.Admission`; its exports, the asks for
  them and their ends, :class:`~hybridkv.transport.exports.Exports`;
- :class:`Consumer` (:mod:`~hybridkv.transport.consumer`): its side of the handshake,
  :class:`~hybridkv.transport.dial.Dialer`; what it asked for,
  :class:`~hybridkv.transport.parts.Parts`; what it hears from its producers and the leases it
  renews, :class:`~hybridkv.transport.links.ProducerLinks`; one import,
  :class:`~hybridkv.transport.fetch.Importer`.

Their configuration and results are in :mod:`hybridkv.transport.config`.

Both drive their transfers through a :class:`~hybridkv.fencing.scheduler.TransferScheduler`:
a transfer is posted only when the fence allows it (``post_export`` /
``post_import``) and its end is reported back (``transfer_landed`` /
``transfer_failed``), so the fence table stays consistent on every path.

Completion travels as a NIXL notification (``hkv:<request id>``, with a secret
followed by a tag under the session's key, so no other peer can send it), which
reaches the target after the data: in pull mode the consumer's READ tells the
producer it may free the blocks; in push mode the producer's WRITE tells the
consumer its blocks are filled. The control channel carries the rest
(:mod:`hybridkv.wire`). A push transfer is terminal for the consumer only on
the notification or on the producer's ``Done`` (it will not write); its
``Failure``, losing it, or the consumer's own abort fail the request and keep
the blocks out of reuse until then or the drain deadline: bytes may still land
in the blocks otherwise (rule 5; :mod:`hybridkv.transport.drains`).

Everything runs on one asyncio loop, which also pumps the NIXL agent (the
progress thread is off by default; docs/background/nixl.md §1.3).
"""

from __future__ import annotations

# Callers import the endpoints, their configuration and results from here.
from hybridkv.transport.config import FailurePolicy, Outcome, Pairing, Result, Stats, TransportConfig
from hybridkv.transport.consumer import Consumer
from hybridkv.transport.plan import PeerPlanner, Planner, TransferPlan
from hybridkv.transport.producer import Producer
from hybridkv.transport.side import NOTIF_PREFIX as NOTIF_PREFIX

__all__ = ["Consumer", "FailurePolicy", "Outcome", "Pairing", "PeerPlanner", "Planner", "Producer", "Result", "Stats",
           "TransferPlan", "TransportConfig"]
