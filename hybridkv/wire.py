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

import enum
import hashlib
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import msgpack
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


# ---------------------------------------------------------------- encoding
def _blocks_out(blocks: tuple[GroupBlocks, ...]) -> list:
    return [[g.group_id, np.asarray(g.ids, dtype="<i4").tobytes()] for g in blocks]


def _layout_out(t: LayoutTable) -> list:
    return [t.tp, t.rank, [[g.group_id, g.kind, g.block_tokens, g.window,
                            np.asarray(g.layers, dtype="<i4").tobytes(),
                            [[p.region_id, bytes(p.rows)] for p in g.placements]] for g in t.groups]]


def _body(msg: Message) -> dict[str, Any]:
    if isinstance(msg, Hello):
        return {
            "agent": msg.agent,
            "metadata": bytes(msg.metadata),
            "role": int(msg.role),
            "mode": int(msg.mode),
            "compat": dict(msg.compat),
            "hash": bytes(msg.compat_hash),
            "regions": [
                [r.region_id, r.base_addr, r.stride, r.page_bytes, r.num_pages, int(r.mem), r.device_id]
                for r in msg.regions
            ],
            "groups": [[g.group_id, list(g.region_ids)] for g in msg.groups],
            "lease_s": float(msg.lease_s),
            "layout": None if msg.layout is None else _layout_out(msg.layout),
        }
    if isinstance(msg, Refuse):
        return {"reason": msg.reason, "diffs": [[d.field, d.local, d.remote] for d in msg.differences]}
    if isinstance(msg, Export):
        return {"rid": msg.request_id, "blocks": _blocks_out(msg.blocks), "lease_s": float(msg.lease_s)}
    if isinstance(msg, Import):
        return {"rid": msg.request_id, "blocks": _blocks_out(msg.blocks)}
    if isinstance(msg, Done):
        return {"rid": msg.request_id, "ok": bool(msg.ok)}
    if isinstance(msg, Failure):
        return {"rid": msg.request_id, "code": int(msg.code), "detail": msg.detail}
    if isinstance(msg, Heartbeat):
        return {"seq": msg.seq, "rids": list(msg.request_ids)}
    if isinstance(msg, Lease):
        return {"rid": msg.request_id, "lease_s": float(msg.lease_s)}
    if isinstance(msg, Bye):
        return {"reason": msg.reason}
    if isinstance(msg, Want):
        return {"rid": msg.request_id, "readers": int(msg.readers)}
    raise ValueError(f"message {msg!r}; expected one of {[t.__name__ for t in _KIND_OF]}")


def encode(msg: Message) -> bytes:
    """Serialise a message. Round-trips through :func:`decode` (which validates)."""
    data = msgpack.packb({"v": PROTOCOL_VERSION, "k": int(_KIND_OF[type(msg)]), "b": _body(msg)},
                         use_bin_type=True)
    if len(data) > MAX_MESSAGE_BYTES:
        raise ValueError(f"message of {len(data)} bytes; expected at most {MAX_MESSAGE_BYTES}")
    return data


# ---------------------------------------------------------------- decoding
def _fail(what: str) -> WireError:
    return WireError(what)


def _map(v: Any, name: str, keys: frozenset[str]) -> dict:
    if not isinstance(v, dict):
        raise _fail(f"{name} is {type(v).__name__}; expected a map")
    got = frozenset(v)
    if got != keys:
        raise _fail(f"{name} has keys {sorted(map(str, got))}; expected {sorted(keys)}")
    return v


def _int(v: Any, name: str, lo: int, hi: int) -> int:
    if type(v) is not int:
        raise _fail(f"{name} is {type(v).__name__}; expected an int")
    if not lo <= v <= hi:
        raise _fail(f"{name} = {v}; expected {lo}..{hi}")
    return v


def _float(v: Any, name: str, lo: float, hi: float) -> float:
    if type(v) not in (int, float):
        raise _fail(f"{name} is {type(v).__name__}; expected a number")
    f = float(v)
    if not math.isfinite(f) or not lo <= f <= hi:
        raise _fail(f"{name} = {v!r}; expected a finite number in {lo}..{hi}")
    return f


def _str(v: Any, name: str, limit: int, *, empty: bool = False) -> str:
    if type(v) is not str:
        raise _fail(f"{name} is {type(v).__name__}; expected a string")
    if len(v) > limit or (not empty and not v):
        raise _fail(f"{name} has length {len(v)}; expected {0 if empty else 1}..{limit}")
    return v


