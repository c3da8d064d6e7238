"""The SGLang manager's side of authentication (the handshake and sealing themselves: sessions.py).

`PeerAuth` is a base of `conn.HybridKVManager`: it starts the prefill's gate or the decode's keys,
decides which received frames the control loops act on (``_unproven_message``: the session they were
sealed in, or dropped and counted), seals every push of a prefill rank, binds each room to the
proven decode that claimed it (``_may_claim``), and, on a decode without a secret, turns a prefill
rank's answer to its probe into failed rooms that name the missing setting.
"""

from __future__ import annotations

import logging
from typing import Optional

from hybridkv.connectors.sglang import messages as msgs
from hybridkv.connectors.sglang import sessions
from hybridkv.connectors.sglang.sessions import DecodeKeys, PrefillGate, ReplySockets, Session
from sglang.srt.disaggregation.base.conn import KVPoll
from sglang.srt.disaggregation.common.conn import CommonKVReceiver
from sglang.srt.utils.network import NetworkAddress

logger = logging.getLogger(__name__)

_MAX_ROOM_WRITERS = 1 << 16  # decode rooms whose expected writers are remembered (a receiver's lifetime)


class PeerAuth:
    """Mixed into HybridKVManager, which provides config, auth_stats, gate, keys, probe, sched_lock,
    _room_writers, _auth_required, transfer_infos and SGLang's CommonKVManager state."""

    def _start_auth(self, secret: bytes, *, decode: bool) -> None:
        local = (self.local_ip, int(self.rank_port))
        if decode:
            self.keys = DecodeKeys(secret=secret, local=local, send=self._push_to_prefill, stats=self.auth_stats)
        else:
            self._reply_socks = ReplySockets(self._zmq_ctx)
            self.gate = PrefillGate(secret=secret, local=local, send=self._reply_unproven,
                                    tcp_of=lambda ip, port: NetworkAddress(ip, port).to_tcp(), stats=self.auth_stats,
                                    max_sessions=self.config.max_sessions, on_end=self._session_ended)

    def _push_to_prefill(self, ip: str, port: int, frames: list[bytes]) -> None:
        # The socket SGLang's REGISTER and METADATA take to that rank: the Proof arrives before them.
        na = NetworkAddress(ip, port)
        sock, lock = CommonKVReceiver._connect(na.to_tcp(), is_ipv6=na.is_ipv6)
        with lock:
            sock.send_multipart(frames)

    def _reply_unproven(self, ip: str, port: int, frames: list[bytes]) -> None:
        try:
            na = NetworkAddress(ip, port)
            self._reply_socks.send(na.to_tcp(), frames)
        except Exception as e:  # an address a forged Hello made up
            logger.info("hybridkv: no handshake reply to %s:%s: %s", ip, port, e)

    def _send_multipart_locked(self, endpoint: str, parts: list[bytes], is_ipv6: bool = False):
        """Every push of this prefill rank (SGLang's KV_STATUS, LANDED, DRAINED, STUCK) goes sealed, and only
        to a decode rank that proved the secret."""
        if self.gate is None:
            return super()._send_multipart_locked(endpoint, parts, is_ipv6=is_ipv6)
        session = self.session_for(endpoint)
        if session is None:
            raise RuntimeError(f"no authenticated session with {endpoint}; nothing is sent to it")
        sock = self._connect(endpoint, is_ipv6=is_ipv6)
        with self._socket_send_locks[endpoint]:
            sock.send_multipart(session.seal(parts))  # sealed under the lock: sequence numbers leave in order

    def expect_writers(self, room: int, prefills: frozenset[tuple[str, int]]) -> None:
        """Decode: the prefill ranks the room's receiver fetched; only their sealed messages touch the room."""
        with self.sched_lock:
            self._room_writers.pop(room, None)
            self._room_writers[room] = prefills
            while len(self._room_writers) > _MAX_ROOM_WRITERS:
                self._room_writers.popitem(last=False)

    def _unproven_message(self, frames: list[bytes]) -> Optional[tuple[Optional[Session], list[bytes]]]:
        """The frames to act on and the session they came in (None without a secret), or None: dropped."""
        auth = self.gate or self.keys
        if auth is None:
            if self.probe is not None and sessions.is_handshake(frames):
                prefill = self.probe.on_handshake(frames)
                if prefill is not None:
                    self._prefill_requires_auth(prefill)
                return None
            if sessions.is_handshake(frames) or sessions.is_sealed(frames):
                self.auth_stats.unproven += 1
                if self.auth_stats.unproven & (self.auth_stats.unproven - 1) == 0:  # 1, 2, 4, ...: a lab decode's
                    # probes (sessions.AuthProbe) land here too, so the log is bounded
                    logger.warning("hybridkv: %d authentication message(s) dropped (from a decode with a shared "
                                   "secret, or one without asking whether this rank needs it): this rank has none "
                                   "(HYBRIDKV_SGLANG_SECRET_FILE / _SECRET_ENV)", self.auth_stats.unproven)
                return None
            return None, frames
        if sessions.is_handshake(frames):
            auth.on_handshake(frames)
            return None
        if not sessions.is_sealed(frames):
            # Anything unsealed (SGLang's own ABORT or KV_STATUS, a REGISTER, garbage) is from nobody proven.
            self.auth_stats.unproven += 1
            if self.auth_stats.unproven & (self.auth_stats.unproven - 1) == 0:  # 1, 2, 4, ...: the log is bounded too
                logger.warning("hybridkv: dropped %d unauthenticated message(s) so far", self.auth_stats.unproven)
            return None
        return auth.open(frames)

    # ------------------------------------------------------------ decode without a secret (sessions.AuthProbe)
    def probe_prefill(self, prefill: tuple[str, int]) -> None:
        with self.sched_lock:
            self._auth_required.discard(prefill)  # asked again: it may have been restarted without a secret
        self.probe.probe(prefill)

    def auth_refusal(self, prefills) -> Optional[str]:
        """Why a room with these writers cannot work (one requires authentication), or None."""
        with self.sched_lock:
            required = sorted(self._auth_required.intersection(prefills))
        if not required:
            return None
        names = ", ".join(f"{ip}:{port}" for ip, port in required)
        return (f"hybridkv: prefill rank {names} requires authentication; set HYBRIDKV_SGLANG_SECRET_FILE or "
                "HYBRIDKV_SGLANG_SECRET_ENV on this decode (the prefill's shared secret)")

    def forget_registration(self, prefill: tuple[str, int]) -> None:
        """Decode: SGLang's cached registrations with that prefill rank go; the next request there registers again."""
        with self.connection_lock:
            for key in [k for k, infos in self.connection_pool.items()
                        if any((i["rank_ip"], int(i["rank_port"])) == prefill for i in infos or ())]:
                del self.connection_pool[key]

    def _prefill_requires_auth(self, prefill: tuple[str, int]) -> None:
        """Listener thread: the rooms that prefill rank was to write fail now. It dropped their REGISTER and
        METADATA unread, so nothing of it lands; a room whose every writer requires authentication has no
        write in flight, and its imports end at once."""
        with self.sched_lock:
            self._auth_required.add(prefill)
            rooms = {r: w for r, w in self._room_writers.items() if prefill in w}
        reason = self.auth_refusal({prefill})
        logger.error("%s", reason)
        self.forget_registration(prefill)  # the next request registers (and asks) again
        for room, writers in rooms.items():
            if self.request_status.get(room) in (None, KVPoll.Success, KVPoll.Failed):
                continue
            self.record_failure(room, self.auth_refusal(writers))
            self.update_status(room, KVPoll.Failed)
            with self.sched_lock:
                quiet = writers <= self._auth_required
            if quiet:
                self.settle_imports(room, "every writer requires authentication")

    def _foreign(self, session: Session, what: str) -> None:
        self.auth_stats.foreign += 1
        logger.warning("hybridkv: dropped a message from %s:%s: %s", *session.peer, what)

    def _may_claim(self, md: msgs.Metadata, session: Session) -> bool:
        """A proven decode rank names only its own agent and address, joins a room only while it has room
        for another destination rank, and holds at most MAX_ROOMS_PER_SESSION rooms here."""
        if md.agent_name != session.agent or (md.endpoint, md.port) != session.peer:
            self._foreign(session, f"METADATA for agent {md.agent_name!r} at {md.endpoint}:{md.port}, not its own")
            return False
        infos = self.transfer_infos.get(md.room) or {}
        if infos and md.agent_name not in infos:
            first = next(iter(infos.values()))
            if len(infos) >= first.required_dst_info_num or md.required_dst_info_num != first.required_dst_info_num:
                self._foreign(session, f"METADATA for room {md.room}, claimed by another decode")
                return False
        if md.room not in session.rooms and len(session.rooms) >= sessions.MAX_ROOMS_PER_SESSION:
            for r in [r for r in session.rooms if session.agent not in (self.transfer_infos.get(r) or {})]:
                del session.rooms[r]
            if len(session.rooms) >= sessions.MAX_ROOMS_PER_SESSION:
                self._foreign(session, f"{len(session.rooms)} rooms open; expected at most "
                                       f"{sessions.MAX_ROOMS_PER_SESSION}")
                return False
        session.rooms[md.room] = None
        return True
