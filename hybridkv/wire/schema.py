"""How a type declares its wire form, once, next to its fields; and the registry of messages.

Each field of a wire dataclass is declared with :func:`on_wire`: its key and its
codec (:mod:`hybridkv.wire.fields`). That one declaration gives the encoder,
the decoder and the exact set of keys a peer must send. A message type is then
registered with ``@message(Kind.X)``; nothing else names it, so the codec
(:mod:`hybridkv.wire.codec`) stays generic.

A message is a msgpack map of its fields' keys; a type nested in one (a
:class:`Record`) is a fixed-length array of its fields in declaration order.
Fields decode in declaration order, so of several bad fields the first is the
one named. Either may define ``_check(self, name)`` for what no single field's
codec can see (relations between fields); it runs after the fields decode and
raises :class:`~hybridkv.wire.WireError` naming ``name``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import MISSING, dataclass
from typing import Any, TypeVar

from hybridkv.wire.enums import Kind
from hybridkv.wire.fields import Codec, expect_list, expect_map
from hybridkv.wire.limits import WireError

_SPEC = "hybridkv.wire"  # the dataclass field metadata key of a field's Spec

T = TypeVar("T")


@dataclass(frozen=True, kw_only=True)
class Spec:
    """One field on the wire."""

    key: str  # its key in a message's map; its name (in errors) in a record's array
    codec: Codec


def on_wire(key: str, codec: Codec, *, default: Any = MISSING) -> Any:
    """Declare a dataclass field together with how it travels: ``x: int = on_wire("x", Int(lo=0, hi=9))``."""
    return dataclasses.field(default=default, metadata={_SPEC: Spec(key=key, codec=codec)})


def specs_of(cls: type) -> tuple[tuple[str, Spec], ...]:
    """(attribute, spec) of every field of a wire dataclass, in declaration order."""
    out = []
    for f in dataclasses.fields(cls):
        spec = f.metadata.get(_SPEC)
        if spec is None:
            raise TypeError(f"{cls.__name__}.{f.name} has no wire spec; expected it declared with on_wire(...)")
        out.append((f.name, spec))
    keys = [s.key for _, s in out]
    if len(set(keys)) != len(keys):
        raise TypeError(f"{cls.__name__} repeats a wire key in {keys}; expected distinct keys")
    return tuple(out)


def _checked(obj: T, name: str) -> T:
    check = getattr(obj, "_check", None)
    if check is not None:
        check(name)
    return obj


@dataclass(frozen=True, kw_only=True)
class Record:
    """A value nested in a message, sent as the array of its fields. Build one with
    :func:`record_of`, or give ``specs`` for a type declared outside the wire package."""

    cls: type
    specs: tuple[tuple[str, Spec], ...]

    def key_of(self, attr: str) -> str:
        return next(s.key for a, s in self.specs if a == attr)

    def encode(self, value: Any) -> list:
        return [s.codec.encode(getattr(value, a)) for a, s in self.specs]

    def decode(self, raw: Any, name: str) -> Any:
        e = expect_list(raw, name, len(self.specs))
        if len(e) != len(self.specs):
            raise WireError(f"{name} has {len(e)} entries; expected [{', '.join(s.key for _, s in self.specs)}]")
        return _checked(self.cls(**{a: s.codec.decode(v, f"{name}.{s.key}") for (a, s), v in zip(self.specs, e)}),
                        name)


def record_of(cls: type) -> Record:
    return Record(cls=cls, specs=specs_of(cls))


def record_with(cls: type, **codecs: Codec) -> Record:
    """The wire form of a type declared outside the wire (no :func:`on_wire` fields): each keyword is
    an attribute, sent under its own name, in the order given."""
    return Record(cls=cls, specs=tuple((attr, Spec(key=attr, codec=c)) for attr, c in codecs.items()))


class Message:
    """Base of every control-plane message (each a frozen dataclass registered with :func:`message`)."""


@dataclass(frozen=True, kw_only=True)
class MessageSchema:
    kind: Kind
    cls: type
    specs: tuple[tuple[str, Spec], ...]
    keys: frozenset[str]
    label: str  # the message in errors: "hello body", "hello.agent"

    def body(self, msg: Message) -> dict[str, Any]:
        # Keys in declaration order: msgpack keeps map order, so the bytes depend on it.
        return {s.key: s.codec.encode(getattr(msg, a)) for a, s in self.specs}

    def from_body(self, raw: Any) -> Message:
        b = expect_map(raw, f"{self.label} body", self.keys)
        return _checked(self.cls(**{a: s.codec.decode(b[s.key], f"{self.label}.{s.key}") for a, s in self.specs}),
                        self.label)


SCHEMAS: dict[Kind, MessageSchema] = {}
KIND_OF: dict[type, Kind] = {}


def message(kind: Kind):
    """Register a message dataclass under ``kind``: ``@message(Kind.X)`` above ``@dataclass(...)``."""

    def register(cls: type[T]) -> type[T]:
        if not (isinstance(cls, type) and issubclass(cls, Message) and dataclasses.is_dataclass(cls)):
            raise TypeError(f"@message({kind.name}) on {cls!r}; expected a dataclass subclassing Message")
        if kind in SCHEMAS:
            raise TypeError(f"kind {kind.name} is declared twice, by {SCHEMAS[kind].cls.__name__} and "
                            f"{cls.__name__}; expected one message type per kind")
        specs = specs_of(cls)
        SCHEMAS[kind] = MessageSchema(kind=kind, cls=cls, specs=specs, keys=frozenset(s.key for _, s in specs),
                                      label=kind.name.lower())
        KIND_OF[cls] = kind
        return cls

    return register


def require_every_kind() -> None:
    """A Kind member without a message type would decode to nothing; refuse it at import."""
    missing = [k.name for k in Kind if k not in SCHEMAS]
    if missing:
        raise TypeError(f"kinds {missing} have no message type; expected each declared with @message(Kind.X)")


def schema_of(msg: Any) -> MessageSchema:
    kind = KIND_OF.get(type(msg))
    if kind is None:
        raise ValueError(f"message {msg!r}; expected one of {[t.__name__ for t in KIND_OF]}")
    return SCHEMAS[kind]


__all__ = ["KIND_OF", "SCHEMAS", "Message", "MessageSchema", "Record", "Spec", "message", "on_wire", "record_of",
           "require_every_kind", "schema_of", "specs_of"]