def _bytes(v: Any, name: str, limit: int) -> bytes:
    if type(v) is not bytes:
        raise _fail(f"{name} is {type(v).__name__}; expected bytes")
    if len(v) > limit:
        raise _fail(f"{name} has {len(v)} bytes; expected at most {limit}")
    return v


def _list(v: Any, name: str, limit: int) -> list:
    if type(v) is not list:
        raise _fail(f"{name} is {type(v).__name__}; expected an array")
    if len(v) > limit:
        raise _fail(f"{name} has {len(v)} entries; expected at most {limit}")
    return v


def _enum(v: Any, name: str, cls: type[enum.IntEnum]):
    i = _int(v, name, 0, MAX_I32)
    try:
        return cls(i)
    except ValueError:
        raise _fail(f"{name} = {i}; expected one of {[int(m) for m in cls]}") from None


def _blocks_in(v: Any, name: str) -> tuple[GroupBlocks, ...]:
    out = []
    seen: set[int] = set()
    for i, entry in enumerate(_list(v, name, MAX_GROUPS)):
        e = _list(entry, f"{name}[{i}]", 2)
        if len(e) != 2:
            raise _fail(f"{name}[{i}] has {len(e)} entries; expected [group, ids]")
        group = _int(e[0], f"{name}[{i}].group", 0, MAX_GROUPS - 1)
        if group in seen:
            raise _fail(f"{name} lists group {group} twice; expected each group once")
        seen.add(group)
        raw = _bytes(e[1], f"{name}[{i}].ids", 4 * MAX_BLOCKS_PER_GROUP)
        if len(raw) % 4:
            raise _fail(f"{name}[{i}].ids has {len(raw)} bytes; expected a multiple of 4 (int32)")
        ids = np.frombuffer(raw, dtype="<i4")
        if ids.size and int(ids.min()) < 0:
            raise _fail(f"{name}[{i}].ids has negative id {int(ids.min())}; expected ids >= 0")
        if np.unique(ids).size != ids.size:
            raise _fail(f"{name}[{i}].ids repeats a block id; expected distinct ids")
        out.append(GroupBlocks(group_id=group, ids=tuple(ids.tolist())))
    return tuple(out)


def _region(v: Any, name: str) -> RegionInfo:
    e = _list(v, name, 7)
    if len(e) != 7:
        raise _fail(f"{name} has {len(e)} entries; expected 7")
    r = RegionInfo(
        region_id=_int(e[0], f"{name}.region_id", 0, MAX_REGIONS - 1),
        base_addr=_int(e[1], f"{name}.base_addr", 1, MAX_ADDR),
        stride=_int(e[2], f"{name}.stride", 1, MAX_ADDR),
        page_bytes=_int(e[3], f"{name}.page_bytes", 1, MAX_ADDR),
        num_pages=_int(e[4], f"{name}.num_pages", 1, MAX_I32),
        mem=_enum(e[5], f"{name}.mem", Mem),
        device_id=_int(e[6], f"{name}.device_id", 0, 1 << 16),
    )
    if r.num_pages > 1 and r.stride < r.page_bytes:
        raise _fail(f"{name}: stride {r.stride} < page_bytes {r.page_bytes}; expected pages not to overlap")
    if r.base_addr + r.stride * (r.num_pages - 1) + r.page_bytes - 1 > MAX_ADDR:
        raise _fail(f"{name} ends past the 64-bit address space")
    return r


