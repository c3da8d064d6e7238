"""The core pieces a connector's own handshake is built of (the SGLang backend's, connectors/sglang):
stateless cookies, the token bucket of replies to unproven peers, the bounded memory of recent ids."""

from __future__ import annotations

import pytest

from hybridkv.transport.cookies import Cookies
from hybridkv.transport.recent import Recent
from hybridkv.transport.throttle import TokenBucket


class Clock:
    def __init__(self, t: float = 1_000_000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def test_cookie_is_bound_fresh_and_spent_once() -> None:
    clock = Clock()
    jar = Cookies(size=32, ttl_s=30.0, clock=clock)
    c = jar.issue(b"nd", b"10.0.0.1:7000")
    assert len(c) == 32 and jar.valid(c, b"nd", b"10.0.0.1:7000")
    assert not jar.valid(c, b"nd", b"10.0.0.2:7000")  # bound to what it was issued for
    assert not jar.valid(c, b"other", b"10.0.0.1:7000")
    assert not Cookies(size=32, ttl_s=30.0, clock=clock).valid(c, b"nd", b"10.0.0.1:7000")  # another process's key
    assert not jar.valid(c[:-1] + bytes([c[-1] ^ 1]), b"nd", b"10.0.0.1:7000")
    assert not jar.valid(c[:16], b"nd", b"10.0.0.1:7000")
    jar.spend(c)
    assert not jar.valid(c, b"nd", b"10.0.0.1:7000")  # a recorded exchange makes no second session
    fresh = jar.issue(b"nd", b"10.0.0.1:7000")
    clock.t += 31
    assert not jar.valid(fresh, b"nd", b"10.0.0.1:7000")  # stale
    assert not jar._spent  # a spent cookie is forgotten once it would be stale anyway


@pytest.mark.parametrize("kw, match", [(dict(size=8, ttl_s=1.0), "cookie size = 8"),
                                       (dict(size=32, ttl_s=0), "cookie ttl_s = 0")])
def test_cookie_settings_refused(kw, match) -> None:
    with pytest.raises(ValueError, match=match):
        Cookies(**kw)


def test_token_bucket_refills_at_its_rate() -> None:
    clock = Clock()
    bucket = TokenBucket(4, clock=clock)
    assert [bucket.take() for _ in range(5)] == [True] * 4 + [False]
    clock.t += 0.5  # two tokens back
    assert [bucket.take() for _ in range(3)] == [True, True, False]
    clock.t += 100  # never more than a burst of `rate`
    assert sum(bucket.take() for _ in range(10)) == 4
    with pytest.raises(ValueError, match="rate = 0"):
        TokenBucket(0)


def test_recent_keeps_the_last_set() -> None:
    r: Recent[str, int] = Recent(2)
    r["a"], r["b"] = 1, 2
    r["a"] = 3  # set again: the newest
    r["c"] = 4
    assert list(r.items()) == [("a", 3), ("c", 4)]
    with pytest.raises(ValueError, match="limit = 0; expected an int >= 1"):
        Recent(0)


def test_enum_value_and_record_with() -> None:
    """Codecs for types declared outside the wire (the SGLang backend's shapes and message types)."""
    import enum
    from dataclasses import dataclass

    from hybridkv.wire import WireError
    from hybridkv.wire.fields import EnumValue, Int
    from hybridkv.wire.schema import record_with

    class Colour(enum.Enum):
        RED = "red"

    @dataclass(frozen=True, kw_only=True)
    class Point:
        x: int
        colour: Colour

    rec = record_with(Point, x=Int(lo=0, hi=9), colour=EnumValue(enum=Colour))
    p = Point(x=3, colour=Colour.RED)
    assert rec.encode(p) == [3, "red"] and rec.decode([3, "red"], "point") == p
    with pytest.raises(WireError, match=r"point.colour = 'blue'; expected one of \['red'\]"):
        rec.decode([3, "blue"], "point")


def test_source_ranks_refuses_bools() -> None:
    from hybridkv.descriptors.planning import source_ranks

    assert source_ranks(4, 3, 2) == ((1,), 2) and source_ranks(1, 0, 4) == ((0, 1, 2, 3), 1)
    with pytest.raises(ValueError, match="local_tp = True; expected a positive int"):
        source_ranks(True, 0, 2)
    with pytest.raises(ValueError, match="local_rank = True"):
        source_ranks(2, True, 2)
