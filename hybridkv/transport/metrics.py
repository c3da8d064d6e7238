"""Transfer metrics, counted once for every connector: what moved, what failed, what waited.

The transport (:class:`~hybridkv.transport.consumer.Consumer`,
:class:`~hybridkv.transport.producer.Producer`) and the connectors' own paths
(the vLLM scheduler half, the SGLang backend) feed one :class:`TransferMetrics`
per worker; whoever reports them (vLLM's ``get_kv_connector_stats``, SGLang's
metrics) takes a :class:`MetricsSnapshot` of what was counted since the last
take. A snapshot is plain data in :meth:`MetricsSnapshot.to_dict` (str keys,
lists and ints), so an engine can send it between processes and merge the
snapshots of its workers.

Per-transfer figures (bytes, descriptors, seconds) are kept as lists, one entry
per transfer that landed, as vLLM's NixlKVConnectorStats does, so a histogram or
a percentile can be made from them; the rest are counts. Counts are per worker:
a request read by two decode ranks is two transfers, and a lease that lapses on
two prefill ranks is two expiries (vLLM's NIXL stats count the same way).

No engine, torch or NIXL import: the core's counters.
"""

from __future__ import annotations

import enum
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


class FailureKind(enum.Enum):
    """Why a transfer (or a request's load or export) failed."""

    HANDSHAKE = "handshake"  # the peer could not be reached, or refused the handshake
    NO_EXPORT = "no_export"  # the producer's Export did not come in time
    REFUSED = "refused"  # the peer refused the request (claimed by another, unknown, aborted there)
    PEER_LOST = "peer_lost"  # the peer's connection dropped, or it said Bye
    PROTOCOL = "protocol"  # block lists or a message that do not match what was agreed
    LEASE = "lease"  # the lease lapsed, or was too short to start the transfer inside it
    TRANSFER = "transfer"  # NIXL reported an error (or refused to post)
    TIMEOUT = "timeout"  # a transfer still running past its deadline: aborted, or quarantined
    INCOMPLETE = "incomplete"  # the peer reported success but a component never landed
    FENCED = "fenced"  # a destination block is still fenced (a write of an earlier request may reach it)


_LISTS = ("transfer_seconds", "post_seconds", "bytes", "descriptors", "fence_wait_steps")
_COUNTS = ("lease_expiries", "quarantined_blocks", "released_blocks")


@dataclass(frozen=True, kw_only=True)
class MetricsSnapshot:
    """What a :class:`TransferMetrics` counted between two takes (or several merged)."""

    transfer_seconds: tuple[float, ...] = ()  # one per transfer that landed: post -> done
    post_seconds: tuple[float, ...] = ()  # of those, making and posting the descriptors
    bytes: tuple[int, ...] = ()
    descriptors: tuple[int, ...] = ()  # descriptors NIXL posted
    failures: Mapping[FailureKind, int] = field(default_factory=dict)
    lease_expiries: int = 0  # exports whose lease lapsed before every reader was done
    fence_wait_steps: tuple[int, ...] = ()  # one per load: steps it waited for the fence to allow it
    quarantined_blocks: int = 0  # blocks kept out of reuse because a transfer into/out of them could not stop
    released_blocks: int = 0  # of those, blocks whose transfer has since ended
    # 1 while an endpoint of this worker runs in lab mode (TransportConfig.insecure_no_auth: no
    # secret, any peer served): a gauge, not a count, so merging takes the larger, never the sum.
    insecure_no_auth: int = 0

    def __post_init__(self) -> None:
        n = len(self.transfer_seconds)
        if not len(self.post_seconds) == len(self.bytes) == len(self.descriptors) == n:
            raise ValueError(f"per-transfer lists of lengths {len(self.transfer_seconds)}, {len(self.post_seconds)}, "
                             f"{len(self.bytes)}, {len(self.descriptors)}; expected equal lengths")
        for kind, count in self.failures.items():
            if not isinstance(kind, FailureKind) or not _is_count(count):
                raise ValueError(f"failures[{kind!r}] = {count!r}; expected a FailureKind and a count >= 0")
        for name in (*_COUNTS, "insecure_no_auth"):
            if not _is_count(getattr(self, name)):
                raise ValueError(f"{name} = {getattr(self, name)!r}; expected an int >= 0")

    @property
    def transfers(self) -> int:
        return len(self.transfer_seconds)

    @property
    def num_failures(self) -> int:
        return sum(self.failures.values())

    def is_empty(self) -> bool:
        return not (self.transfers or self.failures or self.fence_wait_steps
                    or any(getattr(self, n) for n in _COUNTS))

    def merge(self, other: MetricsSnapshot) -> MetricsSnapshot:
        """Both snapshots' counts together (two workers, or two intervals)."""
        failures = dict(self.failures)
        for kind, n in other.failures.items():
            failures[kind] = failures.get(kind, 0) + n
        return MetricsSnapshot(**{n: getattr(self, n) + getattr(other, n) for n in _LISTS + _COUNTS},
                               failures=failures, insecure_no_auth=max(self.insecure_no_auth, other.insecure_no_auth))

    def to_dict(self) -> dict[str, Any]:
        """Plain data (str keys, lists, ints, floats): what an engine sends between processes."""
        out: dict[str, Any] = {n: list(getattr(self, n)) for n in _LISTS}
        out["failures"] = {k.value: n for k, n in self.failures.items()}
        out.update({n: getattr(self, n) for n in _COUNTS})
        out["insecure_no_auth"] = self.insecure_no_auth
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> MetricsSnapshot:
        """The inverse of :meth:`to_dict`; a missing key counts as zero, an unknown one is refused."""
        if not isinstance(data, Mapping):
            raise ValueError(f"metrics payload {data!r}; expected a mapping")
        unknown = sorted(set(data) - set(_LISTS) - set(_COUNTS) - {"failures", "insecure_no_auth"})
        if unknown:
            raise ValueError(f"metrics payload has unknown key(s) {unknown}; expected some of "
                             f"{sorted(_LISTS + _COUNTS + ('failures', 'insecure_no_auth'))}")
        kinds = {k.value: k for k in FailureKind}
        failures = {}
        for name, n in dict(data.get("failures") or {}).items():
            if name not in kinds:
                raise ValueError(f"failure kind {name!r}; expected one of {sorted(kinds)}")
            failures[kinds[name]] = n
        return cls(**{n: tuple(data.get(n, ())) for n in _LISTS}, **{n: data.get(n, 0) for n in _COUNTS},
                   failures=failures, insecure_no_auth=data.get("insecure_no_auth", 0))