def _hello(b: dict) -> Hello:
    compat_raw = b["compat"]
    if not isinstance(compat_raw, dict) or len(compat_raw) > MAX_COMPAT_FIELDS:
        raise _fail(f"hello.compat; expected a map of at most {MAX_COMPAT_FIELDS} string fields")
    compat = {_str(k, "hello.compat key", 64): _str(v, f"hello.compat[{k!r}]", MAX_NAME, empty=True)
              for k, v in compat_raw.items()}
    regions = tuple(_region(r, f"hello.regions[{i}]") for i, r in enumerate(_list(b["regions"], "hello.regions",
                                                                                    MAX_REGIONS)))
    rids = [r.region_id for r in regions]
    if len(set(rids)) != len(rids):
        raise _fail(f"hello.regions repeat a region id {rids}; expected distinct ids")
    groups = []
    for i, g in enumerate(_list(b["groups"], "hello.groups", MAX_GROUPS)):
        e = _list(g, f"hello.groups[{i}]", 2)
        if len(e) != 2:
            raise _fail(f"hello.groups[{i}] has {len(e)} entries; expected [group, regions]")
        members = tuple(_int(x, f"hello.groups[{i}].region", 0, MAX_REGIONS - 1)
                        for x in _list(e[1], f"hello.groups[{i}].regions", MAX_REGIONS))
        unknown = sorted(set(members) - set(rids))
        if unknown:
            raise _fail(f"hello.groups[{i}] names regions {unknown} that the hello does not list")
        groups.append(GroupInfo(group_id=_int(e[0], f"hello.groups[{i}].group", 0, MAX_GROUPS - 1),
                                region_ids=members))
    gids = [g.group_id for g in groups]
    if len(set(gids)) != len(gids):
        raise _fail(f"hello.groups repeat a group id {gids}; expected distinct ids")
    layout = None if b["layout"] is None else _layout_in(b["layout"], {r.region_id: r for r in regions},
                                                               {g.group_id for g in groups})
    return Hello(
        layout=layout,
        agent=_str(b["agent"], "hello.agent", MAX_NAME),
        metadata=_bytes(b["metadata"], "hello.metadata", MAX_METADATA_BYTES),
        role=_enum(b["role"], "hello.role", Role),
        mode=_enum(b["mode"], "hello.mode", Mode),
        compat=compat,
        compat_hash=_hash_bytes(b["hash"]),
        regions=regions,
        groups=tuple(groups),
        lease_s=_float(b["lease_s"], "hello.lease_s", 0.0, MAX_LEASE_S),
    )


def _layout_in(v: Any, regions: Mapping[int, RegionInfo], group_ids: set[int]) -> LayoutTable:
    e = _list(v, "hello.layout", 3)
    if len(e) != 3:
        raise _fail(f"hello.layout has {len(e)} entries; expected [tp, rank, groups]")
    tp = _int(e[0], "hello.layout.tp", 1, 1 << 16)
    rank = _int(e[1], "hello.layout.rank", 0, tp - 1)
    groups, seen = [], set()
    total = 0
    for i, g in enumerate(_list(e[2], "hello.layout.groups", MAX_GROUPS)):
        name = f"hello.layout.groups[{i}]"
        ge = _list(g, name, 6)
        if len(ge) != 6:
            raise _fail(f"{name} has {len(ge)} entries; expected [group, kind, block_tokens, window, layers, placements]")
        gid = _int(ge[0], f"{name}.group", 0, MAX_GROUPS - 1)
        if gid in seen or gid not in group_ids:
            raise _fail(f"{name}.group = {gid}; expected a distinct group the hello lists ({sorted(group_ids)})")
        seen.add(gid)
        raw = _bytes(ge[4], f"{name}.layers", 4 * 65536)
        if len(raw) % 4:
            raise _fail(f"{name}.layers has {len(raw)} bytes; expected int32s")
        layers = np.frombuffer(raw, dtype="<i4")
        if layers.size and int(layers.min()) < 0:
            raise _fail(f"{name}.layers has a negative layer; expected layer indices >= 0")
        placements = []
        for j, p in enumerate(_list(ge[5], f"{name}.placements", MAX_REGIONS)):
            pe = _list(p, f"{name}.placements[{j}]", 2)
            if len(pe) != 2:
                raise _fail(f"{name}.placements[{j}] has {len(pe)} entries; expected [region, fields]")
            rid = _int(pe[0], f"{name}.placements[{j}].region", 0, MAX_REGIONS - 1)
            if rid not in regions:
                raise _fail(f"{name}.placements[{j}] names region {rid} that the hello does not list")
            rows = _bytes(pe[1], f"{name}.placements[{j}].fields", 8 * FIELD_COLUMNS * MAX_FIELDS)
            if len(rows) % (8 * FIELD_COLUMNS):
                raise _fail(f"{name}.placements[{j}].fields has {len(rows)} bytes; expected rows of "
                            f"{FIELD_COLUMNS} int64")
            total += len(rows) // (8 * FIELD_COLUMNS)
            if total > MAX_FIELDS:
                raise _fail(f"hello.layout has more than {MAX_FIELDS} fields")
            a = np.frombuffer(rows, dtype="<i8").reshape(-1, FIELD_COLUMNS)
            if a.size:
                if int(a.min()) < 0:
                    raise _fail(f"{name}.placements[{j}].fields has a negative entry; expected all >= 0")
                if int(a[:, 4].min()) <= 0:
                    raise _fail(f"{name}.placements[{j}].fields has an empty field; expected nbytes > 0")
                end = int((a[:, 3] + a[:, 4]).max())
                if end > regions[rid].page_bytes:
                    raise _fail(f"{name}.placements[{j}].fields end at byte {end}, past the page "
                                f"({regions[rid].page_bytes} bytes) of region {rid}")
                tb = a[:, 5]
                if ((tb > 0) & (a[:, 4] % np.maximum(tb, 1) != 0)).any():
                    raise _fail(f"{name}.placements[{j}].fields: nbytes not a multiple of token_bytes")
            placements.append(PlacementTable(region_id=rid, rows=rows))
        groups.append(GroupTable(
            group_id=gid, kind=_int(ge[1], f"{name}.kind", 0, 255),
            block_tokens=_int(ge[2], f"{name}.block_tokens", 0, MAX_I32),
            window=_int(ge[3], f"{name}.window", 0, MAX_I32),
            layers=tuple(layers.tolist()), placements=tuple(placements)))
    return LayoutTable(tp=tp, rank=rank, groups=tuple(groups))


