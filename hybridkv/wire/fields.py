"""Field codecs: how one value goes onto the wire, and how it is validated coming off it.

A codec has ``encode(value)``, a Python value to what msgpack packs (the sender
is trusted, so this only converts), and ``decode(raw, name)``, an untrusted
msgpack value to the typed value, or :class:`~hybridkv.wire.WireError` naming
the field ``name`` and what was expected (type, range, length, distinct ids).
Message and record schemas (:mod:`hybridkv.wire.schema`) are built from them.
"""

from __future__ import annotations

import enum
import math
import operator
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from hybridkv.wire.limits import MAX_I32, WireError


class Codec(Protocol):
    def encode(self, value: Any) -> Any: ...

    def decode(self, raw: Any, name: str) -> Any: ...


# ---------------------------------------------------------------- shapes shared with the framing
def expect_map(v: Any, name: str, keys: frozenset[str]) -> dict:
    """A map with exactly ``keys``: a peer may neither leave a field out nor add one."""
    if not isinstance(v, dict):
        raise WireError(f"{name} is {type(v).__name__}; expected a map")
    got = frozenset(v)
    if got != keys:
        raise WireError(f"{name} has keys {sorted(map(str, got))}; expected {sorted(keys)}")
    return v


def expect_list(v: Any, name: str, limit: int) -> list:
    if type(v) is not list:
        raise WireError(f"{name} is {type(v).__name__}; expected an array")
    if len(v) > limit:
        raise WireError(f"{name} has {len(v)} entries; expected at most {limit}")
    return v


# ---------------------------------------------------------------- scalars
@dataclass(frozen=True, kw_only=True)
class Int:
    lo: int
    hi: int

    def encode(self, value: Any) -> int:
        # Numpy ints (from a layout) become plain ints; floats and strings are refused, not truncated.
        return operator.index(value)

    def decode(self, raw: Any, name: str) -> int:
        # type(), not isinstance: a bool is not a number here.
        if type(raw) is not int:
            raise WireError(f"{name} is {type(raw).__name__}; expected an int")
        if not self.lo <= raw <= self.hi:
            raise WireError(f"{name} = {raw}; expected {self.lo}..{self.hi}")
        return raw


@dataclass(frozen=True, kw_only=True)
class Float:
    lo: float
    hi: float

    def encode(self, value: Any) -> float:
        return float(value)

    def decode(self, raw: Any, name: str) -> float:
        if type(raw) not in (int, float):
            raise WireError(f"{name} is {type(raw).__name__}; expected a number")
        f = float(raw)
        if not math.isfinite(f) or not self.lo <= f <= self.hi:
            raise WireError(f"{name} = {raw!r}; expected a finite number in {self.lo}..{self.hi}")
        return f


_ENUM_NUMBER = Int(lo=0, hi=MAX_I32)


@dataclass(frozen=True, kw_only=True)
class Flag:
    def encode(self, value: Any) -> bool:
        return bool(value)

    def decode(self, raw: Any, name: str) -> bool:
        if type(raw) is not bool:
            raise WireError(f"{name} is {type(raw).__name__}; expected a bool")
        return raw


@dataclass(frozen=True, kw_only=True)
class Choice:
    """A member of an int enum, sent as its number."""

    enum: type[enum.IntEnum]

    def encode(self, value: Any) -> int:
        return int(value)

    def decode(self, raw: Any, name: str) -> enum.IntEnum:
        i = _ENUM_NUMBER.decode(raw, name)
        try:
            return self.enum(i)
        except ValueError:
            raise WireError(f"{name} = {i}; expected one of {[int(m) for m in self.enum]}") from None


@dataclass(frozen=True, kw_only=True)
class EnumValue:
    """A member of a string-valued enum, sent as its value."""

    enum: type[enum.Enum]

    def encode(self, value: Any) -> Any:
        return value.value

    def decode(self, raw: Any, name: str) -> Any:  # a member of self.enum
        try:
            return self.enum(raw)
        except (ValueError, TypeError):
            raise WireError(f"{name} = {raw!r:.40}; expected one of {[m.value for m in self.enum]}") from None


@dataclass(frozen=True, kw_only=True)
class Text:
    limit: int
    empty: bool = False

    def encode(self, value: Any) -> str:
        return value

    def decode(self, raw: Any, name: str) -> str:
        if type(raw) is not str:
            raise WireError(f"{name} is {type(raw).__name__}; expected a string")
        if len(raw) > self.limit or (not self.empty and not raw):
            raise WireError(f"{name} has length {len(raw)}; expected {0 if self.empty else 1}..{self.limit}")
        return raw


@dataclass(frozen=True, kw_only=True)
class Blob:
    limit: int

    def encode(self, value: Any) -> bytes:
        return bytes(value)

    def decode(self, raw: Any, name: str) -> bytes:
        if type(raw) is not bytes:
            raise WireError(f"{name} is {type(raw).__name__}; expected bytes")
        if len(raw) > self.limit:
            raise WireError(f"{name} has {len(raw)} bytes; expected at most {self.limit}")
        return raw


