"""Who a rank of the SGLang backend listens to: the handshake that proves the shared secret, and the
sessions that seal every message after it.

SGLang's control sockets are ZMQ PUSH/PULL: one-way, and a PULL socket cannot tell who sent a message.
So the peer is not a connection but a session, named in every message. The decode rank starts one per
prefill rank before its REGISTER:

1. decode -> prefill ``Hello``: nonce Nd and the decode's endpoint (where the answer goes);
2. prefill -> decode ``Challenge``: nonce Np and the prefill's proof over (Nd, Np, both endpoints). Np is
   a cookie (a timestamp and a MAC under a key of this process), so a Hello leaves no state behind;
3. the decode checks the proof (a prefill that cannot prove the secret gets nothing, not even the
   REGISTER) and sends ``Proof``: its proof over the same transcript, another label;
4. the prefill checks the cookie (fresh, not used before) and the proof; only then is there a session,
   keyed by both nonces and the secret. Everything after (REGISTER, METADATA, ABORT one way; KV_STATUS,
   LANDED, DRAINED, STUCK the other) travels sealed under that key (hybridkv.transport.sealing: the MAC
   over the direction's label, the sequence number and every frame; a sequence number accepted once).

Both endpoints are in the transcript, so a proof relayed through another address (a forged bootstrap
route) fails, and a recorded exchange or sealed message is useless later (fresh nonces, one-time
sequence numbers). The labels differ from hybridkv's transport handshake, so no proof of one protocol
is accepted by the other. Nothing is encrypted: the MAC authenticates, it does not hide.

A decode rank without a secret sends the same Hello and nothing more (`AuthProbe`): a prefill rank that
answers it with a Challenge requires a secret, and the decode fails that rank's rooms at once, naming the
cause, instead of at SGLang's timeout.

This module holds the sealing and what both sides share; the prefill's side of the handshake is
prefill_gate.py, the decode's decode_keys.py.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Optional

from hybridkv.connectors.sglang import messages as msgs
from hybridkv import wire
from hybridkv.transport import auth, sealing

logger = logging.getLogger(__name__)

SEAL_TAG = b"HYBRIDKV-SEAL"
LABEL_PREFILL = b"hybridkv-sglang-v1 prefill proof"
LABEL_DECODE = b"hybridkv-sglang-v1 decode proof"
LABEL_KEY = b"hybridkv-sglang-v1 session key"
_TO_PREFILL = b"hybridkv-sglang-v1 decode->prefill"
_TO_DECODE = b"hybridkv-sglang-v1 prefill->decode"

REFUSED = "refused"  # all a peer that has not proved the secret is told
COOKIE_TTL_S = 30.0  # a Challenge's nonce is good for this long
MAX_SESSIONS = 256  # sessions a decode rank keeps open for reading (a prefill rank's bound: max_sessions)
MAX_ROOMS_PER_SESSION = 4096  # rooms one decode rank may hold open on one prefill rank
#: ``[SEAL_TAG, sid + seq, mac, *frames]``, sid = both nonces (hybridkv.transport.sealing)
FORMAT = sealing.SealedFormat(tag=SEAL_TAG, sid_bytes=2 * wire.NONCE_BYTES, max_frames=8)


@dataclasses.dataclass
class AuthStats:
    """What the gate let in and what it dropped (tests and logs read it; the manager's threads write it)."""

    challenges: int = 0  # Hellos answered
    sessions: int = 0  # peers proven
    refused: int = 0  # proofs that failed, told "refused"
    unproven: int = 0  # messages dropped: no valid session (unsealed, unknown session, bad MAC)
    oversize: int = 0  # handshake messages dropped for their size, unparsed
    replayed: int = 0  # sealed messages whose sequence number was used
    foreign: int = 0  # a proven peer's message about an agent, address or room that is not its own
    throttled: int = 0  # replies not sent: over REPLIES_PER_S
    disallowed: int = 0  # handshakes naming an address this rank does not dial (PrefillGate's `allowed`)


def endpoint_bytes(ip: str, port: int) -> bytes:
    return f"{ip}:{int(port)}".encode()


def handshake_transcript(nd: bytes, np_: bytes, decode_ep: bytes, prefill_ep: bytes) -> tuple[bytes, ...]:
    return (nd, np_, decode_ep, prefill_ep)


def read_handshake(frames: list[bytes], stats: AuthStats) -> Optional[msgs.Message]:
    """A handshake message from a peer not yet proven, or None: dropped and counted (oversize ones never
    unpacked)."""
    if msgs.frames_size(frames) > wire.MAX_PREAUTH_BYTES:
        stats.oversize += 1
        return None
    try:
        return msgs.decode_auth(frames)
    except ValueError as e:
        stats.unproven += 1
        logger.info("hybridkv: dropped a handshake message: %s", e)
        return None


def open_sealed(session: Optional[Session], frames: list[bytes],
             stats: AuthStats) -> Optional[tuple[Session, list[bytes]]]:
    """(session, the frames it sealed), or None: no such session, or a MAC or sequence number that fails
    (counted either way)."""
    if session is None:
        stats.unproven += 1
        return None
    inner = session.open(frames, stats)
    return None if inner is None else (session, inner)


class Session:
    """One proven peer rank: its sealer (hybridkv.transport.sealing) and what the prefill side binds to it."""

    def __init__(self, *, sid: bytes, key: bytes, peer: tuple[str, int], prefill_side: bool) -> None:
        self.sid = sid
        self.peer = peer  # the other rank's ZMQ endpoint (ip, port), as proven in the transcript
        self.tcp = ""  # the same as SGLang names it in a push ("tcp://ip:port")
        send, recv = (_TO_DECODE, _TO_PREFILL) if prefill_side else (_TO_PREFILL, _TO_DECODE)
        self._sealer = sealing.WindowedSealer(fmt=FORMAT, key=key, sid=sid, send_label=send, recv_label=recv)
        #: prefill side: the NIXL agent this decode rank registered, and the rooms it claimed (oldest first)
        self.agent: Optional[str] = None
        self.rooms: dict[int, None] = {}

    def seal(self, frames: list[bytes]) -> list[bytes]:
        return self._sealer.seal(frames)  # called under the socket's send lock: numbers leave in order

    def open(self, frames: list[bytes], stats: AuthStats) -> Optional[list[bytes]]:
        """The inner frames of a message sealed by the peer, or None (forged, altered or replayed: counted)."""
        try:
            return self._sealer.open(frames)
        except sealing.Replayed:
            stats.replayed += 1
        except sealing.SealError:
            stats.unproven += 1
        return None


def is_sealed(frames: list[bytes]) -> bool:
    return FORMAT.is_sealed(frames)


def is_handshake(frames: list[bytes]) -> bool:
    return bool(frames) and frames[0] == msgs.AUTH_TAG


def derive_session_key(secret: bytes, nd: bytes, np_: bytes, decode_ep: bytes, prefill_ep: bytes) -> bytes:
    return auth.labelled_proof(secret, LABEL_KEY, *handshake_transcript(nd, np_, decode_ep, prefill_ep))


__all__ = ["AuthStats", "FORMAT", "MAX_ROOMS_PER_SESSION", "MAX_SESSIONS", "SEAL_TAG", "Session", "is_handshake",
           "is_sealed"]