def _hash_bytes(v: Any) -> bytes:
    h = _bytes(v, "hello.hash", 32)
    if len(h) != 32:
        raise _fail(f"hello.hash has {len(h)} bytes; expected 32 (sha256)")
    return h


def _opt_str(v: Any, name: str) -> str | None:
    return None if v is None else _str(v, name, MAX_NAME, empty=True)


_KEYS = {
    Kind.HELLO: frozenset({"agent", "metadata", "role", "mode", "compat", "hash", "regions", "groups", "lease_s",
                           "layout"}),
    Kind.REFUSE: frozenset({"reason", "diffs"}),
    Kind.EXPORT: frozenset({"rid", "blocks", "lease_s"}),
    Kind.IMPORT: frozenset({"rid", "blocks"}),
    Kind.DONE: frozenset({"rid", "ok"}),
    Kind.FAILURE: frozenset({"rid", "code", "detail"}),
    Kind.HEARTBEAT: frozenset({"seq", "rids"}),
    Kind.LEASE: frozenset({"rid", "lease_s"}),
    Kind.BYE: frozenset({"reason"}),
    Kind.WANT: frozenset({"rid", "readers"}),
}


def _diff(v: Any, i: int) -> Difference:
    e = _list(v, f"refuse.diffs[{i}]", 3)
    if len(e) != 3:
        raise _fail(f"refuse.diffs[{i}] has {len(e)} entries; expected [field, local, remote]")
    return Difference(field=_str(e[0], f"refuse.diffs[{i}].field", 64),
                      local=_opt_str(e[1], f"refuse.diffs[{i}].local"),
                      remote=_opt_str(e[2], f"refuse.diffs[{i}].remote"))


def _rid(v: Any) -> str:
    return _str(v, "request id", MAX_NAME)


def _reject_ext(code: int, data: bytes) -> Any:
    raise WireError(f"msgpack extension type {code}; expected none")


