"""The windowed sealer (hybridkv/transport/sealing.py): each message opens once, in any order within the window,
only in its direction, under its session's key, unaltered."""

from __future__ import annotations

import pytest

from hybridkv.transport import sealing

FMT = sealing.SealedFormat(tag=b"TEST-SEAL", sid_bytes=4, max_frames=3)
KEY = b"k" * 32


def _pair(key: bytes = KEY, sid: bytes = b"sid1", window: int = 8):
    a = sealing.WindowedSealer(fmt=FMT, key=key, sid=sid, send_label=b"a->b", recv_label=b"b->a", window=window)
    b = sealing.WindowedSealer(fmt=FMT, key=key, sid=sid, send_label=b"b->a", recv_label=b"a->b", window=window)
    return a, b


def test_a_message_opens_once_in_any_order_within_the_window():
    a, b = _pair()
    first, second = a.seal([b"x", b"one"]), a.seal([b"x", b"two"])
    assert FMT.sid_of(first) == b"sid1" and first[0] == b"TEST-SEAL"
    assert b.open(second) == [b"x", b"two"]
    assert b.open(first) == [b"x", b"one"]  # out of order, within the window
    with pytest.raises(sealing.Replayed, match="message 0 was accepted before"):
        b.open(first)


def test_a_number_past_the_window_is_refused_as_a_replay():
    a, b = _pair(window=8)
    sent = [a.seal([bytes([i])]) for i in range(10)]
    assert b.open(sent[9]) == [b"\x09"]
    assert b.open(sent[2]) == [b"\x02"]  # 7 behind: inside
    with pytest.raises(sealing.Replayed, match="more than 8 behind"):
        b.open(sent[1])


def test_altered_reflected_foreign_or_malformed_messages_do_not_open():
    a, b = _pair()
    altered = a.seal([b"x", b"three"])
    altered[-1] = b"thre3"
    with pytest.raises(sealing.SealError, match="does not carry the session's MAC") as e:
        b.open(altered)
    assert not isinstance(e.value, sealing.Replayed)
    with pytest.raises(sealing.SealError, match="MAC"):
        a.open(a.seal([b"x"]))  # its own direction's label
    with pytest.raises(sealing.SealError, match="MAC"):
        _pair(key=b"j" * 32)[1].open(a.seal([b"x"]))  # another key
    with pytest.raises(sealing.SealError, match="not a sealed message of this session"):
        _pair(sid=b"sid2")[1].open(a.seal([b"x"]))
    m = a.seal([b"x"])
    for bad in ([b"OTHER", *m[1:]], m[:3], [*m, b"1", b"2", b"3"], [m[0], m[1][:-1], *m[2:]]):
        assert FMT.sid_of(bad) is None
        with pytest.raises(sealing.SealError, match="not a sealed message"):
            b.open(bad)
    assert b.open(m) == [b"x"]  # none of those used its number


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="session id of 3 bytes; expected 4"):
        sealing.WindowedSealer(fmt=FMT, key=KEY, sid=b"abc", send_label=b"a", recv_label=b"b")
    with pytest.raises(ValueError, match="one label b'a' for both directions"):
        sealing.WindowedSealer(fmt=FMT, key=KEY, sid=b"abcd", send_label=b"a", recv_label=b"a")
    with pytest.raises(ValueError, match="replay window of 0; expected an int >= 1"):
        sealing.ReplayWindow(0)
