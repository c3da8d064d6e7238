"""Decode side: what a prefill rank sends, routed once the authentication opened it (peer_auth.py).

hybridkv's messages (LANDED, DRAINED, STUCK) go to the imports (decode_side.py), SGLang's (ABORT_ACK,
KV_STATUS) to SGLang's own handling first; a Success or Failed status then reaches the imports too.
A proven prefill rank speaks only of rooms this rank expects it to write, and may end its session.
"""

from __future__ import annotations

from typing import Optional

from hybridkv.connectors.sglang import messages as msgs
from hybridkv.connectors.sglang.decode_side import DecodeImports
from hybridkv.connectors.sglang.peer_auth import PeerAuth
from hybridkv.connectors.sglang.rooms import Rooms
from hybridkv.connectors.sglang.sessions import Session
from sglang.srt.disaggregation.base.conn import KVPoll


def sglang_room(frames: list[bytes]) -> Optional[int]:
    """The room an SGLang message (KV_STATUS, ABORT_ACK) names, or None."""
    try:
        return int(frames[1] if frames[0] in (b"KV_STATUS", b"ABORT_ACK") else frames[0])
    except (IndexError, ValueError):
        return None


class DecodeInbox:
    def __init__(self, *, auth: PeerAuth, imports: DecodeImports, rooms: Rooms) -> None:
        self.auth, self.imports, self.rooms = auth, imports, rooms

    def on_message(self, session: Optional[Session], frames: list[bytes]) -> None:
        m = msgs.decode(frames) if frames and frames[0] == msgs.TAG else None
        if isinstance(m, msgs.SessionEnded) and session is not None:
            return self.auth.session_ended(session)
        if session is not None:
            room = m.room if m is not None and hasattr(m, "room") else sglang_room(frames)
            if not self.auth.writes(session.peer, room):
                return self.auth.foreign(session, f"a message about room {room}, which it does not write")
        if m is not None:
            return self.imports.on_message(m)
        if self.rooms.abort_ack(frames):
            return
        parsed = self.rooms.parse_status(frames)
        if parsed is None:
            raise ValueError(f"unknown message tag {frames[0][:16]!r}")
        room, status, rank, reason = parsed
        self.rooms.apply_prefill_status(room, status, rank, reason)
        if status in (KVPoll.Success, KVPoll.Failed):
            # Success comes after the rank's last WRITE ended (drained); Failed does not (decode_side.py).
            self.imports.note_status(room, rank, success=status == KVPoll.Success, reason=reason)


__all__ = ["DecodeInbox"]