def decode(data: bytes) -> Message:
    """Bytes from a peer -> a typed message, or :class:`WireError`."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise WireError(f"data is {type(data).__name__}; expected bytes")
    if len(data) > MAX_MESSAGE_BYTES:
        raise WireError(f"message of {len(data)} bytes; expected at most {MAX_MESSAGE_BYTES}")
    try:
        top = msgpack.unpackb(
            bytes(data), raw=False, use_list=True, strict_map_key=True, ext_hook=_reject_ext,
            max_str_len=MAX_TEXT, max_bin_len=MAX_METADATA_BYTES,
            max_array_len=MAX_BLOCKS_PER_GROUP, max_map_len=MAX_REGIONS, max_ext_len=0,
        )
    except WireError:
        raise
    except Exception as exc:  # msgpack raises many types (ExtraData, StackError, UnicodeDecodeError, ...)
        raise WireError(f"not a msgpack message: {type(exc).__name__}: {exc}") from None
    try:
        return _decode_top(top)
    except WireError:
        raise
    except RecursionError:
        raise WireError("message nests too deeply") from None


def _decode_top(top: Any) -> Message:
    t = _map(top, "message", frozenset({"v", "k", "b"}))
    version = _int(t["v"], "version", 0, MAX_I32)
    if version != PROTOCOL_VERSION:
        raise WireError(f"protocol version {version}; expected {PROTOCOL_VERSION}")
    kind = _enum(t["k"], "kind", Kind)
    b = _map(t["b"], f"{kind.name.lower()} body", _KEYS[kind])
    if kind is Kind.HELLO:
        return _hello(b)
    if kind is Kind.REFUSE:
        return Refuse(reason=_str(b["reason"], "refuse.reason", MAX_TEXT),
                      differences=tuple(_diff(d, i) for i, d in enumerate(_list(b["diffs"], "refuse.diffs",
                                                                                 MAX_COMPAT_FIELDS))))
    if kind is Kind.EXPORT:
        return Export(request_id=_rid(b["rid"]), blocks=_blocks_in(b["blocks"], "export.blocks"),
                      lease_s=_float(b["lease_s"], "export.lease_s", 0.0, MAX_LEASE_S))
    if kind is Kind.IMPORT:
        return Import(request_id=_rid(b["rid"]), blocks=_blocks_in(b["blocks"], "import.blocks"))
    if kind is Kind.DONE:
        if type(b["ok"]) is not bool:
            raise WireError(f"done.ok is {type(b['ok']).__name__}; expected a bool")
        return Done(request_id=_rid(b["rid"]), ok=b["ok"])
    if kind is Kind.FAILURE:
        return Failure(request_id=_rid(b["rid"]), code=_enum(b["code"], "failure.code", FailureCode),
                       detail=_str(b["detail"], "failure.detail", MAX_TEXT, empty=True))
    if kind is Kind.HEARTBEAT:
        return Heartbeat(seq=_int(b["seq"], "heartbeat.seq", 0, (1 << 63) - 1),
                         request_ids=tuple(_rid(r) for r in _list(b["rids"], "heartbeat.rids",
                                                                   MAX_REQUESTS_PER_HEARTBEAT)))
    if kind is Kind.LEASE:
        return Lease(request_id=_rid(b["rid"]), lease_s=_float(b["lease_s"], "lease.lease_s", 0.0, MAX_LEASE_S))
    if kind is Kind.WANT:
        return Want(request_id=_rid(b["rid"]), readers=_int(b["readers"], "want.readers", 1, MAX_READERS))
    return Bye(reason=_str(b["reason"], "bye.reason", MAX_TEXT, empty=True))


# ---------------------------------------------------------------- checks against what a peer has
def check_blocks(blocks: tuple[GroupBlocks, ...], allowed: Mapping[int, Any], *, what: str) -> None:
    """Every id must be in ``allowed[group]`` (a set, or an int bound: ids < bound).

    Raises :class:`WireError` naming the first offending group and ids, so a peer
    can touch only what it was given.
    """
    for g in blocks:
        if g.group_id not in allowed:
            raise WireError(f"{what}: group {g.group_id} was not given; expected one of {sorted(allowed)}")
        ok = allowed[g.group_id]
        if isinstance(ok, int):
            bad = [b for b in g.ids if b >= ok]
            bound = f"ids < {ok}"
        else:
            bad = [b for b in g.ids if b not in ok]
            bound = "ids it was given"
        if bad:
            raise WireError(f"{what}: group {g.group_id} block ids {bad[:8]} are out of bounds; expected {bound}")


# ---------------------------------------------------------------- compatibility
def compat_hash(fields: Mapping[str, str]) -> bytes:
    """sha256 over the canonical (sorted) fields, which include the protocol version."""
    canon = msgpack.packb(sorted(fields.items()), use_bin_type=True)
    return hashlib.sha256(canon).digest()


def compat_differences(local: Mapping[str, str], remote: Mapping[str, str]) -> tuple[Difference, ...]:
    keys = sorted(set(local) | set(remote))
    return tuple(Difference(field=k, local=local.get(k), remote=remote.get(k))
                 for k in keys if local.get(k) != remote.get(k))


__all__ = [
    "Bye", "Done", "Export", "Failure", "FailureCode", "GroupBlocks", "GroupInfo", "Heartbeat", "Hello",
    "Import", "Kind", "Lease", "Mem", "Message", "Mode", "PROTOCOL_VERSION", "Refuse", "RegionInfo", "Role",
    "GroupTable", "LayoutTable", "PlacementTable", "Want", "WireError", "check_blocks", "compat_differences", "compat_hash", "decode", "encode",
]
