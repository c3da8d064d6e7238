"""Control-plane messages: each one frozen dataclass, declared once with its kind and
how every field travels and is validated.

These are what :func:`hybridkv.wire.decode` returns and :func:`hybridkv.wire.encode`
takes. To add a message: a member of :class:`~hybridkv.wire.Kind` and a class here,
``@message(Kind.X)`` over a dataclass whose fields are declared with ``on_wire``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from hybridkv.errors import Difference
from hybridkv.wire.enums import FailureCode, Kind, Mode, Role
from hybridkv.wire.fields import Blob, Choice, Digest, Exact, Flag, Float, Int, ListOf, Named, Nullable, Text, TextMap
from hybridkv.wire.layout_table import LayoutTable
from hybridkv.wire.limits import (
    MAX_COMPAT_FIELDS,
    MAX_COMPAT_NAME,
    MAX_I63,
    MAX_LEASE_S,
    MAX_METADATA_BYTES,
    MAX_NAME,
    MAX_READERS,
    MAX_REQUESTS_PER_HEARTBEAT,
    MAX_STAGE_MASK,
    MAX_TEXT,
    NONCE_BYTES,
    PROOF_BYTES,
    TOKEN_BYTES,
    WireError,
)
from hybridkv.wire.regions import BLOCKS, GROUPS, REGIONS, GroupBlocks, GroupInfo, RegionInfo
from hybridkv.wire.schema import Message, Record, Spec, message, on_wire, record_of, require_every_kind

REQUEST_ID = Named(label="request id", inner=Text(limit=MAX_NAME))
LEASE_S = Float(lo=0.0, hi=MAX_LEASE_S)
# A request's capability: whoever sends a message about a request must hold its token.
TOKEN = Named(label="capability token", inner=Exact(size=TOKEN_BYTES))
# Done and Failure may leave it empty in code (the producer stamps its own before sending); a
# receiver still compares it with the request's, so an empty one names no request.
_MAYBE_TOKEN = Named(label="capability token", inner=Exact(size=TOKEN_BYTES, empty=True))
_MAYBE_NAME = Nullable(inner=Text(limit=MAX_NAME, empty=True))
# Difference is the error hierarchy's type (hybridkv.errors), so its wire form is given here.
_DIFFERENCE = Record(cls=Difference, specs=(
    ("field", Spec(key="field", codec=Text(limit=MAX_COMPAT_NAME))),
    ("local", Spec(key="local", codec=_MAYBE_NAME)),
    ("remote", Spec(key="remote", codec=_MAYBE_NAME)),
))


@message(Kind.AUTH)
@dataclass(frozen=True, kw_only=True)
class Auth(Message):
    """The handshake's first messages, before any Hello. First each side's fresh nonce with the
    connection as it sees it (the consumer: the address it dialled and its agent name; the producer:
    its own address and agent name), then each side's HMAC over all of that, proving the shared
    secret (empty where the sender has none). Small: a listener reads at most
    ``MAX_PREAUTH_BYTES`` from an unproven peer."""

    nonce: bytes = on_wire("nonce", Exact(size=NONCE_BYTES, empty=True), default=b"")
    proof: bytes = on_wire("proof", Exact(size=PROOF_BYTES, empty=True), default=b"")
    address: str = on_wire("addr", Text(limit=MAX_NAME, empty=True), default="")
    agent: str = on_wire("agent", Text(limit=MAX_NAME, empty=True), default="")


@dataclass(frozen=True, kw_only=True)
class Ticket:
    """A request named together with its capability token (a Heartbeat renews a list of them)."""

    request_id: str = on_wire("rid", REQUEST_ID)
    token: bytes = on_wire("token", TOKEN)


@message(Kind.HELLO)
@dataclass(frozen=True, kw_only=True)
class Hello(Message):
    agent: str = on_wire("agent", Text(limit=MAX_NAME))
    metadata: bytes = on_wire("metadata", Blob(limit=MAX_METADATA_BYTES))
    role: Role = on_wire("role", Choice(enum=Role))
    mode: Mode = on_wire("mode", Choice(enum=Mode))
    compat: Mapping[str, str] = on_wire("compat", TextMap(limit=MAX_COMPAT_FIELDS, key=Text(limit=MAX_COMPAT_NAME),
                                                          value=Text(limit=MAX_NAME, empty=True)))
    compat_hash: bytes = on_wire("hash", Digest())
    regions: tuple[RegionInfo, ...] = on_wire("regions", REGIONS)
    groups: tuple[GroupInfo, ...] = on_wire("groups", GROUPS)
    lease_s: float = on_wire("lease_s", LEASE_S)
    layout: LayoutTable | None = on_wire("layout", Nullable(inner=record_of(LayoutTable)), default=None)

    def _check(self, name: str) -> None:
        # Groups and field tables name regions and groups by id: only ones this hello lists,
        # or the receiver would index memory the peer never registered.
        regions = {r.region_id: r for r in self.regions}
        for i, g in enumerate(self.groups):
            unknown = sorted(set(g.region_ids) - regions.keys())
            if unknown:
                raise WireError(f"{name}.groups[{i}] names regions {unknown} that the hello does not list")
        if self.layout is not None:
            self.layout.check_refs(regions, {g.group_id for g in self.groups}, f"{name}.layout")


@message(Kind.REFUSE)
@dataclass(frozen=True, kw_only=True)
class Refuse(Message):
    reason: str = on_wire("reason", Text(limit=MAX_TEXT))
    differences: tuple[Difference, ...] = on_wire("diffs", ListOf(item=_DIFFERENCE, limit=MAX_COMPAT_FIELDS))


@message(Kind.EXPORT)
@dataclass(frozen=True, kw_only=True)
class Export(Message):
    """Producer -> consumer (pull): these blocks hold the request; read them within the lease."""

    request_id: str = on_wire("rid", REQUEST_ID)
    blocks: tuple[GroupBlocks, ...] = on_wire("blocks", BLOCKS)
    lease_s: float = on_wire("lease_s", LEASE_S)
    # Staged (the Want asked, a slot was free): (offset, nbytes) of the packed slices in the producer's
    # staging region (transport/staging.py); empty: read the blocks themselves.
    stage: tuple[int, ...] = on_wire("stage", ListOf(item=Int(lo=0, hi=MAX_I63), limit=2), default=())


@message(Kind.IMPORT)
@dataclass(frozen=True, kw_only=True)
class Import(Message):
    """Consumer -> producer (push): write the request into these blocks of mine."""

    request_id: str = on_wire("rid", REQUEST_ID)
    blocks: tuple[GroupBlocks, ...] = on_wire("blocks", BLOCKS)


@message(Kind.DONE)
@dataclass(frozen=True, kw_only=True)
class Done(Message):
    """The sender is finished with the request's transfer (ok or not)."""

    request_id: str = on_wire("rid", REQUEST_ID)
    ok: bool = on_wire("ok", Flag())
    token: bytes = on_wire("token", _MAYBE_TOKEN, default=b"")


