"""Control-plane message types, and the limits a message from a peer must respect.

These frozen dataclasses are what :func:`hybridkv.wire.decode` returns and
:func:`hybridkv.wire.encode` takes. The design (framing, strict validation, the
compatibility hash) is in :mod:`hybridkv.wire`, which re-exports everything here.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from hybridkv.errors import Difference, HybridKVError

PROTOCOL_VERSION = 1

MAX_MESSAGE_BYTES = 16 << 20
MAX_METADATA_BYTES = 4 << 20
MAX_NAME = 256
MAX_TEXT = 4096
MAX_COMPAT_FIELDS = 64
MAX_REGIONS = 4096
MAX_GROUPS = 1024
MAX_BLOCKS_PER_GROUP = 1 << 22
MAX_REQUESTS_PER_HEARTBEAT = 65536
MAX_ADDR = (1 << 64) - 1
MAX_I32 = (1 << 31) - 1
MAX_LEASE_S = 86400.0


class WireError(ValueError, HybridKVError):
    """Bytes from a peer that are not a valid message."""


class Kind(enum.IntEnum):
    HELLO = 1
    REFUSE = 2
    EXPORT = 3
    IMPORT = 4
    DONE = 5
    FAILURE = 6
    HEARTBEAT = 7
    LEASE = 8
    BYE = 9
    WANT = 10


class Role(enum.IntEnum):
    PRODUCER = 1  # prefill: owns the blocks to be read / pushes them
    CONSUMER = 2  # decode: pulls them / offers blocks to be written


class Mode(enum.IntEnum):
    PULL = 1  # consumer READs (default)
    PUSH = 2  # producer WRITEs


class Mem(enum.IntEnum):
    DRAM = 1
    VRAM = 2


class FailureCode(enum.IntEnum):
    TRANSFER_ERROR = 1
    LEASE_EXPIRED = 2
    UNKNOWN_REQUEST = 3
    ABORTED = 4
    PROTOCOL = 5
    CLAIMED = 6  # another consumer already reads the request


@dataclass(frozen=True, kw_only=True)
class RegionInfo:
    """A registered region as the peer sees it: page p at base_addr + p*stride."""

    region_id: int
    base_addr: int
    stride: int
    page_bytes: int
    num_pages: int
    mem: Mem
    device_id: int


@dataclass(frozen=True, kw_only=True)
class GroupInfo:
    """Logical block b of the group is page b of each of these regions."""

    group_id: int
    region_ids: tuple[int, ...]


@dataclass(frozen=True, kw_only=True)
class GroupBlocks:
    group_id: int
    ids: tuple[int, ...]


FIELD_COLUMNS = 6  # component code, layer, head, offset, nbytes, token_bytes
MAX_FIELDS = 1 << 20


@dataclass(frozen=True, kw_only=True)
class PlacementTable:
    """The fields inside page b of one region for one group: int64 rows of
    (component code, layer, global head, offset, nbytes, token_bytes), little-endian."""

    region_id: int
    rows: bytes

    def array(self) -> np.ndarray:
        return np.frombuffer(self.rows, dtype="<i8").reshape(-1, FIELD_COLUMNS)


@dataclass(frozen=True, kw_only=True)
class GroupTable:
    group_id: int
    kind: int  # layer-kind code (0: opaque); the codes are the transport's (memory.py)
    block_tokens: int  # 0: a state group (one block holds one state)
    window: int  # 0: no sliding window
    layers: tuple[int, ...]
    placements: tuple[PlacementTable, ...]


@dataclass(frozen=True, kw_only=True)
class LayoutTable:
    """What a peer needs to rebuild the sender's layout field by field (heterogeneous TP,
    different block sizes): its TP shard and every group's field tables."""

    tp: int
    rank: int
    groups: tuple[GroupTable, ...]


@dataclass(frozen=True, kw_only=True)
class Hello:
    agent: str
    metadata: bytes
    role: Role
    mode: Mode
    compat: Mapping[str, str]
    compat_hash: bytes
    regions: tuple[RegionInfo, ...]
    groups: tuple[GroupInfo, ...]
    lease_s: float
    layout: LayoutTable | None = None


@dataclass(frozen=True, kw_only=True)
class Refuse:
    reason: str
    differences: tuple[Difference, ...]


@dataclass(frozen=True, kw_only=True)
class Export:
    """Producer -> consumer (pull): these blocks hold the request; read them within the lease."""

    request_id: str
    blocks: tuple[GroupBlocks, ...]
    lease_s: float


@dataclass(frozen=True, kw_only=True)
class Import:
    """Consumer -> producer (push): write the request into these blocks of mine."""

    request_id: str
    blocks: tuple[GroupBlocks, ...]


@dataclass(frozen=True, kw_only=True)
class Done:
    """The sender is finished with the request's transfer (ok or not)."""

    request_id: str
    ok: bool


@dataclass(frozen=True, kw_only=True)
class Failure:
    request_id: str
    code: FailureCode
    detail: str


@dataclass(frozen=True, kw_only=True)
class Heartbeat:
    """Liveness, and lease renewal for the listed requests."""

    seq: int
    request_ids: tuple[str, ...]


@dataclass(frozen=True, kw_only=True)
class Lease:
    """Reply to a renewal: remaining lease in seconds; 0 means it is gone."""

    request_id: str
    lease_s: float


@dataclass(frozen=True, kw_only=True)
class Bye:
    reason: str


@dataclass(frozen=True, kw_only=True)
class Want:
    """Consumer -> producer: export this request to me. ``readers`` consumers share it
    (decode ranks reading different heads of one producer rank); any other claim is refused."""

    request_id: str
    readers: int = 1


MAX_READERS = 1024

Message = Hello | Refuse | Export | Import | Done | Failure | Heartbeat | Lease | Bye | Want

_KIND_OF: dict[type, Kind] = {
    Hello: Kind.HELLO,
    Refuse: Kind.REFUSE,
    Export: Kind.EXPORT,
    Import: Kind.IMPORT,
    Done: Kind.DONE,
    Failure: Kind.FAILURE,
    Heartbeat: Kind.HEARTBEAT,
    Lease: Kind.LEASE,
    Bye: Kind.BYE,
    Want: Kind.WANT,
}


__all__ = [
    "Bye", "Done", "Export", "Failure", "FailureCode", "GroupBlocks", "GroupInfo", "Heartbeat", "Hello",
    "Import", "Kind", "Lease", "Mem", "Message", "Mode", "PROTOCOL_VERSION", "Refuse", "RegionInfo", "Role",
    "GroupTable", "LayoutTable", "PlacementTable", "Want", "WireError",
]
