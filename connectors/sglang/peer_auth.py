"""The SGLang manager's part of authentication (the handshake and sealing themselves: sessions.py,
prefill_gate.py, decode_keys.py).

`PeerAuth` starts the prefill's gate or the decode's keys (or, on a decode without a secret, its
probe), decides which received frames the control loops act on (`open`: the session they were
sealed in, or dropped and counted), gives the session that seals each push of a prefill rank
(`session_for`, the last one that ended included), binds each room to the proven decode that claimed
it (`may_claim`), and, on a decode without a secret, turns a prefill rank's answer to its probe into
failed rooms that name the missing setting. When a prefill rank evicts a decode rank's session, that
rank is told, so that it registers again before its next room there, and its NIXL agent retires
(retiring.py) unless a live session took it over.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Optional

import zmq

from hybridkv.connectors.sglang import messages as msgs
from hybridkv.connectors.sglang import sessions
from hybridkv.connectors.sglang.config import SGLangConfig
from hybridkv.connectors.sglang.rooms import Endpoint, Rooms
from hybridkv.connectors.sglang.prefill_links import PrefillLinks
from hybridkv.connectors.sglang.decode_keys import AuthProbe, DecodeKeys
from hybridkv.connectors.sglang.prefill_gate import PrefillGate, ReplySockets
from hybridkv.connectors.sglang.sessions import MAX_SESSIONS, AuthStats, Session
from hybridkv.transport.recent import Recent
from sglang.srt.disaggregation.base.conn import KVPoll
from sglang.srt.disaggregation.common.conn import CommonKVReceiver
from sglang.srt.utils.network import NetworkAddress

logger = logging.getLogger(__name__)

_MAX_ROOM_WRITERS = 1 << 16  # decode rooms whose expected writers are remembered (a receiver's lifetime)


class PeerAuth:
    """One manager's authentication, with a secret (`gate` on a prefill, `keys` on a decode) or without
    (`probe` on a decode; nothing on a prefill). Given the manager's address and ZMQ context, SGLang's rooms,
    and what it does elsewhere: `retire_agent` (prefill: retiring.py), `forget_registration` (decode: SGLang's
    cached registrations with a prefill rank) and `settle` (decode: a room's imports end, decode_side.py)."""

    def __init__(self, *, secret: Optional[bytes], decode: bool, local: Endpoint, zmq_ctx: zmq.Context,
                 config: SGLangConfig, stats: AuthStats, rooms: Rooms,
                 retire_agent: Callable[[str, str], None], forget_registration: Callable[[Endpoint], None],
                 settle: Callable[[int, str], None]) -> None:
        self.config = config
        self.stats = stats
        self.rooms = rooms
        self.retire_agent = retire_agent
        self.forget_registration = forget_registration
        self.settle = settle
        self.gate: Optional[PrefillGate] = None
        self.keys: Optional[DecodeKeys] = None
        self.probe: Optional[AuthProbe] = None  # decode without a secret: which prefill ranks require one
        self._reply_socks: Optional[ReplySockets] = None
        self._lock = threading.Lock()
        self._auth_required: set[Endpoint] = set()  # prefill ranks that answered a probe
        # decode: the prefill ranks (ip, port) each room's receiver expects to hear from, oldest first
        self._room_writers: Recent[int, frozenset[Endpoint]] = Recent(_MAX_ROOM_WRITERS)
        # prefill: sessions that ended, by the decode's ZMQ endpoint: what is still told to a decode rank whose
        # session ended (its rooms' Failed) is sealed with them; bounded, the oldest forgotten first.
        self._ended: Recent[str, Session] = Recent(MAX_SESSIONS)
        #: decode with a secret: the handshake per prefill rank, off SGLang's scheduler thread
        self.links: Optional[PrefillLinks] = None
        if secret is not None and decode:
            self.keys = DecodeKeys(secret=secret, local=local, send=self._push_to_prefill, stats=stats)
            self.links = PrefillLinks(keys=self.keys, timeout_s=config.handshake_timeout_s,
                                      socket_of=self._socket_to_prefill)
        elif secret is not None:
            self._reply_socks = ReplySockets(zmq_ctx)
            self.gate = PrefillGate(secret=secret, local=local, send=self._reply_unproven,
                                    tcp_of=lambda ip, port: NetworkAddress(ip, port).to_tcp(), stats=stats,
                                    max_sessions=config.max_sessions, on_end=self._session_ended,
                                    allowed=config.decode_host_allowed)
        elif decode:
            self.probe = AuthProbe(local=local, send=self._push_to_prefill, stats=stats)

    def close(self) -> None:
        if self._reply_socks is not None:
            self._reply_socks.close()

    @staticmethod
    def _socket_to_prefill(prefill: Endpoint):
        """SGLang's (socket, lock) to a prefill rank: the one its REGISTER and METADATA take."""
        na = NetworkAddress(*prefill)
        return CommonKVReceiver._connect(na.to_tcp(), is_ipv6=na.is_ipv6)

    def _push_to_prefill(self, ip: str, port: int, frames: list[bytes]) -> None:
        # The socket SGLang's REGISTER and METADATA take to that rank: the Proof arrives before them.
        sock, lock = self._socket_to_prefill((ip, port))
        with lock:
            sock.send_multipart(frames)

    def _reply_unproven(self, ip: str, port: int, frames: list[bytes]) -> None:
        try:
            na = NetworkAddress(ip, port)
            self._reply_socks.send(na.to_tcp(), frames)
        except Exception as e:  # an address a forged Hello made up
            logger.info("hybridkv: no handshake reply to %s:%s: %s", ip, port, e)

    # ------------------------------------------------------------ prefill with a secret
    def session_for(self, endpoint: str) -> Optional[Session]:
        """The session that seals a push to `endpoint`: the live one, else the last one that ended."""
        return self.gate.by_peer.get(endpoint) or self._ended.get(endpoint)

    def agent_owner(self, agent: str) -> Optional[Session]:
        return self.gate.agent_owner(agent)

    def _session_ended(self, session: Session) -> None:
        """PrefillGate's on_end."""
        self._ended[session.tcp] = session
        if self.gate.by_peer.get(session.tcp) is None:
            # Evicted, not replaced: the decode rank does not know, and would seal its next METADATA with it.
            self.rooms.push(*session.peer, msgs.SessionEnded(prefill_rank=self.rooms.prefill_rank()).to_frames(),
                            "the end of its session")
        agent = session.agent
        if agent is None or self.gate.agent_owner(agent) is not None:
            return  # it never registered, or the session that replaced it took the agent over
        self.retire_agent(agent, f"the authenticated session of decode rank {session.peer[0]}:{session.peer[1]} "
                                 f"ended (more than max_sessions = {self.config.max_sessions} decode ranks, or "
                                 "replaced); its NIXL agent is removed")

    # ------------------------------------------------------------ decode
    def expect_writers(self, room: int, prefills: frozenset[Endpoint]) -> None:
        """Decode: the prefill ranks the room's receiver fetched; only their sealed messages touch the room."""
        with self._lock:
            self._room_writers[room] = prefills

    def writes(self, prefill: Endpoint, room: Optional[int]) -> bool:
        """Decode: that prefill rank is one the room's receiver expects to hear from."""
        with self._lock:
            writers = self._room_writers.get(room, ()) if room is not None else ()
        return prefill in writers

    def session_ended(self, session: Session) -> None:
        """Decode: the prefill rank evicted this rank's session: the next room there registers again (a new
        handshake)."""
        logger.warning("hybridkv: prefill rank %s:%s ended this decode rank's session; the next request there "
                       "registers again", *session.peer)
        self.keys.ended(session)
        self.forget_registration(session.peer)

    # ------------------------------------------------------------ both
    def open(self, frames: list[bytes],
             source: Optional[str] = None) -> Optional[tuple[Optional[Session], list[bytes]]]:
        """The frames to act on and the session they came in (None without a secret), or None: dropped.
        `source`: the IP the frames came from (ZMQ's Peer-Address), which a prefill's handshake reply may go to."""
        auth = self.gate or self.keys
        if auth is None:
            if self.probe is not None and sessions.is_handshake(frames):
                prefill = self.probe.on_handshake(frames)
                if prefill is not None:
                    self._prefill_requires_auth(prefill)
                return None
            if sessions.is_handshake(frames) or sessions.is_sealed(frames):
                self.stats.unproven += 1
                if self.stats.unproven & (self.stats.unproven - 1) == 0:  # 1, 2, 4, ...: a lab decode's
                    # probes (decode_keys.AuthProbe) land here too, so the log is bounded
                    logger.warning("hybridkv: %d authentication message(s) dropped (from a decode with a shared "
                                   "secret, or one without asking whether this rank needs it): this rank has none "
                                   "(HYBRIDKV_SGLANG_SECRET_FILE / _SECRET_ENV)", self.stats.unproven)
                return None
            return None, frames
        if sessions.is_handshake(frames):
            if self.gate is not None:
                self.gate.on_handshake(frames, source)
            else:
                self.keys.on_handshake(frames)
            return None
        if not sessions.is_sealed(frames):
            # Anything unsealed (SGLang's own ABORT or KV_STATUS, a REGISTER, garbage) is from nobody proven.
            self.stats.unproven += 1
            if self.stats.unproven & (self.stats.unproven - 1) == 0:  # 1, 2, 4, ...: the log is bounded too
                logger.warning("hybridkv: dropped %d unauthenticated message(s) so far", self.stats.unproven)
            return None
        return auth.open(frames)

    # ------------------------------------------------------------ decode without a secret (decode_keys.AuthProbe)
    def probe_prefill(self, prefill: Endpoint) -> None:
        with self._lock:
            self._auth_required.discard(prefill)  # asked again: it may have been restarted without a secret
        self.probe.probe(prefill)

    def refusal(self, prefills) -> Optional[str]:
        """Why a room with these writers cannot work (one requires authentication), or None."""
        with self._lock:
            required = sorted(self._auth_required.intersection(prefills))
        if not required:
            return None
        names = ", ".join(f"{ip}:{port}" for ip, port in required)
        return (f"hybridkv: prefill rank {names} requires authentication; set HYBRIDKV_SGLANG_SECRET_FILE or "
                "HYBRIDKV_SGLANG_SECRET_ENV on this decode (the prefill's shared secret)")

    def _prefill_requires_auth(self, prefill: Endpoint) -> None:
        """Listener thread: the rooms that prefill rank was to write fail now. It dropped their REGISTER and
        METADATA unread, so nothing of it lands; a room whose every writer requires authentication has no
        write in flight, and its imports end at once."""
        with self._lock:
            self._auth_required.add(prefill)
            rooms = {r: w for r, w in self._room_writers.items() if prefill in w}
        reason = self.refusal({prefill})
        logger.error("%s", reason)
        self.forget_registration(prefill)  # the next request registers (and asks) again
        for room, writers in rooms.items():
            if self.rooms.status(room) in (None, KVPoll.Success, KVPoll.Failed):
                continue
            self.rooms.record_failure(room, self.refusal(writers))
            self.rooms.update_status(room, KVPoll.Failed)
            with self._lock:
                quiet = writers <= self._auth_required
            if quiet:
                self.settle(room, "every writer requires authentication")

    # ------------------------------------------------------------ prefill: what a proven decode may do
    def foreign(self, session: Session, what: str) -> None:
        self.stats.foreign += 1
        logger.warning("hybridkv: dropped a message from %s:%s: %s", *session.peer, what)

    def release_room(self, room: int, agents: frozenset[str]) -> None:
        """Prefill: the room ended for these decode agents (its claims went): it no longer counts against
        their sessions' MAX_ROOMS_PER_SESSION."""
        if self.gate is None:
            return
        for agent in agents:
            session = self.gate.agent_owner(agent)
            if session is not None:
                session.rooms.pop(room, None)

    def may_claim(self, md: msgs.Metadata, session: Session) -> bool:
        """A proven decode rank names only its own agent and address, joins a room only while it has room
        for another destination rank, and holds at most MAX_ROOMS_PER_SESSION rooms here."""
        if md.agent_name != session.agent or (md.endpoint, md.port) != session.peer:
            self.foreign(session, f"METADATA for agent {md.agent_name!r} at {md.endpoint}:{md.port}, not its own")
            return False
        infos = self.rooms.infos(md.room) or {}
        if infos and md.agent_name not in infos:
            first = next(iter(infos.values()))
            if len(infos) >= first.required_dst_info_num or md.required_dst_info_num != first.required_dst_info_num:
                self.foreign(session, f"METADATA for room {md.room}, claimed by another decode")
                return False
        if md.room not in session.rooms and len(session.rooms) >= sessions.MAX_ROOMS_PER_SESSION:
            for r in [r for r in session.rooms if session.agent not in (self.rooms.infos(r) or {})]:
                del session.rooms[r]
            if len(session.rooms) >= sessions.MAX_ROOMS_PER_SESSION:
                self.foreign(session, f"{len(session.rooms)} rooms open; expected at most "
                                       f"{sessions.MAX_ROOMS_PER_SESSION}")
                return False
        session.rooms[md.room] = None
        return True
