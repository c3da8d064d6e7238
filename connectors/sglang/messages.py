"""Control messages of the hybridkv SGLang backend.

They ride SGLang's ZMQ PUSH/PULL sockets (the Common* layer owns those) as two
frames: a tag and one msgpack map. No pickle; every field is type-checked on
receipt and a bad message raises ValueError naming the field. The version
lets an old peer be refused with a clear reason instead of a misparse.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np

TAG = b"HYBRIDKV"
VERSION = 3


class MsgType(enum.Enum):
    REGISTER = "register"  # decode rank -> prefill rank, once per connection
    METADATA = "metadata"  # decode rank -> prefill rank, once per request
    DRAINED = "drained"  # prefill rank -> decode rank: no write for the room in flight
    LANDED = "landed"  # prefill rank -> decode rank: these components of the room are written
    STUCK = "stuck"  # prefill rank -> decode rank: a write NIXL would not abort may still land; wait for DRAINED


def _field(m: dict, name: str, typ: type | tuple[type, ...]) -> Any:
    if name not in m:
        raise ValueError(f"message lacks field {name!r}")
    v = m[name]
    if isinstance(v, bool) and typ is int:
        raise ValueError(f"field {name!r} is {v!r}; expected int")
    if not isinstance(v, typ):
        raise ValueError(f"field {name!r} is {type(v).__name__}; expected {typ}")
    return v


def _int_list(m: dict, name: str) -> np.ndarray:
    v = _field(m, name, (bytes, list))
    if isinstance(v, bytes):
        if len(v) % 4:
            raise ValueError(f"field {name!r} has {len(v)} bytes; expected int32 array")
        return np.frombuffer(v, dtype=np.int32).astype(np.int64)
    if not all(isinstance(x, int) and not isinstance(x, bool) for x in v):
        raise ValueError(f"field {name!r} holds a non-int")
    return np.asarray(v, dtype=np.int64)


def encode(kind: MsgType, body: dict[str, Any]) -> list[bytes]:
    return [TAG, msgpack.packb({"v": VERSION, "type": kind.value, **body}, use_bin_type=True)]


def decode(frames: list[bytes]) -> tuple[MsgType, dict[str, Any]]:
    if len(frames) != 2 or frames[0] != TAG:
        raise ValueError(f"not a hybridkv message: {len(frames)} frames, tag {frames[0][:16]!r}")
    try:
        m = msgpack.unpackb(frames[1], raw=False, strict_map_key=True)
    except Exception as e:  # msgpack raises several unrelated types
        raise ValueError(f"undecodable hybridkv message: {e}") from None
    if not isinstance(m, dict):
        raise ValueError(f"hybridkv message is {type(m).__name__}; expected a map")
    v = m.get("v")
    if v != VERSION:
        raise ValueError(f"hybridkv message version {v!r}; this side speaks {VERSION}")
    try:
        kind = MsgType(m.get("type"))
    except ValueError:
        raise ValueError(f"hybridkv message type {m.get('type')!r}; expected one of {[t.value for t in MsgType]}") from None
    return kind, m


@dataclass(frozen=True, kw_only=True)
class Register:
    endpoint: str
    port: int
    agent_name: str
    agent_metadata: bytes
    layout: dict[str, Any]
    attn_tp_size: int
    attn_tp_rank: int
    state_types: tuple[str, ...]
    fingerprint: str

    def to_frames(self) -> list[bytes]:
        return encode(MsgType.REGISTER, {
            "endpoint": self.endpoint, "port": self.port, "agent_name": self.agent_name,
            "agent_metadata": self.agent_metadata, "layout": self.layout,
            "attn_tp_size": self.attn_tp_size, "attn_tp_rank": self.attn_tp_rank,
            "state_types": list(self.state_types), "fingerprint": self.fingerprint,
        })

    @classmethod
    def parse(cls, m: dict) -> Register:
        st = _field(m, "state_types", list)
        if not all(isinstance(s, str) for s in st):
            raise ValueError("field 'state_types' holds a non-string")
        return cls(
            endpoint=_field(m, "endpoint", str), port=_field(m, "port", int),
            agent_name=_field(m, "agent_name", str), agent_metadata=_field(m, "agent_metadata", bytes),
            layout=_field(m, "layout", dict), attn_tp_size=_field(m, "attn_tp_size", int),
            attn_tp_rank=_field(m, "attn_tp_rank", int), state_types=tuple(st),
            fingerprint=_field(m, "fingerprint", str),
        )


@dataclass(frozen=True, kw_only=True)
class Metadata:
    room: int
    endpoint: str
    port: int
    agent_name: str
    kv_indices: np.ndarray
    aux_index: int
    state_indices: tuple[np.ndarray | None, ...]
    required_dst_info_num: int
    decode_prefix_len: int
    is_dummy: bool

    def to_frames(self) -> list[bytes]:
        return encode(MsgType.METADATA, {
            "room": self.room, "endpoint": self.endpoint, "port": self.port,
            "agent_name": self.agent_name,
            "kv_indices": np.ascontiguousarray(self.kv_indices, dtype=np.int32).tobytes(),
            "aux_index": self.aux_index,
            "state_indices": [None if s is None else np.ascontiguousarray(s, dtype=np.int32).tobytes()
                              for s in self.state_indices],
            "required_dst_info_num": self.required_dst_info_num,
            "decode_prefix_len": self.decode_prefix_len, "is_dummy": self.is_dummy,
        })

    @classmethod
    def parse(cls, m: dict) -> Metadata:
        raw_states = _field(m, "state_indices", list)
        states = []
        for i, s in enumerate(raw_states):
            states.append(None if s is None else _int_list({f"state_indices[{i}]": s}, f"state_indices[{i}]"))
        required = _field(m, "required_dst_info_num", int)
        if required < 1:
            raise ValueError(f"field 'required_dst_info_num' is {required}; expected >= 1")
        return cls(
            room=_field(m, "room", int), endpoint=_field(m, "endpoint", str), port=_field(m, "port", int),
            agent_name=_field(m, "agent_name", str), kv_indices=_int_list(m, "kv_indices"),
            aux_index=_field(m, "aux_index", int), state_indices=tuple(states),
            required_dst_info_num=required, decode_prefix_len=_field(m, "decode_prefix_len", int),
            is_dummy=_field(m, "is_dummy", bool),
        )


@dataclass(frozen=True, kw_only=True)
class Drained:
    room: int
    prefill_rank: int

    def to_frames(self) -> list[bytes]:
        return encode(MsgType.DRAINED, {"room": self.room, "prefill_rank": self.prefill_rank})

    @classmethod
    def parse(cls, m: dict) -> Drained:
        return cls(room=_field(m, "room", int), prefill_rank=_field(m, "prefill_rank", int))


@dataclass(frozen=True, kw_only=True)
class Stuck:
    """Sent before the room's KV_STATUS Failed: that status does not mean this rank is quiet."""

    room: int
    prefill_rank: int

    def to_frames(self) -> list[bytes]:
        return encode(MsgType.STUCK, {"room": self.room, "prefill_rank": self.prefill_rank})

    @classmethod
    def parse(cls, m: dict) -> Stuck:
        return cls(room=_field(m, "room", int), prefill_rank=_field(m, "prefill_rank", int))


@dataclass(frozen=True, kw_only=True)
class Landed:
    """Every write of these components of the room completed (NIXL DONE on the writer)."""

    room: int
    prefill_rank: int
    components: tuple[tuple[int, str], ...]  # (group, ComponentKind value)

    def to_frames(self) -> list[bytes]:
        return encode(MsgType.LANDED, {"room": self.room, "prefill_rank": self.prefill_rank,
                                       "components": [list(c) for c in self.components]})

    @classmethod
    def parse(cls, m: dict) -> Landed:
        comps = _field(m, "components", list)
        out = []
        for c in comps:
            if (not isinstance(c, list) or len(c) != 2 or not isinstance(c[0], int) or isinstance(c[0], bool)
                    or not isinstance(c[1], str)):
                raise ValueError(f"field 'components' holds {c!r}; expected [group, kind]")
            out.append((c[0], c[1]))
        return cls(room=_field(m, "room", int), prefill_rank=_field(m, "prefill_rank", int), components=tuple(out))
