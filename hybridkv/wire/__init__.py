"""Control-plane messages: versioned msgpack, strictly validated, no pickle.

Every message is a msgpack map ``{"v": version, "k": kind, "b": body}``; the
body's keys are exactly those of the kind. :func:`decode` accepts bytes from
an untrusted peer and either returns a typed, frozen message or raises
:class:`WireError` (a ``ValueError``): not msgpack, trailing bytes, wrong
shape or types, unknown version or kind, oversized lengths, hostile nesting,
negative or out-of-range numbers. Block ids travel as little-endian int32
arrays (compact and validated in one vectorised pass); whether a peer may
touch them is checked against what was exported (:func:`check_blocks`).

The compatibility hash covers everything both sides must agree on
(:func:`compat_hash`); :func:`compat_differences` names what differs so a
refusal says why.
"""

from __future__ import annotations

# The protocol is split by what each part holds: message types and limits
# (wire_messages), encoding and decoding (wire_codec, over the field validators
# of wire_validate), and checks against a peer (wire_checks). Callers use this
# module: `from hybridkv import wire; wire.Hello`.
from hybridkv.errors import Difference as Difference
from hybridkv.errors import HybridKVError as HybridKVError
from hybridkv.wire.checks import check_blocks, compat_differences, compat_hash
from hybridkv.wire.codec import decode, encode
from hybridkv.wire.messages import _KIND_OF as _KIND_OF
from hybridkv.wire.messages import FIELD_COLUMNS as FIELD_COLUMNS
from hybridkv.wire.messages import MAX_ADDR as MAX_ADDR
from hybridkv.wire.messages import MAX_BLOCKS_PER_GROUP as MAX_BLOCKS_PER_GROUP
from hybridkv.wire.messages import MAX_COMPAT_FIELDS as MAX_COMPAT_FIELDS
from hybridkv.wire.messages import MAX_FIELDS as MAX_FIELDS
from hybridkv.wire.messages import MAX_GROUPS as MAX_GROUPS
from hybridkv.wire.messages import MAX_I32 as MAX_I32
from hybridkv.wire.messages import MAX_LEASE_S as MAX_LEASE_S
from hybridkv.wire.messages import MAX_MESSAGE_BYTES as MAX_MESSAGE_BYTES
from hybridkv.wire.messages import MAX_METADATA_BYTES as MAX_METADATA_BYTES
from hybridkv.wire.messages import MAX_NAME as MAX_NAME
from hybridkv.wire.messages import MAX_READERS as MAX_READERS
from hybridkv.wire.messages import MAX_REGIONS as MAX_REGIONS
from hybridkv.wire.messages import MAX_REQUESTS_PER_HEARTBEAT as MAX_REQUESTS_PER_HEARTBEAT
from hybridkv.wire.messages import MAX_TEXT as MAX_TEXT
from hybridkv.wire.messages import (
    PROTOCOL_VERSION,
    Bye,
    Done,
    Export,
    Failure,
    FailureCode,
    GroupBlocks,
    GroupInfo,
    GroupTable,
    Heartbeat,
    Hello,
    Import,
    Kind,
    LayoutTable,
    Lease,
    Mem,
    Message,
    Mode,
    PlacementTable,
    Refuse,
    RegionInfo,
    Role,
    Want,
    WireError,
)

__all__ = [
    "Bye", "Done", "Export", "Failure", "FailureCode", "GroupBlocks", "GroupInfo", "Heartbeat", "Hello",
    "Import", "Kind", "Lease", "Mem", "Message", "Mode", "PROTOCOL_VERSION", "Refuse", "RegionInfo", "Role",
    "GroupTable", "LayoutTable", "PlacementTable", "Want", "WireError", "check_blocks", "compat_differences", "compat_hash", "decode", "encode",
]