_DIGEST_BYTES = Blob(limit=32)


@dataclass(frozen=True, kw_only=True)
class Digest:
    """A sha256 digest: exactly 32 bytes."""

    def encode(self, value: Any) -> bytes:
        return bytes(value)

    def decode(self, raw: Any, name: str) -> bytes:
        h = _DIGEST_BYTES.decode(raw, name)
        if len(h) != 32:
            raise WireError(f"{name} has {len(h)} bytes; expected 32 (sha256)")
        return h


@dataclass(frozen=True, kw_only=True)
class Exact:
    """Bytes of exactly ``size`` (or none, where ``empty``): a nonce, a proof, a capability token."""

    size: int
    empty: bool = False

    def encode(self, value: Any) -> bytes:
        return bytes(value)

    def decode(self, raw: Any, name: str) -> bytes:
        b = Blob(limit=self.size).decode(raw, name)
        if len(b) != self.size and not (self.empty and not b):
            raise WireError(f"{name} has {len(b)} bytes; expected {'0 or ' if self.empty else ''}{self.size}")
        return b


@dataclass(frozen=True, kw_only=True)
class Int32s:
    """Non-negative ints as one little-endian int32 array: compact, and validated in one
    vectorised pass (a block list can hold millions)."""

    limit: int  # entries
    what: str  # what an entry is, for errors
    distinct: bool

    def encode(self, value: Any) -> bytes:
        return np.asarray(value, dtype="<i4").tobytes()

    def decode(self, raw: Any, name: str) -> tuple[int, ...]:
        data = Blob(limit=4 * self.limit).decode(raw, name)
        if len(data) % 4:
            raise WireError(f"{name} has {len(data)} bytes; expected a multiple of 4 (int32)")
        a = np.frombuffer(data, dtype="<i4")
        if a.size and int(a.min()) < 0:
            raise WireError(f"{name} has negative {self.what} {int(a.min())}; expected {self.what}s >= 0")
        if self.distinct:
            values, counts = np.unique(a, return_counts=True)
            if values.size != a.size:
                raise WireError(f"{name} repeats {self.what} {int(values[counts > 1][0])}; "
                                f"expected distinct {self.what}s")
        return tuple(a.tolist())


# ---------------------------------------------------------------- wrappers and containers
@dataclass(frozen=True, kw_only=True)
class Named:
    """Errors name the value ``label`` wherever it sits: a request id is "request id" in every message."""

    label: str
    inner: Codec

    def encode(self, value: Any) -> Any:
        return self.inner.encode(value)

    def decode(self, raw: Any, name: str) -> Any:
        return self.inner.decode(raw, self.label)


@dataclass(frozen=True, kw_only=True)
class Nullable:
    inner: Codec

    def encode(self, value: Any) -> Any:
        return None if value is None else self.inner.encode(value)

    def decode(self, raw: Any, name: str) -> Any:
        return None if raw is None else self.inner.decode(raw, name)


@dataclass(frozen=True, kw_only=True)
class ListOf:
    """A tuple of values sent as an array. ``distinct`` names an attribute of the items (a
    :class:`~hybridkv.wire.schema.Record`'s) that must differ between them, e.g. an id."""

    item: Codec
    limit: int
    distinct: str | None = None

    def __post_init__(self) -> None:
        if self.distinct is not None and not hasattr(self.item, "key_of"):
            raise TypeError(f"ListOf(distinct={self.distinct!r}) of {self.item!r}; expected items that are a Record")

    def encode(self, value: Any) -> list:
        return [self.item.encode(x) for x in value]

    def decode(self, raw: Any, name: str) -> tuple:
        item = self.item.decode
        out = tuple(item(v, f"{name}[{i}]") for i, v in enumerate(expect_list(raw, name, self.limit)))
        if self.distinct is not None:
            seen: set = set()
            for x in out:
                key = getattr(x, self.distinct)
                if key in seen:
                    what = self.item.key_of(self.distinct)  # type: ignore[attr-defined]
                    raise WireError(f"{name} lists {what} {key} twice; expected each {what} once")
                seen.add(key)
        return out


@dataclass(frozen=True, kw_only=True)
class TextMap:
    """A map of strings to strings (a dict after decoding)."""

    limit: int
    key: Text
    value: Text

    def encode(self, value: Mapping[str, str]) -> dict:
        return dict(value)

    def decode(self, raw: Any, name: str) -> dict[str, str]:
        if not isinstance(raw, dict) or len(raw) > self.limit:
            raise WireError(f"{name}; expected a map of at most {self.limit} string fields")
        return {self.key.decode(k, f"{name} key"): self.value.decode(v, f"{name}[{k!r}]") for k, v in raw.items()}


__all__ = [
    "Blob", "Choice", "Codec", "Digest", "Exact", "Flag", "Float", "Int", "Int32s", "ListOf", "Named", "Nullable", "Text",
    "TextMap", "expect_list", "expect_map",
]
