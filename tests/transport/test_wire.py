"""wire.decode: round trips, every kind of malformed input, hypothesis fuzzing."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridkv import wire
from hybridkv.errors import Difference
from hybridkv.wire import WireError


def _hello(**over):
    fields = {"protocol": "1", "geometry": "abc", "mode": "PULL"}
    kw = dict(
        agent="prefill-0", metadata=b"\x00" * 100, role=wire.Role.PRODUCER, mode=wire.Mode.PULL,
        compat=fields, compat_hash=wire.compat_hash(fields),
        regions=(wire.RegionInfo(region_id=0, base_addr=4096, stride=64, page_bytes=64, num_pages=10,
                                 mem=wire.Mem.DRAM, device_id=0),),
        groups=(wire.GroupInfo(group_id=0, region_ids=(0,)),), lease_s=30.0,
    )
    kw.update(over)
    return wire.Hello(**kw)


def _layout(rows=((1, 3, 0, 0, 32, 4), (1, 3, 1, 32, 32, 4))):
    table = np.array(rows, dtype="<i8").reshape(-1, wire.FIELD_COLUMNS).tobytes()
    return wire.LayoutTable(tp=2, rank=1, groups=(wire.GroupTable(
        group_id=0, kind=1, block_tokens=8, window=0, layers=(3,),
        placements=(wire.PlacementTable(region_id=0, rows=table),)),))


TOKEN = bytes(range(16))

SAMPLES = [
    _hello(),
    _hello(layout=_layout()),
    wire.Auth(nonce=bytes(32), proof=b""),
    wire.Auth(nonce=b"", proof=b"\x01" * 32),
    wire.Want(request_id="r1", token=TOKEN, readers=2),
    wire.Want(request_id="r1", token=TOKEN, stage=True, fields=b"\xff\x0f"),
    wire.Refuse(reason="incompatible", differences=(Difference(field="dtype", local="bf16", remote=None),)),
    wire.Export(request_id="r1", blocks=(wire.GroupBlocks(group_id=0, ids=(3, 1, 2)),
                                         wire.GroupBlocks(group_id=1, ids=(7,))), lease_s=12.5),
    wire.Import(request_id="r1", blocks=(wire.GroupBlocks(group_id=0, ids=()),)),
    wire.Done(request_id="r1", ok=True, token=TOKEN),
    wire.Failure(request_id="r1", code=wire.FailureCode.LEASE_EXPIRED, detail="late", token=TOKEN),
    wire.Heartbeat(seq=5, tickets=(wire.Ticket(request_id="a", token=TOKEN), wire.Ticket(request_id="b", token=TOKEN))),
    wire.Lease(request_id="r1", lease_s=0.0),
    wire.Bye(reason=""),
]


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda m: type(m).__name__)
def test_round_trip(msg):
    assert wire.decode(wire.encode(msg)) == msg


def test_every_kind_has_one_message_type():
    assert sorted(wire._KIND_OF.values()) == sorted(wire.Kind)
    assert {wire._KIND_OF[type(m)] for m in SAMPLES} == set(wire.Kind)


def test_a_kind_cannot_be_declared_twice():
    from dataclasses import dataclass

    from hybridkv.wire.fields import Flag
    from hybridkv.wire.schema import Message, message, on_wire

    @dataclass(frozen=True, kw_only=True)
    class Other(Message):
        ok: bool = on_wire("ok", Flag())

    with pytest.raises(TypeError, match="declared twice"):
        message(wire.Kind.DONE)(Other)
    assert type(wire.decode(wire.encode(wire.Done(request_id="r", ok=True)))) is wire.Done


# The exact bytes of a few messages, as the protocol has sent them since version 2: a peer
# built from another commit must read them, so any change here is a protocol change. Version 2
# (from 1): "v" is 2, Done/Failure/Want carry the request's capability token (appended last),
# Heartbeat carries (id, token) tickets, and Auth (kind 11) comes before any Hello. Version 5: "v" is 5 and
# Want carries the field mask to stage ("fields", appended last; empty: every field).
_PINNED_HELLO = wire.Hello(
    agent="p0", metadata=b"m", role=wire.Role.PRODUCER, mode=wire.Mode.PUSH, compat={"protocol": "1"},
    compat_hash=bytes(range(32)),
    regions=(wire.RegionInfo(region_id=0, base_addr=4096, stride=64, page_bytes=64, num_pages=2, mem=wire.Mem.VRAM,
                             device_id=1),),
    groups=(wire.GroupInfo(group_id=0, region_ids=(0,)),), lease_s=30.0,
    layout=wire.LayoutTable(tp=2, rank=1, groups=(wire.GroupTable(
        group_id=0, kind=1, block_tokens=8, window=0, layers=(3,),
        placements=(wire.PlacementTable(region_id=0, rows=np.array([(1, 3, 0, 0, 32, 4)], "<i8").tobytes()),)),)))
PINNED = [
    (wire.Done(request_id="r1", ok=True, token=TOKEN),
     "83a17605a16b05a16283a3726964a27231a26f6bc3a5746f6b656ec410000102030405060708090a0b0c0d0e0f"),
    (wire.Export(request_id="r1", blocks=(wire.GroupBlocks(group_id=0, ids=(3, 1, 2)),
                                          wire.GroupBlocks(group_id=1, ids=(7,))), lease_s=12.5),
     "83a17605a16b03a16284a3726964a27231a6626c6f636b73929200c40c0300000001000000020000009201c40407000000a76c6561"
     "73655f73cb4029000000000000a5737461676590"),
    (wire.Refuse(reason="incompatible", differences=(Difference(field="dtype", local="bf16", remote=None),)),
     "83a17605a16b02a16282a6726561736f6eac696e636f6d70617469626c65a564696666739193a56474797065a462663136c0"),
    (wire.Failure(request_id="r1", code=wire.FailureCode.CLAIMED, detail="taken", token=TOKEN),
     "83a17605a16b06a16284a3726964a27231a4636f646506a664657461696ca574616b656ea5746f6b656ec410000102030405060708"
     "090a0b0c0d0e0f"),
    (wire.Want(request_id="r1", token=TOKEN, readers=2),
     "83a17605a16b0aa16285a3726964a27231a5746f6b656ec410000102030405060708090a0b0c0d0e0fa77265616465727302"
     "a57374616765c2a66669656c6473c400"),
    (wire.Heartbeat(seq=5, tickets=(wire.Ticket(request_id="a", token=TOKEN),)),
     "83a17605a16b07a16282a373657105a77469636b6574739192a161c410000102030405060708090a0b0c0d0e0f"),
    (wire.Auth(nonce=bytes(range(32)), proof=b"", address="127.0.0.1:5", agent="a"),
     "83a17605a16b0ba16284a56e6f6e6365c420000102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1fa57072"
     "6f6f66c400a461646472ab3132372e302e302e313a35a56167656e74a161"),
    (_PINNED_HELLO,
     "83a17605a16b01a1628aa56167656e74a27030a86d65746164617461c4016da4726f6c6501a46d6f646502a6636f6d70617481a870"
     "726f746f636f6ca131a468617368c420000102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1fa7726567"
     "696f6e73919700cd10004040020201a667726f7570739192009100a76c656173655f73cb403e000000000000a66c61796f757493"
     "0201919600010800c40403000000919200c4300100000000000000030000000000000000000000000000000000000000000000"
     "20000000000000000400000000000000"),
]


@pytest.mark.parametrize("msg,hex_", PINNED, ids=[type(m).__name__ for m, _ in PINNED])
def test_encoding_is_pinned(msg, hex_):
    assert wire.encode(msg).hex() == hex_
    assert wire.decode(bytes.fromhex(hex_)) == msg


def _raw(kind, body, v=wire.PROTOCOL_VERSION):
    return msgpack.packb({"v": v, "k": int(kind), "b": body}, use_bin_type=True)


def _body(msg):
    return msgpack.unpackb(wire.encode(msg), raw=False)["b"]


BAD = {
    "not msgpack": b"\xc1\xc1\xc1",
    "truncated": wire.encode(SAMPLES[2])[:-3],
    "trailing bytes": wire.encode(SAMPLES[4]) + b"\x00",
    "not a map": msgpack.packb([1, 2, 3]),
    "extra top key": msgpack.packb({"v": 1, "k": 5, "b": {"rid": "r", "ok": True}, "x": 1}),
    "unknown version": _raw(wire.Kind.DONE, {"rid": "r", "ok": True}, v=1),
    "unknown kind": _raw(99, {}),
    "bool kind": msgpack.packb({"v": 1, "k": True, "b": {}}),
    "missing key": _raw(wire.Kind.DONE, {"rid": "r"}),
    "wrong type": _raw(wire.Kind.DONE, {"rid": "r", "ok": 1, "token": TOKEN}),
    "empty rid": _raw(wire.Kind.DONE, {"rid": "", "ok": True, "token": TOKEN}),
    "oversized rid": _raw(wire.Kind.DONE, {"rid": "x" * 1000, "ok": True, "token": TOKEN}),
    "negative block id": _raw(wire.Kind.IMPORT, {"rid": "r", "blocks": [[0, np.array([-1], "<i4").tobytes()]]}),
    "ragged block ids": _raw(wire.Kind.IMPORT, {"rid": "r", "blocks": [[0, b"\x00\x00\x00"]]}),
    "repeated block id": _raw(wire.Kind.IMPORT, {"rid": "r", "blocks": [[0, np.array([1, 1], "<i4").tobytes()]]}),
    "repeated group": _raw(wire.Kind.IMPORT, {"rid": "r", "blocks": [[0, b""], [0, b""]]}),
    "negative lease": _raw(wire.Kind.LEASE, {"rid": "r", "lease_s": -1.0}),
    "nan lease": _raw(wire.Kind.LEASE, {"rid": "r", "lease_s": float("nan")}),
    "huge seq": _raw(wire.Kind.HEARTBEAT, {"seq": 1 << 64 - 1, "tickets": []}),
    "hostile nesting": b"\x91" * 100_000 + b"\xc0",
    "ext type": msgpack.packb(msgpack.ExtType(5, b"xx")),
    "bad utf8": b"\x81\xa1v\xa2\xff\xfe",
    "unknown mem": _raw(wire.Kind.HELLO, {**_body(_hello()), "regions": [[0, 4096, 64, 64, 10, 7, 0]]}),
    "overlapping pages": _raw(wire.Kind.HELLO, {**_body(_hello()), "regions": [[0, 4096, 32, 64, 10, 1, 0]]}),
    "zero pages": _raw(wire.Kind.HELLO, {**_body(_hello()), "regions": [[0, 4096, 64, 64, 0, 1, 0]]}),
    "region past 2^64": _raw(wire.Kind.HELLO, {**_body(_hello()), "regions": [[0, (1 << 64) - 64, 64, 64, 10, 1, 0]]}),
    "group names unknown region": _raw(wire.Kind.HELLO, {**_body(_hello()), "groups": [[0, [3]]]}),
    "short hash": _raw(wire.Kind.HELLO, {**_body(_hello()), "hash": b"abc"}),
    "want no readers": _raw(wire.Kind.WANT, {"rid": "r", "token": TOKEN, "readers": 0}),
    "want huge readers": _raw(wire.Kind.WANT, {"rid": "r", "token": TOKEN, "readers": wire.MAX_READERS + 1}),
    "want without token": _raw(wire.Kind.WANT, {"rid": "r", "readers": 1}),
    "want empty token": _raw(wire.Kind.WANT, {"rid": "r", "token": b"", "readers": 1}),
    "want short token": _raw(wire.Kind.WANT, {"rid": "r", "token": TOKEN[:15], "readers": 1}),
    "done long token": _raw(wire.Kind.DONE, {"rid": "r", "ok": True, "token": TOKEN + b"x"}),
    "heartbeat ticket without token": _raw(wire.Kind.HEARTBEAT, {"seq": 1, "tickets": [["a"]]}),
    "heartbeat too many tickets": _raw(wire.Kind.HEARTBEAT, {
        "seq": 1, "tickets": [["a", TOKEN]] * (wire.MAX_REQUESTS_PER_HEARTBEAT + 1)}),
    "auth short nonce": _raw(wire.Kind.AUTH, {"nonce": b"x" * 31, "proof": b"", "addr": "", "agent": ""}),
    "auth short proof": _raw(wire.Kind.AUTH, {"nonce": b"", "proof": b"x" * 31, "addr": "", "agent": ""}),
    "layout field past page": _raw(wire.Kind.HELLO, {**_body(_hello(layout=_layout(((1, 3, 0, 40, 32, 4),))))}),
    # offset + nbytes wraps an int64: the end check must not see it as ending early
    "layout field end wraps": _raw(wire.Kind.HELLO, {**_body(_hello(layout=_layout(((1, 3, 0, 2**63 - 1, 4, 4),))))}),
    "layout negative field": _raw(wire.Kind.HELLO, {**_body(_hello(layout=_layout(((1, -3, 0, 0, 32, 4),))))}),
    "layout ragged fields": _raw(wire.Kind.HELLO, {**_body(_hello()), "layout": [1, 0, [[0, 1, 8, 0, b"", [[0, b"x" * 47]]]]]}),
    "layout unknown region": _raw(wire.Kind.HELLO, {**_body(_hello()), "layout": [1, 0, [[0, 1, 8, 0, b"", [[5, b""]]]]]}),
    "layout unknown group": _raw(wire.Kind.HELLO, {**_body(_hello()), "layout": [1, 0, [[4, 1, 8, 0, b"", []]]]}),
    "layout rank past tp": _raw(wire.Kind.HELLO, {**_body(_hello()), "layout": [2, 2, []]}),
    "layout tokens split": _raw(wire.Kind.HELLO, {**_body(_hello(layout=_layout(((1, 3, 0, 0, 30, 4),))))}),
    "oversized metadata": _raw(wire.Kind.HELLO, {**_body(_hello()), "metadata": b"x" * (wire.MAX_METADATA_BYTES + 1)}),
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_malformed_is_wire_error(name):
    with pytest.raises(WireError):
        wire.decode(BAD[name])


# A refusal names the field, the bad value and what was expected.
REASONS = {
    "missing key": r"^done body has keys \['rid'\]; expected \['ok', 'rid', 'token'\]$",
    "wrong type": r"^done\.ok is int; expected a bool$",
    "empty rid": r"^request id has length 0; expected 1\.\.256$",
    "unknown kind": r"^kind = 99; expected one of \[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11\]$",
    "unknown version": rf"^protocol version 1; expected {wire.PROTOCOL_VERSION}$",
    "negative block id": r"^import\.blocks\[0\]\.ids has negative id -1; expected ids >= 0$",
    "repeated group": r"^import\.blocks lists group 0 twice; expected each group once$",
    "nan lease": r"^lease\.lease_s = nan; expected a finite number in 0\.0\.\.86400\.0$",
    "unknown mem": r"^hello\.regions\[0\]\.mem = 7; expected one of \[1, 2\]$",
    "overlapping pages": r"^hello\.regions\[0\]: stride 32 < page_bytes 64; expected pages not to overlap$",
    "group names unknown region": r"^hello\.groups\[0\] names regions \[3\] that the hello does not list$",
    "short hash": r"^hello\.hash has 3 bytes; expected 32 \(sha256\)$",
    "layout field past page": r"^hello\.layout\.groups\[0\]\.placements\[0\]\.fields end at byte 72, past the page",
    "layout field end wraps": r"^hello\.layout\.groups\[0\]\.placements\[0\]\.fields end at byte 9223372036854775811, past",
    "layout unknown region": r"^hello\.layout\.groups\[0\]\.placements\[0\] names region 5 that the hello",
    "layout rank past tp": r"^hello\.layout\.rank = 2; expected 0\.\.1$",
    "layout ragged fields": r"^hello\.layout\.groups\[0\]\.placements\[0\]\.fields has 47 bytes; expected rows of 6",
}


@pytest.mark.parametrize("name", sorted(REASONS))
def test_refusal_says_why(name):
    with pytest.raises(WireError, match=REASONS[name]):
        wire.decode(BAD[name])


def test_wire_error_is_value_error():
    assert issubclass(WireError, ValueError)
    with pytest.raises(ValueError):
        wire.decode(b"")


def test_oversized_message_refused_before_parsing():
    with pytest.raises(WireError, match="at most"):
        wire.decode(b"\x00" * (wire.MAX_MESSAGE_BYTES + 1))


def test_check_blocks_against_export():
    blocks = (wire.GroupBlocks(group_id=0, ids=(1, 2)),)
    wire.check_blocks(blocks, {0: {1, 2, 3}}, what="pull")
    with pytest.raises(WireError, match="out of bounds"):
        wire.check_blocks((wire.GroupBlocks(group_id=0, ids=(1, 9)),), {0: {1, 2, 3}}, what="pull")
    with pytest.raises(WireError, match="not given"):
        wire.check_blocks((wire.GroupBlocks(group_id=1, ids=(1,)),), {0: {1}}, what="pull")
    with pytest.raises(WireError, match="ids < 4"):
        wire.check_blocks((wire.GroupBlocks(group_id=0, ids=(4,)),), {0: 4}, what="push")


def test_compat_hash_and_differences():
    a = {"protocol": "1", "dtype": "bf16"}
    b = {"protocol": "1", "dtype": "fp8", "extra": "x"}
    assert wire.compat_hash(a) == wire.compat_hash(dict(reversed(a.items())))
    assert wire.compat_hash(a) != wire.compat_hash(b)
    assert {d.field for d in wire.compat_differences(a, b)} == {"dtype", "extra"}


# ------------------------------------------------------------------ fuzzing
_leaf = st.one_of(st.none(), st.booleans(), st.integers(-(1 << 63), (1 << 64) - 1), st.floats(),
                  st.text(max_size=20), st.binary(max_size=40))
_tree = st.recursive(_leaf, lambda c: st.one_of(st.lists(c, max_size=4),
                                                st.dictionaries(st.text(max_size=8), c, max_size=4)),
                     max_leaves=30)


def _decode_or_wire_error(data: bytes) -> None:
    try:
        msg = wire.decode(data)
    except WireError:
        return
    # Whatever decodes must re-encode to something that decodes to the same message.
    assert wire.decode(wire.encode(msg)) == msg


@settings(max_examples=300)
@given(st.binary(max_size=200))
def test_fuzz_random_bytes(data):
    _decode_or_wire_error(data)


@settings(max_examples=300)
@given(st.sampled_from(list(wire.Kind)), _tree)
def test_fuzz_structured_bodies(kind, body):
    _decode_or_wire_error(_raw(kind, body))


@settings(max_examples=200)
@given(st.sampled_from(SAMPLES), st.data())
def test_fuzz_mutated_valid_messages(msg, data):
    raw = bytearray(wire.encode(msg))
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(raw) - 1))
        raw[i] = data.draw(st.integers(0, 255))
    _decode_or_wire_error(bytes(raw))


@settings(max_examples=200)
@given(st.sampled_from(SAMPLES), st.data())
def test_fuzz_field_replaced(msg, data):
    body = _body(msg)
    key = data.draw(st.sampled_from(sorted(body)))
    body[key] = data.draw(_tree)
    _decode_or_wire_error(_raw(wire._KIND_OF[type(msg)], body))
