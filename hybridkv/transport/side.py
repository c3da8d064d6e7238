"""What producer and consumer share: one endpoint's core, its peers, and the pump.

:class:`Side` is held by :class:`~hybridkv.transport.producer.Producer` and
:class:`~hybridkv.transport.consumer.Consumer`, and is the interface their parts
(admission, dialling, exports, imports) are given: the memory map, scheduler, config and
planner the endpoint was built with, its data plane, its connected peers and its counters.
It builds and checks the ``Hello`` (compatibility fields, role, and what the side's planner
promises: pages cut alike, or field tables for pairing by fields), pumps the NIXL agent on
the asyncio loop and waits on transfers. The design is in :mod:`hybridkv.transport.endpoint`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from hybridkv import wire
from hybridkv.errors import HandshakeRefused, PeerLost
from hybridkv.transport import auth, control, ucxx_context
from hybridkv.transport import config as _config
from hybridkv.transport.config import Pairing, Stats, TransportConfig
from hybridkv.transport.dataplane import DataPlane, Transfer, XferState
from hybridkv.transport.host_memory import check_host_memory
from hybridkv.transport.memory import PAGE_SHAPE_FIELDS, MemoryMap, check_peer_shapes
from hybridkv.transport.metrics import TransferMetrics
from hybridkv.transport.plan import Planner

#: What a completion notification starts with; the request id follows.
NOTIF_PREFIX = b"hkv:"

log = logging.getLogger(__name__)


@dataclass(eq=False, kw_only=True)
class Peer:
    """One connected peer: its NIXL agent, control channel and memory map."""

    agent: str
    channel: control.Channel
    memory: MemoryMap
    lease_s: float
    alive: bool = True
    wants: int = 0  # producer: this peer's Wants waiting for their export
    # producer: Lease replies to this peer's Heartbeats not yet sent (one batch per Heartbeat), and
    # whether a task is sending them
    lease_replies: list = field(default_factory=list)
    renewing: bool = False


#: How many finished / released request ids an endpoint remembers (to answer late or repeated messages).
_REMEMBER = 1 << 16


def remember(seen: OrderedDict, key, value=None) -> None:
    """Record ``key`` in a bounded, oldest-first memory of ids."""
    seen[key] = value
    if len(seen) > _REMEMBER:
        seen.popitem(last=False)


def rid_of(notif: bytes) -> str | None:
    """The request id a completion notification names, or None if it is not one of ours."""
    if not notif.startswith(NOTIF_PREFIX):
        return None
    try:
        return notif[len(NOTIF_PREFIX):].decode()
    except UnicodeDecodeError:
        return None


def notification(peer: Peer, rid: str) -> bytes:
    """The completion notification of request ``rid`` to ``peer``: ``NOTIF_PREFIX`` and the id, and
    with a secret a NUL and the session's tag (auth.Sealer.tag), so that only this session's peer
    can have sent it."""
    body = NOTIF_PREFIX + rid.encode()
    sealer = peer.channel.sealer
    return body if sealer is None else body + b"\0" + sealer.tag(body)


async def send_quietly(ch: control.Channel, msg: wire.Message) -> None:
    """Send, ignoring a lost peer (its loss is noticed where its channel is read)."""
    try:
        await ch.send(msg)
    except PeerLost:
        pass


class Side:
    """One endpoint's core. Its attributes are the interface its parts share: read them, never
    rebind them. ``peers`` is the one table of connected peers (NIXL agent name -> :class:`Peer`);
    ``closing`` turns true when the endpoint starts closing."""

    def __init__(self, memory: MemoryMap, scheduler, config: TransportConfig, planner: Planner, *,
                 role: wire.Role) -> None:
        # Before anything is registered: an endpoint without a secret starts only in lab mode, by name.
        _config.check_auth_mode(config, role.name.lower())
        check_host_memory(authenticated=config.secret is not None,
                          host_memory=any(r.mem is wire.Mem.DRAM for r in memory.regions),
                          accepted=config.insecure_host_memory, what=role.name.lower(),
                          opt_in="TransportConfig.insecure_host_memory=True")
        self.role = role
        self.memory = memory
        self.scheduler = scheduler
        self.config = config
        self.planner = planner
        self.pairing = planner.pairing
        self.dp = DataPlane(memory, config.dataplane)
        compat = {**memory.shape_fields(), "protocol": str(wire.PROTOCOL_VERSION), "mode": config.mode.name,
                  "pairing": self.pairing.name}
        if self.pairing is Pairing.FIELDS:
            # Pages may be cut differently; the field tables in the handshake say how.
            compat = {k: v for k, v in compat.items() if k not in PAGE_SHAPE_FIELDS}
        clash = sorted(set(config.compat) & set(compat))
        if clash:
            raise ValueError(f"TransportConfig.compat keys {clash} are the transport's own compatibility fields; "
                             f"expected other names than {sorted(compat)}")
        self.compat = {**compat, **config.compat}
        self.stats = Stats()
        #: what moved, failed and waited, taken by the connector that reports it (metrics.py)
        self.metrics = TransferMetrics()
        self.metrics.insecure_no_auth = config.secret is None
        self.peers: dict[str, Peer] = {}
        self.closing = False
        self._pump_task: asyncio.Task | None = None
        self._busy = 0  # transfers being waited on: the pump spins while any is

    def hello(self) -> wire.Hello:
        return wire.Hello(
            agent=self.dp.name, metadata=self.dp.metadata(), role=self.role, mode=self.config.mode,
            compat=self.compat, compat_hash=wire.compat_hash(self.compat), regions=self.memory.regions,
            groups=self.memory.groups, lease_s=float(self.scheduler.leases.duration_s),
            layout=self.memory.table if self.pairing is Pairing.FIELDS else None,
        )

    def check_hello(self, h: wire.Hello) -> MemoryMap:
        """Refuse an incompatible peer, saying what differs; returns its memory map."""
        if h.role is self.role:
            raise HandshakeRefused("both peers have one role", [
                wire.Difference(field="role", local=self.role.name, remote=h.role.name)])
        if wire.compat_hash(h.compat) != h.compat_hash:
            raise HandshakeRefused("the peer's compatibility hash does not match its own fields")
        diffs = wire.compat_differences(self.compat, h.compat)
        if diffs:
            raise HandshakeRefused("incompatible peer", diffs)
        remote = MemoryMap(regions=h.regions, groups=h.groups, table=h.layout)
        if self.pairing is Pairing.PAGES:
            check_peer_shapes(self.memory, h.regions, h.groups)
        elif h.layout is None:
            raise HandshakeRefused("the peer pairs by fields but sent no field tables", [
                wire.Difference(field="layout", local="field tables", remote=None)])
        return remote

    def warn_if_open(self, where: str) -> None:
        """Unauthenticated mode is for a lab: say so loudly, once, when the endpoint starts."""
        if self.config.secret is None:
            log.warning("INSECURE: hybridkv %s%s runs WITHOUT a shared secret (%s): any peer that reaches it gets "
                        "its NIXL metadata and one-sided READ and WRITE access to this process's registered "
                        "memory, and over UCX's software transports to more of it (docs/security.md). Set "
                        "TransportConfig.secret (auth.load_secret; `hybridkv secret FILE` makes one) on both sides.",
                        self.role.name.lower(), f" {where}" if where else "",
                        "insecure_no_auth" if self.config.insecure_no_auth else "no secret given")

    def notified(self, agent: str, msg: bytes) -> str | None:
        """The request a completion notification from ``agent`` names, or None (counted here: in
        ``stats.unknown`` where it is not one of ours or no peer of that name is connected, in
        ``stats.forbidden`` where, with a secret, it lacks the tag of that peer's session). NIXL names
        the sender as the sender names itself, so without the tag any peer holding this side's
        metadata could end another session's transfer under its agent name."""
        if self.config.secret is None:
            body = msg
        else:
            peer = self.peers.get(agent)
            n = auth.NOTIF_TAG_BYTES  # the tag is binary: it may hold a NUL itself
            body, sep, tag = msg[:-n - 1], msg[-n - 1:-n], msg[-n:]
            if peer is None or peer.channel.sealer is None:
                self.stats.unknown += 1  # no session of that name (gone, or never)
                return None
            if len(msg) <= n + 1 or sep != b"\0" or not peer.channel.sealer.tag_ok(body, tag):
                self.stats.forbidden += 1
                log.warning("dropped a completion notification under the agent name %r without its session's "
                            "tag (another peer sending under that name?)", agent)
                return None
        rid = rid_of(body)
        if rid is None:
            self.stats.unknown += 1
        return rid

    def describe(self) -> dict:
        """What is in flight, for an operator or a stuck test to print (plain data)."""
        return {"role": self.role.name, "closing": self.closing, "busy": self._busy,
                "pump": None if self._pump_task is None else ("done" if self._pump_task.done() else "running"),
                "peers": {a: p.alive for a, p in self.peers.items()}, "stats": vars(self.stats).copy()}

    def start_pump(self, on_notif: Callable[[str, bytes], None], tick: Callable[[], None] | None = None) -> None:
        """Pump the NIXL agent from now on (once; later calls do nothing): each completion
        notification goes to ``on_notif(agent, message)``, then ``tick()`` runs, every round."""
        if self._pump_task is None:
            self._pump_task = asyncio.get_running_loop().create_task(self._pump(on_notif, tick))

    async def _pump(self, on_notif: Callable[[str, bytes], None], tick: Callable[[], None] | None) -> None:
        cfg = self.config
        while not self.closing:
            for agent, msgs in self.dp.pump().items():
                for m in msgs:
                    on_notif(agent, m)
            if tick is not None:
                tick()
            await asyncio.sleep(cfg.pump_busy_s if self._busy else cfg.pump_idle_s)

    def spin_up(self) -> None:
        """A transfer is being waited on: the pump runs at its busy pace until :meth:`spin_down`."""
        self._busy += 1

    def spin_down(self) -> None:
        self._busy -= 1

    async def next_message(self, peer: Peer) -> wire.Message | None:
        """The peer's next well-formed message (malformed ones are counted and skipped); None once lost."""
        while True:
            try:
                return await peer.channel.recv()
            except wire.WireError:
                self.stats.rejected += 1
            except PeerLost:
                return None

    async def wait_xfer(self, xfer: Transfer, until: Callable[[], float] | None = None) -> XferState:
        """The transfer's terminal state, or IN_PROGRESS once ``until()`` (a monotonic time) passed."""
        # Every poll costs the READ's latency (its DONE is seen at the next one, a loop iteration later), so
        # a poll is one call (DataPlane.poller) and ``until()`` is asked again only once the clock passes what
        # it said last: a deadline only ever moves later (a lease renewed), never earlier.
        self._busy += 1
        poll, in_progress, clock = self.dp.poller(xfer), XferState.IN_PROGRESS, time.monotonic
        deadline = until() if until is not None else float("inf")
        spin_s = self.dp.config.spin_s  # DataPlaneConfig.spin_s: back to back first
        spin_until = time.perf_counter() + spin_s if spin_s else 0.0
        try:
            while (s := poll()) is in_progress:
                if clock() > deadline:
                    deadline = until()  # type: ignore[misc]  # not None: deadline is finite
                    if clock() > deadline:
                        return s
                if not spin_s or time.perf_counter() > spin_until:
                    await asyncio.sleep(0)
            return s
        finally:
            self._busy -= 1

    def drop_agent(self, agent: str) -> None:
        """Unload a peer's NIXL agent (``remove_remote_agent``), which NIXL may have dropped already."""
        try:
            self.dp.remove_peer(agent)
        except Exception:  # nothing else refers to it
            pass

    def start_closing(self) -> None:
        """From now on the endpoint's loops stop and a lost peer's channel is not closed twice."""
        self.closing = True

    async def close(self) -> None:
        self.closing = True
        if self._pump_task is not None:
            self._pump_task.cancel()
            try:
                await self._pump_task
            except (asyncio.CancelledError, Exception):
                pass
        self.dp.close()
        ucxx_context.release()  # ucxx's notifier thread and context, once no listener or channel is open


__all__ = ["NOTIF_PREFIX", "Peer", "Side", "remember", "rid_of", "send_quietly"]
