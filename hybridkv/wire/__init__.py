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

# The protocol is split by what each part holds: limits and enums; field codecs
# (fields) and the declaration machinery (schema); the types, each declared once
# with its wire form (regions, layout_table, messages); the generic framing
# (codec); and checks against a peer (checks). Callers use this package:
# `from hybridkv import wire; wire.Hello`.
from hybridkv.errors import Difference as Difference
from hybridkv.errors import HybridKVError as HybridKVError
from hybridkv.wire.checks import check_blocks, compat_differences, compat_hash
from hybridkv.wire.codec import decode, encode
from hybridkv.wire.enums import FailureCode, Kind, Mem, Mode, Role
from hybridkv.wire.layout_table import FIELD_COLUMNS as FIELD_COLUMNS
from hybridkv.wire.layout_table import GroupTable, LayoutTable, PlacementTable
from hybridkv.wire.limits import MAX_ADDR as MAX_ADDR
from hybridkv.wire.limits import MAX_BLOCKS_PER_GROUP as MAX_BLOCKS_PER_GROUP
from hybridkv.wire.limits import MAX_COMPAT_FIELDS as MAX_COMPAT_FIELDS
from hybridkv.wire.limits import MAX_COMPAT_NAME as MAX_COMPAT_NAME
from hybridkv.wire.limits import MAX_FIELDS as MAX_FIELDS
from hybridkv.wire.limits import MAX_GROUPS as MAX_GROUPS
from hybridkv.wire.limits import MAX_I32 as MAX_I32
from hybridkv.wire.limits import MAX_LEASE_S as MAX_LEASE_S
from hybridkv.wire.limits import MAX_MESSAGE_BYTES as MAX_MESSAGE_BYTES
from hybridkv.wire.limits import MAX_METADATA_BYTES as MAX_METADATA_BYTES
from hybridkv.wire.limits import MAX_NAME as MAX_NAME
from hybridkv.wire.limits import MAX_READERS as MAX_READERS
from hybridkv.wire.limits import MAX_STAGE_MASK as MAX_STAGE_MASK
from hybridkv.wire.limits import MAX_REGIONS as MAX_REGIONS
from hybridkv.wire.limits import MAX_PREAUTH_BYTES as MAX_PREAUTH_BYTES
from hybridkv.wire.limits import MAX_REQUESTS_PER_HEARTBEAT as MAX_REQUESTS_PER_HEARTBEAT
from hybridkv.wire.limits import NONCE_BYTES as NONCE_BYTES
from hybridkv.wire.limits import PROOF_BYTES as PROOF_BYTES
from hybridkv.wire.limits import MAC_BYTES as MAC_BYTES
from hybridkv.wire.limits import TOKEN_BYTES as TOKEN_BYTES
from hybridkv.wire.limits import MAX_TEXT as MAX_TEXT
from hybridkv.wire.limits import PROTOCOL_VERSION, WireError
from hybridkv.wire.messages import Auth, Bye, Done, Export, Failure, Heartbeat, Hello, Import, Lease, Refuse, Ticket, Want
from hybridkv.wire.regions import GroupBlocks, GroupInfo, RegionInfo
from hybridkv.wire.schema import KIND_OF as _KIND_OF
from hybridkv.wire.schema import Message

__all__ = [
    "Auth", "Bye", "Done", "Export", "Failure", "FailureCode", "GroupBlocks", "GroupInfo", "Heartbeat", "Hello",
    "Import", "Kind", "Lease", "Mem", "Message", "Mode", "PROTOCOL_VERSION", "Refuse", "RegionInfo", "Role",
    "GroupTable", "LayoutTable", "PlacementTable", "Ticket", "Want", "WireError", "check_blocks", "compat_differences", "compat_hash", "decode", "encode",
]
