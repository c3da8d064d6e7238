"""Control messages of the hybridkv SGLang backend, declared with hybridkv's wire schema.

They ride SGLang's ZMQ PUSH/PULL sockets (the Common* layer owns those) as two
frames: a tag and one msgpack array ``[version, type, body]``. The handshake of
sessions.py travels the same way under its own tag (``AUTH_TAG``), at most
``wire.MAX_PREAUTH_BYTES`` in all, checked before anything is unpacked. Each message type
is one frozen dataclass whose fields are declared with ``hybridkv.wire``'s
``on_wire`` codecs: that declaration is its encoder and its validator (a
``Record``), and the bounded unpacker is the wire's too, so a message from a
peer is checked exactly as hybridkv's own are. No pickle; a bad message raises
``WireError`` (a ValueError) naming the field. The version lets an old peer be
refused with a clear reason instead of a misparse.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np

from hybridkv.connectors.sglang.shapes import BufferShape, Parallel, Slicing
from hybridkv import wire
from hybridkv.fencing.request_state import Component, ComponentKind
from hybridkv.wire.codec import unpack
from hybridkv.wire.fields import Blob, EnumValue, Exact, Flag, Int, Int32s, ListOf, Nullable, Text, expect_list
from hybridkv.wire.limits import MAX_BLOCKS_PER_GROUP, MAX_FIELDS, MAX_GROUPS, MAX_I32, MAX_METADATA_BYTES, MAX_NAME, \
    MAX_TP
from hybridkv.wire.regions import GROUP_ID, GROUPS, REGIONS
from hybridkv.wire.schema import on_wire, record_of, record_with

TAG = b"HYBRIDKV"
AUTH_TAG = b"HYBRIDKV-AUTH"  # the handshake, before the peer proved the shared secret
VERSION = 6  # 5: METADATA, LANDED, STUCK and DRAINED carry the decode import's generation; 6: staging slots


class MsgType(enum.Enum):
    REGISTER = "register"  # decode rank -> prefill rank, once per connection
    METADATA = "metadata"  # decode rank -> prefill rank, once per request
    DRAINED = "drained"  # prefill rank -> decode rank: no write for the room in flight
    LANDED = "landed"  # prefill rank -> decode rank: these components of the room are written
    STUCK = "stuck"  # prefill rank -> decode rank: a write NIXL would not abort may still land; wait for DRAINED
    SESSION_ENDED = "session_ended"  # prefill rank -> decode rank, sealed with the session that ended (evicted)


class AuthType(enum.Enum):
    HELLO = "hello"  # decode rank -> prefill rank: its nonce and where to answer
    CHALLENGE = "challenge"  # prefill -> decode: the prefill's nonce and its proof over both
    PROOF = "proof"  # decode -> prefill: its proof over both nonces
    REFUSED = "refused"  # either way: "refused", nothing else


# ---------------------------------------------------------------- codecs the wire has no need of itself
@dataclass(frozen=True, kw_only=True)
class Indices:
    """Block ids as an int32 array on the wire, an int64 numpy array here (the planners' input)."""

    inner: Int32s = Int32s(limit=MAX_BLOCKS_PER_GROUP, what="index", distinct=False)

    def encode(self, value: Any) -> bytes:
        return self.inner.encode(value)

    def decode(self, raw: Any, name: str) -> np.ndarray:
        return np.asarray(self.inner.decode(raw, name), dtype=np.int64)


COUNT = Int(lo=0, hi=MAX_I32)
POSITIVE = Int(lo=1, hi=MAX_I32)
ROOM = Int(lo=0, hi=(1 << 64) - 1)
RANK = Int(lo=0, hi=MAX_I32)
PORT = Int(lo=0, hi=65535)
# A decode import's generation (decode_side.py); 0: not known to the sender (the room is not claimed here).
GENERATION = Int(lo=0, hi=(1 << 63) - 1)
NAME = Text(limit=MAX_NAME)
TP = Int(lo=1, hi=MAX_TP)
_PARALLEL = record_with(Parallel, attn_tp=TP, attn_rank=Int(lo=0, hi=MAX_TP - 1), state_tp=TP,
                        page_size=POSITIVE, kv_heads=POSITIVE, mla=Flag(), kv_layout=Nullable(inner=NAME),
                        draft_entries=COUNT)
_SHAPE = record_with(BufferShape, slicing=EnumValue(enum=Slicing), dim=COUNT, outer=POSITIVE,
                     sub=ListOf(item=POSITIVE, limit=64), conv=Flag())
_COMPONENT = record_with(Component, group=GROUP_ID, kind=EnumValue(enum=ComponentKind))


# ---------------------------------------------------------------- the adopted layout, as its peer gets it
@dataclass(frozen=True, kw_only=True)
class ShapeOf:
    key: int = on_wire("key", COUNT)  # what the buffer holds (buffer_keys.py)
    shape: BufferShape = on_wire("shape", _SHAPE)


@dataclass(frozen=True, kw_only=True)
class ComponentKeys:
    component: Component = on_wire("component", _COMPONENT)
    keys: tuple[int, ...] = on_wire("keys", Int32s(limit=MAX_FIELDS, what="buffer key", distinct=True))


@dataclass(frozen=True, kw_only=True)
class PeerLayout:
    """A side's adopted layout: the regions, groups and field tables hybridkv's core sends
    for any layout (`hybridkv.transport.memory.from_layout`), and what SGLang says about
    the buffers in them (see `hybridkv.connectors.sglang.adopt.from_peer`)."""

    regions: tuple[wire.RegionInfo, ...] = on_wire("regions", REGIONS)
    groups: tuple[wire.GroupInfo, ...] = on_wire("groups", GROUPS)
    table: wire.LayoutTable = on_wire("table", record_of(wire.LayoutTable))
    num_state_groups: int = on_wire("state_groups", Int(lo=0, hi=MAX_GROUPS - 2))
    shapes: tuple[ShapeOf, ...] = on_wire("shapes", ListOf(item=record_of(ShapeOf), limit=MAX_FIELDS, distinct="key"))
    components: tuple[ComponentKeys, ...] = on_wire("components", ListOf(item=record_of(ComponentKeys),
                                                                         limit=3 * MAX_GROUPS))
    parallel: Parallel = on_wire("parallel", _PARALLEL)

    def _check(self, name: str) -> None:
        # The field tables name regions and groups by id: only ones listed here.
        self.table.check_refs({r.region_id: r for r in self.regions}, {g.group_id for g in self.groups},
                              f"{name}.table")


# ---------------------------------------------------------------- messages
class Message:
    def to_frames(self) -> list[bytes]:
        return encode(self)


@dataclass(frozen=True, kw_only=True)
class Register(Message):
    endpoint: str = on_wire("endpoint", NAME)
    port: int = on_wire("port", PORT)
    agent_name: str = on_wire("agent", NAME)
    agent_metadata: bytes = on_wire("metadata", Blob(limit=MAX_METADATA_BYTES))
    layout: PeerLayout = on_wire("layout", record_of(PeerLayout))
    attn_tp_size: int = on_wire("attn_tp", TP)
    attn_tp_rank: int = on_wire("attn_rank", Int(lo=0, hi=MAX_TP - 1))
    state_types: tuple[str, ...] = on_wire("state_types", ListOf(item=NAME, limit=MAX_GROUPS))
    fingerprint: str = on_wire("fingerprint", NAME)
    #: the decode's staging pool (staged_kv.py), registered with its agent; None: it has none
    staging_region: wire.RegionInfo | None = on_wire("staging", Nullable(inner=record_of(wire.RegionInfo)),
                                                     default=None)


@dataclass(frozen=True, kw_only=True)
class StagedSlot:
    """A decode slot for one prefill rank's staged KV of the room: bytes [offset, offset + nbytes) of the decode's
    staging region (its REGISTER named it)."""

    prefill_rank: int = on_wire("rank", RANK)
    offset: int = on_wire("offset", Int(lo=0, hi=(1 << 62)))
    nbytes: int = on_wire("nbytes", Int(lo=1, hi=(1 << 62)))


@dataclass(frozen=True, kw_only=True)
class Metadata(Message):
    room: int = on_wire("room", ROOM)
    endpoint: str = on_wire("endpoint", NAME)
    port: int = on_wire("port", PORT)
    agent_name: str = on_wire("agent", NAME)
    kv_indices: np.ndarray = on_wire("kv", Indices())
    aux_index: int = on_wire("aux", Int(lo=-1, hi=MAX_I32))  # -1: none
    state_indices: tuple[np.ndarray | None, ...] = on_wire("states", ListOf(item=Nullable(inner=Indices()),
                                                                            limit=MAX_GROUPS))
    required_dst_info_num: int = on_wire("required", POSITIVE)
    decode_prefix_len: int = on_wire("prefix_len", COUNT)
    is_dummy: bool = on_wire("dummy", Flag())
    generation: int = on_wire("generation", GENERATION)  # the decode's import of the room; echoed back
    #: decode slots for staged KV, per prefill rank (none: the prefill writes KV sliced or straight into the pages)
    staging: tuple[StagedSlot, ...] = on_wire("staging", ListOf(item=record_of(StagedSlot), limit=MAX_TP),
                                              default=())


@dataclass(frozen=True, kw_only=True)
class Drained(Message):
    room: int = on_wire("room", ROOM)
    prefill_rank: int = on_wire("rank", RANK)
    generation: int = on_wire("generation", GENERATION)


@dataclass(frozen=True, kw_only=True)
class Stuck(Message):
    """Sent before the room's KV_STATUS Failed: that status does not mean this rank is quiet."""

    room: int = on_wire("room", ROOM)
    prefill_rank: int = on_wire("rank", RANK)
    generation: int = on_wire("generation", GENERATION)


@dataclass(frozen=True, kw_only=True)
class SessionEnded(Message):
    """The session this is sealed with ended on the prefill rank (evicted): a decode rank registers again,
    with a new handshake, before its next room there, as its sealed METADATA would be dropped."""

    prefill_rank: int = on_wire("rank", RANK)


@dataclass(frozen=True, kw_only=True)
class Landed(Message):
    """Every write of these components of the room completed (NIXL DONE on the writer)."""

    room: int = on_wire("room", ROOM)
    prefill_rank: int = on_wire("rank", RANK)
    components: tuple[Component, ...] = on_wire("components", ListOf(item=_COMPONENT, limit=3 * MAX_GROUPS))
    generation: int = on_wire("generation", GENERATION)
    #: the room's decode pages this writer put in its staging slot, as flat [start, stop) pairs (staged_kv.py)
    staged: tuple[int, ...] = on_wire("staged", ListOf(item=COUNT, limit=1 << 16), default=())


# ---------------------------------------------------------------- the handshake (sessions.py)
NONCE = Exact(size=wire.NONCE_BYTES)
PROOF = Exact(size=wire.PROOF_BYTES)


@dataclass(frozen=True, kw_only=True)
class Hello(Message):
    nonce: bytes = on_wire("nonce", NONCE)
    endpoint: str = on_wire("endpoint", NAME)  # the decode rank's ZMQ endpoint: where the challenge goes
    port: int = on_wire("port", PORT)


@dataclass(frozen=True, kw_only=True)
class Challenge(Message):
    decode_nonce: bytes = on_wire("decode_nonce", NONCE)
    prefill_nonce: bytes = on_wire("prefill_nonce", NONCE)
    proof: bytes = on_wire("proof", PROOF)


@dataclass(frozen=True, kw_only=True)
class Proof(Message):
    decode_nonce: bytes = on_wire("decode_nonce", NONCE)
    prefill_nonce: bytes = on_wire("prefill_nonce", NONCE)
    endpoint: str = on_wire("endpoint", NAME)
    port: int = on_wire("port", PORT)
    proof: bytes = on_wire("proof", PROOF)


@dataclass(frozen=True, kw_only=True)
class Refused(Message):
    reason: str = on_wire("reason", Text(limit=16))


_TYPES: dict[MsgType, type] = {MsgType.REGISTER: Register, MsgType.METADATA: Metadata, MsgType.DRAINED: Drained,
                               MsgType.LANDED: Landed, MsgType.STUCK: Stuck, MsgType.SESSION_ENDED: SessionEnded}
_TYPE_OF = {cls: t for t, cls in _TYPES.items()}
_RECORDS = {t: record_of(cls) for t, cls in _TYPES.items()}
_MSG_TYPE = EnumValue(enum=MsgType)


_AUTH_TYPES: dict[AuthType, type] = {AuthType.HELLO: Hello, AuthType.CHALLENGE: Challenge, AuthType.PROOF: Proof,
                                      AuthType.REFUSED: Refused}
_AUTH_TYPE_OF = {cls: t for t, cls in _AUTH_TYPES.items()}
_AUTH_RECORDS = {t: record_of(cls) for t, cls in _AUTH_TYPES.items()}
_AUTH_TYPE = EnumValue(enum=AuthType)


def encode(msg: Message) -> list[bytes]:
    if type(msg) in _AUTH_TYPE_OF:
        t = _AUTH_TYPE_OF[type(msg)]
        return [AUTH_TAG, msgpack.packb([VERSION, t.value, _AUTH_RECORDS[t].encode(msg)], use_bin_type=True)]
    t = _TYPE_OF[type(msg)]
    return [TAG, msgpack.packb([VERSION, t.value, _RECORDS[t].encode(msg)], use_bin_type=True)]


def frames_size(frames: list[bytes]) -> int:
    return sum(len(f) for f in frames)


def decode_auth(frames: list[bytes]) -> Message:
    """A handshake message from a peer not yet proven: WireError for anything but two frames of at most
    ``wire.MAX_PREAUTH_BYTES`` in all, checked before a byte of it is unpacked."""
    if len(frames) != 2 or frames[0] != AUTH_TAG:
        raise wire.WireError(f"not a hybridkv handshake message: {len(frames)} frames")
    if frames_size(frames) > wire.MAX_PREAUTH_BYTES:
        raise wire.WireError(f"handshake message of {frames_size(frames)} bytes; expected at most "
                             f"{wire.MAX_PREAUTH_BYTES}")
    top = expect_list(unpack(frames[1]), "hybridkv handshake message", 3)
    if len(top) != 3 or top[0] != VERSION:
        raise wire.WireError(f"hybridkv handshake message is not [version {VERSION}, type, body]")
    t = _AUTH_TYPE.decode(top[1], "hybridkv handshake message type")
    return _AUTH_RECORDS[t].decode(top[2], t.value)


def decode(frames: list[bytes]) -> Message:
    """Two frames from a peer -> a typed message, or WireError (a ValueError) naming what is wrong."""
    if len(frames) != 2 or frames[0] != TAG:
        raise wire.WireError(f"not a hybridkv message: {len(frames)} frames, tag {frames[0][:16]!r}")
    top = expect_list(unpack(frames[1]), "hybridkv message", 3)
    if len(top) != 3:
        raise wire.WireError(f"hybridkv message has {len(top)} entries; expected [version, type, body]")
    if top[0] != VERSION:
        raise wire.WireError(f"hybridkv message version {top[0]!r:.20}; this side speaks {VERSION}")
    t = _MSG_TYPE.decode(top[1], "hybridkv message type")
    return _RECORDS[t].decode(top[2], t.value)
