"""Request and transfer records kept by the transfer scheduler.

A request holds blocks per KV-cache group. What must arrive before a remote
request may compute is a set of *components*: one per attention group (its
KV), and for a GDN/Mamba group the conv state and the SSM state, which
engines move as separate transfers (SGLang #39846 declared a request complete
after its first component). :class:`Component` names one.

Records are mutable internal state of :class:`~hybridkv.fencing.scheduler.TransferScheduler`
(kept in :class:`~hybridkv.fencing.records.SchedulerRecords`); engines read them through the
scheduler's query methods.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Self

from hybridkv.fencing.fence import NEVER
from hybridkv.ids import GroupId, RequestId, TransferId
# Which components a group has is its layer kind's fact (LayerSpec.components), so the enum lives with the kinds.
from hybridkv.layout.kinds.base import ComponentKind


@dataclass(frozen=True, kw_only=True, eq=False, init=False)
class Component:
    """One separately-arriving piece of a request's cache: (group, kind).

    Interned: equal fields give the same object, so equality and hashing are by
    identity. The scheduler builds and compares sets of components on every
    import call; a dataclass hash (a tuple of an int and an enum, both hashed in
    Python) made that a measurable share of its per-step cost.
    """

    group: GroupId
    kind: ComponentKind

    def __new__(cls, *, group: GroupId, kind: ComponentKind) -> Self:
        key = (cls, group, kind)
        c = _INTERNED.get(key)
        if c is None:
            c = object.__new__(cls)
            object.__setattr__(c, "group", group)
            object.__setattr__(c, "kind", kind)
            _INTERNED[key] = c
        return c

    def __reduce__(self) -> tuple[object, tuple[GroupId, ComponentKind]]:
        # pickle/copy rebuild through the constructor, so a copy is the interned object.
        return (_component, (self.group, self.kind))


_INTERNED: dict[tuple[type, int, ComponentKind], Any] = {}


def _component(group: GroupId, kind: ComponentKind) -> Component:
    return Component(group=group, kind=kind)


def attention_component(group: int) -> Component:
    return Component(group=GroupId(group), kind=ComponentKind.KV)


def gdn_components(group: int) -> tuple[Component, Component]:
    return (
        Component(group=GroupId(group), kind=ComponentKind.CONV),
        Component(group=GroupId(group), kind=ComponentKind.SSM),
    )


class RequestPhase(enum.Enum):
    LOCAL = "local"  # computes here; not waiting for anything remote
    IMPORTING = "importing"  # waiting for remote components
    READY = "ready"  # every component arrived; may join a step
    RUNNING = "running"  # resident in the running batch
    EXPORTING = "exporting"  # finished; blocks held for a consumer under a lease
    FAILED = "failed"  # an import failed; the engine recomputes or drops it


class TransferDirection(enum.Enum):
    INBOUND = "inbound"  # writes local blocks
    OUTBOUND = "outbound"  # reads local blocks


class TransferOutcome(enum.Enum):
    """What the scheduler made of a completion report."""

    ACCEPTED = "accepted"
    DUPLICATE = "duplicate"  # already terminal; ignored
    DISCARDED = "discarded"  # terminal, but its request was aborted: bytes ignored
    LATE = "late"  # landed after its lease deadline: bytes not trusted, counted as failed
    UNKNOWN = "unknown"  # never posted here


@dataclass(slots=True, kw_only=True, eq=False)
class RequestRecord:
    id: RequestId
    phase: RequestPhase
    resident: bool = False
    last_step: int = NEVER
    blocks: dict[int, list[int]] = field(default_factory=dict)  # group -> block keys
    expected: frozenset[Component] = frozenset()
    arrived: set[Component] = field(default_factory=set)
    transfers: set[TransferId] = field(default_factory=set)
    abandoned: bool = False  # aborted while exporting: held until the lease ends, never renewed


@dataclass(slots=True, kw_only=True, eq=False)
class TransferRecord:
    id: TransferId
    request: RequestId
    direction: TransferDirection
    keys: list[int]
    components: frozenset[Component]
    deadline: float | None
    orphaned: bool = False  # its request was aborted or released meanwhile
