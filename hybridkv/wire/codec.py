"""Encoding and decoding of control-plane messages: versioned msgpack, no pickle.

:func:`encode` writes ``{"v": version, "k": kind, "b": body}``; :func:`decode`
reads bytes from an untrusted peer and returns a typed message or raises
:class:`~hybridkv.wire.WireError` (see :mod:`hybridkv.wire` for what it
refuses). Field validators live in :mod:`hybridkv.wire.validate`.
"""

from __future__ import annotations

from typing import Any

import msgpack
import numpy as np

from hybridkv.errors import Difference
from hybridkv.wire.messages import (
    _KIND_OF,
    MAX_BLOCKS_PER_GROUP,
    MAX_COMPAT_FIELDS,
    MAX_GROUPS,
    MAX_I32,
    MAX_LEASE_S,
    MAX_MESSAGE_BYTES,
    MAX_METADATA_BYTES,
    MAX_NAME,
    MAX_READERS,
    MAX_REGIONS,
    MAX_REQUESTS_PER_HEARTBEAT,
    MAX_TEXT,
    PROTOCOL_VERSION,
    Bye,
    Done,
    Export,
    Failure,
    FailureCode,
    GroupBlocks,
    GroupInfo,
    Heartbeat,
    Hello,
    Import,
    Kind,
    LayoutTable,
    Lease,
    Message,
    Mode,
    Refuse,
    Role,
    Want,
    WireError,
)
from hybridkv.wire.validate import (
    _blocks_in,
    _bytes,
    _enum,
    _fail,
    _float,
    _hash_bytes,
    _int,
    _layout_in,
    _list,
    _map,
    _opt_str,
    _region,
    _str,
)


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


__all__ = ["decode", "encode"]
