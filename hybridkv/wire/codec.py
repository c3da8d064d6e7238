"""Encoding and decoding of control-plane messages: versioned msgpack, no pickle.

:func:`encode` writes ``{"v": version, "k": kind, "b": body}``; :func:`decode`
reads bytes from an untrusted peer and returns a typed message or raises
:class:`~hybridkv.wire.WireError` (see :mod:`hybridkv.wire` for what it
refuses). Nothing here knows a message type: the body's keys, encoding and
validation come from each type's declaration (:mod:`hybridkv.wire.schema`).
"""

from __future__ import annotations

from typing import Any

import msgpack

from hybridkv.wire import messages as _messages  # noqa: F401  (declaring the messages registers them)
from hybridkv.wire.enums import Kind
from hybridkv.wire.fields import Choice, Int, expect_map
from hybridkv.wire.limits import (
    MAX_BLOCKS_PER_GROUP,
    MAX_I32,
    MAX_MESSAGE_BYTES,
    MAX_METADATA_BYTES,
    MAX_REGIONS,
    MAX_TEXT,
    PROTOCOL_VERSION,
    WireError,
)
from hybridkv.wire.schema import SCHEMAS, Message, schema_of

_TOP_KEYS = frozenset({"v", "k", "b"})
_VERSION = Int(lo=0, hi=MAX_I32)
_KIND = Choice(enum=Kind)


def encode(msg: Message) -> bytes:
    """Serialise a message. Round-trips through :func:`decode` (which validates)."""
    schema = schema_of(msg)
    data = msgpack.packb({"v": PROTOCOL_VERSION, "k": int(schema.kind), "b": schema.body(msg)}, use_bin_type=True)
    if len(data) > MAX_MESSAGE_BYTES:
        raise ValueError(f"message of {len(data)} bytes; expected at most {MAX_MESSAGE_BYTES}")
    return data


def _reject_ext(code: int, data: bytes) -> Any:
    raise WireError(f"msgpack extension type {code}; expected none")


def decode(data: bytes) -> Message:
    """Bytes from a peer -> a typed message, or :class:`WireError`."""
    top = unpack(data)
    try:
        return _decode_top(top)
    except WireError:
        raise
    except RecursionError:
        raise WireError("message nests too deeply") from None


def unpack(data: bytes) -> Any:
    """Bytes from a peer -> the msgpack value, within the wire's limits, or :class:`WireError`.
    Also the framing of messages declared outside this package (a connector's own, built
    from the same field codecs and records)."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise WireError(f"data is {type(data).__name__}; expected bytes")
    if len(data) > MAX_MESSAGE_BYTES:
        raise WireError(f"message of {len(data)} bytes; expected at most {MAX_MESSAGE_BYTES}")
    try:
        # The unpacker's own bounds stop a hostile length before anything is allocated for it.
        top = msgpack.unpackb(
            bytes(data), raw=False, use_list=True, strict_map_key=True, ext_hook=_reject_ext,
            max_str_len=MAX_TEXT, max_bin_len=MAX_METADATA_BYTES,
            max_array_len=MAX_BLOCKS_PER_GROUP, max_map_len=MAX_REGIONS, max_ext_len=0,
        )
    except WireError:
        raise
    except Exception as exc:  # msgpack raises many types (ExtraData, StackError, UnicodeDecodeError, ...)
        raise WireError(f"not a msgpack message: {type(exc).__name__}: {exc}") from None
    return top


def _decode_top(top: Any) -> Message:
    t = expect_map(top, "message", _TOP_KEYS)
    version = _VERSION.decode(t["v"], "version")
    if version != PROTOCOL_VERSION:
        raise WireError(f"protocol version {version}; expected {PROTOCOL_VERSION}")
    kind = _KIND.decode(t["k"], "kind")
    return SCHEMAS[kind].from_body(t["b"])


__all__ = ["decode", "encode", "unpack"]