def _is_count(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


class TransferMetrics:
    """One worker's counters. Fed from the transport's event loop and the engine's threads
    alike (each call takes a lock); :meth:`take` hands out what was counted and starts over."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        #: set by an endpoint started in lab mode (no secret); every take reports it, never reset
        self.insecure_no_auth = False
        self._reset()

    def _reset(self) -> None:
        self._seconds: list[float] = []
        self._post: list[float] = []
        self._bytes: list[int] = []
        self._descs: list[int] = []
        self._failures: dict[FailureKind, int] = {}
        self._expiries = 0
        self._waits: list[int] = []
        self._quarantined = 0
        self._released = 0

    def transfer(self, *, nbytes: int, descriptors: int, seconds: float, post_seconds: float = 0.0) -> None:
        """A transfer landed."""
        with self._lock:
            self._bytes.append(int(nbytes))
            self._descs.append(int(descriptors))
            self._seconds.append(float(seconds))
            self._post.append(float(post_seconds))

    def failure(self, kind: FailureKind) -> None:
        if not isinstance(kind, FailureKind):
            raise ValueError(f"failure kind {kind!r}; expected a FailureKind")
        with self._lock:
            self._failures[kind] = self._failures.get(kind, 0) + 1

    def lease_expired(self) -> None:
        with self._lock:
            self._expiries += 1

    def fence_wait(self, steps: int) -> None:
        """A load started after waiting ``steps`` scheduler steps for the fence (0: at once)."""
        if steps < 0:
            raise ValueError(f"fence wait of {steps} steps; expected >= 0")
        with self._lock:
            self._waits.append(int(steps))

    def quarantined(self, blocks: int) -> None:
        """``blocks`` stay out of reuse until a transfer that could not be stopped ends."""
        with self._lock:
            self._quarantined += int(blocks)

    def quarantine_released(self, blocks: int) -> None:
        with self._lock:
            self._released += int(blocks)

    def take(self) -> MetricsSnapshot:
        with self._lock:
            snap = MetricsSnapshot(transfer_seconds=tuple(self._seconds), post_seconds=tuple(self._post),
                                   bytes=tuple(self._bytes), descriptors=tuple(self._descs),
                                   failures=dict(self._failures), lease_expiries=self._expiries,
                                   fence_wait_steps=tuple(self._waits), quarantined_blocks=self._quarantined,
                                   released_blocks=self._released, insecure_no_auth=int(self.insecure_no_auth))
            self._reset()
        return snap


__all__ = ["FailureKind", "MetricsSnapshot", "TransferMetrics"]