@message(Kind.FAILURE)
@dataclass(frozen=True, kw_only=True)
class Failure(Message):
    request_id: str = on_wire("rid", REQUEST_ID)
    code: FailureCode = on_wire("code", Choice(enum=FailureCode))
    detail: str = on_wire("detail", Text(limit=MAX_TEXT, empty=True))
    token: bytes = on_wire("token", _MAYBE_TOKEN, default=b"")


@message(Kind.HEARTBEAT)
@dataclass(frozen=True, kw_only=True)
class Heartbeat(Message):
    """Liveness, and lease renewal for the listed requests (each with its token)."""

    seq: int = on_wire("seq", Int(lo=0, hi=MAX_I63))
    tickets: tuple[Ticket, ...] = on_wire("tickets", ListOf(item=record_of(Ticket), limit=MAX_REQUESTS_PER_HEARTBEAT))


@message(Kind.LEASE)
@dataclass(frozen=True, kw_only=True)
class Lease(Message):
    """Reply to a renewal: remaining lease in seconds; 0 means it is gone."""

    request_id: str = on_wire("rid", REQUEST_ID)
    lease_s: float = on_wire("lease_s", LEASE_S)


@message(Kind.BYE)
@dataclass(frozen=True, kw_only=True)
class Bye(Message):
    reason: str = on_wire("reason", Text(limit=MAX_TEXT, empty=True))


@message(Kind.WANT)
@dataclass(frozen=True, kw_only=True)
class Want(Message):
    """Consumer -> producer: export this request to me. ``readers`` consumers share it
    (decode ranks reading different heads of one producer rank); any other claim is refused."""

    request_id: str = on_wire("rid", REQUEST_ID)
    token: bytes = on_wire("token", TOKEN)
    readers: int = on_wire("readers", Int(lo=1, hi=MAX_READERS), default=1)
    stage: bool = on_wire("stage", Flag(), default=False)  # pack my slices into a staging slot (hetero TP)
    # With stage: the fields to pack, bit i (least significant first) for field i of those the pair shares in
    # the consumer's order (descriptors/staging.py field_mask); empty: every one (protocol 5).
    fields: bytes = on_wire("fields", Blob(limit=MAX_STAGE_MASK), default=b"")


require_every_kind()

__all__ = ["Auth", "Bye", "Done", "Export", "Failure", "Heartbeat", "Hello", "Import", "Lease", "Message", "Refuse", "Ticket", "Want"]
